"""Steps 1 and 2 of a queue worker's tick: claim due items and lock their
parents, never waiting.

One statement reads up to ``batch_size`` due items in key order (those
whose item advisory lock it gets: workers side by side take different
items), locks their parents ``FOR KEY SHARE SKIP LOCKED``, then takes the
entries of the items whose parents are locked (or gone) ``FOR UPDATE SKIP
LOCKED``: parents before entries, the order of a user who changes a parent
and then enqueues it. A queue of the plugin's own (``job.claim``) is claimed by the
plugin; its items' parents are then locked here the same way.

Each function returns the four sets of a claim: (items to process, items
whose parent is gone, items left for later because a user holds their
parent, items whose key doesn't fit the scope's types).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import Later, driver, frozen, later, send
from ..jobs import RUN_SAVEPOINT, QueueJob, RunContext
from ..queue import key_json
from ..target import Target, cached_target
from .cursor import Cursor, Read, rows_read, split_sample
from .small import Composed, small_enough
from .state import (
    KEYS_SHAPE,
    Tick,
    create_keys_table,
    ensure_keys_table,
    error_text,
    forget_keys_table,
    forget_keys_table_of,
    is_run_level,
    keys_table_fits,
    keys_table_known,
    keys_table_known_for,
    next_savepoint,
    release,
    rollback_to,
    savepoint,
)
from .statements import KEYED_AT, SEQ_AT, Statements, statements_for

log = logging.getLogger(__name__)

#: up to this batch size the claim also loads the keys table (a round trip saved)
PRELOAD_BATCH = 100

Claimed = tuple[list[str], list[str], list[str], dict[str, BaseException]]


def claim(t: Tick) -> Claimed:
    """Claim from pgjobs' queue: the four sets (see the module docstring)."""
    if not t.statements.item_parents:
        # Nothing to lock first: keys that don't fit fail when processed.
        ensure_keys_table(t)
        return claim_rows(t), [], [], {}
    sp = next_savepoint(t)
    params, read = claim_params(t.job, t.ctx)
    if t.job.batch_size <= PRELOAD_BATCH and keys_table_known(t):
        try:
            known = claim_known(t, sp, params, read)
        except psycopg.DataError:
            rollback_to(t, sp)
            return lock_readable(t, claim_rows(t))
        if known is not None:
            return known
    try:
        # One round trip: the keys table's shape, a savepoint and the
        # claim (which reads the keys table's row type). When the table
        # is missing or has another shape, the claim's effects (locks
        # included) are rolled back, the table made, and the claim redone.
        # The claim also loads the claimed items' keys into the keys table;
        # the savepoint of their processing and the keys themselves come
        # back in the same round trip (see tick.process).
        shape = later(t.conn, KEYS_SHAPE)
        # Only for small batches, where the round trip is what counts: at
        # batch 1,000 loading inside the claim drained at 3,000 items/s
        # against 5,300 loaded apart.
        preload = t.job.batch_size <= PRELOAD_BATCH
        first = next_savepoint(t) if preload else None
        statements: list[tuple[sql.Composable, Any]] = [
            (sql.SQL("savepoint {}").format(sp), None),
            (t.statements.claim_loading if preload else t.statements.claim, params),
        ]
        if first is not None:  # after the claim: its savepoint, and the keys it loaded
            statements.append((sql.SQL("savepoint {}").format(first), None))
            statements.append((t.statements.loaded_keys, None))
        try:
            _, rows, *loaded = send(t.conn, *statements)
            fits = keys_table_fits(t, shape.result.one() if shape.result else None)
            result = rows.all() if fits else []
        except psycopg.DatabaseError as exc:
            if is_run_level(exc) or shape.result is None:
                raise
            if keys_table_fits(t, shape.result.one()):
                raise
            fits = False
        if not fits:
            rollback_to(t, sp)
            create_keys_table(t)
            sp = savepoint(t)
            params, read = claim_params(t.job, t.ctx)
            result = t.raw.execute(t.statements.claim, params).fetchall()
        elif first is not None:
            t.preloaded = (first, [tuple(k) for k in loaded[-1].all()])
    except psycopg.DataError:
        # A key that does not convert to the scope's types: claim plainly
        # and find it one by one (rare, so this path may hold the entries
        # of deferred items until commit; it still waits for nothing).
        rollback_to(t, sp)
        return lock_readable(t, claim_rows(t))
    # The savepoint stays open (the commit releases it): a round trip saved.
    return classify(t, moved(t, read, result))


def cursor_of(ctx: RunContext) -> Cursor:
    """The job's cursor in this runner (a throwaway one, reading from the
    start, where the context has none)."""
    cursors = ctx.queue_cursors
    return Cursor() if cursors is None else cursors.of(ctx.schema, ctx.job.name)


def claim_params(job: QueueJob, ctx: RunContext) -> tuple[dict[str, Any], Read]:
    """The claim's parameters, with where the job's cursor says to read."""
    read = cursor_of(ctx).params()
    read.limit = job.batch_size * (1 if job.workers == 1 else 4)
    params = {"job": job.name, "n": job.batch_size, "low": read.low, "recheck": list(read.recheck)}
    return params, read


def moved(
    t: Tick,
    read: Read,
    rows: list[tuple[Any, ...]],
    seq_at: int = SEQ_AT,
    claimed_at: int = 3,
) -> list[tuple[Any, ...]]:
    """The cursor after a claim's ``rows`` (and the sample among them), and
    what it does when the tick ends (pgjobs/worker/cursor.py); returns the
    rows of the entries, the sample's taken out. The rows' number, path,
    read count and ctid are at ``seq_at`` and after it; whether the entry
    was claimed, at ``claimed_at`` (the item itself in :func:`claim_rows`'
    rows, ``None`` for an entry held)."""
    cursor = cursor_of(t.ctx)
    rows, sample = split_sample(rows, seq_at)
    token = cursor.advance(rows_read(read, rows, seq_at, claimed_at))
    if sample is not None:
        cursor.sample(*sample)
    claimed = {r[0]: int(r[seq_at]) for r in rows if r[0] is not None and r[claimed_at]}
    t.ctid_of.update((r[0], r[seq_at + 3]) for r in rows if r[0] in claimed)

    def committed(conn: Connection) -> None:
        # claimed, and neither processed, dropped nor failed: left queued
        # (kept for a lock, or past the isolation's bound): read again
        left = set(claimed) - set(t.done) - set(t.dropped) - set(t.failed)
        cursor.ended(token, committed=True, left=[claimed[i] for i in left])

    t.ctx.after_commit.append(committed)
    t.ctx.after_rollback.append(lambda: cursor.ended(token, committed=False))
    return rows


@dataclass(frozen=True, slots=True)
class Ahead:
    """A claim sent ahead, with the runner's lock round trip (:func:`claim_ahead`)."""

    #: the reflection it was composed from (the cached one, unverified then)
    target: Target
    claimed: Later
    #: where it read (the cursor's)
    read: Read
    #: the small write sent after it, for the keys it loaded: (its composed
    #: statement, its handle), or ``None``
    write: tuple[Composed, Later] | None = None


#: The claim sent ahead is undone by a rollback to the run's savepoint,
#: taken just before it in the lock's round trip (between the two only
#: read-only statements, which give back the settings they change
#: themselves), and its items are processed under a savepoint of their own.
_AHEAD_UNDO = frozen(sql.SQL("rollback to savepoint {}").format(sql.Identifier(RUN_SAVEPOINT)))
_AHEAD_AFTER = sql.Identifier("pgjobs_q1")
_AHEAD_SAVEPOINT = frozen(sql.SQL("savepoint {}").format(_AHEAD_AFTER))
_AHEAD_BACK = frozen(sql.SQL("rollback to savepoint {}").format(_AHEAD_AFTER))


def claim_ahead(conn: Connection, job: QueueJob, ctx: RunContext) -> Ahead | None:
    """Queue :func:`claim_known`'s claim and the savepoint after it for the
    runner's lock round trip, on speculation: a claim in the lock's round
    trip, not one of its own. Only where :func:`claim_known` would run (the session's
    keys table known to fit), composed from the target as last reflected.

    Guarded (:func:`pgjobs._pg.later`): when it fails, nothing else does.
    It runs under the run's savepoint whatever the job's state says; when
    the tick does not go on (the job paused or backing off) the
    transaction's rollback undoes it, when the
    verified reflection is another (the target changed) or it failed,
    :func:`claim_adopted` (or :func:`ahead_undone`) rolls back to the
    run's savepoint and the tick claims as usual. Its locks never wait (SKIP LOCKED, item locks tried).

    Only for a job with flow, whose group lock is waited for (briefly):
    when it is not granted the lock statement fails, and the pipeline
    stops before the claim, which so never runs without the lock. (A try
    lock answers false and the pipeline goes on: a claim ahead of it
    would hold, until the rollback, entries the lock's holder may then
    pass over.)"""
    if job.claim is not None or not job.flow or job.batch_size > PRELOAD_BATCH:
        return None
    target = cached_target(conn, job.target, key=job.key, parents=job.parents)
    if target is None or not keys_table_known_for(driver(conn), job, target):
        return None
    statements = statements_for(job, ctx.schema, target)
    if not statements.item_parents:
        return None
    params, read = claim_params(job, ctx)
    claimed = later(conn, statements.claim_keyed, params, guarded=True)
    later(conn, _AHEAD_SAVEPOINT, guarded=True)
    return Ahead(target, claimed, read, _write_ahead(conn, job, statements))


def _write_ahead(
    conn: Connection, job: QueueJob, statements: Statements
) -> tuple[Composed, Later] | None:
    """The small write (:mod:`.small`) of the keys the claim loads, queued
    after the claim's savepoint, on speculation too: when the job's compute
    is SQL text whose statement takes no parameter (composed at an earlier
    tick), and its last claim took no more keys than the statement reads
    (a trickle, the tail of a drain: a worker draining full batches of a
    hundred would throw it away at each tick). :func:`claim_adopted` takes
    it as the batch's write, or undoes it (back to the claim's savepoint)."""
    composed = statements.small_ready.get(job.compute) if isinstance(job.compute, str) else None
    if composed is None or statements.last_claimed > composed.most:
        return None
    return composed, later(conn, composed.statement, {}, guarded=True)


def ahead_undone(conn: Connection, job: QueueJob, ahead: Ahead | None) -> Ahead | None:
    """A claim sent ahead that failed left the transaction aborted: rolled
    back to its savepoint first thing, before the tick reads anything (the
    target's reflection, when the change that made the claim fail changed
    it too); ``None`` then, else ``ahead``."""
    if ahead is None or ahead.claimed.error is None:
        return ahead
    raw = driver(conn)
    raw.execute(_AHEAD_UNDO)
    forget_keys_table_of(raw)
    error = ahead.claimed.error
    if is_run_level(error):
        raise error
    log.debug("pgjobs: %s: the claim sent ahead failed: %s", job.name, error)
    return None


def claim_adopted(t: Tick, ahead: Ahead | None) -> Claimed | None:
    """The claim sent ahead (after :func:`ahead_undone`), if it holds:
    ``None`` when there was none, or the target's verified reflection is
    not the one it was composed from (then it is undone: the caller claims
    as usual)."""
    if ahead is None:
        return None
    t.savepoints = 1  # (_AHEAD_AFTER)
    result = ahead.claimed.result
    if result is None or t.target is not ahead.target:
        t.raw.execute(_AHEAD_UNDO)
        return None
    rows = moved(t, ahead.read, result.all())
    claimed = keyed(t, rows, _AHEAD_AFTER)
    if ahead.write is not None:
        adopt_write(t, *ahead.write)
    return claimed


def adopt_write(t: Tick, composed: Composed, write: Later) -> None:
    """The small write sent with the claim is the batch's when the batch
    takes the small path with that statement (the claimed keys, loaded into
    the keys table, are all it read: at least one, at most its LIMIT);
    otherwise it is undone, back to the savepoint after the claim, which
    stays."""
    assert t.preloaded is not None
    keys = len(t.preloaded[1])
    if keys == 0:
        return  # it read an empty keys table: it wrote nothing, marked nothing
    if keys <= composed.most and small_enough(t, keys) and write.result is not None:
        t.ahead_write = (composed, write.result)
    else:
        t.raw.execute(_AHEAD_BACK)


def claim_known(t: Tick, sp: sql.Identifier, params: dict[str, Any], read: Read) -> Claimed | None:
    """The claim when this session's keys table is known to fit: the
    savepoint, the claim (which loads the keys table and returns each
    claimed item's typed key) and the savepoint of their processing, three
    statements in one round trip. ``None``: the keys table was not what
    was known (dropped, say): rolled back, forgotten, the caller asks."""
    first = next_savepoint(t)
    try:
        _, rows, _ = send(
            t.conn,
            (sql.SQL("savepoint {}").format(sp), None),
            (t.statements.claim_keyed, params),
            (sql.SQL("savepoint {}").format(first), None),
        )
    except psycopg.DatabaseError as exc:
        if is_run_level(exc) or isinstance(exc, psycopg.DataError):
            raise
        log.debug("pgjobs: %s: the keys table was not as known", t.job.name, exc_info=True)
        rollback_to(t, sp)
        forget_keys_table(t)
        return None
    return keyed(t, moved(t, read, rows.all()), first)


def keyed(t: Tick, result: list[tuple[Any, ...]], first: sql.Identifier) -> Claimed:
    """The keyed claim's rows as the four sets; the claimed items' typed keys
    kept as loaded, under ``first`` (the savepoint of their processing)."""
    width = len(t.job.scope)
    claimed = classify(t, result)
    gone = set(claimed[1])
    keys = (tuple(r[KEYED_AT : KEYED_AT + width]) for r in result if r[3] and r[0] not in gone)
    t.preloaded = (first, list(dict.fromkeys(keys)))
    t.statements.last_claimed = len(t.preloaded[1])
    return claimed


def classify(t: Tick, result: list[tuple[Any, ...]]) -> Claimed:
    """The claim statement's rows as the four sets; attempts and ages kept."""
    ok: list[str] = []
    gone: list[str] = []
    deferred: list[str] = []
    # Items neither listed as claimed nor deferred have an entry that a
    # user's transaction holds (an uncommitted enqueue): skipped.
    t.claimed_at = time.perf_counter()
    for item, attempts, is_gone, claimed, age, *_ in result:
        if item is None:  # read, and another transaction held it: skipped
            t.held += 1
            continue
        if claimed:
            t.attempts_of[item] = attempts
            t.age_of[item] = age
            (gone if is_gone else ok).append(item)
        else:
            deferred.append(item)
    return sorted(ok), sorted(gone), sorted(deferred), {}


def claim_rows(t: Tick) -> list[str]:
    """Claim due entries plainly (a batch of them), no parent locked."""
    params, read = claim_params(t.job, t.ctx)
    (claimed,) = send(t.conn, (t.statements.claim_all, params))
    rows = moved(t, read, claimed.all(), seq_at=3, claimed_at=0)
    t.claimed_at = time.perf_counter()
    items = []
    for item, attempts, age, *_ in rows:
        if item is None:  # read, and another transaction held it: skipped
            t.held += 1
        else:
            t.attempts_of[item] = attempts
            t.age_of[item] = age
            items.append(item)
    return sorted(items)


def claim_own(t: Tick) -> Claimed:
    """:func:`claim` for a queue of the plugin's own: ``job.claim`` takes
    and locks the items, then their parents are locked here, never
    waiting."""
    assert t.job.claim is not None
    width = len(t.job.scope)
    t.own = {}
    for key in t.job.claim(t.conn, t.job.batch_size):
        values = tuple(key) if isinstance(key, tuple | list) else (key,)
        t.own.setdefault(key_json(values, width), values)
    items = list(t.own)
    if not items:
        return [], [], [], {}
    ensure_keys_table(t)
    if not t.statements.item_parents:
        return sorted(items), [], [], {}
    sp = savepoint(t)
    try:
        ok, gone, deferred = lock_parents(t, items)
    except psycopg.DataError:
        rollback_to(t, sp)
        return lock_readable(t, items)
    return ok, gone, deferred, {}


def finish_own(t: Tick) -> None:
    """Hand the plugin its done and failed keys (a queue of its own)."""
    assert t.own is not None and t.job.finish is not None
    own = t.own
    done = [own[i] for i in (*t.dropped, *t.done)]
    failed = {own[i]: exc for i, exc in sorted(t.failed.items())}
    for key, exc in failed.items():
        log.warning("pgjobs: %s: item %s failed: %s", t.job.name, key, error_text(exc))
    t.job.finish(t.conn, done, failed)


def lock_readable(t: Tick, items: list[str]) -> Claimed:
    """After a key failed to convert to the scope's types: find such keys
    one by one, then lock the others' parents."""
    bad = unreadable(t, items)
    ok, gone, deferred = lock_parents(t, [i for i in items if i not in bad])
    return ok, gone, deferred, bad


def unreadable(t: Tick, items: list[str]) -> dict[str, BaseException]:
    """Keys that don't convert to the scope's column types, one by one."""
    bad: dict[str, BaseException] = {}
    for item in items:
        sp = savepoint(t)
        try:
            t.raw.execute(t.statements.unreadable_probe, ([item],))
        except psycopg.DatabaseError as exc:
            if is_run_level(exc):
                raise
            rollback_to(t, sp)
            bad[item] = exc
        else:
            release(t, sp)
    return bad


def lock_parents(t: Tick, items: list[str]) -> tuple[list[str], list[str], list[str]]:
    """For claimed ``items``: (parents locked, a parent gone, a parent busy)."""
    if not items:
        return [], [], []
    # Each item comes back as it was given (text), not as jsonb prints it.
    ok, gone, deferred = [], [], []
    for item, is_locked, is_present in t.raw.execute(
        t.statements.lock_parents, (items,)
    ).fetchall():
        if not is_present:
            gone.append(item)
        elif is_locked:
            ok.append(item)
        else:
            deferred.append(item)
    return sorted(ok), sorted(gone), sorted(deferred)


__all__ = [
    "PRELOAD_BATCH",
    "Ahead",
    "Claimed",
    "adopt_write",
    "ahead_undone",
    "claim",
    "claim_adopted",
    "claim_ahead",
    "claim_known",
    "claim_own",
    "claim_params",
    "claim_rows",
    "classify",
    "cursor_of",
    "finish_own",
    "keyed",
    "lock_parents",
    "lock_readable",
    "moved",
    "unreadable",
]
