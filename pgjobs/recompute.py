"""The body of a :class:`~pgjobs.RecomputeJob`: compute the new rows into
an analyzed temp table holding no row lock, then let the diff writer
(:mod:`pgjobs.diff`) write only the difference.

The runner (:mod:`pgjobs.runner`) calls :data:`BODY` inside the job's
transaction with the group lock held. Staging is :mod:`pgjobs.staging`,
the target's reflection :mod:`pgjobs.target`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import later, send
from .diff import DiffWriter
from .jobs import RecomputeJob, RunContext
from .locking import WAIT_SESSION_SQL, WAIT_XACT_SQL, lock_name
from .results import Execution
from .staging import check_coverage, stage
from .target import Target, describe, prefetch_fingerprint, reflect_target

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


def run_recompute(conn: Connection, job: RecomputeJob, ctx: RunContext) -> Execution:
    """The body of a :class:`~pgjobs.RecomputeJob`: compute and stage the new
    rows holding no row lock, then write the difference
    (:class:`~pgjobs.diff.DiffWriter`), committing after each chunk when it
    is written in chunks. Runs inside the job's transaction with the group
    lock held."""
    started = time.perf_counter()
    target = reflect_target(
        conn,
        job.target,
        key=job.key,
        parents=job.parents,
        prefetched=ctx.extra.pop("fingerprint", None),
    )
    flow = _Flow.start(conn, job, ctx, target) if job.flows else None
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
        **result.detail,
    }
    return Execution(
        stats=result.stats,
        compute_seconds=compute_seconds,
        write_seconds=result.write_seconds,
        lock_seconds=result.lock_seconds,
        detail=detail,
    )


class _Flow:
    """A recompute with flow (``docs/DESIGN.md``, "Flow"): the group's write
    lock for an instant at the start (the snapshot S0), and again for each
    chunk's writes, which first leave out the keys a worker rewrote after S0."""

    def __init__(
        self, conn: Connection, job: RecomputeJob, ctx: RunContext, target: Target, s0: str
    ) -> None:
        self.conn, self.job, self.target, self.s0 = conn, job, target, s0
        self.write_lock = lock_name(ctx.namespace, job.group or job.name)
        self.marks = sql.Identifier(ctx.schema, "mark")

    @classmethod
    def start(cls, conn: Connection, job: RecomputeJob, ctx: RunContext, target: Target) -> _Flow:
        """S0: the write lock, waited for (no worker transaction is then open),
        and in a statement after the grant the snapshot, and the lock given
        back: one round trip."""
        write_lock = lock_name(ctx.namespace, job.group or job.name)
        _, taken = send(
            conn,
            (WAIT_SESSION_SQL, (write_lock,)),
            (_SNAPSHOT_AND_UNLOCK, (write_lock,)),
        )
        return cls(conn, job, ctx, target, str(taken.scalar()))

    def exclude(self, writer: DiffWriter, chunk: int | None) -> None:
        """The write lock for this chunk's transaction, to its commit; then,
        in a statement after the grant (same round trip), the rows of keys a
        worker rewrote after S0 out of the chunk."""
        later(self.conn, WAIT_XACT_SQL, (self.write_lock,))
        self.exclude_now(writer, chunk)

    def exclude_now(self, writer: DiffWriter, chunk: int | None) -> None:
        """The exclusion itself: the keys whose mark is not visible in S0."""
        assert self.job.worker_scope is not None
        writer.exclude(
            chunk,
            self.job.worker_scope,
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


#: S0, read in a statement after the write lock's grant, and the lock given back
_SNAPSHOT_AND_UNLOCK = (
    "select pg_current_snapshot()::text, pg_advisory_unlock(hashtextextended(%s, 0))"
)


class RecomputeBody:
    """How the runner runs a :class:`~pgjobs.RecomputeJob`."""

    def work_query(
        self, job: RecomputeJob, ctx: RunContext
    ) -> tuple[sql.Composed, Sequence[Any]] | None:
        return None

    def check_work(self, conn: Connection, job: RecomputeJob, ctx: RunContext) -> bool:
        return True if job.has_work is None else bool(job.has_work(conn))

    def prefetch(self, conn: Connection, job: RecomputeJob, ctx: RunContext) -> None:
        # the reflection cache's catalog check (see reflect_target)
        ctx.extra["fingerprint"] = prefetch_fingerprint(conn, job.target, job.parents)
        if not job.atomic:
            later(conn, _DROP_LEFTOVERS)

    def execute(
        self, conn: Connection, job: RecomputeJob, ctx: RunContext, prefetched: None
    ) -> Execution:
        return run_recompute(conn, job, ctx)


BODY = RecomputeBody()
