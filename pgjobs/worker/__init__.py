"""The body of a :class:`~pgjobs.QueueJob`: one tick claims a batch of
items, computes their new rows once, writes one diff scoped to them, calls
``after``, and takes them off the queue with the commit.

1. *Claim*, in one statement: the due items in key order; their parents
   ``FOR KEY SHARE SKIP LOCKED``; then the entries of the items whose
   parents are locked (or gone) ``FOR UPDATE SKIP LOCKED``. Nothing waits.
2. Load the batch's keys into ``pgjobs_keys`` and call ``compute(conn, keys)``.
3. Write one scoped diff, then ``after``: a small batch in one statement
   (:mod:`.small`), a larger one through :func:`pgjobs.diff.write_diff`.
4. Delete the processed entries in the commit's round trip.

Read on, top to bottom: :mod:`.tick` (the tick, and the isolation of
failing items), :mod:`.claim` (step 1), :mod:`.small`, :mod:`.state` (the
tick's state, which every step takes), :mod:`.statements` (composed once
per job), :mod:`.vacuum`. The queue table's API is :mod:`pgjobs.queue`;
why each step is as it is: ``docs/DESIGN.md``, "The queue and its worker".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import driver, frozen, later
from ..flow import record_for_tick
from ..jobs import Locks, QueueJob, RunContext
from ..queue import queue_table
from ..results import Execution
from ..target import Prefetched, prefetch_fingerprint
from .claim import Ahead, claim_ahead
from .state import item_lock_wait
from .tick import run_tick


def pending_query(job: QueueJob, ctx: RunContext) -> tuple[sql.Composed, tuple[str]]:
    """Is a live item of ``job`` due? One index probe, taken before any lock.

    The earliest due entry, not EXISTS: for a job with most of the queue,
    the planner took EXISTS as a Seq Scan stopping at the first match, which
    reads past every entry drained before it (13 ms against 0.04 ms at 1 M
    entries, 500k drained: tests/test_plans.py); ORDER BY not_before is
    what only queue_due_idx serves without a sort."""
    return _pending_sql(ctx.schema), (job.name,)


@functools.lru_cache(maxsize=16)
def _pending_sql(schema: str) -> sql.Composed:
    # (a Composed of one SQL: what the runner's hook takes, walked at once)
    statement = sql.SQL(
        "select (select 1 from {} where job = %s and dead_at is null and not_before <= now()"
        " order by not_before limit 1) is not null"
    ).format(queue_table(schema))
    return sql.Composed([frozen(statement)])


def has_pending(conn: Connection, job: QueueJob, ctx: RunContext) -> bool:
    """:func:`pending_query`'s answer."""
    row = driver(conn).execute(*pending_query(job, ctx)).fetchone()
    return bool(row and row[0])


@dataclass(frozen=True, slots=True)
class QueuePrefetched:
    """What a queue tick sends with the runner's lock round trip."""

    #: the reflection cache's catalog check (see reflect_target)
    fingerprint: Prefetched | None
    #: the claim, on speculation (see claim_ahead)
    ahead: Ahead | None = None


def run_queue(
    conn: Connection, job: QueueJob, ctx: RunContext, prefetched: QueuePrefetched | None = None
) -> Execution:
    """One tick of ``job``: claim a batch, compute it once, write one scoped
    diff, call ``after``; inside the job's transaction, the group lock held."""
    if prefetched is None:
        return run_tick(conn, job, ctx)
    return run_tick(conn, job, ctx, prefetched.fingerprint, prefetched.ahead)


class QueueBody:
    """How the runner runs a :class:`~pgjobs.QueueJob`."""

    def work_query(
        self, job: QueueJob, ctx: RunContext
    ) -> tuple[sql.Composed, Sequence[Any]] | None:
        return None if job.has_work is not None else pending_query(job, ctx)

    def check_work(self, conn: Connection, job: QueueJob, ctx: RunContext) -> bool:
        if job.has_work is not None:
            return bool(job.has_work(conn))
        return has_pending(conn, job, ctx)

    def prefetch(self, conn: Connection, job: QueueJob, ctx: RunContext) -> QueuePrefetched:
        """The reflection cache's catalog check (see reflect_target), read
        by :meth:`execute`; and, after the write lock, this job's record for
        recomputes run elsewhere (pgjobs.flow), unless a fresh one is there
        (then an index probe) or this process sent it lately (then nothing:
        :func:`pgjobs.flow.record_for_tick`)."""
        fingerprint = prefetch_fingerprint(conn, job.target, job.parents)
        committed = record_for_tick(conn, job, ctx.namespace, ctx.schema)
        if committed is not None:
            ctx.after_commit.append(committed)
        # the writes' lock waits bounded before any of them (the write sent ahead too)
        later(conn, *item_lock_wait(job))
        # last (the runner's savepoint is taken before): the claim, on speculation
        return QueuePrefetched(fingerprint, claim_ahead(conn, job, ctx))

    def locks(self, job: QueueJob, ctx: RunContext) -> Locks:
        # with flow, the group's write lock shared with the other workers
        return Locks.SHARED_WRITE if job.flow else Locks.WRITE

    def chunked(self, job: QueueJob, ctx: RunContext) -> bool:
        return False

    def execute(
        self, conn: Connection, job: QueueJob, ctx: RunContext, prefetched: QueuePrefetched | None
    ) -> Execution:
        return run_queue(conn, job, ctx, prefetched)

    def next_due(self, job: QueueJob, started: datetime, scheduled: datetime | None) -> datetime:
        # due whenever it has work: its interval is how often it looks when
        # nothing wakes it, not a pace
        return started


BODY = QueueBody()


__all__ = [
    "BODY",
    "QueueBody",
    "QueuePrefetched",
    "has_pending",
    "pending_query",
    "run_queue",
]
