"""pgjobs' round trips: the per-connection queue of statements that go
out together, and running composed psycopg SQL on a SQLAlchemy connection;
besides, how a database error is read (:func:`error_text`,
:func:`sqlstate_of`, :func:`connection_lost`).

pgjobs talks SQLAlchemy at its edges (callbacks receive a SQLAlchemy
``Connection``) and psycopg inside, because dynamic identifiers are composed
with :mod:`psycopg.sql` and rows are loaded with ``COPY``. Both share one
driver connection and so one transaction.

Round trips: :func:`later` queues a statement to go out with the next
:func:`send` on the same connection, which sends what is queued and its own
statements in one round trip. Every statement is one SQL command.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection, RootTransaction

from . import _wire
from ._wire import Result

Params = Sequence[Any] | Mapping[str, Any] | None

log = logging.getLogger(__name__)


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn``; ``conn`` must be in a transaction,
    so that SQLAlchemy commits or rolls back what is done on it."""
    if not conn.in_transaction():
        raise RuntimeError("pgjobs: expected a connection inside a transaction (conn.begin())")
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def abandon(conn: Connection, trans: RootTransaction) -> None:
    """Roll ``trans`` back, and the driver's transaction with it; what was
    queued with :func:`later` is dropped.

    After a statement failed in a psycopg pipeline, or a COMMIT sent in one,
    SQLAlchemy may see its transaction as over while the server still holds
    an aborted one: the connection's next ``begin()`` would then fail.
    Never raises: a connection that cannot roll back (it is gone) is
    invalidated, so that its pool does not hand it out again."""
    raw = conn.connection.driver_connection if not conn.invalidated else None
    if isinstance(raw, psycopg.Connection):
        _queued.pop(raw, None)
    try:
        trans.rollback()
        if (
            isinstance(raw, psycopg.Connection)
            and not raw.closed
            and raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
        ):
            raw.rollback()
    except Exception:
        log.debug("pgjobs: rolling back failed; dropping the connection", exc_info=True)
        with contextlib.suppress(Exception):
            conn.invalidate()


def open_transaction(conn: Connection) -> bool:
    """Does the server still hold ``conn``'s transaction (running, or aborted
    by an error, its locks kept)? False when the connection is gone."""
    if conn.invalidated or conn.closed:
        return False
    raw = conn.connection.driver_connection
    return (
        isinstance(raw, psycopg.Connection)
        and not raw.closed
        and raw.info.transaction_status
        in (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.INERROR)
    )


def connection_lost(exc: BaseException) -> bool:
    """Did ``exc`` come from a connection that is gone (or from the server
    shutting the session down)?"""
    state = sqlstate_of(exc)
    if state is not None:
        return state.startswith(("08", "57P"))
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (current, getattr(current, "orig", None)):
            if isinstance(candidate, psycopg.OperationalError | psycopg.InterfaceError):
                return True
            if getattr(candidate, "connection_invalidated", False):
                return True
        current = current.__cause__ or current.__context__
    return False


def unavailable(exc: BaseException) -> bool:
    """Is the database away (:func:`connection_lost`), or a read-only server
    (SQLSTATE 25006: the URL reached a standby), rather than wrong?"""
    return connection_lost(exc) or sqlstate_of(exc) == "25006"


def why_unavailable(exc: BaseException) -> str:
    """One line for :func:`unavailable`'s ``exc``."""
    if sqlstate_of(exc) == "25006":
        return f"a read-only server, SQLSTATE 25006: {first_line(exc)}"
    return first_line(exc)


# -- round trips ----------------------------------------------------------------------
class Later:
    """A statement queued by :func:`later`; :attr:`result` once it was sent.
    A *guarded* one (``later(..., guarded=True)``) keeps its failure in
    :attr:`error` instead of raising it (see :func:`send`)."""

    __slots__ = ("error", "guarded", "params", "result", "statement")

    def __init__(
        self, statement: sql.Composable | str, params: Params, guarded: bool = False
    ) -> None:
        self.statement = statement
        self.params = params
        self.guarded = guarded
        self.result: Result | None = None
        self.error: psycopg.Error | None = None


#: statements waiting for the next round trip, per driver connection
_queued: weakref.WeakKeyDictionary[psycopg.Connection[Any], list[Later]] = (
    weakref.WeakKeyDictionary()
)


def later(
    conn: Connection,
    statement: sql.Composable | str,
    params: Params = None,
    *,
    guarded: bool = False,
) -> Later:
    """Queue ``statement`` (one SQL command) to go out, in order, with the next
    :func:`send` on ``conn``: a write or a setting whose result nobody waits
    for, or one the caller reads afterwards from the returned handle.

    ``guarded``: work done ahead on speculation, whose caller looks at it
    later and takes another way when it failed. Guarded statements come
    after every unguarded one of the round trip (the first one guarded is
    best a savepoint, to roll back to): when one fails, and every
    statement before the guarded ones went through, the error is kept on
    the guarded handles (:attr:`Later.error`) and not raised, and the
    transaction is left aborted for their caller to roll back to its
    savepoint."""
    item = Later(statement, params, guarded)
    _queued.setdefault(driver(conn), []).append(item)
    return item


def send(
    conn: Connection,
    *statements: tuple[sql.Composable | str, Params],
    commit: RootTransaction | None = None,
) -> list[Result]:
    """Send what is queued on ``conn`` and then ``statements`` (each one SQL
    command, with its parameters or ``None``) in one round trip, and with
    ``commit``, COMMIT that transaction in it too. Returns the results of
    ``statements``.

    Inside a transaction already under way, several statements without
    parameters anywhere (DDL, the diff writer's statements on its session
    tables) go as one simple query: none of them is prepared, their plans
    follow those tables as they are. Otherwise (parameters, a statement
    alone, a COMMIT, or a transaction whose BEGIN has yet to be sent, which
    then travels with them) they go in one pipeline, straight through
    libpq (:mod:`pgjobs._wire`; psycopg's pipeline where that cannot run).
    When a statement fails there, the results of those before it are kept
    on their handles."""
    raw = driver(conn)
    todo = [*_queued.pop(raw, ()), *(Later(s, p) for s, p in statements)]
    begun = raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    simple = begun and commit is None and not any(item.guarded for item in todo)
    if simple and len(todo) > 1 and all(item.params is None for item in todo):
        cur = raw.execute(sql.SQL("; ").join(_composable(i.statement) for i in todo))
        for item in todo:
            item.result = _result(cur)
            cur.nextset()
    elif simple and len(todo) == 1 and not _wire.usable(raw):
        item = todo[0]
        item.result = _result(raw.execute(item.statement, item.params))
    elif todo or commit is not None:
        _pipeline(raw, todo, commit)
    out = [item.result for item in todo[len(todo) - len(statements) :]]
    return [r if r is not None else Result() for r in out]


def _pipeline(
    raw: psycopg.Connection[Any], todo: list[Later], commit: RootTransaction | None
) -> None:
    """``todo`` (and COMMIT) in one pipeline, straight through libpq
    (:mod:`pgjobs._wire`), or psycopg's where that cannot run. The COMMIT
    goes as a statement, and SQLAlchemy is told afterwards (psycopg then
    has nothing left to do): should a statement before it fail, the server
    skips the COMMIT and keeps the transaction open, aborted, with its
    locks, which the caller may roll back to a savepoint and go on in."""
    if not _wire.usable(raw):
        _psycopg_pipeline(raw, todo, commit)
        return
    outcomes, first = _wire.round_trip(
        raw, [(item.statement, item.params) for item in todo], commit=commit is not None
    )
    for item, outcome in zip(todo, outcomes, strict=True):
        if outcome is not None:
            item.result = outcome
    if first is not None:
        if _guarded_failed(raw, todo, first, commit):
            return
        raise first
    if commit is not None:
        commit.commit()


def _psycopg_pipeline(
    raw: psycopg.Connection[Any], todo: list[Later], commit: RootTransaction | None
) -> None:
    """``todo`` (and COMMIT) in one psycopg pipeline. The COMMIT goes as a
    statement, and SQLAlchemy is told afterwards (psycopg then has nothing
    left to do): should a statement before it fail, the server skips the
    COMMIT and keeps the transaction open, aborted, with its locks, which
    the caller may roll back to a savepoint and go on in."""
    cursors: list[psycopg.Cursor[Any]] = []
    # psycopg may read results while statements are still being queued, and
    # raise there; the pipeline's exit then fails too ("pipeline aborted"),
    # and psycopg logs a warning about it. So the first error is kept, the
    # pipeline left normally (its exit reports the abort, not logged), and
    # the first error raised after it.
    first: psycopg.Error | None = None
    try:
        with raw.pipeline():
            try:
                for item in todo:
                    cursors.append(
                        raw.execute(
                            item.statement,  # type: ignore[arg-type]
                            item.params,
                            prepare=False if isinstance(item.statement, _wire.Replanned) else None,
                        )
                    )
                if commit is not None:
                    raw.execute("commit")
            except psycopg.Error as exc:
                first = exc
    except BaseException as exc:
        for item, cur in zip(todo, cursors, strict=False):
            if cur.pgresult is not None and cur.pgresult.status in _OK:
                item.result = _result(cur)
        if isinstance(exc, psycopg.Error) and _guarded_failed(raw, todo, first or exc, commit):
            return
        if first is not None and isinstance(exc, psycopg.Error):
            raise first from None
        raise
    if first is not None:
        for item, cur in zip(todo, cursors, strict=False):
            if cur.pgresult is not None and cur.pgresult.status in _OK:
                item.result = _result(cur)
        if _guarded_failed(raw, todo, first, commit):
            return
        raise first
    for item, cur in zip(todo, cursors, strict=True):
        item.result = _result(cur)
    if commit is not None:
        commit.commit()


_OK = (psycopg.pq.ExecStatus.TUPLES_OK, psycopg.pq.ExecStatus.COMMAND_OK)


def _guarded_failed(
    raw: psycopg.Connection[Any], todo: list[Later], exc: psycopg.Error, commit: object
) -> bool:
    """Did ``exc`` come from the round trip's guarded tail (every statement
    before it through, no COMMIT after it, the server still there)? Then it
    is kept on the guarded handles (see :func:`later`)."""
    start = next((n for n, item in enumerate(todo) if item.guarded), None)
    if start is None or commit is not None:
        return False
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return False
    if raw.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
        return False
    head, tail = todo[:start], todo[start:]
    if any(item.result is None for item in head) or not all(item.guarded for item in tail):
        return False
    for item in tail:
        item.error = exc
    return True


def flush(conn: Connection) -> None:
    """Send what is queued on ``conn`` now, if its transaction can still run it
    (after an error it cannot: then it is dropped)."""
    raw = driver(conn)
    if raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
        _queued.pop(raw, None)
    elif _queued.get(raw):
        send(conn)


def _result(cur: psycopg.Cursor[Any]) -> Result:
    # the column names from the result itself: cur.description builds a
    # Column object per column on each access (some 30 a queue tick)
    res = cur.pgresult
    if res is None or res.status != psycopg.pq.ExecStatus.TUPLES_OK:
        return Result(cur.rowcount)
    encoding = cur.connection.info.encoding
    names = tuple((res.fname(i) or b"").decode(encoding) for i in range(res.nfields))
    return Result(cur.rowcount, cur.fetchall(), names)


def frozen(statement: sql.Composable) -> sql.SQL:
    """``statement`` rendered once: an ``sql.SQL`` that psycopg only encodes
    (a ``Composed`` is walked and joined again on each execution)."""
    return sql.SQL(statement.as_string(None))


def replanned(statement: sql.Composable) -> _wire.Replanned:
    """``statement`` rendered once, and never prepared: planned at each run
    for its tables as they are then (:class:`pgjobs._wire.Replanned`)."""
    return _wire.Replanned(statement.as_string(None))


def _composable(statement: sql.Composable | str) -> sql.Composable:
    return sql.SQL(statement) if isinstance(statement, str) else statement


def execute(
    conn: Connection, query: sql.Composable | str, params: Params = None
) -> psycopg.Cursor[Any]:
    """Execute ``query`` (composed SQL) with ``params`` on ``conn``'s driver connection."""
    return driver(conn).execute(query, params)  # type: ignore[arg-type]


_DO_TAG = "$pgjobs$"


def one_statement(statements: Sequence[sql.Composable]) -> list[sql.Composable]:
    """Statements without parameters (DDL, ``delete``), as one ``DO`` block:
    the server runs them in order all the same, and the client sends,
    tracks and reads one statement instead of each (a pipelined statement
    costs the client about 0.07 ms here). Left as they are when there are
    fewer than two, or when one of them holds the block's dollar-quote tag
    (an identifier could)."""
    if len(statements) < 2:
        return list(statements)
    body = sql.SQL("; ").join(statements)
    if _DO_TAG in body.as_string(None):
        return list(statements)
    return [sql.SQL("do " + _DO_TAG + " begin {}; end " + _DO_TAG).format(body)]


def set_local(settings: Mapping[str, str]) -> tuple[sql.Composed, list[str]]:
    """A ``select`` that sets ``settings`` for the current transaction
    (``SET LOCAL``, which takes no parameters, as ``set_config(..., true)``),
    to run alone or as a subquery of another statement: one round trip."""
    calls = sql.SQL(", ").join(sql.SQL("set_config(%s, %s, true)") for _ in settings)
    params = [part for item in settings.items() for part in item]
    return sql.SQL("select {}").format(calls), params


def qualified(name: str) -> sql.Identifier:
    """``"schema.table"`` or ``"table"`` as a (qualified) identifier."""
    parts = name.split(".")
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"not a table name: {name!r}")
    return sql.Identifier(*parts)


def driver_error(exc: BaseException) -> BaseException:
    """The driver's error under SQLAlchemy's wrapper (which repeats the SQL
    and adds a link), else ``exc`` itself."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def error_text(
    exc: BaseException, *, limit: int = 4000, sqlstate: bool = False, first: bool = False
) -> str:
    """The one rendering of a database error pgjobs stores and prints: what
    the driver said (SQLAlchemy's wrapper unwrapped), as ``Type: message``;
    ``first``: only the first line of the message, without the type (the
    type's name when the message is empty); ``sqlstate``: the SQLSTATE
    after it, when the database gave one; cut to ``limit`` characters."""
    orig = driver_error(exc)
    message = str(orig).strip()
    if first:
        text = message.splitlines()[0] if message else type(orig).__name__
    else:
        text = f"{type(orig).__name__}: {message}".strip()
    state = sqlstate_of(exc) if sqlstate else None
    if state:
        text += f" (SQLSTATE {state})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(exc: BaseException) -> str:
    """The first line of what the driver said (SQLAlchemy's wrapper unwrapped),
    or the error's type when it said nothing: :func:`error_text` with
    ``first``."""
    return error_text(exc, first=True)


def sqlstate_of(exc: BaseException | None) -> str | None:
    """The SQLSTATE of the first database error in ``exc``'s chain, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for candidate in (exc, getattr(exc, "orig", None)):
            state = getattr(candidate, "sqlstate", None)
            if isinstance(state, str) and state:
                return state
        exc = exc.__cause__ or exc.__context__
    return None


#: The statistics target pgjobs analyzes its own temp tables with. ANALYZE
#: samples 300 rows per unit of target: 3,000 rows here against 30,000 at
#: the server's default of 100. The tables are freshly loaded, and what their
#: plans need is their size, which columns are unique and the few values of
#: ``op``; at 50,000 staged rows that ANALYZE took 19 ms at the default
#: target and 3 ms at this one.
TEMP_STATISTICS_TARGET = 10


def swap_settings(settings: Mapping[str, str]) -> tuple[list[sql.Composed], sql.Composed]:
    """Statements that set ``settings`` for a while inside the transaction:
    (keep each current value in ``pgjobs.<name>``, then set the new one) and
    the statement that gives the kept values back. No parameters, so they
    can travel with other statements in one round trip."""

    def each(*templates: str) -> sql.Composed:
        return sql.SQL("select {}").format(
            sql.SQL(", ").join(
                sql.SQL(template).format(
                    name=sql.Literal(name), kept=sql.Literal(f"pgjobs.{name}"), value=sql.Literal(v)
                )
                for template in templates
                for name, v in settings.items()
            )
        )

    # one statement: a select list is evaluated left to right, so every value
    # is kept before any is changed
    change = each(
        "set_config({kept}, current_setting({name}), true)", "set_config({name}, {value}, true)"
    )
    back = each(
        "set_config({name}, coalesce(nullif(current_setting({kept}, true), ''),"
        " current_setting({name})), true)"
    )
    return [change], back


def analyze_statements(
    table: sql.Identifier, columns: Sequence[str] = ()
) -> list[sql.SQL | sql.Composed]:
    """``ANALYZE table (columns)`` with :data:`TEMP_STATISTICS_TARGET`, the
    caller's ``default_statistics_target`` restored after it: statements
    without parameters (for a pipeline)."""
    cols: sql.Composable = sql.SQL("")
    if columns:
        cols = sql.SQL(" ({})").format(sql.SQL(", ").join(map(sql.Identifier, columns)))
    change, back = swap_settings({"default_statistics_target": str(TEMP_STATISTICS_TARGET)})
    return [*change, sql.SQL("analyze {}{}").format(table, cols), back]


def analyze(table: sql.Identifier, columns: Sequence[str] = ()) -> sql.Composed:
    """:func:`analyze_statements` as one string, to send in one round trip."""
    return sql.SQL("; ").join(analyze_statements(table, columns))


__all__ = [
    "TEMP_STATISTICS_TARGET",
    "Later",
    "Params",
    "Result",
    "abandon",
    "analyze",
    "analyze_statements",
    "connection_lost",
    "driver",
    "driver_error",
    "error_text",
    "execute",
    "first_line",
    "flush",
    "frozen",
    "later",
    "one_statement",
    "open_transaction",
    "qualified",
    "replanned",
    "send",
    "set_local",
    "sqlstate_of",
    "swap_settings",
    "unavailable",
    "why_unavailable",
]
