"""Staging new rows given as SQL: text or a SQLAlchemy selectable, loaded
with one ``INSERT ... SELECT``.

SQL text whose binds need nothing from SQLAlchemy runs on the driver
connection (:func:`plain_sql`), its column names learnt from a LIMIT 0
probe; query text loaded before into a session table goes in one round
trip with the names it had last time (:func:`stage_plain`). Anything else
goes through SQLAlchemy (:func:`insert_select`). Read
:mod:`pgjobs.staging` first; the reasons are in ``docs/DESIGN.md``, "Staging".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import column, insert, literal_column, select, table, text
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import Select
from sqlalchemy.sql.sqltypes import NullType

from .._pg import Later, analyze_statements, execute, later, one_statement, send
from ..errors import ConfigError, JobError
from ..target import Target
from .table import (
    add_key_sql,
    check_columns,
    check_repeated,
    create_sql,
    key_errors,
    prepare_statements,
    repeated_key_sql,
    session_name,
)


# -- SQL text ----------------------------------------------------------------------
def strip(query: str) -> str:
    """``query`` without surrounding blanks and trailing semicolons."""
    query = query.strip()
    while query.endswith(";"):
        query = query[:-1].rstrip()
    if not query:
        raise ConfigError("compute: empty SQL")
    return query


def bind(clause: TextClause, params: Mapping[str, Any] | None) -> dict[str, Any]:
    # Pass only the binds the SQL declares: a queue job offers ``:keys`` to
    # SQL that may join the keys' temp table instead.
    declared = set(clause._bindparams)
    return {k: v for k, v in (params or {}).items() if k in declared}


#: SQL text -> the text compiled for psycopg (``%(name)s`` binds, ``%``
#: doubled), or None when it needs SQLAlchemy to run; bounded
_plain_cache: dict[tuple[str, str], str | None] = {}
_PLAIN_CACHE_SIZE = 256


def plain_sql(conn: Connection, clause: TextClause) -> str | None:
    """``clause`` compiled once for psycopg, when its binds need nothing from
    SQLAlchemy (untyped, not expanding, names psycopg takes as they are):
    SQL text computes then run on the driver connection, without
    SQLAlchemy's per-statement work (most of a small batch's Python time)."""
    cache_key = (conn.dialect.name + ":" + conn.dialect.paramstyle, clause.text)
    try:
        return _plain_cache[cache_key]
    except KeyError:
        pass
    plain: str | None = None
    if conn.dialect.paramstyle == "pyformat" and all(
        isinstance(b.type, NullType) and not b.expanding for b in clause._bindparams.values()
    ):
        compiled = clause.compile(dialect=conn.dialect)
        if (
            not compiled.positional
            and not compiled.escaped_bind_names
            and "POSTCOMPILE" not in compiled.string
        ):
            plain = compiled.string
    if len(_plain_cache) >= _PLAIN_CACHE_SIZE:
        _plain_cache.clear()
    _plain_cache[cache_key] = plain
    return plain


def probe_sql(query: str) -> sql.Composed:
    """``query``'s column names, planned but not run."""
    return sql.SQL("select * from ({}) as pgjobs_source limit 0").format(sql.SQL(query))


def insert_sql(ident: sql.Identifier, names: Sequence[str], query: str) -> sql.Composed:
    # INSERT INTO stage (the query's columns, in its order) <the query>, with
    # no subquery around it: an untyped NULL or literal then takes the
    # column's type, as it would in an INSERT the user wrote.
    return sql.SQL("insert into {} ({}) {}").format(
        ident, sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(query)
    )


# -- compiled SQL text into a temp table of its own -----------------------------------------
def stage_plain_temp(
    conn: Connection,
    target: Target,
    query: str,
    params: dict[str, Any],
    ident: sql.Identifier,
    preserve: bool,
) -> tuple[tuple[str, ...], int]:
    """:func:`~pgjobs.staging.stage` of compiled SQL text into a new temp
    table on the driver connection: its column names (planned with LIMIT 0),
    then the table, the load, the key and ``ANALYZE`` in one round trip. A
    repeated or NULL key fails the transaction (nothing is written before a
    stage)."""
    (probe,) = send(conn, (probe_sql(query), params))
    names = probe.columns or ()
    columns = check_columns(target, names, "the new rows' SQL")
    with key_errors(target):
        _, inserted, *_ = send(
            conn,
            (create_sql(target, ident, columns, preserve), None),
            (insert_sql(ident, names, query), params),
            (add_key_sql(target, ident), None),
            *((statement, None) for statement in analyze_statements(ident, target.key)),
        )
    return columns, max(inserted.rowcount, 0)


# -- compiled SQL text into a session table -----------------------------------------------
#: query text -> the column names it produced last time (session loads);
#: bounded. Checked again at every load, in the load's own round trip.
_names_seen: dict[str, tuple[str, ...]] = {}
_NAMES_SEEN_SIZE = 256

_SAVEPOINT_STAGE = sql.SQL("savepoint pgjobs_stage")
_ROLLBACK_STAGE = [
    (sql.SQL("rollback to savepoint pgjobs_stage"), None),
    (sql.SQL("release savepoint pgjobs_stage"), None),
]


def stage_plain(
    conn: Connection, target: Target, query: str, params: dict[str, Any]
) -> tuple[str, tuple[str, ...], int]:
    """Stage compiled SQL text on the driver connection: its column names
    (planned with LIMIT 0, no row computed), then the stage table's
    preparation and the ``INSERT ... SELECT`` in one round trip.

    Query text loaded before (a queue job's, tick after tick) takes one
    round trip in all: it is loaded with the names it had last time, under a
    savepoint, beside the LIMIT 0 probe that says what its names are now;
    should they differ (DDL under a ``*``), the load is rolled back and done
    again with the new ones."""
    probe = probe_sql(query)
    seen = _names_seen.get(query)
    if seen is not None:
        columns = check_columns(target, seen, "the new rows' SQL")
        name = session_name(target, "stage", columns)
        loaded = _load_as_seen(conn, target, name, columns, query, params, probe, seen)
        if isinstance(loaded, int):
            return name, columns, loaded
        names = loaded
    else:
        (probed,) = send(conn, (probe, params))
        names = probed.columns or ()
    columns = check_columns(target, names, "the new rows' SQL")
    if len(_names_seen) >= _NAMES_SEEN_SIZE:
        _names_seen.clear()
    _names_seen[query] = names
    name = session_name(target, "stage", columns)
    with key_errors(target):
        inserted = _queue_load(conn, target, name, names, columns, query, params)
        (repeated,) = send(conn, (repeated_key_sql(target, sql.Identifier(name)), None))
    assert inserted.result is not None
    check_repeated(target, repeated.one())
    return name, columns, max(inserted.result.rowcount, 0)


def _queue_load(
    conn: Connection,
    target: Target,
    name: str,
    names: tuple[str, ...],
    columns: tuple[str, ...],
    query: str,
    params: dict[str, Any],
) -> Later:
    """Queue the stage table's preparation and the load for the next round trip."""
    for statement in one_statement(prepare_statements(target, name, columns)):
        later(conn, statement)
    return later(conn, insert_sql(sql.Identifier(name), names, query), params)


def _load_as_seen(
    conn: Connection,
    target: Target,
    name: str,
    columns: tuple[str, ...],
    query: str,
    params: dict[str, Any],
    probe_statement: sql.Composed,
    seen: tuple[str, ...],
) -> int | tuple[str, ...]:
    """Load ``query`` with the names ``seen`` last time: the rows loaded, or
    the names the query has now when they differ (the load rolled back)."""

    later(conn, _SAVEPOINT_STAGE)
    probe = later(conn, probe_statement, params)
    try:
        with key_errors(target):
            inserted = _queue_load(conn, target, name, seen, columns, query, params)
            (repeated,) = send(conn, (repeated_key_sql(target, sql.Identifier(name)), None))
    except (psycopg.Error, JobError):
        # the query failed before its names were known, or they are the same
        if probe.result is None or probe.result.columns in (None, seen):
            raise
        send(conn, *_ROLLBACK_STAGE)
        return probe.result.columns
    now = probe.result.columns if probe.result else None
    assert now is not None  # the probe ran: the load after it did
    if now != seen:
        send(conn, *_ROLLBACK_STAGE)
        return now
    # The savepoint stays (the commit releases it): no round trip for it.
    assert inserted.result is not None
    check_repeated(target, repeated.one())
    return max(inserted.result.rowcount, 0)


# -- through SQLAlchemy ------------------------------------------------------------------
def query_names(
    conn: Connection, clause: TextClause, params: Mapping[str, Any] | None
) -> tuple[str, ...]:
    # Planning the query once more with LIMIT 0 is the portable way to learn
    # its column names; it reads no rows.
    sub = clause.columns().subquery("pgjobs_source")
    probe: Select[Any] = select(literal_column("*")).select_from(sub).limit(0)
    return tuple(conn.execute(probe, bind(clause, params)).keys())


def check_sql(conn: Connection, target: Target, query: str) -> tuple[str, ...]:
    """Plan the SQL text ``query`` (LIMIT 0, no row computed) and check its
    columns against ``target`` as :func:`~pgjobs.staging.stage` will; returns
    the staged columns. The registry validates config-declared SQL with it
    before any run."""
    return check_columns(target, query_names(conn, text(strip(query)), None), "the new rows' SQL")


def insert_select(
    conn: Connection,
    name: str,
    names: Sequence[str],
    query: Any,
    params: dict[str, Any],
    keyed: Target | None = None,
) -> int:
    """``INSERT INTO name (names) <query>``; the rows inserted."""
    # INSERT INTO stage (the query's columns, in its order) <the query>, with no
    # subquery around it: an untyped NULL or literal then takes the column's
    # type, as it would in an INSERT the user wrote.
    stage_table = table(name, *(column(c) for c in names))
    statement = insert(stage_table).from_select(list(names), query)
    # preserve_rowcount (SQLAlchemy >= 2.0.28) keeps the driver's row count of
    # INSERT ... SELECT; without it, the rows are counted.
    options = {"preserve_rowcount": True}
    if keyed is not None:
        # the session table's key columns are NOT NULL
        with key_errors(keyed):
            result = conn.execute(statement, params, execution_options=options)
    else:
        result = conn.execute(statement, params, execution_options=options)
    if result.rowcount >= 0:
        return int(result.rowcount)
    counted = execute(conn, sql.SQL("select count(*) from {}").format(sql.Identifier(name)))
    row = counted.fetchone()
    return int(row[0]) if row else 0


__all__ = [
    "bind",
    "check_sql",
    "insert_select",
    "insert_sql",
    "plain_sql",
    "probe_sql",
    "query_names",
    "stage_plain",
    "stage_plain_temp",
    "strip",
]
