"""Flow in any process layout: the queue workers' records, and what a
recompute learns from them (``docs/flow.md``; the protocol itself:
``docs/DESIGN.md``, "Flow").

A recompute with flow leaves out of its writes the scope keys a queue
worker rewrote after its snapshot S0; to match rows to the workers' marks
it must know their scope, and that every worker that may write its target
meanwhile marks (has flow on) and takes the same write lock (group and
namespace). A registry knows that only of the queue jobs registered beside
the recompute. So each queue job records itself in ``flow_worker``
(migration 010): a scheduler for its queue jobs when it starts and every
:data:`RENEW_EVERY` while it runs; a tick of a queue job, in its own
transaction after the write lock (:func:`record_query`), when no record of
the same kind is fresh (younger than :data:`FRESH`). A record not renewed
for :data:`STALE` is disregarded: its worker no longer runs, or is idle.

A recompute reads the records three times:

1. before its lock (:func:`read_plan`): with flow only when every live
   record (and what its own process knows, ``worker_scope``) agrees on one
   scope, its group and namespace, and flow on; the runner takes its locks
   by that plan. Otherwise it runs without flow (the write lock from start to
   commit, always exact) and says why, once per process and job.
2. in the statement that takes S0 (:func:`snapshot_query`): the same plan
   again, or the run is given up (``busy``; the workers changed just then).
3. before each chunk's writes, after the write lock's grant
   (:func:`changed_query`): the records renewed after S0 (their xid is not
   visible in S0); one that disagrees with the plan gives the run up.

Why that is enough: a worker tick T that writes after S0 renews its record
in T unless a record of its kind was younger than FRESH at that moment. Such
a record was either visible in S0, and then younger than STALE at S0 (S0 is
earlier than T, and FRESH < STALE): the plan counted it; or written after
S0, and then check 3 sees it (it committed before T, and T before the chunk's
grant). A tick the plan did not count therefore never writes unseen.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import driver, execute, later, qualified, send
from .jobs import QueueJob, RecomputeJob

log = logging.getLogger(__name__)

#: a tick renews its job's record when none of its kind is younger than this
FRESH = timedelta(minutes=1)
#: a record not renewed for this long is disregarded by recomputes
STALE = timedelta(minutes=5)
#: a scheduler renews the records of its queue jobs this often
RENEW_EVERY = timedelta(seconds=60)
#: records older than this are deleted (by the recomputes of their target):
#: until then a stale record says that workers ran (a warning, not an info
#: line, when none is live); the table keeps a few rows per kind of worker
PRUNE_AFTER = timedelta(hours=1)

#: the process, as records show it
WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _interval(value: timedelta) -> str:
    return f"{int(value.total_seconds() * 1000)} milliseconds"


# -- the workers' side ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _record_sql(schema: str) -> sql.Composed:
    table = sql.Identifier(schema, "flow_worker")
    return sql.SQL(
        "insert into {t} as w (target, job, grp, namespace, scope, flow, backend, worker,"
        " seen_at, xid)"
        " select r.label, %s, %s, %s, %s::text[], %s, pg_backend_pid(), %s, clock_timestamp(),"
        " pg_current_xact_id()"
        " from (select n.nspname || '.' || c.relname as label from pg_class c"
        " join pg_namespace n on n.oid = c.relnamespace where c.oid = to_regclass(%s)) as r"
        " where not exists (select from {t} as f where f.target = r.label and f.job = %s"
        " and f.grp = %s and f.namespace = %s and f.scope = %s::text[] and f.flow = %s"
        " and f.seen_at > clock_timestamp() - %s::interval)"
        " on conflict (target, job, grp, namespace, scope, flow, backend) do update"
        " set seen_at = excluded.seen_at, xid = excluded.xid, worker = excluded.worker"
    ).format(t=table)


def _regclass_text(target: str) -> str:
    return qualified(target).as_string(None)


def record_query(
    job: QueueJob, namespace: str, schema: str, *, fresh: timedelta = FRESH
) -> tuple[sql.Composed, tuple[Any, ...]]:
    """The statement that records ``job`` as a worker of its target, unless
    a record of the same kind is younger than ``fresh`` (then it writes
    nothing: one index probe). A tick sends it after its write lock."""
    group = job.group or job.name
    scope = list(job.scope)
    return _record_sql(schema), (
        job.name,
        group,
        namespace,
        scope,
        job.flow,
        WORKER,
        _regclass_text(job.target),
        job.name,
        group,
        namespace,
        scope,
        job.flow,
        _interval(fresh),
    )


#: (server, database, schema, namespace, job, its kind) -> time.monotonic() at
#: the start of a tick of this process that sent its record and committed
_recorded: dict[tuple[Any, ...], float] = {}


def record_for_tick(conn: Connection, job: QueueJob, namespace: str, schema: str) -> Any:
    """Queue ``job``'s record on ``conn`` for the tick's lock round trip
    (:func:`record_query`), unless a tick of this process sent it, and
    committed, less than ``FRESH / 2`` ago. Returns what to call after the
    tick's commit (``None``: nothing sent).

    Why leaving it out keeps the argument of the module docstring: the
    committed tick T0 left a record of this kind whose ``seen_at`` is at
    most ``FRESH`` before T0's start (it wrote one, or found one that
    fresh), and nothing deletes a record younger than ``PRUNE_AFTER``. A
    tick T within ``FRESH / 2`` of T0's start therefore has a committed
    record younger than ``1.5 * FRESH < STALE``: the one the statement
    would have found. Saves a statement on nearly every tick."""
    info = driver(conn).info
    group = job.group or job.name
    key = (
        info.host,
        info.port,
        info.dbname,
        schema,
        namespace,
        job.name,
        group,
        tuple(job.scope),
        job.flow,
        job.target,
    )
    started = time.monotonic()
    last = _recorded.get(key)
    if last is not None and started - last < FRESH.total_seconds() / 2:
        return None
    later(conn, *record_query(job, namespace, schema))

    def committed(_conn: Connection) -> None:
        if len(_recorded) >= 1024:
            _recorded.clear()
        _recorded[key] = started

    return committed


def renew(conn: Connection, jobs: Iterable[QueueJob], namespace: str, schema: str) -> None:
    """Record ``jobs`` (a scheduler's queue jobs) as workers of their
    targets, in one round trip of its own transaction."""
    statements = [record_query(job, namespace, schema, fresh=RENEW_EVERY / 2) for job in jobs]
    if statements:
        with conn.begin():
            send(conn, *statements)


# -- the recompute's side ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One row of ``flow_worker`` as a recompute reads it."""

    job: str
    group: str
    namespace: str
    scope: tuple[str, ...]
    flow: bool
    worker: str
    #: seconds since it was last renewed
    age: float

    @property
    def kind(self) -> tuple[str, str, tuple[str, ...], bool]:
        """What a recompute must agree with: (group, namespace, scope, flow)."""
        return (self.group, self.namespace, self.scope, self.flow)

    def describe(self) -> str:
        flow = "" if self.flow else ", flow = false"
        return (
            f"{self.job} (scope ({', '.join(self.scope)}), group {self.group!r}{flow})"
            f" on {self.worker}, {_age(self.age)} ago"
        )


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """How a recompute runs: with flow and its workers' ``scope``, or
    without (``scope`` is ``None``), and why (``state``, ``reason``)."""

    #: the workers' scope columns; ``None``: without flow
    scope: tuple[str, ...] | None
    #: "on"; or why not: "off" (flow = false), "no workers" (none known),
    #: "unknown" (workers were seen, none lately), "conflict"
    state: str
    #: what the warning says (empty when flow is on)
    reason: str = ""

    @property
    def flows(self) -> bool:
        return self.scope is not None


OFF = FlowPlan(None, "off")

#: the rows of a target's records, as one jsonb array (one round trip, any number)
_RECORDS = (
    "select coalesce(jsonb_agg(jsonb_build_array(job, grp, namespace, scope, flow, worker,"
    " extract(epoch from clock_timestamp() - seen_at)::float8)), '[]'::jsonb)"
    " from {t} where target = {label}"
)


def _records_sql(schema: str, label: sql.Composable, where: str = "") -> sql.Composed:
    return sql.SQL(_RECORDS + where).format(t=sql.Identifier(schema, "flow_worker"), label=label)


_LABEL_OF = sql.SQL(
    "(select n.nspname || '.' || c.relname from pg_class c join pg_namespace n"
    " on n.oid = c.relnamespace where c.oid = to_regclass(%s))"
)


def records(value: Any) -> list[WorkerRecord]:
    """The records of a :data:`_RECORDS` answer."""
    rows = json.loads(value) if isinstance(value, str) else (value or [])
    return [
        WorkerRecord(str(j), str(g), str(n), tuple(s), bool(f), str(w), float(a))
        for j, g, n, s, f, w, a in rows
    ]


def read_plan(conn: Connection, job: RecomputeJob, namespace: str, schema: str) -> FlowPlan:
    """Step 1 (module docstring): the plan by the live records of ``job``'s
    target and its own ``worker_scope``, read in the caller's transaction
    (the runner's work check), and said once per process and job when it is
    without flow."""
    if not job.flow:
        return OFF
    mark = sql.Identifier(schema, "mark")
    statement = sql.SQL("select ({records}), exists (select from {mark} where target = {label})")
    label = _regclass_text(job.target)
    row = execute(
        conn,
        statement.format(records=_records_sql(schema, _LABEL_OF), mark=mark, label=_LABEL_OF),
        (label, label),
    ).fetchone()
    assert row is not None
    plan = plan_for(job, namespace, records(row[0]), marked=bool(row[1]))
    tell(job, plan)
    return plan


def snapshot_query(schema: str, label: str, unlock: str) -> tuple[sql.Composed, tuple[Any, ...]]:
    """S0, the target's records (seen by S0 itself: one statement, one
    snapshot) and the write lock ``unlock`` given back."""
    return (
        sql.SQL(
            "select pg_current_snapshot()::text, ({records}),"
            " pg_advisory_unlock(hashtextextended(%s, 0))"
        ).format(records=_records_sql(schema, sql.Placeholder())),
        (label, unlock),
    )


def changed_query(schema: str, label: str, s0: str) -> tuple[sql.Composed, tuple[Any, ...]]:
    """The target's records renewed after S0 (their xid is not visible in S0)."""
    return (
        _records_sql(
            schema, sql.Placeholder(), " and not pg_visible_in_snapshot(xid, %s::pg_snapshot)"
        ),
        (label, s0),
    )


def prune_query(schema: str, label: str) -> tuple[sql.Composed, tuple[Any, ...]]:
    """Delete the target's records older than :data:`PRUNE_AFTER`, skipping
    any a session is renewing (never waits)."""
    table = sql.Identifier(schema, "flow_worker")
    return (
        sql.SQL(
            "delete from {t} where ctid = any(array(select ctid from {t} where target = %s"
            " and seen_at < clock_timestamp() - %s::interval for update skip locked))"
        ).format(t=table),
        (label, _interval(PRUNE_AFTER)),
    )


def plan_for(
    job: RecomputeJob, namespace: str, found: Sequence[WorkerRecord], *, marked: bool = False
) -> FlowPlan:
    """The plan by ``found`` (the target's records) and ``job.worker_scope``
    (the scope of the queue jobs registered beside it, if any). ``marked``:
    workers have left marks on the target (evidence that some exist)."""
    if not job.flow:
        return OFF
    group = job.group or job.name
    live = [r for r in found if r.age < STALE.total_seconds()]
    kinds = {r.kind for r in live}
    if job.worker_scope is not None:
        kinds.add((group, namespace, job.worker_scope, True))
    if not kinds:
        if found or marked:
            seen = sorted(found, key=lambda r: r.age)
            last = f" (last seen: {seen[0].describe()})" if seen else ""
            return FlowPlan(None, "unknown", _UNKNOWN.format(last=last, stale=_age(_STALE_S)))
        return FlowPlan(None, "no workers", _NO_WORKERS)
    wrong = [r for r in live if r.group != group or r.namespace != namespace]
    if wrong:
        return FlowPlan(
            None,
            "conflict",
            f"{_list(wrong)} take(s) another write lock than this recompute's"
            f" ({namespace}:{group}): give the jobs of one table one group (and namespace)",
        )
    off = [r for r in live if not r.flow]
    if off:
        return FlowPlan(
            None, "conflict", f"{_list(off)} has flow = false, so it leaves no marks to exclude by"
        )
    scopes = {k[2] for k in kinds}
    if len(scopes) > 1:
        mine = (
            f"; this process registers its queue jobs with scope ({', '.join(job.worker_scope)})"
            if job.worker_scope is not None
            else ""
        )
        return FlowPlan(
            None,
            "conflict",
            f"its queue workers disagree on the scope: {_list(live)}{mine}. During a deploy this"
            f" ends by itself once the old version's record is {_age(_STALE_S)} old; otherwise"
            " give every queue job of the table the same scope",
        )
    return FlowPlan(scopes.pop(), "on")


_STALE_S = STALE.total_seconds()
_NO_WORKERS = "no queue worker of its target is known"
_UNKNOWN = (
    "no queue worker of its target has renewed its record in the last {stale}{last}, so it"
    " cannot know which rows they rewrite. A worker records itself when its scheduler starts"
    " and while it runs, and at a tick: once the target's queue job runs again (on a pgjobs"
    " with migration 010), the next run has flow"
)


def _list(found: Sequence[WorkerRecord]) -> str:
    return "; ".join(r.describe() for r in sorted(found, key=lambda r: (r.job, r.age)))


def disagrees(
    plan: FlowPlan, job: RecomputeJob, namespace: str, found: Sequence[WorkerRecord]
) -> str:
    """Why ``found`` (records renewed after S0) do not fit the plan, or ""."""
    group = job.group or job.name
    wrong = [r for r in found if r.kind != (group, namespace, plan.scope, True)]
    return f"a queue worker recorded itself during the run: {_list(wrong)}" if wrong else ""


class WorkersChanged(Exception):
    """The records changed while a recompute with flow ran: it gives up."""


# -- saying so once ------------------------------------------------------------------------------
#: per recompute job, the state last said (a process says each change once)
_told: dict[str, str] = {}


def tell(job: RecomputeJob, plan: FlowPlan) -> None:
    """One line per process and job when its plan changes: a warning when
    it runs without flow though workers were seen (or disagree), an info
    line when flow is back; a debug line only when no worker is known (a
    recompute alone, the usual case: flow would change nothing)."""
    before = _told.get(job.name)
    if before == plan.state or (before is None and plan.state in ("on", "off")):
        return
    _told[job.name] = plan.state
    if plan.state == "on":
        log.info("pgjobs: %s: runs with flow again (workers' scope %s)", job.name, plan.scope)
    elif plan.state == "no workers":
        log.debug(
            "pgjobs: %s: runs without flow: %s (without one nothing waits for it)",
            job.name,
            plan.reason,
        )
    elif plan.state != "off":
        log.warning(
            "pgjobs: %s: runs WITHOUT flow, holding group %r's write lock for its whole run"
            " (queue items of the group wait for it): %s; see docs/flow.md",
            job.name,
            job.group or job.name,
            plan.reason,
        )


__all__ = [
    "FRESH",
    "RENEW_EVERY",
    "STALE",
    "FlowPlan",
    "WorkerRecord",
    "WorkersChanged",
    "plan_for",
    "read_plan",
    "record_for_tick",
    "record_query",
    "renew",
]
