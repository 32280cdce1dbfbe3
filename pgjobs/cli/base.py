"""What every ``pgjobs`` command shares: the ``cli`` group, the --config and
--database options (before the command or after it), the exit codes, the
mapping of errors to them, logging and JSON. The commands live in the
package's other modules, one per group; :mod:`pgjobs.cli` lists them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click

from ..config import Config, load_config
from ..errors import ConfigError, PgJobsError
from ..registry import Registry

log = logging.getLogger("pgjobs.cli")  # the name it had as one module

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DATABASE = 0, 1, 2, 3

#: the name on the package index (``pgjobs`` there is another project); the
#: import name and the entry-point group stay ``pgjobs``
DISTRIBUTION = "pgjobs-derived"

F = TypeVar("F", bound=Callable[..., Any])


def _common(func: F) -> F:
    func = click.option(
        "--database",
        metavar="URL",
        default=None,
        help="PostgreSQL URL (default: $PGJOBS_DATABASE_URL, else the config's database).",
    )(func)
    func = click.option(
        "--config",
        "-c",
        "config_path",
        metavar="FILE",
        default=None,
        help="Config file (default: $PGJOBS_CONFIG, else ./pgjobs.toml if present).",
    )(func)
    return func


def _verbosity(func: F) -> F:
    return click.option("-v", "--verbose", count=True, help="More log output (repeat for more).")(
        func
    )


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Config and plugin errors exit 2; a database that cannot be reached (or
    that refuses pgjobs' own statements, outside any job) exits 3, so that a
    health check tells it from a failing job (1); each with one readable line."""
    try:
        yield
    except PgJobsError as exc:
        click.echo(f"pgjobs: error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as exc:
        import psycopg
        from sqlalchemy.exc import DBAPIError

        if not isinstance(exc, DBAPIError | psycopg.Error):
            raise
        from .._pg import first_line
        from ..deadline import passed

        said = first_line(passed(exc) or exc).removeprefix("pgjobs: ")
        click.echo(f"pgjobs: database error: {said}", err=True)
        sys.exit(EXIT_DATABASE)


def _log_format(func: F) -> F:
    return click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        envvar="PGJOBS_LOG_FORMAT",
        help="Log lines as text, or as JSON objects with the same fields (for log shippers);"
        " also $PGJOBS_LOG_FORMAT.",
    )(func)


@contextlib.contextmanager
def _logging(
    verbose: int, default: int, *, quiet: Sequence[str] = (), log_format: str = "text"
) -> Iterator[None]:
    """Configure logging for one command (the library never does), and put
    it back afterwards, so that commands invoked in-process leave no trace.

    pgjobs' own loggers log at ``default`` (INFO for ``run``: each run that
    did something, failures, backoffs); ``-v``: pgjobs' DEBUG too (every
    tick, even those that changed nothing, and tracebacks); ``-vv``: every
    library's DEBUG (APScheduler, ...) and SQLAlchemy's statements
    (INFO). Other libraries show warnings only, below ``-vv``."""
    from ..logs import JsonFormatter, TextFormatter

    root, own = logging.getLogger(), logging.getLogger("pgjobs")
    names = ("apscheduler", "sqlalchemy.engine", *quiet)
    saved = {name: logging.getLogger(name).level for name in names}
    saved_root, saved_own = root.level, own.level
    handler: logging.Handler | None = None
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
    own.setLevel(default if verbose == 0 else logging.DEBUG)
    if verbose >= 2:  # SQLAlchemy sets its own loggers to WARNING on import
        logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO)
    if verbose == 0:
        for name in quiet:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        root.setLevel(saved_root)
        own.setLevel(saved_own)
        for name, value in saved.items():
            logging.getLogger(name).setLevel(value)
        if handler is not None:
            root.removeHandler(handler)


def _given(name: str, value: str | None) -> str | None:
    """An option of the command, else the same option given before it
    (``pgjobs --config f list`` is ``pgjobs list --config f``)."""
    if value is not None:
        return value
    context = click.get_current_context(silent=True)
    found = None if context is None else context.find_root().params.get(name)
    return found if isinstance(found, str) else None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """What a host application gives the commands instead of a config file
    (``manage.py pgjobs``: the ``PGJOBS`` setting and ``DATABASES``): the
    config, how its registry is built, and the database URL (``--database``
    still wins over it)."""

    config: Config
    url: str | None
    registry: Callable[[Config], Registry] = Registry.load


_PRESET: contextvars.ContextVar[Preset | None] = contextvars.ContextVar(
    "pgjobs_preset", default=None
)


@contextlib.contextmanager
def preset(given: Preset) -> Iterator[None]:
    """Run the commands invoked in this block with ``given`` instead of a config file."""
    token = _PRESET.set(given)
    try:
        yield
    finally:
        _PRESET.reset(token)


def _load(config_path: str | None, database: str | None) -> tuple[Config, Registry, str | None]:
    config_path, database = _given("config_path", config_path), _given("database", database)
    host = _PRESET.get()
    if host is not None:
        if config_path is not None:
            raise ConfigError(
                f"--config: not here; the host application gives the config ({host.config.source})"
            )
        return host.config, host.registry(host.config), database or host.url
    config = load_config(config_path)
    registry = Registry.load(config)
    return config, registry, config.database_url(database)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name=DISTRIBUTION, message="%(prog)s (distribution %(package)s) %(version)s"
)
@_common
def cli(config_path: str | None, database: str | None) -> None:
    """PostgreSQL background jobs that rewrite derived data without deadlocks.

    --config and --database go before the command or after it; given in
    both places, the command's own wins."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


#: set by ``run`` once its scheduler has stopped and everything is written
_STOPPED = threading.Event()


__all__ = [
    "DISTRIBUTION",
    "F",
    "Preset",
    "cli",
    "preset",
]
