"""The ``PGJOBS`` setting and ``DATABASES``, as pgjobs' :class:`~pgjobs.Config`
and a database URL.

``PGJOBS`` is a dict whose keys are ``pgjobs.toml``'s (``jobs``,
``namespace``, ``schema``, ``plugins``, timeouts ...), checked by the same
parser, plus two of Django's own:

* ``using``: the ``DATABASES`` alias pgjobs lives in (default ``"default"``);
* ``transaction_pooling``: a transaction pooler (PgBouncer,
  ``pool_mode = transaction``) is in between; by default what the alias'
  ``DISABLE_SERVER_SIDE_CURSORS`` says, the setting Django asks for there.

``database`` is refused: the URL comes from ``DATABASES``. Errors name the
setting (``settings.PGJOBS``) and the key, as the file's name the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL

from ...config import Config, parse_config
from ...errors import ConfigError
from ...store import DEFAULT_SCHEMA

SETTING = "PGJOBS"
#: the keys of ``PGJOBS`` that are not ``pgjobs.toml``'s
OWN_KEYS = ("using", "transaction_pooling")
#: Django's engines on PostgreSQL (PostGIS' is one too)
ENGINES = ("django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis")
#: ``OPTIONS`` of Django's PostgreSQL backend that are not libpq's
DJANGO_OPTIONS = (
    "isolation_level",
    "server_side_binding",
    "pool",
    "assume_role",
    "cursor_factory",
    "context",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """``settings.PGJOBS`` read: pgjobs' config, the alias, the pooler."""

    config: Config
    using: str = "default"
    transaction_pooling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.using, str) or not self.using:
            raise ConfigError(
                f"settings.{SETTING}: using: expected a DATABASES alias, got {self.using!r}"
            )


def load() -> Settings:
    """``settings.PGJOBS`` now (read afresh each call: tests override settings)."""
    from django.conf import settings

    raw = getattr(settings, SETTING, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"settings.{SETTING}: expected a dict, got {raw!r}")
    if "database" in raw:
        raise ConfigError(
            f"settings.{SETTING}: database: not here; pgjobs uses a DATABASES alias"
            f" ('using', default 'default'), got {raw['database']!r}"
        )
    using = raw.get("using", "default")
    databases = settings.DATABASES
    if using not in databases:
        raise ConfigError(
            f"settings.{SETTING}: using: no such alias in DATABASES"
            f" (known: {', '.join(databases) or 'none'}), got {using!r}"
        )
    pooling = raw.get(
        "transaction_pooling", bool(databases[using].get("DISABLE_SERVER_SIDE_CURSORS", False))
    )
    if not isinstance(pooling, bool):
        raise ConfigError(
            f"settings.{SETTING}: transaction_pooling: expected True or False, got {pooling!r}"
        )
    data = {k: v for k, v in raw.items() if k not in OWN_KEYS}
    # Relative sql_file paths and plugin modules are found from the project's
    # directory, as a pgjobs.toml's are from the file's.
    base = Path(str(getattr(settings, "BASE_DIR", "") or Path.cwd()))
    try:
        config = parse_config(data, path=base / f"settings.{SETTING}")
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{base / 'settings.'}", "settings.", 1)) from None
    return Settings(config=config, using=using, transaction_pooling=pooling)


def target() -> tuple[str, str]:
    """``(alias, schema)`` from ``settings.PGJOBS``, without parsing the
    jobs: what :func:`~pgjobs.contrib.django.enqueue` needs on each call (a
    request's enqueue reads no SQL file)."""
    from django.conf import settings

    raw = getattr(settings, SETTING, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"settings.{SETTING}: expected a dict, got {raw!r}")
    using, schema = raw.get("using", "default"), raw.get("schema", DEFAULT_SCHEMA)
    for key, value in (("using", using), ("schema", schema)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"settings.{SETTING}: {key}: expected a name, got {value!r}")
    return using, schema


def database_url(settings_dict: dict[str, Any], *, alias: str = "default") -> str:
    """A ``postgresql+psycopg://`` URL for the database of one entry of
    ``DATABASES`` (Django's ``connections[alias].settings_dict``, which names
    the test database in tests): host, port, user, password, name and the
    libpq ``OPTIONS`` (``sslmode``, ``sslrootcert``, ``options``,
    ``target_session_attrs``, ``service`` ...)."""
    engine = settings_dict.get("ENGINE", "")
    if engine not in ENGINES:
        raise ConfigError(
            f"DATABASES[{alias!r}]: ENGINE: pgjobs needs PostgreSQL ({ENGINES[0]}), got {engine!r}"
        )
    query: dict[str, str] = {}
    for name, value in (settings_dict.get("OPTIONS") or {}).items():
        if name in DJANGO_OPTIONS or value is None:
            continue
        if not isinstance(value, str | int | float | bool):
            raise ConfigError(
                f"DATABASES[{alias!r}]: OPTIONS: {name}: expected a libpq setting (text or"
                f" number), got {value!r}"
            )
        query[name] = str(int(value)) if isinstance(value, bool) else str(value)
    host = settings_dict.get("HOST") or None
    if host is not None and host.startswith("/"):
        query["host"], host = host, None  # a Unix socket directory
    port = settings_dict.get("PORT") or None
    url = URL.create(
        "postgresql+psycopg",
        username=settings_dict.get("USER") or None,
        password=settings_dict.get("PASSWORD") or None,
        host=host,
        port=int(port) if port is not None else None,
        database=settings_dict.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def url_of(using: str) -> str:
    """The URL of the database Django's alias ``using`` connects to now."""
    from django.db import connections

    return database_url(connections[using].settings_dict, alias=using)


__all__ = [
    "ENGINES",
    "OWN_KEYS",
    "SETTING",
    "Settings",
    "database_url",
    "load",
    "target",
    "url_of",
]
