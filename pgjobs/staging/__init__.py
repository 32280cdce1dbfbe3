"""Staging: the new rows of a target, loaded into an analyzed temp table.

:func:`stage` takes what a job's ``compute`` returned (SQL text, a
SQLAlchemy selectable, or an iterable of Python rows) and loads it into a
temp table shaped like the target's columns and keyed by the diff key, so
that every plan the diff writer makes afterwards rests on real statistics.
Nothing here takes a row lock. ``session=True`` loads into a table the
session keeps, for small and frequent loads such as queue batches.

Read on: :mod:`.query` (SQL text and selectables, ``INSERT ... SELECT``),
:mod:`.rows` (Python rows, ``COPY``), :mod:`.table` (the tables' names and
DDL, the column and key checks). Why each choice, with the figures:
``docs/DESIGN.md``, "Staging".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from psycopg import sql
from sqlalchemy import column, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import FromClause, SelectBase

from .._pg import analyze, execute
from ..errors import ConfigError
from ..target import Target
from .query import (
    bind,
    check_sql,
    insert_select,
    plain_sql,
    query_names,
    stage_plain,
    stage_plain_temp,
    strip,
)
from .rows import copy_rows, python_rows
from .table import (
    add_key,
    check_columns,
    check_coverage,
    check_repeated,
    create,
    key_errors,
    prepare_session,
    repeated_key_sql,
    session_name,
    temp_name,
)

#: session temp tables (and the diff's sets) with at least this many rows are
#: ``ANALYZE``d; below, the planner's estimate from the table's size serves
ANALYZE_ROWS = 1000


@dataclass(frozen=True, kw_only=True, slots=True)
class Staged:
    """New rows loaded by :func:`stage`."""

    #: the temp table (unqualified: temp tables live in the session's pg_temp)
    table: sql.Identifier
    name: str
    #: the target columns the new rows provide, in target order
    columns: tuple[str, ...]
    rows: int
    #: ``ON COMMIT PRESERVE ROWS`` (chunked writes) rather than ``ON COMMIT DROP``
    preserve: bool = False


def stage(
    conn: Connection,
    target: Target,
    source: object,
    *,
    params: Mapping[str, Any] | None = None,
    name: str | None = None,
    preserve: bool = False,
    session: bool = False,
) -> Staged:
    """Load ``source`` (the complete new rows) into an analyzed temp table.

    ``source``: SQL text (run with ``params`` bound, e.g. ``:keys``; it is a
    SQLAlchemy ``text()``, so a literal colon is written ``\\:``), a
    SQLAlchemy selectable, or an iterable of rows — tuples in the order of
    ``target.columns``, or mappings by column name. The temp table is
    dropped at commit (``preserve=True``: kept until dropped explicitly, for
    writes that commit in chunks) and has the diff key as primary key: a
    duplicate or NULL key raises :class:`JobError` naming the key, before
    anything is written.

    ``session=True`` (small, frequent loads such as queue batches): load into
    a temp table kept for the session instead, one per target shape, emptied
    at each commit (``ON COMMIT DELETE ROWS``) and by the next session load of
    the same shape, so that a load costs no DDL. Its key columns are NOT
    NULL and a repeated key is looked for after the load (no unique index:
    see :func:`.table.prepare_statements`).
    It is only ``ANALYZE``d above :data:`ANALYZE_ROWS` rows: below that, the
    planner's estimate from the table's size serves as well.
    """
    if session:
        if preserve or name is not None:
            raise ConfigError("stage: session=True excludes preserve and name")
        return _stage_session(conn, target, source, params)
    name = name or temp_name("stage")
    ident = sql.Identifier(name)
    if isinstance(source, str):
        clause = text(strip(source))
        plain = plain_sql(conn, clause)
        if plain is not None:
            columns, rows = stage_plain_temp(
                conn, target, plain, bind(clause, params), ident, preserve
            )
            return Staged(table=ident, name=name, columns=columns, rows=rows, preserve=preserve)
    if isinstance(source, str | TextClause):
        clause = text(strip(source)) if isinstance(source, str) else source
        names = query_names(conn, clause, params)
        columns = check_columns(target, names, "the new rows' SQL")
        create(conn, target, ident, columns, preserve)
        textual = clause.columns(*(column(n) for n in names))
        rows = insert_select(conn, name, names, textual, bind(clause, params))
    elif isinstance(source, SelectBase | FromClause):
        selectable = source if isinstance(source, SelectBase) else select(source)
        names = tuple(selectable.selected_columns.keys())
        columns = check_columns(target, names, "the new rows' query")
        create(conn, target, ident, columns, preserve)
        rows = insert_select(conn, name, names, selectable, dict(params or {}))
    elif _is_rows(source):
        iterator = iter(source)
        first = next(iterator, None)
        columns, converted = python_rows(target, first, iterator)
        create(conn, target, ident, columns, preserve)
        rows = copy_rows(conn, target, ident, columns, converted)
    else:
        raise _unsupported(target, source)
    add_key(conn, target, ident)
    # Statistics for the columns plans join on (the key); the values are only
    # compared, never joined or filtered on, and sampling them costs time.
    execute(conn, analyze(ident, target.key))
    return Staged(table=ident, name=name, columns=columns, rows=rows, preserve=preserve)


def _stage_session(
    conn: Connection, target: Target, source: object, params: Mapping[str, Any] | None
) -> Staged:
    if isinstance(source, str):
        clause = text(strip(source))
        plain = plain_sql(conn, clause)
        if plain is not None:
            name, columns, rows = stage_plain(conn, target, plain, bind(clause, params))
            return _session_staged(conn, target, name, columns, rows)
    if isinstance(source, str | TextClause):
        clause = text(strip(source)) if isinstance(source, str) else source
        names = query_names(conn, clause, params)
        columns = check_columns(target, names, "the new rows' SQL")
        name = prepare_session(conn, target, columns)
        textual = clause.columns(*(column(n) for n in names))
        rows = insert_select(conn, name, names, textual, bind(clause, params), target)
    elif isinstance(source, SelectBase | FromClause):
        selectable = source if isinstance(source, SelectBase) else select(source)
        names = tuple(selectable.selected_columns.keys())
        columns = check_columns(target, names, "the new rows' query")
        name = prepare_session(conn, target, columns)
        rows = insert_select(conn, name, names, selectable, dict(params or {}), target)
    elif _is_rows(source):
        iterator = iter(source)
        first = next(iterator, None)
        columns, converted = python_rows(target, first, iterator)
        name = prepare_session(conn, target, columns)
        with key_errors(target):
            rows = copy_rows(conn, target, sql.Identifier(name), columns, converted)
    else:
        raise _unsupported(target, source)
    check_repeated(target, execute(conn, repeated_key_sql(target, sql.Identifier(name))).fetchone())
    return _session_staged(conn, target, name, columns, rows)


def _session_staged(
    conn: Connection, target: Target, name: str, columns: tuple[str, ...], rows: int
) -> Staged:
    ident = sql.Identifier(name)
    if rows >= ANALYZE_ROWS:
        execute(conn, analyze(ident, target.key))
    return Staged(table=ident, name=name, columns=columns, rows=rows)


def _is_rows(source: object) -> TypeGuard[Iterable[Any]]:
    """``source`` is an iterable of Python rows (not bytes, not one mapping)."""
    return isinstance(source, Iterable) and not isinstance(source, bytes | bytearray | Mapping)


def _unsupported(target: Target, source: object) -> ConfigError:
    return ConfigError(
        f"target {target.label}: compute returned {type(source).__name__}; expected SQL "
        f"text, a SQLAlchemy selectable or an iterable of rows"
    )


__all__ = [
    "ANALYZE_ROWS",
    "Staged",
    "check_coverage",
    "check_sql",
    "session_name",
    "stage",
    "temp_name",
]
