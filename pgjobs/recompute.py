"""The body of a :class:`~pgjobs.RecomputeJob`: compute the new rows into
an analyzed temp table holding no row lock, then let the diff writer
(:mod:`pgjobs.diff`) write only the difference.

The runner (:mod:`pgjobs.runner`) calls :data:`BODY` inside the job's
transaction with the group lock held. Staging is :mod:`pgjobs.staging`,
the target's reflection :mod:`pgjobs.target`; whether it runs with flow
(and its workers' scope), :mod:`pgjobs.flow`, read in the work check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import later, send
from .diff import DiffWriter
from .flow import (
    OFF,
    FlowPlan,
    WorkersChanged,
    changed_query,
    disagrees,
    plan_for,
    prune_query,
    read_plan,
    records,
    snapshot_query,
)
from .jobs import Locks, RecomputeJob, RunContext, next_due_after_success
from .locking import WAIT_SESSION_SQL, WAIT_XACT_SQL, lock_name
from .results import Execution
from .staging import check_coverage, stage
from .target import Prefetched, Target, describe, prefetch_fingerprint, reflect_target

log = logging.getLogger(__name__)

#: Drops the temp tables a failed chunked run left in this session. Chunked
#: runs keep theirs across commits (ON COMMIT PRESERVE ROWS) and drop them at
#: the end; a run that failed half-way cannot, and a pooled connection would
#: carry them on. At the start of a recompute's transaction any such table
#: is a leftover: the others are dropped at commit. One statement, queued
#: for the next round trip.
_DROP_LEFTOVERS = sql.SQL(
    "do $pgjobs$ declare r record; begin"
    " for r in select c.relname from pg_class c"
    " where c.relnamespace = pg_my_temp_schema() and c.relkind = 'r'"
    " and c.relname ~ '^pgjobs_(stage|diff|need|alive|gone|bad|selfparents|selflocked)_[0-9]+$'"
    " loop execute format('drop table if exists pg_temp.%I', r.relname); end loop;"
    " end $pgjobs$"
)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a recompute's step 3 hands its run: the reflection cache's
    catalog check, sent with the lock (``None``: nothing to check), and the
    work check's plan of flow (:mod:`pgjobs.flow`)."""

    fingerprint: Prefetched | None = None
    plan: FlowPlan = OFF


def run_recompute(
    conn: Connection, job: RecomputeJob, ctx: RunContext, prepared: Prepared | None = None
) -> Execution:
    """The body of a :class:`~pgjobs.RecomputeJob`: compute and stage the new
    rows holding no row lock, then write the difference
    (:class:`~pgjobs.diff.DiffWriter`), committing after each chunk when it
    is written in chunks. Runs inside the job's transaction with the group
    lock held (and, without flow, the write lock). With flow, a worker that
    recorded itself during the run and does not fit the plan gives the run
    up: ``busy``, and the next run plans again (:mod:`pgjobs.flow`)."""
    prepared = prepared or Prepared(plan=_plan(ctx))
    target = reflect_target(
        conn, job.target, key=job.key, parents=job.parents, prefetched=prepared.fingerprint
    )
    plan = prepared.plan
    if job.flow:
        # The records no recompute will read again, in the commit's round trip
        # (with the write lock held: a worker renewing one cannot wait for it).
        ctx.before_commit.append(prune_query(ctx.schema, target.label))
    try:
        return _run(conn, job, ctx, target, plan)
    except WorkersChanged as exc:
        log.warning("pgjobs: %s: gives up this run and tries again: %s", job.name, exc)
        return Execution(busy=True, detail={"flow": "changed", "flow_reason": str(exc)})


def _run(
    conn: Connection, job: RecomputeJob, ctx: RunContext, target: Target, plan: FlowPlan
) -> Execution:
    started = time.perf_counter()
    flow = _Flow.start(conn, job, ctx, target, plan) if plan.flows else None
    # Chunks need tables that outlive a commit, and a runner that commits. A
    # target that references itself is written at once, unless chunks of
    # parents are asked for (which the writer refuses there, saying why).
    chunked = (
        not job.atomic
        and ctx.checkpoint is not None
        and (target.self_reference is None or job.chunk_parents is not None)
    )
    ctx.report("compute", None, None)
    source = job.compute if isinstance(job.compute, str) else job.compute(conn)
    ctx.report("stage", None, None)
    staged = stage(conn, target, source, preserve=chunked)
    check_coverage(target, staged.columns, job.columns, "the new rows")
    ctx.report("stage", staged.rows, staged.rows)
    compute_seconds = time.perf_counter() - started
    with DiffWriter(
        conn,
        target,
        staged,
        chunk_parents=job.chunk_parents if chunked else None,
        chunk_rows=job.chunk_rows if chunked and job.chunk_parents is None else None,
        progress=ctx.progress,
    ) as writer:
        for n, chunk in enumerate(writer.chunks):
            if n and ctx.checkpoint is not None:
                ctx.checkpoint()  # commit the chunks so far, go on in a new transaction
            if flow is not None:
                ctx.report("write-lock", n, len(writer.chunks))
                flow.exclude(writer, chunk)
            writer.write_chunk(chunk)
        if flow is not None:
            flow.prune()
        repaired = _repaired_sample(conn, writer)  # goes out with the finish
        result = writer.finish()
    if chunked:
        later(conn, sql.SQL("drop table if exists {}").format(staged.table))
    detail = {
        "target": describe(target),
        "staged_rows": staged.rows,
        "diff_seconds": round(result.diff_seconds, 6),
        "chunks": result.chunks,
        "max_chunk_lock_seconds": round(result.max_chunk_lock_seconds, 6),
        "deferred": result.deferred,
        "flow": plan.state,
        **result.detail,
    }
    if sample := repaired():
        detail["repaired"] = sample
    return Execution(
        stats=result.stats,
        compute_seconds=compute_seconds,
        write_seconds=result.write_seconds,
        lock_seconds=result.lock_seconds,
        detail=detail,
    )


#: keys of each kind of change a recompute records in its run (``detail["repaired"]``)
REPAIRED_SAMPLE = 5


def _repaired_sample(
    conn: Connection, writer: DiffWriter
) -> Callable[[], dict[str, list[dict[str, Any]]]]:
    """The first keys of the difference inserted, updated and deleted: on a
    target that workers maintain, what the queue path missed (the status
    page shows them, ``docs/drift.md``). One statement, a top-N of each op
    over the difference (no row lock), queued after the writes: flow's
    exclusions have taken the keys a worker rewrote out of the difference
    by then (those were the worker's, not repaired). Returns its reader
    (after the next round trip); none when the difference was empty."""
    if not any(writer.counts.values()):
        return dict
    plan = writer.plan
    keys = [sql.Identifier(plan.new[k]) for k in plan.key]
    cols = sql.SQL(", ").join(keys)
    parts = [
        sql.SQL("(select {op}, {cols} from {d} where op = {op} order by {cols} limit {n})").format(
            op=sql.Literal(op), cols=cols, d=plan.difference, n=sql.Literal(REPAIRED_SAMPLE)
        )
        for op, n in writer.counts.items()
        if n
    ]
    found = later(conn, sql.SQL(" union all ").join(parts))
    names = {"i": "inserted", "u": "updated", "d": "deleted"}

    def read() -> dict[str, list[dict[str, Any]]]:
        assert found.result is not None
        out: dict[str, list[dict[str, Any]]] = {}
        for row in found.result.all():
            key = dict(zip(plan.key, row[1:], strict=True))
            out.setdefault(names[str(row[0])], []).append(key)
        return out

    return read


class _Flow:
    """A recompute with flow (``docs/DESIGN.md``, "Flow"): the group's write
    lock for an instant at the start (the snapshot S0), and again for each
    chunk's writes, which first leave out the keys a worker rewrote after S0."""

    def __init__(
        self,
        conn: Connection,
        job: RecomputeJob,
        ctx: RunContext,
        target: Target,
        plan: FlowPlan,
        s0: str,
    ) -> None:
        self.conn, self.job, self.target, self.s0 = conn, job, target, s0
        self.namespace, self.schema = ctx.namespace, ctx.schema
        self.write_lock = lock_name(ctx.namespace, job.group or job.name)
        self.marks = sql.Identifier(ctx.schema, "mark")
        #: the plan of the work check (pgjobs.flow): the workers' scope
        self.plan = plan
        assert self.plan.scope is not None
        self.scope: tuple[str, ...] = self.plan.scope

    @classmethod
    def start(
        cls, conn: Connection, job: RecomputeJob, ctx: RunContext, target: Target, plan: FlowPlan
    ) -> _Flow:
        """S0: the write lock, waited for (no worker transaction is then open),
        and in a statement after the grant the snapshot, the workers' records
        as that snapshot sees them, and the lock given back: one round trip.
        Records that no longer give the work check's plan give the run up."""
        write_lock = lock_name(ctx.namespace, job.group or job.name)
        lock = later(conn, WAIT_SESSION_SQL, (write_lock,))
        try:
            (taken,) = send(conn, snapshot_query(ctx.schema, target.label, write_lock))
        except Exception:
            if lock.result is not None:
                # granted, and the statement that gives it back failed: a
                # session lock outlives the rollback, and a pooled
                # connection must never go back holding the group lock
                log.warning(
                    "pgjobs: %s: taking S0 failed with the write lock held; dropping the"
                    " connection",
                    job.name,
                )
                conn.invalidate()
            raise
        row = taken.one()
        assert row is not None
        flow = cls(conn, job, ctx, target, plan, str(row[0]))
        again = plan_for(job, ctx.namespace, records(row[1]))
        if again.scope != flow.scope:
            raise WorkersChanged(
                f"its queue workers' records changed as it started: {again.reason or again.scope}"
            )
        return flow

    def exclude(self, writer: DiffWriter, chunk: int | None) -> None:
        """The write lock for this chunk's transaction, to its commit; then,
        in a statement after the grant (same round trip), the rows of keys a
        worker rewrote after S0 out of the chunk; and the records renewed
        after S0, which must fit the plan (else the run is given up)."""
        later(self.conn, WAIT_XACT_SQL, (self.write_lock,))
        changed = later(self.conn, *changed_query(self.schema, self.target.label, self.s0))
        self.exclude_now(writer, chunk)
        assert changed.result is not None
        reason = disagrees(self.plan, self.job, self.namespace, records(changed.result.scalar()))
        if reason:
            raise WorkersChanged(reason)

    def exclude_now(self, writer: DiffWriter, chunk: int | None) -> None:
        """The exclusion itself: the keys whose mark is not visible in S0."""
        writer.exclude(
            chunk,
            self.scope,
            sql.SQL(
                "select m.key from {} as m where m.target = %s"
                " and not pg_visible_in_snapshot(m.xid, %s::pg_snapshot)"
            ).format(self.marks),
            (self.target.label, self.s0),
        )

    def prune(self) -> None:
        """The marks S0 covers are never needed again: gone with the commit."""
        later(
            self.conn,
            sql.SQL(
                "delete from {} where target = %s and pg_visible_in_snapshot(xid, %s::pg_snapshot)"
            ).format(self.marks),
            (self.target.label, self.s0),
        )


class RecomputeBody:
    """How the runner runs a :class:`~pgjobs.RecomputeJob`."""

    def work_query(
        self, job: RecomputeJob, ctx: RunContext
    ) -> tuple[sql.Composed, Sequence[Any]] | None:
        return None

    def work_answer(self, job: RecomputeJob, ctx: RunContext, row: Sequence[Any] | None) -> bool:
        return bool(row and row[0])

    def check_work(self, conn: Connection, job: RecomputeJob, ctx: RunContext) -> bool:
        if job.has_work is not None and not job.has_work(conn):
            return False
        # with flow or not, and the workers' scope: from their records
        ctx.extra["flow"] = read_plan(conn, job, ctx.namespace, ctx.schema)
        return True

    def locks(self, job: RecomputeJob, ctx: RunContext) -> Locks:
        """The group's recompute lock; without flow (by the work check's
        plan, from the workers' records) the write lock too, to the commit."""
        return Locks.RECOMPUTE if _plan(ctx).flows else Locks.RECOMPUTE_AND_WRITE

    def chunked(self, job: RecomputeJob, ctx: RunContext) -> bool:
        return not job.atomic

    def prefetch(self, conn: Connection, job: RecomputeJob, ctx: RunContext) -> Prepared:
        # the reflection cache's catalog check (see reflect_target)
        fingerprint = prefetch_fingerprint(conn, job.target, job.parents)
        if not job.atomic:
            later(conn, _DROP_LEFTOVERS)
        return Prepared(fingerprint=fingerprint, plan=_plan(ctx))

    def execute(
        self, conn: Connection, job: RecomputeJob, ctx: RunContext, prefetched: Prepared
    ) -> Execution:
        return run_recompute(conn, job, ctx, prefetched)

    def next_due(
        self, job: RecomputeJob, started: datetime, scheduled: datetime | None
    ) -> datetime:
        return next_due_after_success(job, started, scheduled)


def _plan(ctx: RunContext) -> FlowPlan:
    """The work check's plan of flow (``OFF`` if it made none)."""
    plan: FlowPlan = ctx.extra.get("flow", OFF)
    return plan


BODY = RecomputeBody()


__all__ = [
    "BODY",
    "REPAIRED_SAMPLE",
    "Prepared",
    "RecomputeBody",
    "run_recompute",
]
