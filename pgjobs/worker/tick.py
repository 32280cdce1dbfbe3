"""One tick of a queue worker, top to bottom: claim (:mod:`.claim`),
process the claimed items (compute once, write one scoped diff, ``after``),
take the processed items off the queue with the commit.

A failing batch is retried in halves under savepoints until the failing
items are found; the others commit. Errors no item caused (deadlock, lost
connection, timeouts, a ``ConfigError``) fail the whole run instead.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import analyze, later, send, sqlstate_of
from ..diff import Scope, WriteResult, write_diff
from ..jobs import Keys, QueueJob, RunContext
from ..results import Execution
from ..staging import check_coverage, stage
from ..target import Prefetched
from .claim import Ahead, ahead_undone, claim, claim_adopted, claim_own, finish_own
from .small import small_enough, write_small
from .state import (
    ANALYZE_KEYS,
    KEYS_TABLE,
    LOCK_NOT_AVAILABLE,
    MAX_LOCK_WAITS,
    MAX_SAVEPOINTS,
    Tick,
    error_text,
    is_run_level,
    item_lock_wait,
    new_tick,
    next_savepoint,
    release,
    rollback_to,
)
from .vacuum import count_deleted

log = logging.getLogger(__name__)


def run_tick(
    conn: Connection,
    job: QueueJob,
    ctx: RunContext,
    prefetched: Prefetched | None = None,
    ahead: Ahead | None = None,
) -> Execution:
    """One tick of ``job``, inside the job's transaction, the group lock held
    (``ahead``: the claim sent with the lock, :func:`.claim.claim_ahead`)."""
    sent = ahead
    ahead = ahead_undone(conn, job, ahead)
    t = new_tick(conn, job, ctx, prefetched)
    if job.claim is not None:
        items, gone, deferred, unreadable = claim_own(t)
    else:  # (a claim adopted is a tuple of four lists: true, even when they are empty)
        adopted = claim_adopted(t, ahead)
        if sent is not None and adopted is None:
            # the claim sent ahead was undone, and the lock wait set before it
            # with it (QueueBody.prefetch): set again, with the claim
            later(conn, *item_lock_wait(job))
        items, gone, deferred, unreadable = adopted or claim(t)
    ctx.report("claim", len(items), None)
    t.failed.update(unreadable)
    if gone:
        t.dropped.extend(gone)
        log.info("pgjobs: %s: dropped %d item(s) whose parent is gone", job.name, len(gone))
    if not (items or gone or deferred or unreadable):
        # a worker beside this one took them, or a user's transaction holds
        # them (an uncommitted enqueue of an item already queued: its commit
        # wakes nobody, so the tick comes again within seconds)
        return Execution(idle=True, retry_soon=t.held > 0)
    if items:
        process(t, items)
    dead = 0
    if t.own is not None:
        finish_own(t)
    else:
        delete(t, [*t.dropped, *t.done])
        if t.failed:
            dead = record_failures(t)
    since_claim = time.perf_counter() - t.claimed_at
    return Execution(
        stats=t.stats,
        compute_seconds=t.compute_seconds,
        write_seconds=t.write_seconds,
        lock_seconds=t.lock_seconds,
        items=len(t.done),
        failed_items=len(t.failed),
        detail={
            "claimed": len(items) + len(gone) + len(unreadable),
            "parent_gone": len(gone),
            "deferred": len(deferred),
            "held": t.held,
            "kept": len(t.kept),
            "rows_deferred": t.rows_deferred,
            "locked": len(t.locked),
            "dead": dead,
        },
        queue_lag=tuple(t.age_of[i] + since_claim for i in t.done if i in t.age_of),
        # items left for a lock someone holds: tried again within seconds
        retry_soon=bool(deferred or t.kept or t.held),
    )


def process(t: Tick, items: list[str]) -> None:
    """Compute, write and ``after`` for ``items``; failing items isolated."""
    preloaded, t.preloaded = t.preloaded, None
    sp = preloaded[0] if preloaded else next_savepoint(t)
    try:
        write(t, items, sp, preloaded[1] if preloaded else None)
    except Exception as exc:
        waited = sqlstate_of(exc) == LOCK_NOT_AVAILABLE
        if is_run_level(exc) and not waited:
            raise
        rollback_to(t, sp)
        if waited:
            # A lock someone else holds: a derived row of some item (then
            # that item waits for a later tick, its neighbours are written),
            # or the target itself (a CREATE INDEX: nobody writes, the tick
            # is a transient failure, retried within seconds).
            target_free(t)
            t.lock_waits += 1
            if len(items) == 1 or t.lock_waits >= MAX_LOCK_WAITS:
                log.info(
                    "pgjobs: %s: %d item(s) left for a later tick: a lock someone holds (%s)",
                    t.job.name,
                    len(items),
                    error_text(exc).splitlines()[0],
                )
                t.kept.extend(items)
                t.locked.extend(items)
                return
        elif len(items) == 1:
            t.failed[items[0]] = exc
            return
        if t.savepoints >= MAX_SAVEPOINTS:
            # Past some 64 subtransactions in one transaction, every
            # snapshot in the database gets slower: leave the rest queued,
            # untouched, for the next tick (the items found failing so far
            # back off meanwhile).
            log.warning(
                "pgjobs: %s: %d item(s) left for the next tick: too many failures to isolate",
                t.job.name,
                len(items),
            )
            t.kept.extend(items)
            return
        log.info(
            "pgjobs: %s: a batch of %d items failed (%s); isolating the failing items",
            t.job.name,
            len(items),
            type(exc).__name__,
        )
        half = len(items) // 2
        process(t, items[:half])
        process(t, items[half:])


def target_free(t: Tick) -> None:
    """Take the target's ROW EXCLUSIVE lock (what its writes take), waiting
    no longer than the items' writes: when someone holds a lock on the table
    that blocks every write (SHARE: a CREATE INDEX), the lock timeout
    raised here fails the whole tick, transiently, instead of leaving each
    item for later one by one. Once per tick: then it is held to commit."""
    if not t.target_held:
        t.raw.execute(sql.SQL("lock table {} in row exclusive mode").format(t.target.ident))
        t.target_held = True


def load_keys(t: Tick, items: list[str], savepoint: sql.Identifier) -> Keys:
    """The savepoint and the keys table's load in one round trip."""
    _, loaded = send(
        t.conn,
        (sql.SQL("savepoint {}").format(savepoint), None),
        (t.statements.load_keys, (items,)),
    )
    return [tuple(r) for r in loaded.all()]


def compute_params(job: QueueJob, keys: Keys) -> dict[str, Any]:
    """What compute SQL may bind: ``:keys`` (the first scope column's
    values) and ``:keys_<column>`` for each scope column."""
    params: dict[str, Any] = {"keys": [k[0] for k in keys]}
    for n, column in enumerate(job.scope):
        params[f"keys_{column}"] = [k[n] for k in keys]
    return params


def write(t: Tick, items: list[str], savepoint: sql.Identifier, keys: Keys | None = None) -> None:
    """Process ``items`` under ``savepoint`` (taken here, unless the claim
    took it and loaded their ``keys``; released by the commit, or rolled
    back to by the caller when this raises)."""
    reload = keys is None  # loaded under the savepoint (not by the claim, before it)
    if keys is None:
        keys = load_keys(t, items, savepoint)
    if len(keys) > ANALYZE_KEYS:
        # Up to this size, the planner's estimate from the table's current
        # size serves joins as well as statistics would, for less.
        t.raw.execute(analyze(sql.Identifier("pg_temp", KEYS_TABLE)))
    started = time.perf_counter()
    job = t.job
    params = compute_params(job, keys)
    source = job.compute if isinstance(job.compute, str) else job.compute(t.conn, keys)
    t.ctx.report("write", len(keys), None)
    result = None
    if small_enough(t, len(keys)):
        result = write_small(t, items, source, params, savepoint, reload=reload)
    if result is not None:
        t.compute_seconds += time.perf_counter() - started - result.write_seconds
    else:
        result = write_general(t, source, params, len(keys), started)
    t.write_seconds += result.write_seconds
    t.lock_seconds += result.lock_seconds
    t.stats = t.stats + result.stats
    if result.deferred:
        # Some rows wait for a parent a user holds: what was written stays,
        # the items stay queued, and the next tick finishes them.
        t.kept.extend(items)
        t.rows_deferred += result.deferred
        release(t, savepoint)
        return
    if job.after is not None:
        job.after(t.conn, keys, result.stats)
    # The savepoint stays open (the commit releases it): a round trip
    # saved. Should a later sub-batch fail, it is rolled back to its own.
    t.done.extend(items)


def write_general(
    t: Tick, source: object, params: dict[str, Any], keys: int, started: float
) -> WriteResult:
    """The general writer: the new rows staged in a session table, then
    :func:`pgjobs.diff.write_diff` scoped to the keys table."""
    job = t.job
    staged = stage(t.conn, t.target, source, params=params, session=True)
    check_coverage(t.target, staged.columns, job.columns, "the new rows")
    if job.flow:
        mark(t)
    t.compute_seconds += time.perf_counter() - started
    # wait_busy=False: this transaction holds queue entries, and a user may
    # lock a parent FOR UPDATE and then enqueue one of our items (a delete
    # cascading to a table with an enqueue trigger); waiting for that
    # parent would deadlock. Its rows are deferred, the items stay queued.
    return write_diff(
        t.conn,
        t.target,
        staged,
        # The claim locked every item's item parents FOR KEY SHARE (in
        # its savepoint, which no isolation rolls back): not again.
        scope=Scope(
            columns=job.scope, keys=t.statements.keys_table, rows=keys, parents_locked=True
        ),
        wait_busy=False,
    )


def mark(t: Tick) -> None:
    """Flow: record, in this transaction, that its xid rewrote these keys
    (``docs/DESIGN.md``, "Flow"); a recompute that computed meanwhile
    leaves them out. Goes with the diff's first round trip, under the
    sub-batch's savepoint."""
    later(t.conn, t.statements.mark, (t.target.label,))


def delete(t: Tick, items: list[str]) -> None:
    """Take ``items`` (processed, or their parent gone) off the queue, with
    the commit: the statement goes out in the runner's last round trip,
    before the run record and COMMIT. Their entries stay locked by this
    transaction until then."""
    if not items:
        return
    later(t.conn, t.statements.delete, (tid_array([t.ctid_of[i] for i in items]),))
    count_deleted(t.ctx, len(items))


def tid_array(ctids: list[str]) -> str:
    """``ctids`` (the claim's ``ctid::text``, ``(block,offset)``: nothing in
    them to escape) as one ``tid[]`` literal. Given as a list, psycopg
    quotes and escapes each element with a regular expression: 0.2 ms of
    client CPU a tick of 100 items, 1.5 % of a drain at batch 100."""
    return '{"' + '","'.join(ctids) + '"}'


def record_failures(t: Tick) -> int:
    """Back the failed items off (or park them, at ``max_attempts``);
    returns how many were parked."""
    job = t.job
    policy = job.item_backoff
    assert not isinstance(policy, str | int | float | timedelta)
    names, delays, texts, dead = [], [], [], 0
    for item, exc in sorted(t.failed.items()):
        attempts = t.attempts_of.get(item, 0) + 1
        names.append(item)
        delays.append(policy.delay(attempts).total_seconds())
        texts.append(error_text(exc))
        if attempts >= job.max_attempts:
            dead += 1
            log.error(
                "pgjobs: %s: item %s failed %d times and is parked: %s",
                job.name,
                item,
                attempts,
                texts[-1],
            )
        else:
            log.warning(
                "pgjobs: %s: item %s failed (attempt %d of %d), retrying in %.0fs: %s",
                job.name,
                item,
                attempts,
                job.max_attempts,
                delays[-1],
                texts[-1],
            )
    t.raw.execute(t.statements.record_failures, (job.max_attempts, names, delays, texts, job.name))
    return dead


__all__ = [
    "compute_params",
    "delete",
    "load_keys",
    "mark",
    "process",
    "record_failures",
    "run_tick",
    "tid_array",
    "write",
    "write_general",
]
