"""The ``pgjobs`` command.

::

    pgjobs run              start the scheduler in the foreground (SIGTERM/SIGINT stop it)
    pgjobs once JOB         run one tick of JOB now, showing its phases and progress
    pgjobs list             jobs, owner plugins, kinds, groups and schedules
    pgjobs status           last outcome, next attempt, failures, rows changed, queue depth
    pgjobs pause JOB        pause JOB on every scheduler (``resume JOB`` resumes it)
    pgjobs enqueue JOB KEY  add items to JOB's queue (``revive JOB`` brings dead ones back)
    pgjobs migrate          apply pgjobs' pending migrations (--check: are any? --sql: print them)
    pgjobs demo             the demonstration (see ``pgjobs demo --help``)

Every command takes ``--config/-c`` (default ``$PGJOBS_CONFIG``, else
``./pgjobs.toml`` when present) and ``--database`` (default
``$PGJOBS_DATABASE_URL``, else the config file's ``database``), before the
command (``pgjobs --config f list``) or after it (``pgjobs list --config f``).

Exit codes: 0 ok; 1 a job failed (``once``: the tick failed or found its
group busy; ``status``: a job is failing; ``migrate --check``: migrations
are pending); 2 a usage, config or plugin error, or a schema that does not
fit the code (newer than it, or not migrated with ``auto_migrate = false``);
3 the database is unreachable (or refused pgjobs' own statements, outside
any job: the connection, the checks, the status query). A tick that fails
on the database inside the job is a failed job: 1.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click

from .config import Config, load_config
from .durations import format_duration, parse_duration
from .errors import ConfigError, PgJobsError
from .progress import Display
from .registry import Registry
from .results import Outcome, RunResult

log = logging.getLogger(__name__)

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
        from ._pg import first_line

        click.echo(f"pgjobs: database error: {first_line(exc)}", err=True)
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
    from .logs import JsonFormatter, TextFormatter

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


def _load(config_path: str | None, database: str | None) -> tuple[Config, Registry, str | None]:
    config_path, database = _given("config_path", config_path), _given("database", database)
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


# -- run -----------------------------------------------------------------------------
@cli.command()
@_common
@_verbosity
@_log_format
@click.option("--no-check", is_flag=True, help="Skip checking the jobs against the database first.")
@click.option(
    "--exit-if-unreachable",
    is_flag=True,
    help="Exit 3 when the database cannot be reached at start, instead of waiting for it.",
)
@click.option(
    "--http",
    "http_address",
    metavar="ADDRESS",
    default=None,
    help="Serve the status page on HOST:PORT (a port alone: 127.0.0.1; 0.0.0.0:PORT: every"
    " interface).",
)
@click.option(
    "--metrics",
    "metrics_address",
    metavar="ADDRESS",
    default=None,
    help="Serve Prometheus metrics at /metrics on HOST:PORT (needs pgjobs-derived[metrics]); may be"
    " the --http address.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse to start when a job fails its check against the database (by default that job is"
    " shown failing, backed off and checked again, while the others run).",
)
@click.option(
    "--shutdown-timeout",
    metavar="DURATION",
    default=None,
    help="On SIGTERM/SIGINT, wait at most this long (e.g. 30s) for running jobs, then cancel their"
    " statements on the server and roll back (recorded 'cancelled', no backoff). Default: wait.",
)
def run(
    config_path: str | None,
    database: str | None,
    verbose: int,
    log_format: str,
    no_check: bool,
    exit_if_unreachable: bool,
    http_address: str | None,
    metrics_address: str | None,
    strict: bool,
    shutdown_timeout: str | None,
) -> None:
    """Run the scheduler in the foreground until SIGTERM or SIGINT.

    The first signal stops firing and waits for the running transactions to
    commit or roll back (at most --shutdown-timeout, then their statements
    are cancelled); a second one exits at once (PostgreSQL rolls back).
    A database that cannot be reached at start is waited for (one line says
    so), unless --exit-if-unreachable; one that goes away later is too.
    """
    from .scheduler import Scheduler
    from .serve import parse_address

    with _errors(), _logging(verbose, logging.INFO, log_format=log_format):
        http = None if http_address is None else parse_address(http_address, option="--http")
        scrape = (
            None if metrics_address is None else parse_address(metrics_address, option="--metrics")
        )
        metrics = None
        if scrape is not None:
            from .metrics import Metrics

            metrics = Metrics(process=True)
        options = _run_options(no_check=no_check, strict=strict, shutdown_timeout=shutdown_timeout)
        config, registry, url = _load(config_path, database)
        if not registry.jobs(enabled_only=True):
            raise ConfigError(
                "no enabled jobs: install a plugin package, list modules under plugins = [...] "
                f"or declare jobs in {config.path or 'pgjobs.toml'}"
            )
        scheduler = Scheduler.from_config(config, database=url, registry=registry, **options)
        if metrics is not None:
            metrics.bind(scheduler)  # before the first tick: every tick is counted
        stop = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            if stop.is_set():
                click.echo(
                    "pgjobs: second signal, exiting now; open transactions roll back", err=True
                )
                os._exit(128 + signum)
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        servers: list[Any] = []
        try:
            if not _start(scheduler, stop, wait=not exit_if_unreachable):
                return
            servers = _serve(scheduler, http, scrape, metrics)
            jobs = registry.jobs(enabled_only=True)
            click.echo(
                f"pgjobs: running {len(jobs)} job(s): {', '.join(j.name for j in jobs)}; "
                "SIGTERM or Ctrl-C stops",
                err=True,
            )
            stop.wait()
            click.echo("pgjobs: stopping; waiting for running jobs to finish", err=True)
        finally:
            for server in servers:
                server.close()
            ended = scheduler.shutdown(wait=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        click.echo("pgjobs: stopped", err=True)
        _STOPPED.set()  # main() exits without waiting (see there)
        if not ended:
            log.warning("pgjobs: exiting with a tick still running; PostgreSQL rolls it back")


def _run_options(*, no_check: bool, strict: bool, shutdown_timeout: str | None) -> dict[str, Any]:
    """The scheduler's options from ``run``'s flags; --shutdown-timeout, when
    given, wins over the config's ``shutdown_timeout``."""
    options: dict[str, Any] = {"check": not no_check, "strict": strict, "on_result": _tracing()}
    if shutdown_timeout is not None:
        options["shutdown_timeout"] = parse_duration(shutdown_timeout, field="--shutdown-timeout")
    return options


def _start(scheduler: Any, stop: threading.Event, *, wait: bool) -> bool:
    """Start ``scheduler``; while the database cannot be reached, wait for it
    (one line says so), unless not ``wait``. False: stopped while waiting."""
    from ._pg import unavailable, why_unavailable

    waiting_since: float | None = None
    while True:
        try:
            scheduler.start()
        except Exception as exc:
            if not wait or not unavailable(exc):
                raise
            if waiting_since is None:
                waiting_since = time.monotonic()
                click.echo(
                    f"pgjobs: the database is unreachable ({why_unavailable(exc)}); waiting for it"
                    " (--exit-if-unreachable exits 3 instead)",
                    err=True,
                )
            if stop.wait(1.0):
                return False
            continue
        if waiting_since is not None:
            click.echo(
                f"pgjobs: the database answers, after {time.monotonic() - waiting_since:.1f} s",
                err=True,
            )
        return True


def _tracing() -> Callable[[RunResult], None] | None:
    """OpenTelemetry spans for the runs, where ``opentelemetry-api`` is
    installed (no-ops unless an SDK is configured)."""
    from . import tracing

    return tracing.Tracing().observe if tracing.available() else None


def _serve(
    scheduler: Any, http: tuple[str, int] | None, scrape: tuple[str, int] | None, metrics: Any
) -> list[Any]:
    """The status page and the metrics, on one server when they share an address."""
    from .serve import serve
    from .web import wsgi_app

    routes: dict[tuple[str, int], dict[str, Any]] = {}
    if http is not None:
        routes.setdefault(http, {})["/"] = wsgi_app(scheduler)
    if scrape is not None and metrics is not None:
        routes.setdefault(scrape, {})["/metrics"] = metrics.wsgi_app(scheduler)
    servers = []
    try:
        for address, apps in routes.items():
            server = serve(address, apps)
            servers.append(server)
            if "/" in apps:
                click.echo(f"pgjobs: status page at {server.url}/", err=True)
            if "/metrics" in apps:
                click.echo(f"pgjobs: metrics at {server.url}/metrics", err=True)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


# -- once ----------------------------------------------------------------------------
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


def _summary(result: RunResult) -> str:
    s = result.stats
    head = f"{result.job}: {result.outcome} in {result.seconds:.2f}s"
    if result.outcome is Outcome.RAN:
        parts = [
            f"inserted {s.inserted:,}",
            f"updated {s.updated:,}",
            f"deleted {s.deleted:,}",
            f"unchanged {s.unchanged:,}",
        ]
        if s.skipped_missing_parent:
            parts.append(f"skipped (parent gone) {s.skipped_missing_parent:,}")
        if result.items or result.failed_items:
            parts.append(f"items {result.items:,} ({result.failed_items:,} failed)")
        timing = (
            f"compute {result.compute_seconds:.2f}s, write {result.write_seconds:.2f}s, "
            f"rows locked {result.lock_seconds:.2f}s"
        )
        return f"{head}: {', '.join(parts)}; {timing}"
    if result.outcome in (Outcome.FAILED, Outcome.INTERRUPTED):
        state = f" (SQLSTATE {result.sqlstate})" if result.sqlstate else ""
        when = (
            f"; next scheduled attempt {result.next_attempt_at:%Y-%m-%d %H:%M:%S %Z}"
            if result.next_attempt_at
            else ""
        )
        return f"{head}: {result.error}{state}{when}"
    if result.outcome is Outcome.BUSY:
        return f"{head}: another transaction holds the group lock; nothing was done"
    if result.outcome is Outcome.IDLE:
        return f"{head}: nothing to do (has_work said no)"
    if result.outcome is Outcome.PAUSED:
        from .operate import paused_line

        return paused_line(result)
    return head


@cli.command()
@click.argument("job")
@_common
@_verbosity
@click.option("--json", "as_json", is_flag=True, help="Print the RunResult as JSON.")
@click.option("--no-check", is_flag=True, help="Skip checking the job against the database first.")
@click.option("--force", is_flag=True, help="Run the tick even if the job is paused.")
def once(
    job: str,
    config_path: str | None,
    database: str | None,
    verbose: int,
    as_json: bool,
    no_check: bool,
    force: bool,
) -> None:
    """Run one tick of JOB now, forced: its schedule and backoff are ignored
    (a job that is not due, or backing off after a failure, runs anyway),
    never its group lock (busy: exit 1), nor a pause (``pgjobs pause``: exit
    1; --force runs it anyway). pgjobs.run_once() is not forced by default:
    it honours all of them, as the scheduler does.

    Phases and progress go to stderr (redrawn in place on a terminal, a line
    per phase otherwise); the outcome to stdout. Exit 1 if the tick failed or
    found the job's group busy, 3 if the database cannot be reached.
    """
    from .checks import check_jobs
    from .runner import Runner

    # The summary below reports a failure; the runner's traceback is for -v.
    with _errors(), _logging(verbose, logging.WARNING, quiet=("pgjobs.runner",)):
        config, registry, url = _load(config_path, database)
        target = registry.get(job)
        if not target.enabled:
            click.echo(
                f"pgjobs: note: {job} is disabled (enabled = false); running it anyway", err=True
            )
        with Runner(
            url,
            namespace=config.namespace,
            schema=config.schema,
            auto_migrate=config.auto_migrate,
            call_timeout=config.call_timeout,
        ) as runner:
            if not no_check:
                check_jobs(runner.engine, [registry.entry(job)])
            with Display(job, sys.stderr) as progress:
                result = runner.tick(target, force=True, run_paused=force, progress=progress)
        if as_json:
            click.echo(json.dumps(_jsonable(result), indent=2))
        else:
            click.echo(_summary(result))
        if result.outcome in (Outcome.FAILED, Outcome.BUSY, Outcome.PAUSED, Outcome.INTERRUPTED):
            sys.exit(EXIT_FAILED)


# -- check ---------------------------------------------------------------------------
@cli.command()
@click.argument("job")
@_common
@_verbosity
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option(
    "--sample",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="N",
    help="Keys shown for each kind of change (the first N in key order).",
)
@click.option(
    "--keys",
    multiple=True,
    metavar="K",
    help="A queue job's items to check; a JSON array for a composite scope: '[7, \"b\"]'.",
)
@click.argument("more_keys", nargs=-1, metavar="[K ...]")
def check(
    job: str,
    config_path: str | None,
    database: str | None,
    verbose: int,
    as_json: bool,
    sample: int,
    keys: tuple[str, ...],
    more_keys: tuple[str, ...],
) -> None:
    """Show what a recompute of JOB would write now, writing nothing: rows it
    would insert, update, delete or skip (parent gone), with a sample of keys
    and the old and new values of updated rows (docs/drift.md). No row lock,
    no write; the job's timeouts apply. Rows of items queued or in flight are
    shown apart: they are on their way. A queue job is checked for --keys.

    Exit 0 without drift, 1 with drift, 2 for a bad config or job, 3 if the
    database cannot be reached (or the check failed there).
    """
    import psycopg

    from . import drift
    from ._pg import first_line
    from .api import check as check_job

    if more_keys and not keys:
        raise click.UsageError(f"unexpected {' '.join(more_keys)}: keys go after --keys")
    with _errors(), _logging(verbose, logging.WARNING):
        config, registry, url = _load(config_path, database)
        target = registry.get(job)
        items = drift.parse_keys([*keys, *more_keys]) if keys else None
        workers = drift.workers_of(target, registry.jobs())
        try:
            result = check_job(
                target, url, keys=items, sample=sample, workers=workers, schema=config.schema
            )
        except psycopg.Error as exc:  # the check's own statement (its timeout, the SQL)
            click.echo(f"pgjobs: the check failed: {first_line(exc)}", err=True)
            sys.exit(EXIT_DATABASE)
        out = json.dumps(_jsonable(result.as_dict()), indent=2) if as_json else None
        click.echo(out or drift.summary(result))
        if result.drift:
            sys.exit(EXIT_FAILED)


# -- list ----------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


@cli.command(name="list")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_jobs(config_path: str | None, database: str | None, as_json: bool) -> None:
    """List the jobs: name, owner plugin, kind, group, schedule."""
    with _errors():
        _, registry, _ = _load(config_path, database)
        rows: list[dict[str, Any]] = [
            {
                "job": e.job.name,
                "owner": e.owner,
                "kind": e.job.kind,
                "group": e.job.group,
                "schedule": e.job.schedule,
                "enabled": e.job.enabled,
                "target": getattr(e.job, "target", None),
            }
            for e in registry.entries()
        ]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no jobs (no plugin registers any, and the config declares none)")
            return
        click.echo(
            _table(
                ["JOB", "OWNER", "KIND", "GROUP", "SCHEDULE", "ENABLED"],
                [
                    [
                        r["job"],
                        r["owner"],
                        r["kind"],
                        r["group"],
                        r["schedule"],
                        "yes" if r["enabled"] else "no",
                    ]
                    for r in rows
                ],
            )
        )


# -- status ----------------------------------------------------------------------------
def _ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    delta = now - when
    if delta < timedelta(0):
        return f"in {format_duration(-delta)}"
    return f"{format_duration(timedelta(seconds=int(delta.total_seconds())))} ago"


def _until(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    if when <= now:
        return "due"
    return f"in {format_duration(timedelta(seconds=int((when - now).total_seconds()) or 1))}"


def _status(
    registry: Registry, config: Config, url: str | None
) -> tuple[list[dict[str, Any]], datetime, list[dict[str, Any]]]:
    """Every job's row of ``pgjobs status``: registered jobs first, then jobs
    that are no longer registered but still have a state; and the schedulers'
    heartbeats."""
    from .database import resolve_engine
    from .operate import last_check_of, paused_of
    from .readmodel import read_status

    engine, owned = resolve_engine(url)
    names = [e.job.name for e in registry.entries()]
    try:
        with engine.connect() as conn, conn.begin():
            # Reading must not install pgjobs' tables: status writes nothing.
            read = read_status(conn, config.schema, jobs=names)
    finally:
        if owned:
            engine.dispose()
    queues = {q.job: _jsonable(q) for q in read.queues} if read.installed else None
    names += sorted(set(read.states) - set(names))  # no longer registered, still with state
    rows = []
    for name in names:
        state = read.states.get(name, {})
        run, ran = read.last.get(name, {}), read.last_ran.get(name, {})
        changed = None
        if ran:
            changed = {k: ran[k] for k in ("inserted", "updated", "deleted")}
        rows.append(
            {
                "job": name,
                "registered": name in registry,
                "last_outcome": run.get("outcome"),
                "last_at": run.get("finished_at"),
                "last_ran_at": ran.get("finished_at"),
                "next_attempt_at": state.get("next_attempt_at"),
                "failures": state.get("failures", 0),
                "last_error": state.get("last_error"),
                "last_sqlstate": state.get("last_sqlstate"),
                # runs cut off by a lost connection since it last ran (docs/failover.md)
                "interrupted": read.interrupted.get(name, 0),
                "rows_changed": changed,
                "queue": None if queues is None else queues.get(name),
                "paused": paused_of(state),
                "last_check": last_check_of(read.last_checked.get(name)),
            }
        )
    return rows, read.now, read.schedulers


@cli.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(config_path: str | None, database: str | None, as_json: bool) -> None:
    """Each job's last outcome, next attempt, failures, rows changed and queue depth.

    Exit 1 while a job is failing (backing off), for health checks.
    """
    from .operate import check_line

    with _errors():
        config, registry, url = _load(config_path, database)
        rows, now, schedulers = _status(registry, config, url)
        if as_json:
            data = {"now": now, "jobs": rows, "schedulers": schedulers}
            click.echo(json.dumps(_jsonable(data), indent=2))
        else:
            table = []
            for r in rows:
                changed = r["rows_changed"]
                changed_text = (
                    "-"
                    if changed is None
                    else f"{sum(changed.values()):,} (+{changed['inserted']:,} "
                    f"~{changed['updated']:,} -{changed['deleted']:,})"
                )
                queue = r["queue"]
                queue_text = "-"
                if queue is not None:
                    depth = queue.get("depth")
                    queue_text = f"{depth:,}" if isinstance(depth, int) else "?"
                    if queue.get("dead"):
                        queue_text += f" ({queue['dead']:,} dead)"
                table.append(
                    [
                        r["job"] + ("" if r["registered"] else " (unregistered)"),
                        (r["last_outcome"] or "never ran")
                        + (f" ({r['interrupted']:,} interrupted)" if r["interrupted"] else ""),
                        _ago(r["last_at"], now),
                        _until(r["next_attempt_at"], now),
                        f"{r['failures']:,}",
                        changed_text,
                        queue_text,
                    ]
                )
            headers = [
                "JOB",
                "LAST OUTCOME",
                "WHEN",
                "NEXT ATTEMPT",
                "FAILURES",
                "ROWS CHANGED",
                "QUEUE",
            ]
            click.echo(_table(headers, table) if table else "no jobs")
            for r in rows:
                if r["failures"]:
                    state = f" (SQLSTATE {r['last_sqlstate']})" if r["last_sqlstate"] else ""
                    click.echo(
                        f"\n{r['job']}: failing ({r['failures']:,}x){state}: {r['last_error']}"
                    )
                if r["paused"]:
                    paused = r["paused"]
                    why = f": {paused['reason']}" if paused["reason"] else ""
                    since = f"{paused['since']:%Y-%m-%d %H:%M:%S %Z}"
                    click.echo(f"\n{r['job']}: paused since {since} by {paused['by']}{why}")
                if r["last_check"]:
                    click.echo(f"\n{r['job']}: {check_line(r['last_check'], now)}")
            if schedulers:  # their heartbeats (pgjobs.heartbeat)
                from .operate import schedulers_table

                click.echo("\n" + schedulers_table(schedulers, now))
        if any(r["failures"] for r in rows):
            sys.exit(EXIT_FAILED)


# -- pause, resume, enqueue, revive (their work and words: pgjobs.operate) ------------
@cli.command()
@click.argument("job")
@click.option("--reason", metavar="TEXT", default=None, help="Why, shown by status and the page.")
@_common
def pause(job: str, reason: str | None, config_path: str | None, database: str | None) -> None:
    """Pause JOB on every scheduler of the database, from its next tick.

    Its ticks end 'paused' (counted, not logged); queue items keep
    accumulating. `pgjobs resume JOB` resumes it."""
    from .operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).pause(job, reason=reason))


@cli.command()
@click.argument("job")
@_common
def resume(job: str, config_path: str | None, database: str | None) -> None:
    """Resume JOB, paused by `pgjobs pause`; a queue job drains what waited."""
    from .operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).resume(job))


@cli.command(name="enqueue")
@click.argument("job")
@click.argument("keys", nargs=-1, required=True)
@click.option(
    "--json", "as_json", is_flag=True, help='Each KEY is JSON: [7, "b"] or {"a": 7, "b": "b"}.'
)
@_common
def enqueue_items(
    job: str, keys: tuple[str, ...], as_json: bool, config_path: str | None, database: str | None
) -> None:
    """Add KEYs to queue job JOB's queue, in one transaction (a dead item is revived).

    A KEY is the scope column's value as text (typed by the column); for a
    composite scope, give each as JSON with --json."""
    from .operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).enqueue(job, keys, as_json=as_json))


@cli.command()
@click.argument("job")
@click.argument("keys", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Each KEY is JSON (as for enqueue).")
@_common
def revive(
    job: str, keys: tuple[str, ...], as_json: bool, config_path: str | None, database: str | None
) -> None:
    """Put JOB's dead queue items back: due now, attempts reset; all of them
    when no KEY is given."""
    from .operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).revive(job, keys, as_json=as_json))


# -- migrate --------------------------------------------------------------------------
@cli.command()
@_common
@_verbosity
@click.option("--check", is_flag=True, help="Apply nothing; exit 1 if migrations are pending.")
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Apply nothing; print the pending migrations' SQL (all of them for an empty database).",
)
@click.option(
    "--lock-timeout",
    default="2s",
    show_default=True,
    help="The longest one table lock request waits (replicas' statements queue behind it).",
)
@click.option(
    "--retry-for",
    default="60s",
    show_default=True,
    help="Retry attempts that found a lock taken, with backoff, this long; then give up.",
)
def migrate(
    config_path: str | None,
    database: str | None,
    verbose: int,
    check: bool,
    as_sql: bool,
    lock_timeout: str,
    retry_for: str,
) -> None:
    """Apply the migrations pgjobs' schema lacks, and say which.

    --check exits 1 naming the pending migrations, 0 when the schema is
    current (a deploy gate). --sql prints their SQL, schema name filled in,
    for psql -v ON_ERROR_STOP=1 --single-transaction or a migration tool;
    the schema it installs is recognised as current. docs/upgrades.md.
    """
    from .database import resolve_engine
    from .migrations import MigrateSettings, command

    if check and as_sql:
        raise click.UsageError("--check and --sql: choose one")
    with _errors(), _logging(verbose, logging.INFO):
        config = load_config(_given("config_path", config_path))
        settings = MigrateSettings(lock_timeout=lock_timeout, retry_for=retry_for)
        engine, owned = resolve_engine(config.database_url(_given("database", database)))
        try:
            with engine.connect() as conn:
                code, text = command(
                    conn, config.schema, check=check, as_sql=as_sql, settings=settings
                )
        finally:
            if owned:
                engine.dispose()
        click.echo(text, nl=not text.endswith("\n"))
        sys.exit(code)


# -- demo ----------------------------------------------------------------------------
@cli.command()
@click.option(
    "--database",
    metavar="URL",
    default=None,
    help="Where to run, in a schema of its own (default: $PGJOBS_DATABASE_URL, else an"
    " embedded PostgreSQL in a temporary directory).",
)
@click.option(
    "--seconds", type=float, default=30.0, show_default=True, help="How long each design runs."
)
@click.option(
    "--naive",
    is_flag=True,
    help="First run the naive design (delete all, recompute, reinsert) on a copy of the same data.",
)
@click.option("--exams", type=int, default=10_000, show_default=True, help="Parent rows to create.")
@click.option("--students", type=int, default=5, show_default=True, help="Derived rows per parent.")
@click.option(
    "--compute-seconds",
    type=float,
    default=2.0,
    show_default=True,
    help="Simulated compute time of a recompute.",
)
@click.option(
    "--recompute-every",
    type=float,
    default=5.0,
    show_default=True,
    help="Recompute interval, in seconds.",
)
@click.option("--users", type=int, default=2, show_default=True, help="Concurrent simulated users.")
@click.option("--seed", type=int, default=1, show_default=True, help="Random seed.")
def demo(**options: Any) -> None:
    """The field report's scenario: a queue worker, a periodic recompute and
    users deleting rows, naive vs pgjobs, with deadlock and FK-failure counts."""
    from .demo import main as run_demo

    options["database"] = _given("database", options["database"])
    sys.exit(run_demo(**options))


#: set by ``run`` once its scheduler has stopped and everything is written
_STOPPED = threading.Event()


def main(argv: Sequence[str] | None = None) -> None:
    """The ``pgjobs`` console script.

    Once ``pgjobs run`` has stopped, the process runs its exit handlers
    (logging, trace exporters) and ends, without the interpreter's teardown
    of its modules: that took 0.6 to 1 s on a loaded machine, a third of a
    ``--shutdown-timeout 2s`` budget, to free memory the system frees anyway."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="pgjobs")
    except SystemExit as exc:
        if not _STOPPED.is_set():
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
