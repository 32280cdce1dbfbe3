"""``pgjobs run``: the scheduler in the foreground, with the status page and
the metrics when asked for, until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from ..durations import parse_duration
from ..errors import ConfigError
from ..results import RunResult
from .base import (
    _STOPPED,
    _common,
    _errors,
    _load,
    _log_format,
    _logging,
    _verbosity,
    cli,
    log,
)


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
    from ..scheduler import Scheduler
    from ..serve import parse_address

    with _errors(), _logging(verbose, logging.INFO, log_format=log_format):
        http = None if http_address is None else parse_address(http_address, option="--http")
        scrape = (
            None if metrics_address is None else parse_address(metrics_address, option="--metrics")
        )
        metrics = None
        if scrape is not None:
            from ..metrics import Metrics

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
    from .._pg import unavailable, why_unavailable

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
    from .. import tracing

    return tracing.Tracing().observe if tracing.available() else None


def _serve(
    scheduler: Any, http: tuple[str, int] | None, scrape: tuple[str, int] | None, metrics: Any
) -> list[Any]:
    """The status page and the metrics, on one server when they share an address."""
    from ..serve import serve
    from ..web import wsgi_app

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


__all__ = [
    "run",
]
