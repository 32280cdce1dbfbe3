"""``pgjobs list`` (the registered jobs) and ``pgjobs status`` (what
:func:`pgjobs.readmodel.read_status` read, formatted; no SQL of its own)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from typing import Any

import click

from ..config import Config
from ..durations import format_duration
from ..horizon import Horizon, held_past, horizon_line
from ..registry import Registry
from .base import (
    EXIT_FAILED,
    _common,
    _errors,
    _jsonable,
    _load,
    _table,
    cli,
)


# -- list ----------------------------------------------------------------------------
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
) -> tuple[list[dict[str, Any]], datetime, list[dict[str, Any]], Horizon | None]:
    """Every job's row of ``pgjobs status``: registered jobs first, then jobs
    that are no longer registered but still have a state; the schedulers'
    heartbeats; and the database's oldest snapshot or transaction."""
    from ..database import engine_for
    from ..operate import last_check_of, paused_of
    from ..readmodel import read_status

    bound = config.call_timeout.total_seconds()
    names = [e.job.name for e in registry.entries()]
    with engine_for(url, call_timeout=bound) as engine, engine.connect() as conn, conn.begin():
        # Reading must not install pgjobs' tables: status writes nothing.
        # Each statement stops on the server within the round trip's bound.
        read = read_status(conn, config.schema, jobs=names, statement_timeout=bound)
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
                # runs rolled back by a lock timeout, a deadlock, ... since it last
                # ran: retried within seconds, not failures (docs/operate.md)
                "transient": read.transient.get(name, 0),
                "rows_changed": changed,
                "queue": None if queues is None else queues.get(name),
                "paused": paused_of(state),
                "last_check": last_check_of(read.last_checked.get(name)),
                # a sliced run in progress (docs/slices.md)
                "sliced": read.sliced.get(name),
            }
        )
    return rows, read.now, read.schedulers, read.horizon


def sliced_line(run: dict[str, Any], now: Any) -> str:
    """A sliced run in progress, in one line."""
    processes = run.get("processes") or []
    resumed = ", resumed" if run.get("resumed") else ""
    return (
        f"sliced run in progress: {run['done']:,}/{run['pieces']:,} pieces in"
        f" {run['slices']:,} slices, {run['written']:,} rows written, started"
        f" {_ago(run['started_at'], now)}, last slice {_ago(run['touched_at'], now)},"
        f" {len(processes)} process(es){resumed}"
    )


def _queue_text(queue: dict[str, Any] | None) -> str:
    """The QUEUE column: depth, and apart the items failing (waiting for
    their retry) and the dead ones (parked)."""
    if queue is None:
        return "-"
    depth = queue.get("depth")
    text = f"{depth:,}" if isinstance(depth, int) else "?"
    apart = [
        f"{queue[k]:,} {word}"
        for k, word in (("retrying", "failing"), ("dead", "dead"))
        if queue.get(k)
    ]
    return text + (f" ({', '.join(apart)})" if apart else "")


def _unhealthy(rows: list[dict[str, Any]], max_dead: int) -> list[str]:
    """Why ``pgjobs status --health`` fails: jobs failing (backing off), and
    queues with more than ``max_dead`` dead items; empty when healthy."""
    why = [f"{r['job']}: failing ({r['failures']:,}x)" for r in rows if r["failures"]]
    for r in rows:
        dead = (r["queue"] or {}).get("dead") or 0
        if dead > max_dead:
            why.append(f"{r['job']}: {dead:,} dead item(s), more than {max_dead:,}")
    return why


@cli.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--health",
    is_flag=True,
    help="A health check: one line, exit 1 if a job is failing or a queue has dead items.",
)
@click.option(
    "--max-dead",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="With --health: dead items a queue may have and still pass.",
)
def status(
    config_path: str | None, database: str | None, as_json: bool, health: bool, max_dead: int
) -> None:
    """Each job's last outcome, next attempt, failures, rows changed and queue
    depth (with its failing and dead items apart).

    Exit 1 while a job is failing (backing off). --health prints one line and
    exits 1 also when a queue holds more than --max-dead dead items (0 unless
    given); 3 when the database cannot be reached.
    """
    from ..operate import check_line

    with _errors():
        config, registry, url = _load(config_path, database)
        rows, now, schedulers, horizon = _status(registry, config, url)
        held = held_past(horizon, config.horizon_warning)
        if health:
            problems = _unhealthy(rows, max_dead)
            click.echo(
                f"pgjobs: unhealthy: {'; '.join(problems)}" if problems else "pgjobs: healthy"
            )
            if problems:
                sys.exit(EXIT_FAILED)
            return
        if as_json:
            data = {
                "now": now,
                "jobs": rows,
                "schedulers": schedulers,
                "horizon": None if horizon is None else horizon.as_dict(),
                "horizon_held": held,
            }
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
                unsettled = [f"{r[k]:,} {k}" for k in ("interrupted", "transient") if r[k]]
                table.append(
                    [
                        r["job"] + ("" if r["registered"] else " (unregistered)"),
                        (r["last_outcome"] or "never ran")
                        + (f" ({', '.join(unsettled)})" if unsettled else ""),
                        _ago(r["last_at"], now),
                        _until(r["next_attempt_at"], now),
                        f"{r['failures']:,}",
                        changed_text,
                        _queue_text(r["queue"]),
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
                queue = r["queue"] or {}
                if queue.get("dead"):
                    click.echo(
                        f"\n{r['job']}: {queue['dead']:,} dead item(s), parked after"
                        f" max_attempts failures (pgjobs revive {r['job']})"
                    )
                if r["paused"]:
                    paused = r["paused"]
                    why = f": {paused['reason']}" if paused["reason"] else ""
                    since = f"{paused['since']:%Y-%m-%d %H:%M:%S %Z}"
                    click.echo(f"\n{r['job']}: paused since {since} by {paused['by']}{why}")
                if r["last_check"]:
                    click.echo(f"\n{r['job']}: {check_line(r['last_check'], now)}")
                if r["sliced"]:
                    click.echo(f"\n{r['job']}: {sliced_line(r['sliced'], now)}")
            if schedulers:  # their heartbeats (pgjobs.heartbeat)
                from ..operate import schedulers_table

                click.echo("\n" + schedulers_table(schedulers, now))
            if held:
                assert horizon is not None
                click.echo(f"\n{horizon_line(horizon)}")
        if any(r["failures"] for r in rows):
            sys.exit(EXIT_FAILED)


__all__ = [
    "list_jobs",
    "status",
]
