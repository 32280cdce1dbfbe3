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
) -> tuple[list[dict[str, Any]], datetime, list[dict[str, Any]]]:
    """Every job's row of ``pgjobs status``: registered jobs first, then jobs
    that are no longer registered but still have a state; and the schedulers'
    heartbeats."""
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
                "rows_changed": changed,
                "queue": None if queues is None else queues.get(name),
                "paused": paused_of(state),
                "last_check": last_check_of(read.last_checked.get(name)),
                # a sliced run in progress (docs/slices.md)
                "sliced": read.sliced.get(name),
            }
        )
    return rows, read.now, read.schedulers


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


@cli.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(config_path: str | None, database: str | None, as_json: bool) -> None:
    """Each job's last outcome, next attempt, failures, rows changed and queue depth.

    Exit 1 while a job is failing (backing off), for health checks.
    """
    from ..operate import check_line

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
                if r["sliced"]:
                    click.echo(f"\n{r['job']}: {sliced_line(r['sliced'], now)}")
            if schedulers:  # their heartbeats (pgjobs.heartbeat)
                from ..operate import schedulers_table

                click.echo("\n" + schedulers_table(schedulers, now))
        if any(r["failures"] for r in rows):
            sys.exit(EXIT_FAILED)


__all__ = [
    "list_jobs",
    "status",
]
