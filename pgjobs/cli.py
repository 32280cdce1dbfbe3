"""The ``pgjobs`` command.

::

    pgjobs run              start the scheduler in the foreground (SIGTERM/SIGINT stop it)
    pgjobs once JOB         run one tick of JOB now, showing its phases and progress
    pgjobs list             jobs, owner plugins, kinds, groups and schedules
    pgjobs status           last outcome, next attempt, failures, rows changed, queue depth
    pgjobs demo             the demonstration (see ``pgjobs demo --help``)

Every command takes ``--config/-c`` (default ``$PGJOBS_CONFIG``, else
``./pgjobs.toml`` when present) and ``--database`` (default
``$PGJOBS_DATABASE_URL``, else the config file's ``database``), before the
command (``pgjobs --config f list``) or after it (``pgjobs list --config f``).

Exit codes: 0 ok; 1 a job failed (``once``: the tick failed or found its
group busy; ``status``: a job is failing); 2 a usage, config or plugin error;
3 the database is unreachable (or refused pgjobs' own statements, outside
any job: the connection, the checks, the status query). A tick that fails
on the database inside the job is a failed job: 1.
"""

from __future__ import annotations

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
from .durations import format_duration
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
        from sqlalchemy.exc import DBAPIError

        if not isinstance(exc, DBAPIError):
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
def run(
    config_path: str | None,
    database: str | None,
    verbose: int,
    log_format: str,
    no_check: bool,
    exit_if_unreachable: bool,
    http_address: str | None,
    metrics_address: str | None,
) -> None:
    """Run the scheduler in the foreground until SIGTERM or SIGINT.

    The first signal stops firing and waits for the running transactions to
    commit or roll back; a second one exits at once (PostgreSQL rolls back).
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
        config, registry, url = _load(config_path, database)
        if not registry.jobs(enabled_only=True):
            raise ConfigError(
                "no enabled jobs: install a plugin package, list modules under plugins = [...] "
                f"or declare jobs in {config.path or 'pgjobs.toml'}"
            )
        scheduler = Scheduler.from_config(
            config,
            database=url,
            registry=registry,
            check=not no_check,
            on_result=_tracing(),
        )
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
            scheduler.shutdown(wait=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        click.echo("pgjobs: stopped", err=True)


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
    return head


@cli.command()
@click.argument("job")
@_common
@_verbosity
@click.option("--json", "as_json", is_flag=True, help="Print the RunResult as JSON.")
@click.option("--no-check", is_flag=True, help="Skip checking the job against the database first.")
def once(
    job: str,
    config_path: str | None,
    database: str | None,
    verbose: int,
    as_json: bool,
    no_check: bool,
) -> None:
    """Run one tick of JOB now, forced: its schedule and backoff are ignored
    (a job that is not due, or backing off after a failure, runs anyway),
    never its group lock (busy: exit 1). pgjobs.run_once() is not forced by
    default: it honours both, as the scheduler does.

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
            url, namespace=config.namespace, schema=config.schema, call_timeout=config.call_timeout
        ) as runner:
            if not no_check:
                check_jobs(runner.engine, [registry.entry(job)])
            with Display(job, sys.stderr) as progress:
                result = runner.tick(target, force=True, progress=progress)
        if as_json:
            click.echo(json.dumps(_jsonable(result), indent=2))
        else:
            click.echo(_summary(result))
        if result.outcome in (Outcome.FAILED, Outcome.BUSY, Outcome.INTERRUPTED):
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
) -> tuple[list[dict[str, Any]], datetime]:
    """Every job's row of ``pgjobs status``: registered jobs first, then jobs
    that are no longer registered but still have a state."""
    from .database import resolve_engine
    from .queue import queue_stats
    from .store import Store

    engine, owned = resolve_engine(url)
    queues: dict[str, Any] | None = None
    try:
        with engine.connect() as conn, conn.begin():
            # Reading must not install pgjobs' tables: status writes nothing.
            read = Store(config.schema).status(conn)
            if read.installed:
                queues = {q.job: _jsonable(q) for q in queue_stats(conn, schema=config.schema)}
    finally:
        if owned:
            engine.dispose()
    names = [e.job.name for e in registry.entries()]
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
            }
        )
    return rows, read.now


@cli.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(config_path: str | None, database: str | None, as_json: bool) -> None:
    """Each job's last outcome, next attempt, failures, rows changed and queue depth.

    Exit 1 while a job is failing (backing off), for health checks.
    """
    with _errors():
        config, registry, url = _load(config_path, database)
        rows, now = _status(registry, config, url)
        if as_json:
            click.echo(json.dumps(_jsonable({"now": now, "jobs": rows}), indent=2))
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
        if any(r["failures"] for r in rows):
            sys.exit(EXIT_FAILED)


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


def main(argv: Sequence[str] | None = None) -> None:
    """The ``pgjobs`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="pgjobs")


if __name__ == "__main__":
    main()
