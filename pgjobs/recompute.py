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

from ._pg import later
from .diff import DiffWriter
from .jobs import RecomputeJob, RunContext
from .results import Execution
from .staging import check_coverage, stage
from .target import describe, prefetch_fingerprint, reflect_target

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
            writer.write_chunk(chunk)
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

    def execute(self, conn: Connection, job: RecomputeJob, ctx: RunContext) -> Execution:
        return run_recompute(conn, job, ctx)


BODY = RecomputeBody()
