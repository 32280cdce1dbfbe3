"""One queue tick's state (:class:`Tick`), what every step of the tick reads
and adds to, and the small helpers the steps share: savepoints, the
``pgjobs_keys`` table, and how an error is classified and written down.

The steps are functions that take the tick: :mod:`.claim` (claim the
items and lock their parents), :mod:`.tick` (process them, take them off
the queue), :mod:`.small` (a small batch's write in one statement). The
statements a job runs tick after tick are composed once per job and
target (:mod:`.statements`), not per tick.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import Result, driver, frozen, sqlstate_of
from .._pg import error_text as _error_text
from ..database import transaction_pooling
from ..errors import ConfigError
from ..jobs import QueueJob, RunContext
from ..results import DiffStats
from ..target import Prefetched, Target, reflect_target
from .statements import KEYS_TABLE, Statements, statements_for

#: savepoints one tick may take to isolate failing items (PostgreSQL caches 64
#: subtransactions per transaction; beyond that, snapshots slow down)
MAX_SAVEPOINTS = 48

#: batches with more keys than this get their keys table analyzed
ANALYZE_KEYS = 1000

# SQLSTATEs that say nothing about an item: the run fails and is retried as a whole.
_RUN_LEVEL_CLASSES = ("08", "40", "53", "57", "58", "XX")
#: (26000: a prepared statement of pgjobs' is gone from the session, see
#: pgjobs._wire; 0A000: a cached plan a DDL made stale, pgjobs.records.transient)
_RUN_LEVEL_STATES = ("55P03", "26000", "0A000")

#: the longest an item's writes wait for a lock someone else holds (a
#: derived row, a status row): then the item is left queued for a tick a
#: few seconds later, and its neighbours are written (never the job's
#: ``lock_timeout``, 5 s by default, nor a failure: docs/DESIGN.md,
#: "Locks someone holds")
ITEM_LOCK_WAIT = timedelta(milliseconds=500)
#: lock waits one tick spends finding the items whose locks are held; past
#: them, the items not yet written are left for the next tick as they are
MAX_LOCK_WAITS = 8
#: SQLSTATE lock_not_available: a lock not granted within lock_timeout
LOCK_NOT_AVAILABLE = "55P03"


@dataclass(kw_only=True)
class Tick:
    """One tick of one queue job, inside the job's transaction: what it was
    given, and what it did so far (accumulated across the isolation's
    sub-batches)."""

    conn: Connection
    raw: psycopg.Connection[Any]
    job: QueueJob
    ctx: RunContext
    target: Target
    #: the job's statements, composed once for this job and target
    statements: Statements
    stats: DiffStats = field(default_factory=DiffStats)
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
    lock_seconds: float = 0.0
    done: list[str] = field(default_factory=list)
    #: written, but rows were deferred by the writer: left in the queue
    kept: list[str] = field(default_factory=list)
    rows_deferred: int = 0
    #: of ``kept``: items whose writes found a lock someone else holds
    locked: list[str] = field(default_factory=list)
    #: lock waits so far (each up to :data:`ITEM_LOCK_WAIT`)
    lock_waits: int = 0
    #: the target's ROW EXCLUSIVE lock is held (:func:`.tick.target_free`)
    target_held: bool = False
    failed: dict[str, BaseException] = field(default_factory=dict)
    attempts_of: dict[str, int] = field(default_factory=dict)
    #: seconds since each claimed item's enqueue, at the claim (database clock)
    age_of: dict[str, float] = field(default_factory=dict)
    claimed_at: float = 0.0  #: time.perf_counter() at the claim
    savepoints: int = 0
    #: a queue of the plugin's own (job.claim): item text -> its key as claimed
    own: dict[str, tuple[Any, ...]] | None = None
    #: the items dropped because their parent is gone
    dropped: list[str] = field(default_factory=list)
    #: the claim loaded the keys table with its items' keys, and took the
    #: savepoint of their processing: (that savepoint, the keys)
    preloaded: tuple[sql.Identifier, list[tuple[Any, ...]]] | None = None
    #: the small write went with the claim and is taken as this batch's:
    #: (its composed statement, its result), for :func:`.small.write_small`
    ahead_write: tuple[Any, Result] | None = None
    #: entries the claim read and another transaction held (skipped)
    held: int = 0
    #: each claimed item's entry, by its ctid (the claim locked that version;
    #: the delete takes it by it)
    ctid_of: dict[str, str] = field(default_factory=dict)


def new_tick(
    conn: Connection, job: QueueJob, ctx: RunContext, prefetched: Prefetched | None
) -> Tick:
    """The state of a tick about to claim: the target reflected (from the
    catalog check the lock's round trip brought back), the job's statements."""
    target = reflect_target(
        conn, job.target, key=job.key, parents=job.parents, prefetched=prefetched
    )
    missing = [c for c in job.scope if c not in target.types]
    if missing:
        raise ConfigError(
            f"QueueJob {job.name!r}: scope: {target.label} has no writable column(s) "
            f"{', '.join(missing)}"
        )
    return Tick(
        conn=conn,
        raw=driver(conn),
        job=job,
        ctx=ctx,
        target=target,
        statements=statements_for(job, ctx.schema, target),
    )


def item_lock_wait(job: QueueJob) -> tuple[sql.SQL, None]:
    """The statement that bounds the lock waits of the tick's writes by
    :data:`ITEM_LOCK_WAIT` (or the job's ``lock_timeout``, if shorter)."""
    timeout = job.lock_timeout
    assert isinstance(timeout, timedelta)
    wait = min(timeout, ITEM_LOCK_WAIT) if timeout > timedelta(0) else ITEM_LOCK_WAIT
    return _lock_wait_sql(max(1, int(wait.total_seconds() * 1000))), None


@functools.lru_cache(maxsize=16)
def _lock_wait_sql(ms: int) -> sql.SQL:
    # composed once, a literal: no parameter to adapt at each tick
    return frozen(sql.SQL("select set_config('lock_timeout', {}, true)").format(f"{ms}ms"))


def is_run_level(exc: BaseException) -> bool:
    """An error no item caused: fail the run instead of blaming items."""
    if isinstance(exc, ConfigError):  # the job's definition is wrong, not an item
        return True
    state = sqlstate_of(exc)
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(_RUN_LEVEL_CLASSES) or state in _RUN_LEVEL_STATES


def error_text(exc: BaseException) -> str:
    """What an item's ``last_error`` says: the driver's error (not
    SQLAlchemy's wrapper, which repeats the SQL and adds a link), with its
    SQLSTATE when the database gave one."""
    return _error_text(exc, limit=2000, sqlstate=True)


# -- savepoints -----------------------------------------------------------------------
def next_savepoint(t: Tick) -> sql.Identifier:
    """The name of the tick's next savepoint (taken by the caller)."""
    t.savepoints += 1
    return sql.Identifier(f"pgjobs_q{t.savepoints}")


def savepoint(t: Tick) -> sql.Identifier:
    """Take the tick's next savepoint now; its name."""
    name = next_savepoint(t)
    t.raw.execute(sql.SQL("savepoint {}").format(name))
    return name


def release(t: Tick, name: sql.Identifier) -> None:
    t.raw.execute(sql.SQL("release savepoint {}").format(name))


def rollback_to(t: Tick, name: sql.Identifier) -> None:
    t.raw.execute(sql.SQL("rollback to savepoint {n}; release savepoint {n}").format(n=name))


# -- the keys table -----------------------------------------------------------------------
KEYS_SHAPE = (
    "select array_agg(attname || ':' || atttypid order by attnum) from pg_attribute"
    " where attrelid = to_regclass('pg_temp.pgjobs_keys') and attnum > 0"
    " and not attisdropped"
)
"""The keys table's columns and types, as :func:`keys_table_fits` reads them."""


#: per driver connection: (its server process, the keys table's shape last
#: seen there), so that a tick need not ask again (see keys_table_known)
_shapes: weakref.WeakKeyDictionary[psycopg.Connection[Any], tuple[int, list[str]]] = (
    weakref.WeakKeyDictionary()
)


def _shape(t: Tick) -> list[str]:
    return _shape_of(t.job, t.target)


def _shape_of(job: QueueJob, target: Target) -> list[str]:
    return [f"{c}:{target.types[c].type_oid}" for c in job.scope]


def keys_table_fits(t: Tick, row: tuple[Any, ...] | None) -> bool:
    """Does :data:`KEYS_SHAPE`'s answer ``row`` fit this job's scope? (Kept
    for this connection when it does.)"""
    fits = row is not None and row[0] == _shape(t)
    if fits:
        _shapes[t.raw] = (t.raw.info.backend_pid, _shape(t))
    else:
        _shapes.pop(t.raw, None)
    return fits


def keys_table_known(t: Tick) -> bool:
    """Was the keys table seen (or made) with this job's shape in this
    session? Never behind a transaction pooler: the next transaction may
    run on another session. A claim that trusted it and failed forgets it
    (:func:`forget_keys_table`) and asks."""
    return keys_table_known_for(t.raw, t.job, t.target)


def keys_table_known_for(raw: psycopg.Connection[Any], job: QueueJob, target: Target) -> bool:
    """:func:`keys_table_known`, before a tick has its state."""
    seen = _shapes.get(raw)
    if seen is None or transaction_pooling() or seen[0] != raw.info.backend_pid:
        return False
    try:
        return seen[1] == _shape_of(job, target)
    except KeyError:  # a scope column the target lacks: new_tick says so
        return False


def forget_keys_table(t: Tick) -> None:
    forget_keys_table_of(t.raw)


def forget_keys_table_of(raw: psycopg.Connection[Any]) -> None:
    _shapes.pop(raw, None)


def ensure_keys_table(t: Tick) -> None:
    """``pgjobs_keys`` lives as long as the session (``ON COMMIT DELETE
    ROWS``): creating a temp table per tick costs more catalog writes than
    the rest of a small batch. It is recreated when its columns or their
    types don't match this job's scope."""
    if not keys_table_fits(t, t.raw.execute(KEYS_SHAPE).fetchone()):
        create_keys_table(t)


def create_keys_table(t: Tick) -> None:
    t.raw.execute(t.statements.create_keys)
    _shapes[t.raw] = (t.raw.info.backend_pid, _shape(t))


__all__ = [
    "ITEM_LOCK_WAIT",
    "KEYS_TABLE",
    "LOCK_NOT_AVAILABLE",
    "MAX_LOCK_WAITS",
    "Tick",
    "item_lock_wait",
    "new_tick",
]
