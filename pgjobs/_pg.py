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
from sqlalchemy.engine import Connection

Params = Sequence[Any] | Mapping[str, Any] | None


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn``; ``conn`` must be in a transaction,
    so that SQLAlchemy commits or rolls back what is done on it."""
    if not conn.in_transaction():
        raise RuntimeError("pgjobs: expected a connection inside a transaction (conn.begin())")
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


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
