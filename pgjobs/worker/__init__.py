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
from .claim import Ahead, claim_ahead, cursor_of
from .cursor import sample_sql
from .state import item_lock_wait
from .tick import run_tick


def pending_query(job: QueueJob, ctx: RunContext) -> tuple[sql.Composed, tuple[Any, ...]]:
    """Is a live item of ``job`` due? Index probes, taken before any lock:
    the first entry numbered past the job's cursor (pgjobs/worker/cursor.py:
    not the dead ones below it, whatever the horizon), the earliest retry
    whose time has come, or entries the cursor keeps to read again. The
    cursor's sample goes with it: a replica that finds nothing moves its
    cursor on all the same (:func:`pending_answer`)."""
    low, recheck, safe = cursor_of(ctx).peek()
    ctx.extra[_SAFE] = safe
    return _pending_sql(ctx.schema), (recheck, job.name, low, job.name)


#: ``ctx.extra``'s key for what was safe when the work check was sent
_SAFE = "pgjobs.queue.safe"


@functools.lru_cache(maxsize=16)
def _pending_sql(schema: str) -> sql.Composed:
    # (a Composed of one SQL: what the runner's hook takes, walked at once)
    last, running = sample_sql(schema)
    statement = sql.SQL(
        "select coalesce(w.fresh, w.retry, %s), w.fresh is not null, l.v, l.server, {running}"
        " from (select (select true from {q} where job = %s and dead_at is null"
        " and attempts = 0 and seq > %s order by seq limit 1) as fresh,"
        " (select true from {q} where job = %s and dead_at is null and attempts > 0"
        " and not_before <= now() order by not_before limit 1) as retry) as w, {last}"
    ).format(q=queue_table(schema), running=running, last=last)
    return sql.Composed([frozen(statement)])


def pending_answer(job: QueueJob, ctx: RunContext, row: Sequence[Any] | None) -> bool:
    """The work check's answer, and the cursor after it: with no entry past
    ``low``, every entry up to what was safe when it was sent is gone."""
    if row is None:
        return False
    has_work, fresh, last, server, running = row
    cursor = cursor_of(ctx)
    cursor.sample(last, server, running)
    if not fresh:
        cursor.nothing_past(ctx.extra.pop(_SAFE, (0, -1, False)))
    return bool(has_work)


def has_pending(conn: Connection, job: QueueJob, ctx: RunContext) -> bool:
    """:func:`pending_query`'s answer."""
    return pending_answer(job, ctx, driver(conn).execute(*pending_query(job, ctx)).fetchone())


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

    def work_answer(self, job: QueueJob, ctx: RunContext, row: Sequence[Any] | None) -> bool:
        return pending_answer(job, ctx, row)

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
    "pending_answer",
    "pending_query",
    "run_queue",
]
