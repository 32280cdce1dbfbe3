"""The built-in queue: the table's API (enqueue, triggers, stats, vacuum).

``<schema>.queue`` holds one row per (job, key): the item's scope values as
a JSON array (``[42]``, ``[7, "b"]``), when it was first enqueued, its failed
attempts, ``not_before`` and ``last_error``, and ``dead_at`` once parked.

* :func:`enqueue` adds keys inside the caller's transaction. An entry already
  pending is *locked* (``INSERT ... ON CONFLICT DO UPDATE``, never ``DO
  NOTHING``): the worker claims with ``SKIP LOCKED``, so it cannot consume
  the entry while the caller's change is uncommitted and then lose it.
* :func:`install_enqueue_trigger` does the same from a trigger on a table.
* :func:`queue_stats` gives depth, oldest age, retrying and dead items per job.
* :func:`vacuum_queue` clears the dead entries workers leave behind.

Async applications call :func:`enqueue_async`, :func:`queue_stats_async`,
:func:`install_enqueue_trigger_async` and :func:`drop_enqueue_trigger_async`
with a SQLAlchemy or psycopg ``AsyncConnection``, in their own transaction.
Both paths send the same statements: each is built once, below, and only
the call that sends it differs.

The worker that consumes the queue is :mod:`pgjobs.worker`. The schema is
created by ``pgjobs.install(database)`` or by any job's first tick.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import date, datetime
from datetime import time as dtime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import psycopg
from psycopg import errors, sql
from sqlalchemy.engine import Connection

from ._pg import driver, qualified
from .errors import ConfigError, PgJobsError
from .readmodel import QueueStats, queue_stats_of, queue_stats_query
from .store import DEFAULT_SCHEMA

if TYPE_CHECKING:
    # not imported at run time: SQLAlchemy's asyncio needs greenlet, an extra
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection

log = logging.getLogger(__name__)

_NOT_INSTALLED = (
    "pgjobs' schema {schema!r} is not installed in this database; create it once with "
    "pgjobs.install(database) (or run any job) before enqueueing"
)

AnyConnection = Connection | psycopg.Connection[Any]


@runtime_checkable
class Queued(Protocol):
    """What the queue needs of a job (a :class:`~pgjobs.QueueJob`, or any
    object with these): its name and its scope's columns. The queue knows
    no job kinds."""

    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> tuple[str, ...]: ...


AnyAsyncConnection: TypeAlias = "SAAsyncConnection | psycopg.AsyncConnection[Any]"

#: what a statement on pgjobs' queue raises when the schema is not installed
_MISSING_FUNCTION = (errors.UndefinedFunction, errors.UndefinedTable, errors.InvalidSchemaName)
_MISSING_TABLE = (errors.UndefinedTable, errors.InvalidSchemaName)


# -- connections -------------------------------------------------------------
def _raw(conn: AnyConnection) -> psycopg.Connection[Any]:
    """The psycopg connection to run on, inside the caller's transaction."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, Connection):
        if not conn.in_transaction():
            # What conn.execute() would do (autobegin): the caller commits.
            conn.begin()
        return driver(conn)
    if _is_async(conn):
        raise TypeError(
            f"got an asynchronous {type(conn).__name__}: await the *_async function instead"
            " (pgjobs.enqueue_async, ...)"
        )
    raise TypeError(f"expected a SQLAlchemy or psycopg Connection, got {type(conn).__name__}")


def _sa_async_connection(conn: object) -> bool:
    # If conn is one, SQLAlchemy's asyncio is imported already.
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(conn, module.AsyncConnection)


def _is_async(conn: object) -> bool:
    return isinstance(conn, psycopg.AsyncConnection) or _sa_async_connection(conn)


async def _araw(conn: AnyAsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg ``AsyncConnection`` to run on, inside the caller's transaction."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if _sa_async_connection(conn):
        if not conn.in_transaction():
            # What await conn.execute() would do (autobegin): the caller commits.
            await conn.begin()
        raw = (await conn.get_raw_connection()).driver_connection
        if not isinstance(raw, psycopg.AsyncConnection):
            raise TypeError(
                f"expected an engine on psycopg (postgresql+psycopg://), got the driver "
                f"connection {type(raw).__name__}"
            )
        return raw
    if isinstance(conn, Connection | psycopg.Connection):
        raise TypeError(
            f"got a synchronous {type(conn).__name__}: call the function without _async"
            " (pgjobs.enqueue, ...)"
        )
    raise TypeError(f"expected a SQLAlchemy or psycopg AsyncConnection, got {type(conn).__name__}")


def channel(schema: str, job: str) -> str:
    """The channel an enqueue of ``job`` notifies (its SQL twin is
    ``<schema>.channel(job)``, migration 008): an identifier within 63 bytes
    for any job name, distinct per schema."""
    digest = hashlib.md5(f"{len(schema)}:{schema}{job}".encode()).hexdigest()[:20]
    return f"pgjobs_{digest}"


def queue_table(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, "queue")


# -- keys ----------------------------------------------------------------------
#: the longest key the queue takes, as JSON: a btree index entry holds at most
#: about 2,700 bytes (a 1 MB key failed with "index row requires ... bytes")
MAX_KEY_BYTES = 2_000


def _json_value(value: Any, key: Any) -> Any:
    if value is None:
        raise ConfigError(f"keys: a key value may not be None, got {key!r}")
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"keys: {value!r} is not a key value, in {key!r}")
        return value
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, datetime | date | dtime):
        return value.isoformat()
    raise ConfigError(
        f"keys: {type(value).__name__} is not supported as a key value (use int, str, UUID, "
        f"Decimal, date or datetime), in {key!r}"
    )


def key_json(key: Any, width: int | None = None) -> str:
    """A key as the queue stores it: a JSON array of its scope values.

    ``key`` is a scalar for a one-column scope, a tuple (or list) for a
    composite one; ``width`` (the scope's column count) is checked when given.
    """
    values = tuple(key) if isinstance(key, tuple | list) else (key,)
    if width is not None and len(values) != width:
        raise ConfigError(f"keys: expected {width} scope value(s) per key, got {key!r}")
    if not values:
        raise ConfigError("keys: a key needs at least one value")
    text = json.dumps([_json_value(v, key) for v in values], separators=(",", ":"))
    if len(text.encode()) > MAX_KEY_BYTES:
        raise ConfigError(
            f"keys: a key is at most {MAX_KEY_BYTES:,} bytes as the queue stores it (its"
            f" primary key index holds it), got {len(text.encode()):,} bytes starting"
            f" {text[:60]!r}"
        )
    return text


# -- enqueue -------------------------------------------------------------------
def enqueue(
    conn: AnyConnection,
    job: str | Queued,
    keys: Iterable[Any],
    *,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Put ``keys`` in ``job``'s queue, inside the caller's transaction.

    Keys are scalars for a one-column scope, tuples for a composite scope,
    in the scope's column order. Enqueueing is idempotent: one entry per
    (job, key), however often it is enqueued before the worker gets to it.
    A pending entry is locked until the caller commits, so a worker cannot
    process it on data the caller has not committed yet; enqueue in the
    same transaction as the change::

        with engine.begin() as conn:
            conn.execute(update(exam).where(exam.c.id == 7).values(title="x"))
            pgjobs.enqueue(conn, "exam-worker", [7])

    ``conn`` is a SQLAlchemy ``Connection`` (a transaction is begun if none
    is, as ``conn.execute`` would) or a psycopg ``Connection``. A parked
    (dead) entry is revived with its attempts reset. Returns how many
    entries were added or revived (0 when all were already pending).

    The schema must exist (``pgjobs.install(database)``, or any
    job's first tick); otherwise :class:`~pgjobs.PgJobsError` says so.
    An async application awaits :func:`enqueue_async` instead.
    """
    call = enqueue_call(job, keys, schema)
    if call is None:
        return 0
    raw = _raw(conn)
    try:
        row = raw.execute(*call).fetchone()
    except _MISSING_FUNCTION as exc:
        raise PgJobsError(_NOT_INSTALLED.format(schema=schema)) from exc
    return int(row[0]) if row else 0


async def enqueue_async(
    conn: AnyAsyncConnection,
    job: str | Queued,
    keys: Iterable[Any],
    *,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """:func:`enqueue` for async code: the same statement, on a SQLAlchemy
    ``AsyncConnection`` (an engine on ``postgresql+psycopg://``; a
    transaction is begun if none is) or a psycopg ``AsyncConnection``,
    inside the caller's transaction::

        async with engine.begin() as conn:
            await conn.execute(update(exam).where(exam.c.id == 7).values(title="x"))
            await pgjobs.enqueue_async(conn, "exam-worker", [7])
    """
    call = enqueue_call(job, keys, schema)
    if call is None:
        return 0
    raw = await _araw(conn)
    try:
        row = await (await raw.execute(*call)).fetchone()
    except _MISSING_FUNCTION as exc:
        raise PgJobsError(_NOT_INSTALLED.format(schema=schema)) from exc
    return int(row[0]) if row else 0


def enqueue_call(
    job: str | Queued, keys: Iterable[Any], schema: str
) -> tuple[sql.Composed, tuple[str, str]] | None:
    """The enqueue statement and its parameters; ``None`` when there are no keys
    (what :func:`enqueue` sends; ``pgjobs.contrib.django`` sends it on Django's cursor)."""
    if isinstance(job, Queued):
        name, width = job.name, len(job.scope)
    elif isinstance(job, str) and job:
        name, width = job, None
    else:
        raise ConfigError(f"job: expected a QueueJob or a job name, got {job!r}")
    if isinstance(keys, str | bytes):
        raise ConfigError(
            f"keys: expected an iterable of keys, got the string {keys!r}; wrap it: [key]"
        )
    items = [key_json(k, width) for k in keys]
    if not items:
        return None
    query = sql.SQL("select {}(%s, %s::jsonb)").format(sql.Identifier(schema, "enqueue"))
    return query, (name, "[" + ",".join(items) + "]")


def install_enqueue_trigger(
    conn: AnyConnection,
    *,
    table: str,
    job: str | Queued,
    columns: Sequence[str],
    schema: str = DEFAULT_SCHEMA,
) -> None:
    """Enqueue the keys of ``table``'s inserted, updated and deleted rows.

    ``columns`` are ``table``'s columns that form the job's key, in the
    scope's order (for a parent table, usually its primary key). Updates
    enqueue the old and the new key. Statement-level triggers with
    transition tables: a bulk statement enqueues its keys in one upsert.
    Idempotent (re-installing replaces the triggers); runs in the caller's
    transaction. Its DDL takes the table's SHARE ROW EXCLUSIVE lock
    (CREATE TRIGGER), ACCESS EXCLUSIVE when it replaces triggers (DROP
    TRIGGER): each attempt waits at most :data:`TRIGGER_LOCK_WAIT` for it
    (the table's writers, or readers too, would queue behind a longer
    wait: PostgreSQL grants locks in order), under a savepoint, and is
    retried with backoff for :data:`TRIGGER_RETRY_FOR`, then
    :class:`~pgjobs.PgJobsError`. Remove with :func:`drop_enqueue_trigger`.
    Async code awaits :func:`install_enqueue_trigger_async`.
    """
    name = job.name if isinstance(job, Queued) else job
    cols = _trigger_columns(columns, job)
    raw = _raw(conn)
    query, params = _columns_query(raw, table)
    _check_columns(table, cols, raw.execute(query, params).fetchall())
    statements = _trigger_statements(name, table, cols, schema)
    before = raw.execute(_LOCK_TIMEOUT_NOW).fetchone()
    deadline = time.monotonic() + TRIGGER_RETRY_FOR
    for attempt in itertools.count(1):
        # each attempt under a savepoint (a transaction of its own in
        # autocommit): a lock timeout undoes it alone, never the caller's work
        try:
            with raw.transaction():
                raw.execute(_SET_LOCK_TIMEOUT, (_trigger_wait(),))
                for statement in statements:
                    raw.execute(statement)
        except errors.LockNotAvailable:
            time.sleep(_trigger_retry(table, attempt, deadline))
            continue
        break
    # the caller's own lock_timeout again, for the rest of its transaction
    raw.execute(_SET_LOCK_TIMEOUT, (before[0] if before else "0",))


async def install_enqueue_trigger_async(
    conn: AnyAsyncConnection,
    *,
    table: str,
    job: str | Queued,
    columns: Sequence[str],
    schema: str = DEFAULT_SCHEMA,
) -> None:
    """:func:`install_enqueue_trigger` on an ``AsyncConnection``, in the caller's transaction."""
    name = job.name if isinstance(job, Queued) else job
    cols = _trigger_columns(columns, job)
    raw = await _araw(conn)
    query, params = _columns_query(raw, table)
    _check_columns(table, cols, await (await raw.execute(query, params)).fetchall())
    statements = _trigger_statements(name, table, cols, schema)
    before = await (await raw.execute(_LOCK_TIMEOUT_NOW)).fetchone()
    deadline = time.monotonic() + TRIGGER_RETRY_FOR
    for attempt in itertools.count(1):  # as install_enqueue_trigger does
        try:
            async with raw.transaction():
                await raw.execute(_SET_LOCK_TIMEOUT, (_trigger_wait(),))
                for statement in statements:
                    await raw.execute(statement)
        except errors.LockNotAvailable:
            await asyncio.sleep(_trigger_retry(table, attempt, deadline))
            continue
        break
    await raw.execute(_SET_LOCK_TIMEOUT, (before[0] if before else "0",))


#: how long one attempt of :func:`install_enqueue_trigger` waits for the
#: table's lock: CREATE TRIGGER takes SHARE ROW EXCLUSIVE (DROP TRIGGER of
#: one that exists, ACCESS EXCLUSIVE), and a request queued behind a long
#: transaction holds every later writer (or reader) of the table behind it
#: (PostgreSQL grants locks in order)
TRIGGER_LOCK_WAIT = 2.0
#: how long attempts that found the table's lock taken are retried (with
#: backoff, a log line each) before the lock timeout is raised
TRIGGER_RETRY_FOR = 60.0
_LOCK_TIMEOUT_NOW = "select current_setting('lock_timeout')"
_SET_LOCK_TIMEOUT = "select set_config('lock_timeout', %s, true)"


def _trigger_wait() -> str:
    return f"{max(1, int(TRIGGER_LOCK_WAIT * 1000))}ms"


def _trigger_retry(table: str, attempt: int, deadline: float) -> float:
    """The wait before another attempt at ``table``'s triggers (0.1 s doubling
    to 5 s), said in a log line; raises when the next would pass ``deadline``."""
    delay = min(0.1 * 2.0 ** (attempt - 1), 5.0)
    if time.monotonic() + delay > deadline:
        raise PgJobsError(
            f"install_enqueue_trigger: {table} stayed locked by other transactions for"
            f" {TRIGGER_RETRY_FOR:g} s ({attempt} attempts of {TRIGGER_LOCK_WAIT:g} s);"
            " nothing was changed"
        )
    log.warning(
        "pgjobs: install_enqueue_trigger: %s is locked by another transaction (attempt %d);"
        " trying again in %.1f s",
        table,
        attempt,
        delay,
    )
    return delay


def drop_enqueue_trigger(conn: AnyConnection, *, table: str, job: str | Queued) -> None:
    """Remove the triggers :func:`install_enqueue_trigger` put on ``table`` for ``job``."""
    name = job.name if isinstance(job, Queued) else job
    raw = _raw(conn)
    for statement in _drop_statements(name, table):
        raw.execute(statement)


async def drop_enqueue_trigger_async(
    conn: AnyAsyncConnection, *, table: str, job: str | Queued
) -> None:
    """:func:`drop_enqueue_trigger` on an ``AsyncConnection``, in the caller's transaction."""
    name = job.name if isinstance(job, Queued) else job
    raw = await _araw(conn)
    for statement in _drop_statements(name, table):
        await raw.execute(statement)


#: (event, its REFERENCING clause): the three events whose rows carry keys
TRIGGER_EVENTS = (
    ("insert", "referencing new table as new_rows"),
    ("update", "referencing old table as old_rows new table as new_rows"),
    ("delete", "referencing old table as old_rows"),
)
#: a TRUNCATE has no rows to read (no transition table), only the fact
TRUNCATE_EVENT = ("truncate", "")


def trigger_statements(
    name: str,
    table: str | sql.Identifier,
    schema: str,
    *,
    args: Callable[[str], Sequence[str]],
    function: str = "enqueue_trigger",
    events: Sequence[tuple[str, str]] = TRIGGER_EVENTS,
) -> list[sql.Composed]:
    """Drop, then create, one statement-level trigger per event on
    ``table``, each calling ``<schema>.<function>(args(event))`` (an SQL
    function that enqueues for job ``name``). The one place pgjobs composes
    its enqueue triggers: :func:`install_enqueue_trigger` and the derived
    tables' (:mod:`pgjobs.derived`) both go through it."""
    ident = qualified(table) if isinstance(table, str) else table
    target = sql.Identifier(schema, function)
    statements = []
    for event, referencing in events:
        trigger = sql.Identifier(trigger_name(name, event))
        statements.append(sql.SQL("drop trigger if exists {} on {}").format(trigger, ident))
        statements.append(
            sql.SQL(
                "create trigger {} after "
                + event
                + " on {} "
                + referencing
                + " for each statement execute function {}({})"
            ).format(
                trigger, ident, target, sql.SQL(", ").join(sql.Literal(a) for a in args(event))
            )
        )
    return statements


def _trigger_statements(
    name: str, table: str, cols: tuple[str, ...], schema: str
) -> list[sql.Composed]:
    """Drop, then create, the three statement-level triggers, in that order."""
    return trigger_statements(name, table, schema, args=lambda _event: (name, *cols))


def drop_statements(
    name: str, table: str | sql.Identifier, events: Sequence[tuple[str, str]] = TRIGGER_EVENTS
) -> list[sql.Composed]:
    """Drop the triggers :func:`trigger_statements` creates for ``name``."""
    ident = qualified(table) if isinstance(table, str) else table
    return [
        sql.SQL("drop trigger if exists {} on {}").format(
            sql.Identifier(trigger_name(name, event)), ident
        )
        for event, _ in events
    ]


def _drop_statements(name: str, table: str) -> list[sql.Composed]:
    return drop_statements(name, table)


def _trigger_columns(columns: Sequence[str], job: str | Queued) -> tuple[str, ...]:
    cols = (columns,) if isinstance(columns, str) else tuple(columns)
    if not cols or not all(isinstance(c, str) and c for c in cols):
        raise ConfigError(f"columns: expected column names, got {columns!r}")
    if isinstance(job, Queued) and len(cols) != len(job.scope):
        raise ConfigError(
            f"columns: job {job.name!r} has the scope {job.scope}; give as many columns, got {cols}"
        )
    return cols


def trigger_name(job: str, event: str) -> str:
    # Trigger names are per table and at most 63 bytes: a digest keeps them
    # unique per job however long the job's name is.
    digest = hashlib.sha1(job.encode()).hexdigest()[:10]
    return f"pgjobs_enqueue_{digest}_{event}"


def _columns_query(
    raw: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], table: str
) -> tuple[str, tuple[str]]:
    """The query for ``table``'s column names (``_check_columns`` reads its rows)."""
    return (
        "select attname from pg_attribute where attrelid = %s::regclass and attnum > 0"
        " and not attisdropped",
        (qualified(table).as_string(raw),),
    )


def _check_columns(table: str, columns: tuple[str, ...], rows: Sequence[tuple[Any, ...]]) -> None:
    present = {r[0] for r in rows}
    missing = [c for c in columns if c not in present]
    if missing:
        raise ConfigError(f"columns: {table!r} has no column(s) {missing}")


# -- status ----------------------------------------------------------------------------
# The counts are read by pgjobs.readmodel, which status, the page and the metrics share.
def queue_stats(conn: AnyConnection, *, schema: str = DEFAULT_SCHEMA) -> list[QueueStats]:
    """Per job with anything in the queue: depth, due, retrying, dead, the
    oldest live item's age and the oldest due item's age
    (:class:`QueueStats`). Async code awaits :func:`queue_stats_async`."""
    raw = _raw(conn)
    try:
        rows = raw.execute(queue_stats_query(schema), {"job": None}).fetchall()
    except _MISSING_TABLE as exc:
        raise PgJobsError(_NOT_INSTALLED.format(schema=schema)) from exc
    return queue_stats_of(rows)


async def queue_stats_async(
    conn: AnyAsyncConnection, *, schema: str = DEFAULT_SCHEMA
) -> list[QueueStats]:
    """:func:`queue_stats` on an ``AsyncConnection``, in the caller's transaction."""
    raw = await _araw(conn)
    try:
        rows = await (await raw.execute(queue_stats_query(schema), {"job": None})).fetchall()
    except _MISSING_TABLE as exc:
        raise PgJobsError(_NOT_INSTALLED.format(schema=schema)) from exc
    return queue_stats_of(rows)


# -- upkeep ------------------------------------------------------------------------
def vacuum_queue(conn: Connection, *, schema: str = DEFAULT_SCHEMA) -> int | None:
    """``VACUUM`` the queue table, on ``conn`` outside any transaction; the
    dead entries it had to leave (a snapshot may still see them: a held
    xmin horizon), as the vacuum reported them, or ``None`` when the
    statistics do not say.

    Every processed entry leaves a dead version in the table and its
    indexes until a vacuum removes it. Claims and work checks read past
    them (the cursor, :mod:`pgjobs.worker.cursor`), but a key's next
    enqueue walks that key's dead versions, the cursor's full pass and
    ``queue_stats`` walk them all, and the table grows. Autovacuum looks at
    a table once a minute at best; a queue drained at thousands of items a
    second is worth vacuuming sooner. So a worker vacuums the queue itself
    after every so many entries it took off (:mod:`pgjobs.worker.vacuum`;
    1-5 ms each time here). ``SKIP_LOCKED``: when another vacuum of the
    table runs, this one does nothing. A role that does not own the table
    gets a warning from PostgreSQL and nothing else.
    """
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    if raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise PgJobsError("vacuum_queue: the connection is inside a transaction")
    raw.autocommit = True
    try:
        table = queue_table(schema)
        raw.execute(sql.SQL("vacuum (skip_locked) {}").format(table))
        row = raw.execute(
            "select pg_stat_get_dead_tuples(%s::regclass)", (table.as_string(raw),)
        ).fetchone()
    finally:
        raw.autocommit = False
    return None if row is None or row[0] is None else int(row[0])


__all__ = [
    "TRIGGER_EVENTS",
    "TRIGGER_LOCK_WAIT",
    "TRIGGER_RETRY_FOR",
    "TRUNCATE_EVENT",
    "QueueStats",
    "channel",
    "drop_enqueue_trigger",
    "drop_enqueue_trigger_async",
    "drop_statements",
    "enqueue",
    "enqueue_async",
    "enqueue_call",
    "install_enqueue_trigger",
    "install_enqueue_trigger_async",
    "key_json",
    "queue_stats",
    "queue_stats_async",
    "trigger_name",
    "trigger_statements",
    "vacuum_queue",
]
