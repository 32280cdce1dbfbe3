"""``pgjobs.toml``: the database, the lock namespace, plugin modules, and jobs.

::

    database = "postgresql://app@db/app"   # or $PGJOBS_DATABASE_URL
    namespace = "myapp"                     # advisory-lock namespace
    plugins = ["myapp.jobs"]                # modules with @pgjobs.hookimpl functions
    entry_points = []                       # installed plugins to load (absent: all)
    keep_runs = "7d"                        # prune pgjobs.run older than this ...
    prune_every = "1h"                      # ... this often (under `pgjobs run`)
    auto_migrate = false                    # `pgjobs migrate` applies migrations, not jobs
    call_timeout = "10s"                    # deadline of a bookkeeping round trip
    horizon_warning = "5m"                  # warn of a snapshot held longer (vacuum held back)

    [jobs.exam-scores]                      # a plugin's job: override its settings
    every = "5m"
    backoff = "1h"
    enabled = true

    [jobs.daily-totals]                     # a job declared here, no Python
    kind = "recompute"
    target = "daily_total"
    sql_file = "sql/daily_totals.sql"       # relative to this file (or: sql = "select ...")
    every = "10m"

A ``[derived.NAME]`` table declares a derived table once (its target,
scope, SQL and sources: :class:`~pgjobs.Derived`, ``docs/how-to/derived.md``);
pgjobs makes its jobs and its sources' triggers of it.

A table under ``[jobs]`` *with* ``kind`` declares a job (``recompute``,
``queue`` or ``task``); one *without* overrides a job some plugin registers.
Both take the same settings (:data:`SETTINGS`, each for the kinds it fits),
checked as the job itself checks them; only a declared job takes ``target``,
``sql``/``sql_file`` and ``scope``. Unknown keys are errors, and every error
names the file, the key path (``jobs.exam-scores.every``) and the bad value.

Modules named in ``plugins`` are imported with the config file's directory
on ``sys.path`` (for the import only), so a ``jobs.py`` next to
``pgjobs.toml`` works as is.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import zoneinfo
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .backoff import Backoff
from .cron import check_cron, check_text, check_timezone
from .derived import Derived
from .derived.declare import SETTINGS_FOR as DERIVED_SETTINGS
from .durations import parse_duration, parse_timeout
from .errors import ConfigError
from .horizon import HORIZON_WARNING
from .jobs import (
    MAX_ATTEMPTS,
    MAX_BATCH,
    MAX_CHUNK_ROWS,
    MAX_SLICE_SECONDS,
    MAX_WORKERS,
    Job,
    Parent,
    QueueJob,
    RecomputeJob,
    TaskJob,
    check_name,
    check_pause,
    check_table,
)
from .locking import DEFAULT_NAMESPACE
from .results import DiffStats
from .store import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

_T = TypeVar("_T")

#: Where ``pgjobs`` looks for its config when none is given.
ENV_CONFIG = "PGJOBS_CONFIG"
DEFAULT_FILE = "pgjobs.toml"

_TOP_KEYS = (
    "database",
    "namespace",
    "schema",
    "plugins",
    "entry_points",
    "timezone",
    "keep_runs",
    "prune_every",
    "heartbeat_every",
    "shutdown_timeout",
    "auto_migrate",
    "call_timeout",
    "horizon_warning",
    "jobs",
    "derived",
)
_KINDS = ("recompute", "queue", "task")
_DIFF_KINDS = ("recompute", "queue")
#: the settings of a job, by the job kinds they apply to: a ``[jobs.NAME]``
#: table gives them to a job it declares (with ``kind``) or changes them on
#: a job a plugin registers (without). Callables stay in Python.
SETTINGS: dict[str, tuple[str, ...]] = {
    "every": _KINDS,
    "cron": _KINDS,
    "timezone": _KINDS,
    "group": _KINDS,
    "backoff": _KINDS,
    "lock_timeout": _KINDS,
    "statement_timeout": _KINDS,
    "busy_retry": _KINDS,
    "synchronous_commit": _KINDS,
    "enabled": _KINDS,
    "description": _KINDS,
    "key": _DIFF_KINDS,
    "parents": _DIFF_KINDS,
    "columns": _DIFF_KINDS,
    "flow": _DIFF_KINDS,
    "chunk_parents": ("recompute",),
    "chunk_rows": ("recompute",),
    "atomic": ("recompute",),
    "verify_every": ("recompute",),
    "sliced": ("recompute",),
    "slice_seconds": ("recompute",),
    "slice_pause": ("recompute",),
    "batch_size": ("queue",),
    "workers": ("queue",),
    "max_attempts": ("queue",),
    "item_backoff": ("queue",),
}
#: keys that override a registered job's settings (also allowed on declared jobs)
OVERRIDE_KEYS = tuple(SETTINGS)
#: what only a job declared in the file gives (a plugin's job has them in Python)
DECLARE_KEYS: dict[str, tuple[str, ...]] = {
    "target": _DIFF_KINDS,
    "sql": _KINDS,
    "sql_file": _KINDS,
    "scope": _DIFF_KINDS,
}
#: what a ``[derived.NAME]`` table takes besides the job settings of its jobs
DERIVED_KEYS = ("target", "scope", "sql", "sql_file", "every", "sources", "static")
_BACKOFF_KEYS = ("initial", "factor", "max", "jitter")
_PARENT_KEYS = ("table", "columns", "parent_columns")


def _kinds(kinds: tuple[str, ...]) -> str:
    return " and ".join(kinds) if len(kinds) < 3 else "all"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOverride:
    """What a ``[jobs.NAME]`` table without ``kind`` changes on a registered job.

    ``None`` leaves a setting as the plugin made it. ``given`` keeps the
    values as the file wrote them, for error messages.
    """

    every: timedelta | None = None
    cron: str | None = None
    timezone: str | None = None
    group: str | None = None
    backoff: Backoff | None = None
    lock_timeout: timedelta | None = None
    statement_timeout: timedelta | None = None
    #: ``timedelta(0)``: no busy retry
    busy_retry: timedelta | None = None
    synchronous_commit: bool | None = None
    enabled: bool | None = None
    description: str | None = None
    key: tuple[str, ...] | None = None
    parents: tuple[Parent, ...] | None = None
    columns: tuple[str, ...] | None = None
    flow: bool | None = None
    chunk_parents: int | None = None
    chunk_rows: int | None = None
    atomic: bool | None = None
    #: ``timedelta(0)``: no scheduled verification
    verify_every: timedelta | None = None
    sliced: bool | None = None
    slice_seconds: timedelta | None = None
    slice_pause: float | None = None
    batch_size: int | None = None
    workers: int | None = None
    max_attempts: int | None = None
    item_backoff: Backoff | None = None
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.every is not None and self.cron is not None:
            raise ConfigError("every, cron: give one of them, not both")

    def changes(self) -> dict[str, Any]:
        """The settings this override gives, by name."""
        return {
            name: getattr(self, name) for name in OVERRIDE_KEYS if getattr(self, name) is not None
        }

    def apply(self, job: Job) -> Job:
        """``job`` with these settings; raises :class:`ConfigError` naming the
        setting if one does not fit the job's kind, or the job refuses it."""
        changes = self.changes()
        if not changes:
            return job
        fields = {f.name for f in dataclasses.fields(job)}
        for name, value in changes.items():
            if name not in fields:
                raise ConfigError(
                    f"{name}: applies to {_kinds(SETTINGS[name])} jobs; {job.name!r} is a "
                    f"{job.kind} job, got {self.given.get(name, value)!r}"
                )
        if self.every is not None:
            changes["cron"] = None
        if self.cron is not None:
            changes["every"] = None
        return job.replace(**changes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A parsed ``pgjobs.toml`` (or the defaults, when there is no file).

    Build it with :func:`load_config`; ``path`` is the file it came from.
    """

    path: Path | None = None
    #: database URL; ``$PGJOBS_DATABASE_URL`` wins over it (see :meth:`database_url`)
    database: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    schema: str = DEFAULT_SCHEMA
    #: modules imported and registered as plugins
    plugins: tuple[str, ...] = ()
    #: the installed plugins to load (entry-point or distribution names);
    #: ``None``: all of them, ``()``: none
    entry_points: tuple[str, ...] | None = None
    #: the time zone of cron schedules
    timezone: str = "UTC"
    #: run records older than this are pruned by the scheduler
    keep_runs: timedelta = timedelta(days=7)
    prune_every: timedelta = timedelta(hours=1)
    #: how often each scheduler records its heartbeat (docs/operate.md)
    heartbeat_every: timedelta = timedelta(seconds=5)
    #: how long a stopping scheduler waits for running ticks before it
    #: cancels them; ``None``: as long as they take
    shutdown_timeout: timedelta | None = None
    #: apply pending migrations of pgjobs' schema at start (false: refuse; ``pgjobs migrate``)
    auto_migrate: bool = True
    #: the deadline of each round trip of pgjobs' bookkeeping, and the margin
    #: of a tick's (``docs/failover.md``)
    call_timeout: timedelta = timedelta(seconds=10)
    #: a snapshot or transaction held longer than this is warned about
    #: (``pgjobs status``, the status page, the log: docs/long-transactions.md)
    horizon_warning: timedelta = HORIZON_WARNING
    #: jobs declared entirely in the file
    jobs: tuple[Job, ...] = ()
    #: settings changed on jobs that plugins register, by job name
    overrides: Mapping[str, JobOverride] = field(default_factory=dict)
    #: derived tables declared in the file (``[derived.NAME]``)
    derived: tuple[Derived, ...] = ()

    def __post_init__(self) -> None:
        if self.entry_points is not None and (
            isinstance(self.entry_points, str)
            or not all(isinstance(n, str) and n for n in self.entry_points)
        ):
            raise ConfigError(
                f"{self.source}: entry_points: expected a list of installed plugins' "
                f"entry-point or distribution names, got {self.entry_points!r}"
            )
        for name in ("namespace", "schema"):
            try:
                check_text(getattr(self, name), name)
            except ConfigError as exc:
                raise ConfigError(f"{self.source}: {exc}") from None
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"{self.source}: timezone: expected an IANA time zone such as 'UTC' or "
                f"'Europe/Paris', got {self.timezone!r}"
            ) from exc
        for name in ("keep_runs", "prune_every"):
            try:
                parse_duration(getattr(self, name), field=name)
            except ConfigError as exc:
                raise ConfigError(f"{self.source}: {exc}") from None
        for name in ("prune_every", "heartbeat_every", "call_timeout", "horizon_warning"):
            if getattr(self, name) <= timedelta(0):
                raise ConfigError(
                    f"{self.source}: {name}: must be positive, got {getattr(self, name)!r}"
                )

    @property
    def source(self) -> str:
        """The file name errors start with."""
        return str(self.path) if self.path is not None else "<no config file>"

    def database_url(
        self, override: str | None = None, *, env: Mapping[str, str] | None = None
    ) -> str | None:
        """The database to use: ``override`` (``--database``), else
        ``$PGJOBS_DATABASE_URL``, else the file's ``database``."""
        from .database import ENV_URL

        environ = os.environ if env is None else env
        return override or environ.get(ENV_URL) or self.database


def find_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Path | None:
    """The config file to read: ``path``, else ``$PGJOBS_CONFIG``, else
    ``./pgjobs.toml`` when it exists, else ``None``. A file named explicitly
    (argument or variable) must exist."""
    environ = os.environ if env is None else env
    named = path if path is not None else environ.get(ENV_CONFIG) or None
    if named is not None:
        candidate = Path(named)
        if not candidate.is_file():
            origin = "--config" if path is not None else f"${ENV_CONFIG}"
            raise ConfigError(f"{origin}: no such config file: {str(named)!r}")
        return candidate
    default = Path(DEFAULT_FILE)
    return default if default.is_file() else None


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Config:
    """Read the config file (see :func:`find_config`); the defaults when there is none.

    >>> config = pgjobs.load_config("pgjobs.toml")
    >>> [job.name for job in config.jobs]
    """
    found = find_config(path, env=env)
    if found is None:
        return Config()
    try:
        data = tomllib.loads(found.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{found}: not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{found}: cannot read the config file: {exc}") from exc
    return parse_config(data, path=found)


def parse_config(data: Mapping[str, Any], *, path: Path | None = None) -> Config:
    """Build a :class:`Config` from an already-parsed TOML document."""
    return _Parser(path).config(data)


class _Parser:
    """Turns a TOML document into a :class:`Config`; every error names the
    file, the key path and the value."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.source = str(path) if path is not None else "<config>"

    def fail(self, key: str, problem: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {problem}, got {value!r}")

    def wrap(self, key: str, exc: ConfigError) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {exc}")

    def model(self, check: Callable[[], _T]) -> _T:
        """``check()`` (one of the model's checks, given the key path as its
        field name), its :class:`ConfigError` re-raised naming the file."""
        try:
            return check()
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc}") from None

    # -- scalar readers ------------------------------------------------------
    def check_keys(self, table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
        for key in table:
            if key not in allowed:
                path = f"{where}.{key}" if where else key
                raise ConfigError(
                    f"{self.source}: {path}: unknown key (expected one of: {', '.join(allowed)}), "
                    f"got {key!r} = {table[key]!r}"
                )

    def no_nul(self, value: Any, key: str) -> None:
        """No string anywhere in the document holds a NUL byte (TOML allows
        ``\\u0000``; no PostgreSQL name, text or query can hold one)."""
        if isinstance(value, str) and "\x00" in value:
            raise self.fail(key, "must not contain a NUL byte", value)
        if isinstance(value, dict):
            for name, item in value.items():
                shown = name.replace("\x00", "\\x00")
                path = f"{key}.{shown}" if key else shown
                if "\x00" in name:
                    raise self.fail(path, "a key must not contain a NUL byte", name)
                self.no_nul(item, path)
        if isinstance(value, list):
            for i, item in enumerate(value):
                self.no_nul(item, f"{key}[{i}]")

    def text(self, value: Any, key: str) -> str:
        return self.model(lambda: check_text(value, key))

    def names(self, value: Any, key: str) -> tuple[str, ...]:
        items = (value,) if isinstance(value, str) else value
        if (
            not isinstance(items, list | tuple)
            or not items
            or not all(isinstance(v, str) and v for v in items)
        ):
            raise self.fail(key, "expected a column name or a list of column names", value)
        return tuple(items)

    def duration(self, value: Any, key: str) -> timedelta:
        return self.model(lambda: parse_duration(value, field=key))

    def count(self, value: Any, key: str, maximum: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
            raise self.fail(key, f"expected a positive integer, at most {maximum:,}", value)
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, "expected true or false", value)
        return value

    def backoff(self, value: Any, key: str) -> Backoff:
        if isinstance(value, dict):
            self.check_keys(value, _BACKOFF_KEYS, key)
            fields = dict(value)
            for name in ("initial", "max"):
                if name in fields:
                    # checked here to name the key; Backoff gets the value as written
                    self.duration(fields[name], f"{key}.{name}")
            try:
                return Backoff(**fields)
            except ConfigError as exc:
                raise ConfigError(f"{self.source}: {key}: {exc}") from None
        return Backoff(initial=self.duration(value, key))

    def target(self, value: Any, key: str) -> str:
        return self.model(lambda: check_table(value, key))

    def setting(self, name: str, value: Any, key: str) -> Any:
        """One of :data:`SETTINGS`, read and checked as the job would."""
        if name == "every":
            every = self.duration(value, key)
            if every <= timedelta(0):
                raise self.fail(key, "must be positive", value)
            return every
        if name in ("busy_retry", "verify_every"):
            return self.duration(value, key)
        if name == "slice_seconds":
            seconds = self.duration(value, key)
            if not timedelta(0) < seconds <= MAX_SLICE_SECONDS:
                raise self.fail(
                    key, f"expected more than 0 and at most {MAX_SLICE_SECONDS.seconds} s", value
                )
            return seconds
        if name == "slice_pause":
            return self.model(lambda: check_pause(value, key))
        if name in ("lock_timeout", "statement_timeout"):
            return self.model(lambda: parse_timeout(value, field=key))
        if name == "cron":
            return self.model(lambda: check_cron(value, key))
        if name == "timezone":
            return self.model(lambda: check_timezone(value, key))
        if name == "group":
            return self.model(lambda: check_name(value, key))
        if name == "description":
            if not isinstance(value, str):
                raise self.fail(key, "expected text", value)
            return value
        if name in ("backoff", "item_backoff"):
            return self.backoff(value, key)
        if name in ("enabled", "synchronous_commit", "atomic", "flow", "sliced"):
            return self.boolean(value, key)
        if name in ("key", "columns"):
            return self.names(value, key)
        if name == "parents":
            return self.parents(value, key)
        if name in ("batch_size", "chunk_parents"):
            return self.count(value, key, MAX_BATCH)
        if name == "chunk_rows":
            return self.count(value, key, MAX_CHUNK_ROWS)
        if name == "workers":
            return self.count(value, key, MAX_WORKERS)
        assert name == "max_attempts", name
        return self.count(value, key, MAX_ATTEMPTS)

    # -- the document --------------------------------------------------------
    def config(self, data: Mapping[str, Any]) -> Config:
        self.check_keys(data, _TOP_KEYS, "")
        self.no_nul(dict(data), "")
        fields: dict[str, Any] = {"path": self.path}
        if "database" in data:
            url = self.text(data["database"], "database")
            if not url.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
                raise self.fail("database", "expected a postgresql:// URL", url)
            fields["database"] = url
        for name in ("namespace", "schema", "timezone"):
            if name in data:
                fields[name] = self.text(data[name], name)
        if "plugins" in data:
            plugins = data["plugins"]
            if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
                raise self.fail("plugins", "expected a list of module names", plugins)
            fields["plugins"] = tuple(plugins)
        if "entry_points" in data:
            names = data["entry_points"]
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise self.fail(
                    "entry_points",
                    "expected a list of installed plugins' entry-point or distribution names",
                    names,
                )
            fields["entry_points"] = tuple(names)
        for name in (
            "keep_runs",
            "prune_every",
            "heartbeat_every",
            "shutdown_timeout",
            "call_timeout",
            "horizon_warning",
        ):
            if name in data:
                fields[name] = self.duration(data[name], name)
        if "auto_migrate" in data:
            if not isinstance(data["auto_migrate"], bool):
                raise self.fail("auto_migrate", "expected true or false", data["auto_migrate"])
            fields["auto_migrate"] = data["auto_migrate"]
        jobs = data.get("jobs", {})
        if not isinstance(jobs, dict):
            raise self.fail("jobs", "expected a table of jobs ([jobs.NAME])", jobs)
        declared: list[Job] = []
        overrides: dict[str, JobOverride] = {}
        for name, table in jobs.items():
            where = f"jobs.{name}"
            if not isinstance(table, dict):
                raise self.fail(where, "expected a table ([jobs.NAME])", table)
            if "kind" in table:
                declared.append(self.job(name, table, where))
            else:
                overrides[name] = self.override(table, where)
        fields["jobs"] = tuple(declared)
        fields["overrides"] = overrides
        derived = data.get("derived", {})
        if not isinstance(derived, dict):
            raise self.fail(
                "derived", "expected a table of derived tables ([derived.NAME])", derived
            )
        fields["derived"] = tuple(
            self.derived(name, table, f"derived.{name}") for name, table in derived.items()
        )
        return Config(**fields)

    def derived(self, name: str, table: Any, where: str) -> Derived:
        """A ``[derived.NAME]`` table: :class:`~pgjobs.derived.Derived`."""
        if not isinstance(table, dict):
            raise self.fail(where, "expected a table ([derived.NAME])", table)
        self.check_keys(table, (*DERIVED_KEYS, *DERIVED_SETTINGS), where)
        for required in ("target", "scope", "sources"):
            if required not in table:
                what = {
                    "target": "the table it keeps",
                    "scope": "the key column(s) of an item",
                    "sources": "the tables its SQL reads, each mapped to keys",
                }[required]
                raise self.fail(f"{where}.{required}", f"required: {what}", None)
        sources = table["sources"]
        if not isinstance(sources, dict) or not sources:
            raise self.fail(
                f"{where}.sources",
                'expected a table: table = [its key columns] or table = "mapping SQL"',
                sources,
            )
        for source, value in sources.items():
            key = f"{where}.sources.{source}"
            if isinstance(value, str):
                self.text(value, key)
            elif (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, str) and v for v in value)
            ):
                raise self.fail(
                    key, "expected a list of the key's columns (in scope order) or SQL text", value
                )
        static = table.get("static", [])
        if isinstance(static, str):
            static = [static]
        if not isinstance(static, list) or not all(isinstance(v, str) and v for v in static):
            raise self.fail(f"{where}.static", "expected a list of table names", static)
        settings = {
            setting: self.setting(setting, value, f"{where}.{setting}")
            for setting, value in table.items()
            if setting in DERIVED_SETTINGS
        }
        every: Any = "1h"
        if "every" in table:
            every = self.setting("every", table["every"], f"{where}.every")
            if "cron" in table:
                raise self.fail(f"{where}.cron", "give every or cron, not both", table["cron"])
        try:
            return Derived(
                name=self.model(lambda: check_name(name, where)),
                target=self.target(table["target"], f"{where}.target"),
                scope=self.names(table["scope"], f"{where}.scope"),
                sql=self.query(table, where),
                sources=dict(sources),
                every=every,
                static=tuple(static),
                settings=settings,
                origin=self.source,
            )
        except ConfigError as exc:
            if str(exc).startswith(self.source):
                raise
            raise self.wrap(where, exc) from None

    def override(self, table: Mapping[str, Any], where: str) -> JobOverride:
        if not table:
            raise self.fail(
                where, "expected settings to override, or kind = ... to declare a job", {}
            )
        for name, value in table.items():
            if name in DECLARE_KEYS:
                raise self.fail(
                    f"{where}.{name}",
                    f"only a job declared here (with kind = ...) takes {name}; "
                    "a plugin's job brings its own",
                    value,
                )
        self.check_keys(table, OVERRIDE_KEYS, where)
        fields: dict[str, Any] = {
            name: self.setting(name, value, f"{where}.{name}") for name, value in table.items()
        }
        try:
            return JobOverride(**fields, given=dict(table))
        except ConfigError as exc:
            raise self.wrap(where, exc) from None

    def job(self, name: str, table: Mapping[str, Any], where: str) -> Job:
        kind = table["kind"]
        if kind not in _KINDS:
            raise self.fail(f"{where}.kind", f"expected one of {', '.join(_KINDS)}", kind)
        known = {**DECLARE_KEYS, **SETTINGS}
        self.check_keys(table, ("kind", *known), where)
        for key, value in table.items():
            if key != "kind" and kind not in known[key]:
                raise self.fail(
                    f"{where}.{key}",
                    f"applies to {_kinds(known[key])} jobs, not {kind} jobs",
                    value,
                )
        query = self.query(table, where)
        fields: dict[str, Any] = {"name": name}
        if kind in _DIFF_KINDS:
            if "target" not in table:
                raise self.fail(f"{where}.target", "required: the table this job writes", None)
            fields["target"] = self.target(table["target"], f"{where}.target")
            fields["compute"] = query
        if kind == "queue":
            if "scope" not in table:
                raise self.fail(
                    f"{where}.scope", "required: the column(s) that tie an item to its rows", None
                )
            fields["scope"] = self.names(table["scope"], f"{where}.scope")
        if kind == "recompute" and "scope" in table:
            fields["scope"] = self.names(table["scope"], f"{where}.scope")
        if kind == "task":
            fields["run"] = sql_task(query)
        for setting, value in table.items():
            if setting in SETTINGS:
                fields[setting] = self.setting(setting, value, f"{where}.{setting}")
        if "every" in fields and "cron" in fields:
            raise self.fail(f"{where}.cron", "give every or cron, not both", table["cron"])
        if "cron" in fields:
            fields["every"] = None
        cls: type[Job] = {"recompute": RecomputeJob, "queue": QueueJob, "task": TaskJob}[kind]
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise self.wrap(where, exc) from None

    def query(self, table: Mapping[str, Any], where: str) -> str:
        if "sql" in table and "sql_file" in table:
            raise self.fail(
                f"{where}.sql_file", "give sql or sql_file, not both", table["sql_file"]
            )
        if "sql" in table:
            return self.text(table["sql"], f"{where}.sql")
        if "sql_file" not in table:
            raise self.fail(
                f"{where}.sql", "required: the query (sql = ...) or a file (sql_file = ...)", None
            )
        key = f"{where}.sql_file"
        name = self.text(table["sql_file"], key)
        base = self.path.parent if self.path is not None else Path.cwd()
        file = base / name
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise self.fail(
                key, f"cannot read {str(file)!r} ({exc.__class__.__name__})", name
            ) from exc
        if not text.strip():
            raise self.fail(key, f"{str(file)!r} is empty", name)
        if "\x00" in text:
            raise self.fail(key, f"{str(file)!r} contains a NUL byte", name)
        return text

    def parents(self, value: Any, key: str) -> tuple[Parent, ...]:
        if not isinstance(value, list):
            raise self.fail(
                key, "expected a list of {table, columns, parent_columns} tables", value
            )
        out = []
        for i, item in enumerate(value):
            where = f"{key}[{i}]"
            if not isinstance(item, dict):
                raise self.fail(where, "expected a table {table, columns, parent_columns}", item)
            self.check_keys(item, _PARENT_KEYS, where)
            for required in _PARENT_KEYS:
                if required not in item:
                    raise self.fail(f"{where}.{required}", "required", None)
            try:
                out.append(
                    Parent(
                        table=self.target(item["table"], f"{where}.table"),
                        columns=self.names(item["columns"], f"{where}.columns"),
                        parent_columns=self.names(
                            item["parent_columns"], f"{where}.parent_columns"
                        ),
                    )
                )
            except ConfigError as exc:
                if str(exc).startswith(self.source):
                    raise
                raise self.wrap(where, exc) from None
        return tuple(out)


def sql_task(query: str) -> Callable[[Connection], DiffStats | None]:
    """The body of a config-declared ``task`` job: run ``query`` (one or more
    statements) in the job's transaction."""

    def run(conn: Connection) -> DiffStats | None:
        from ._pg import execute

        execute(conn, query)
        return None

    run.__qualname__ = run.__name__ = "sql_task"
    return run


__all__ = ["Config", "JobOverride", "find_config", "load_config", "parse_config"]
