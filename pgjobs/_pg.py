"""Small helpers to run composed psycopg SQL on a SQLAlchemy connection.

pgjobs talks SQLAlchemy at its edges (callbacks receive a SQLAlchemy
``Connection``) and psycopg inside, because dynamic identifiers are composed
with :mod:`psycopg.sql` and rows are loaded with ``COPY``. Both share one
driver connection and so one transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection, RootTransaction

Params = Sequence[Any] | Mapping[str, Any] | None


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn``; ``conn`` must be in a transaction,
    so that SQLAlchemy commits or rolls back what is done on it."""
    if not conn.in_transaction():
        raise RuntimeError("pgjobs: expected a connection inside a transaction (conn.begin())")
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def abandon(conn: Connection, trans: RootTransaction) -> None:
    """Roll ``trans`` back, and the driver's transaction with it.

    After a statement failed in a psycopg pipeline, or a COMMIT sent in one,
    SQLAlchemy may see its transaction as over while the server still holds
    an aborted one: the connection's next ``begin()`` would then fail."""
    raw = conn.connection.driver_connection
    trans.rollback()
    if (
        isinstance(raw, psycopg.Connection)
        and not raw.closed
        and raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    ):
        raw.rollback()


def execute(
    conn: Connection, query: sql.Composable | str, params: Params = None
) -> psycopg.Cursor[Any]:
    """Execute ``query`` (composed SQL) with ``params`` on ``conn``'s driver connection."""
    return driver(conn).execute(query, params)  # type: ignore[arg-type]


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

    def each(template: str) -> sql.Composed:
        return sql.SQL("select {}").format(
            sql.SQL(", ").join(
                sql.SQL(template).format(
                    name=sql.Literal(name), kept=sql.Literal(f"pgjobs.{name}"), value=sql.Literal(v)
                )
                for name, v in settings.items()
            )
        )

    keep = each("set_config({kept}, current_setting({name}), true)")
    change = each("set_config({name}, {value}, true)")
    back = each(
        "set_config({name}, coalesce(nullif(current_setting({kept}, true), ''),"
        " current_setting({name})), true)"
    )
    return [keep, change], back


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
