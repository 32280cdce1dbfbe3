"""The one read of what status shows: ``pgjobs status`` (:mod:`pgjobs.cli`),
the status page (:mod:`pgjobs.snapshot` for :mod:`pgjobs.web`) and the
metrics (:mod:`pgjobs.metrics`) all read pgjobs' tables through
:func:`read_status`, so a figure means the same on each of them.

What it reads, in one read-only transaction (the caller's), writing
nothing and installing nothing:

* per job, its ``job_state`` row (failures, next attempt, last error, the
  pause with its reason and since when), its last run, its last run that
  ran, its last check (``outcome = 'checked'``, drift), since when it fails
  and how many of its runs were ``interrupted`` or ``transient`` since it
  last succeeded;
* per job with anything queued, :class:`QueueStats`: depth, due, retrying,
  dead, and two ages: the oldest *live* item (``oldest_age``, what
  :func:`pgjobs.queue_stats` has always said) and the oldest *due* item
  (``oldest_due_age``, what the page and the metrics show);
* the schedulers' heartbeats (:func:`pgjobs.heartbeat.schedulers_query`);
* the database's oldest snapshot or transaction and who holds it
  (:mod:`pgjobs.horizon`), whether pgjobs is installed or not;
* each sliced run in progress (:func:`sliced_query`: pieces done of how
  many, rows written so far, the processes taking part);
* optionally, the latest runs and dead items (the page's lists).

Two round trips (:func:`pgjobs._pg.send`): the settings, the clock and
whether pgjobs is installed; then every statement at once, in a pipeline.
Each job's latest run is one probe of the ``(job, started_at)`` index per
job: a ``DISTINCT ON`` over the whole run log sorts all of it (0.45 s at
100k runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import Result, driver, send, set_local
from .durations import setting_ms
from .heartbeat import schedulers_query
from .horizon import Horizon, horizon_of, horizon_query


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueStats:
    """One job's queue, for ``pgjobs status``, the page and the metrics."""

    job: str
    #: live items: due now or waiting for their retry
    depth: int
    #: live items that may be claimed now
    due: int
    #: live items that failed at least once and wait for another attempt
    retrying: int
    #: parked items (failed ``max_attempts`` times), kept until enqueued again
    dead: int
    #: the first enqueue of the oldest live item, and its age (database clock)
    oldest_enqueued_at: datetime | None = None
    oldest_age: timedelta | None = None
    #: the age of the oldest item that may be claimed now (``None``: none is due)
    oldest_due_age: timedelta | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusRead:
    """What :func:`read_status` read; rows as dicts by column name, by job."""

    now: datetime
    installed: bool
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: each job's last run, whatever its outcome
    last: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: each job's last run that ran
    last_ran: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: each job's last check (``pgjobs check``, ``verify_every``)
    last_checked: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per failing job, the start of its first failed run since it last succeeded
    failing_since: dict[str, datetime] = field(default_factory=dict)
    #: per job, its runs ``interrupted`` (a lost connection) since it last succeeded
    interrupted: dict[str, int] = field(default_factory=dict)
    #: per job, its runs ``transient`` (a lock timeout, a deadlock, ...) since it last succeeded
    transient: dict[str, int] = field(default_factory=dict)
    queues: list[QueueStats] = field(default_factory=list)
    #: the latest dead items and runs (only when asked for)
    dead: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    #: the oldest snapshot or transaction of the database (``None``: none)
    horizon: Horizon | None = None
    #: per job, its sliced run in progress (``slice_run``, migration 014):
    #: pieces done of how many, slices, rows written, started, last slice,
    #: resumed, the processes so far
    sliced: dict[str, dict[str, Any]] = field(default_factory=dict)


def _dicts(result: Result) -> list[dict[str, Any]]:
    names = result.columns or ()
    return [dict(zip(names, row, strict=True)) for row in result.all()]


def _by_job(result: Result) -> dict[str, dict[str, Any]]:
    return {r["job"]: r for r in _dicts(result)}


def queue_stats_query(schema: str) -> sql.Composed:
    """Per job with anything queued (or only ``%(job)s``, when not null):
    the columns of :class:`QueueStats`, in its order."""
    return sql.SQL(
        "select job, count(*) filter (where dead_at is null) as depth,"
        " count(*) filter (where dead_at is null and not_before <= now()) as due,"
        " count(*) filter (where dead_at is null and attempts > 0) as retrying,"
        " count(*) filter (where dead_at is not null) as dead,"
        " min(enqueued_at) filter (where dead_at is null) as oldest_enqueued_at,"
        " now() - min(enqueued_at) filter (where dead_at is null) as oldest_age,"
        " now() - min(enqueued_at) filter (where dead_at is null and not_before <= now())"
        " as oldest_due_age from {} where %(job)s::text is null or job = %(job)s"
        " group by job order by job"
    ).format(sql.Identifier(schema, "queue"))


def queue_stats_of(rows: Sequence[Sequence[Any]]) -> list[QueueStats]:
    """:class:`QueueStats` from the rows of :func:`queue_stats_query`."""
    return [
        QueueStats(
            job=r[0],
            depth=r[1],
            due=r[2],
            retrying=r[3],
            dead=r[4],
            oldest_enqueued_at=r[5],
            oldest_age=r[6],
            oldest_due_age=r[7],
        )
        for r in rows
    ]


def _latest(schema: str, only: str) -> sql.Composed:
    """Each job's latest run (of those matching ``only``): one index probe a job."""
    return sql.SQL(
        "with j(job) as (select unnest(%(names)s::text[]) union"
        " select job from {state} where %(job)s::text is null)"
        " select r.* from j, lateral (select * from {run} r where r.job = j.job {only}"
        " order by r.started_at desc, r.id desc limit 1) r"
    ).format(
        state=sql.Identifier(schema, "job_state"),
        run=sql.Identifier(schema, "run"),
        only=sql.SQL(only),
    )


def _per_job(schema: str) -> dict[str, sql.Composed]:
    """The statements of the per-job figures of :class:`StatusRead`, by field."""
    state, run = sql.Identifier(schema, "job_state"), sql.Identifier(schema, "run")
    only = sql.SQL("where (%(job)s::text is null or s.job = %(job)s)")
    return {
        "states": sql.SQL("select * from {} s {}").format(state, only),
        "last": _latest(schema, ""),
        "last_ran": _latest(schema, "and r.outcome = 'ran'"),
        "last_checked": _latest(schema, "and r.outcome = 'checked'"),
        "failing_since": sql.SQL(
            "select r.job, min(r.started_at) as since from {run} r join {state} s"
            " on s.job = r.job {only} and s.failures > 0 and r.outcome = 'failed'"
            " and r.started_at > coalesce(s.last_success_at, '-infinity') group by r.job"
        ).format(run=run, state=state, only=only),
        # per job, a probe of the (job, started_at) index from its last success
        "interrupted": sql.SQL(
            "select s.job, (select count(*) from {run} as r where r.job = s.job"
            " and r.started_at > coalesce(s.last_success_at, '-infinity')"
            " and r.outcome = 'interrupted') from {state} as s {only}"
        ).format(state=state, run=run, only=only),
        "transient": sql.SQL(
            "select s.job, (select count(*) from {run} as r where r.job = s.job"
            " and r.started_at > coalesce(s.last_success_at, '-infinity')"
            " and r.outcome = 'transient') from {state} as s {only}"
        ).format(state=state, run=run, only=only),
        "queues": queue_stats_query(schema),
    }


def sliced_query(schema: str) -> sql.Composed:
    """Each sliced run in progress (or only ``%(job)s``'s)."""
    return sql.SQL(
        "select r.job, r.done, r.pieces, r.slices, r.inserted + r.updated + r.deleted as written,"
        " r.started_at, r.touched_at, r.resumed,"
        " (select array_agg(distinct regexp_replace(s.taken_by, ' #[0-9]+$', '')) from {s} as s"
        "  where s.job = r.job and s.run = r.id and s.taken_by is not null) as processes"
        " from {r} as r where (%(job)s::text is null or r.job = %(job)s)"
    ).format(r=sql.Identifier(schema, "slice_run"), s=sql.Identifier(schema, "slice"))


def _lists(schema: str, *, dead: int, runs: int) -> dict[str, sql.Composed]:
    """The statements of the latest dead items and runs, when asked for."""
    out = {}
    if dead:
        out["dead"] = sql.SQL(
            "select job, key::text as key, attempts, dead_at, last_error from {}"
            " where dead_at is not null and (%(job)s::text is null or job = %(job)s)"
            " order by dead_at desc limit %(dead)s"
        ).format(sql.Identifier(schema, "queue"))
    if runs:
        out["runs"] = sql.SQL(
            "select id, job, outcome, started_at, finished_at, compute_ms, write_ms,"
            " lock_ms, inserted, updated, deleted, skipped_missing_parent, unchanged,"
            " items, failed_items, error, sqlstate, worker, detail from {}"
            " where %(job)s::text is null or job = %(job)s"
            " order by started_at desc, id desc limit %(runs)s"
        ).format(sql.Identifier(schema, "run"))
    return out


#: what ``history=False`` leaves out
_HISTORY = ("last", "last_ran", "failing_since", "interrupted", "transient")

#: how each statement's result becomes its field of :class:`StatusRead`
_FIELDS: dict[str, Callable[[Result], Any]] = {
    "states": _by_job,
    "last": _by_job,
    "last_ran": _by_job,
    "last_checked": _by_job,
    "failing_since": lambda r: {job: at for job, at in r.all()},
    "interrupted": lambda r: {job: n for job, n in r.all() if n},
    "transient": lambda r: {job: n for job, n in r.all() if n},
    "queues": lambda r: queue_stats_of(r.all()),
    "dead": _dicts,
    "runs": _dicts,
    "schedulers": _dicts,
    "sliced": _by_job,
}


def read_status(
    conn: Connection,
    schema: str,
    *,
    jobs: Sequence[str] = (),
    job: str | None = None,
    runs: int = 0,
    dead: int = 0,
    history: bool = True,
    statement_timeout: float | None = None,
) -> StatusRead:
    """Everything status shows, in ``conn``'s transaction, made read-only.

    ``jobs``: the known jobs, whose last runs are read besides those of
    every job with a state; ``job``: only that one (and no heartbeats);
    ``runs``/``dead``: how many of the latest runs and dead items to list;
    ``history``: false skips what the metrics do not show (the last run,
    the last run that ran, failing since, interrupted: most of the cost,
    45 against 156 ms at 1,000 jobs and 50,000 runs on a loaded 2-core
    machine);
    ``statement_timeout`` (seconds) bounds each statement. Where pgjobs'
    tables are not installed, ``installed`` is false and nothing is created.
    """
    settings = {"transaction_read_only": "on"}
    if statement_timeout is not None:
        settings["statement_timeout"] = setting_ms(statement_timeout)
    tables = [
        sql.Identifier(schema, t).as_string(driver(conn))
        for t in ("job_state", "scheduler", "slice_run")
    ]
    # round trip 1: the settings, the clock, what is installed, the horizon
    _, clock, oldest = send(
        conn,
        set_local(settings),
        (
            "select now(), to_regclass(%s) is not null, to_regclass(%s) is not null,"
            " to_regclass(%s) is not null",
            tables,
        ),
        (horizon_query(), None),
    )
    row = clock.one()
    assert row is not None
    now, installed, beating, slicing = row
    horizon = horizon_of(oldest.all())
    if not installed:  # reading installs nothing
        return StatusRead(now=now, installed=False, horizon=horizon)
    # round trip 2: everything else
    names = [job] if job is not None else list(dict.fromkeys(jobs))
    params = {"job": job, "names": names, "runs": runs, "dead": dead}
    statements: list[tuple[str, sql.Composed, Any]] = [
        (name, statement, params)
        for name, statement in {**_per_job(schema), **_lists(schema, dead=dead, runs=runs)}.items()
        if history or name not in _HISTORY
    ]
    if beating and job is None:  # an older schema has no heartbeats
        statements.append(("schedulers", *schedulers_query(schema)))
    if slicing:  # nor sliced runs
        statements.append(("sliced", sliced_query(schema), params))
    results = send(conn, *((statement, p) for _, statement, p in statements))
    fields = {name: _FIELDS[name](r) for (name, _, _), r in zip(statements, results, strict=True)}
    return StatusRead(now=now, installed=True, horizon=horizon, **fields)


__all__ = [
    "QueueStats",
    "StatusRead",
    "queue_stats_of",
    "queue_stats_query",
    "read_status",
    "sliced_query",
]
