"""Staging: the new rows of a target, loaded into an analyzed temp table.

:func:`stage` takes what a job's ``compute`` returned — SQL text, a
SQLAlchemy selectable, or an iterable of Python rows — and loads it into a
temp table shaped like the target's columns, keyed by the diff key, and
``ANALYZE``d, so that every plan the diff writer makes afterwards rests on
real statistics. Nothing here takes a row lock.

* SQL text and selectables run as one ``INSERT ... SELECT`` (through
  SQLAlchemy, so ``:name`` binds work as in ``conn.execute(text(...))``).
* Python rows go through psycopg's binary ``COPY`` with the column types set
  (about 2.5 million rows/s against 68 thousand for ``executemany``); a
  column whose type psycopg cannot dump in binary (an enum, say) makes the
  load use text ``COPY`` instead, values then being sent as their ``str``.

The new rows may cover only some of the target's columns: they must include
the key and every parent's columns; the others keep their value on update
and get their default on insert.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.types.numeric import dump_decimal_to_numeric_binary, dump_int_to_numeric_binary
from sqlalchemy import column, insert, literal_column, select, table, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import FromClause, Select, SelectBase
from sqlalchemy.sql.sqltypes import NullType

from ._pg import Later, analyze, analyze_statements, driver, execute, later, send
from .errors import ConfigError, JobError
from .target import Target

_names = itertools.count(1)

#: psycopg's type OID for ``text``: what a value of a type psycopg cannot
#: dump in binary is sent as, in a text ``COPY``
_TEXT_OID = 25
_NUMERIC_OID = 1700

#: session temp tables (and the diff's sets) with at least this many rows are
#: ``ANALYZE``d; below, the planner's estimate from the table's size serves
ANALYZE_ROWS = 1000


def temp_name(purpose: str) -> str:
    """A temp table name unique in this process (and so in any session of it)."""
    return f"pgjobs_{purpose}_{next(_names)}"


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
    see _prepare_statements).
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
        clause = text(_strip(source))
        plain = _plain_sql(conn, clause)
        if plain is not None:
            columns, rows = _stage_plain_temp(
                conn, target, plain, _bind(clause, params), ident, preserve
            )
            return Staged(table=ident, name=name, columns=columns, rows=rows, preserve=preserve)
    if isinstance(source, str | TextClause):
        clause = text(_strip(source)) if isinstance(source, str) else source
        names = _query_names(conn, clause, params)
        columns = _check_columns(target, names, "the new rows' SQL")
        _create(conn, target, ident, columns, preserve)
        textual = clause.columns(*(column(n) for n in names))
        rows = _insert_select(conn, name, names, textual, _bind(clause, params))
    elif isinstance(source, SelectBase | FromClause):
        selectable = source if isinstance(source, SelectBase) else select(source)
        names = tuple(selectable.selected_columns.keys())
        columns = _check_columns(target, names, "the new rows' query")
        _create(conn, target, ident, columns, preserve)
        rows = _insert_select(conn, name, names, selectable, dict(params or {}))
    elif isinstance(source, Iterable) and not isinstance(source, bytes | bytearray | Mapping):
        iterator = iter(source)
        first = next(iterator, None)
        columns, converted = _python_rows(target, first, iterator)
        _create(conn, target, ident, columns, preserve)
        rows = _copy(conn, target, ident, columns, converted)
    else:
        raise ConfigError(
            f"target {target.label}: compute returned {type(source).__name__}; expected SQL "
            f"text, a SQLAlchemy selectable or an iterable of rows"
        )
    _add_key(conn, target, ident)
    # Statistics for the columns plans join on (the key); the values are only
    # compared, never joined or filtered on, and sampling them costs time.
    execute(conn, analyze(ident, target.key))
    return Staged(table=ident, name=name, columns=columns, rows=rows, preserve=preserve)


def _stage_session(
    conn: Connection, target: Target, source: object, params: Mapping[str, Any] | None
) -> Staged:
    if isinstance(source, str):
        clause = text(_strip(source))
        plain = _plain_sql(conn, clause)
        if plain is not None:
            name, columns, rows = _stage_plain(conn, target, plain, _bind(clause, params))
            return _session_staged(conn, target, name, columns, rows)
    if isinstance(source, str | TextClause):
        clause = text(_strip(source)) if isinstance(source, str) else source
        names = _query_names(conn, clause, params)
        columns = _check_columns(target, names, "the new rows' SQL")
        name = _prepare_session(conn, target, columns)
        textual = clause.columns(*(column(n) for n in names))
        rows = _insert_select(conn, name, names, textual, _bind(clause, params), target)
    elif isinstance(source, SelectBase | FromClause):
        selectable = source if isinstance(source, SelectBase) else select(source)
        names = tuple(selectable.selected_columns.keys())
        columns = _check_columns(target, names, "the new rows' query")
        name = _prepare_session(conn, target, columns)
        rows = _insert_select(conn, name, names, selectable, dict(params or {}), target)
    elif isinstance(source, Iterable) and not isinstance(source, bytes | bytearray | Mapping):
        iterator = iter(source)
        first = next(iterator, None)
        columns, converted = _python_rows(target, first, iterator)
        name = _prepare_session(conn, target, columns)
        with _key_errors(target):
            rows = _copy(conn, target, sql.Identifier(name), columns, converted)
    else:
        raise ConfigError(
            f"target {target.label}: compute returned {type(source).__name__}; expected SQL "
            f"text, a SQLAlchemy selectable or an iterable of rows"
        )
    _check_repeated(
        target, execute(conn, _repeated_key_sql(target, sql.Identifier(name))).fetchone()
    )
    return _session_staged(conn, target, name, columns, rows)


def _session_staged(
    conn: Connection, target: Target, name: str, columns: tuple[str, ...], rows: int
) -> Staged:
    ident = sql.Identifier(name)
    if rows >= ANALYZE_ROWS:
        execute(conn, analyze(ident, target.key))
    return Staged(table=ident, name=name, columns=columns, rows=rows)


def session_name(target: Target, purpose: str, shape: Sequence[object]) -> str:
    """The name of a session temp table for ``target`` and a ``shape`` (what
    determines its columns and their types): ``pgjobs_s<digest>_<purpose>``.
    A change of the target's columns or types gives another name."""
    types = [(c, target.types[c].type_oid, target.types[c].type) for c in target.columns]
    digest = hashlib.sha1(repr((target.oid, types, target.key, tuple(shape))).encode())
    return f"pgjobs_s{digest.hexdigest()[:16]}_{purpose}"


def _prepare_session(conn: Connection, target: Target, columns: Sequence[str]) -> str:
    """Create the session stage table for ``columns`` if this session has none
    yet (idempotent DDL: a savepoint rolled back may have taken it away), and
    empty it; one round trip."""
    name = session_name(target, "stage", columns)
    execute(conn, sql.SQL("; ").join(_prepare_statements(target, name, columns)))
    return name


def _prepare_statements(target: Target, name: str, columns: Sequence[str]) -> list[sql.Composed]:
    # No index: PostgreSQL truncates a session's ON COMMIT DELETE ROWS tables
    # at every commit of a transaction that used a temp table, and rebuilds
    # each of their indexes then, TOAST indexes included (a catalog update
    # each, 0.5-1 ms here, per commit, used or not): a queue tick's commit
    # took 2.9 ms with them, 0.46 ms without. The key is checked by
    # _repeated_key_sql.
    ident = sql.Identifier(name)
    return [
        sql.SQL(
            "create temp table if not exists {t} on commit delete rows as"
            " select {cols} from {target} with no data"
        ).format(
            t=ident, cols=sql.SQL(", ").join(map(sql.Identifier, columns)), target=target.ident
        ),
        sql.SQL("alter table {t} {not_null}").format(
            t=ident,
            not_null=sql.SQL(", ").join(
                sql.SQL("alter column {} set not null").format(sql.Identifier(k))
                for k in target.key
            ),
        ),
        sql.SQL("delete from {}").format(ident),
    ]


#: SQL text -> the text compiled for psycopg (``%(name)s`` binds, ``%``
#: doubled), or None when it needs SQLAlchemy to run; bounded
_plain_cache: dict[tuple[str, str], str | None] = {}
_PLAIN_CACHE_SIZE = 256


def _plain_sql(conn: Connection, clause: TextClause) -> str | None:
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


#: query text -> the column names it produced last time (session loads);
#: bounded. Checked again at every load, in the load's own round trip.
_names_seen: dict[str, tuple[str, ...]] = {}
_NAMES_SEEN_SIZE = 256

_SAVEPOINT_STAGE = sql.SQL("savepoint pgjobs_stage")
_ROLLBACK_STAGE = [
    (sql.SQL("rollback to savepoint pgjobs_stage"), None),
    (sql.SQL("release savepoint pgjobs_stage"), None),
]


def _stage_plain(
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
    probe_sql = _probe_sql(query)
    seen = _names_seen.get(query)
    if seen is not None:
        columns = _check_columns(target, seen, "the new rows' SQL")
        name = session_name(target, "stage", columns)
        loaded = _load_as_seen(conn, target, name, columns, query, params, probe_sql, seen)
        if isinstance(loaded, int):
            return name, columns, loaded
        names = loaded
    else:
        (probe,) = send(conn, (probe_sql, params))
        names = probe.columns or ()
    columns = _check_columns(target, names, "the new rows' SQL")
    if len(_names_seen) >= _NAMES_SEEN_SIZE:
        _names_seen.clear()
    _names_seen[query] = names
    name = session_name(target, "stage", columns)
    with _key_errors(target):
        inserted = _queue_load(conn, target, name, names, columns, query, params)
        (repeated,) = send(conn, (_repeated_key_sql(target, sql.Identifier(name)), None))
    assert inserted.result is not None
    _check_repeated(target, repeated.one())
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
    for statement in _prepare_statements(target, name, columns):
        later(conn, statement)
    return later(conn, _insert_sql(sql.Identifier(name), names, query), params)


def _probe_sql(query: str) -> sql.Composed:
    """``query``'s column names, planned but not run."""
    return sql.SQL("select * from ({}) as pgjobs_source limit 0").format(sql.SQL(query))


def _insert_sql(ident: sql.Identifier, names: Sequence[str], query: str) -> sql.Composed:
    # INSERT INTO stage (the query's columns, in its order) <the query>, with
    # no subquery around it: an untyped NULL or literal then takes the
    # column's type, as it would in an INSERT the user wrote.
    return sql.SQL("insert into {} ({}) {}").format(
        ident, sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(query)
    )


def _load_as_seen(
    conn: Connection,
    target: Target,
    name: str,
    columns: tuple[str, ...],
    query: str,
    params: dict[str, Any],
    probe_sql: sql.Composed,
    seen: tuple[str, ...],
) -> int | tuple[str, ...]:
    """Load ``query`` with the names ``seen`` last time: the rows loaded, or
    the names the query has now when they differ (the load rolled back)."""

    later(conn, _SAVEPOINT_STAGE)
    probe = later(conn, probe_sql, params)
    try:
        with _key_errors(target):
            inserted = _queue_load(conn, target, name, seen, columns, query, params)
            (repeated,) = send(conn, (_repeated_key_sql(target, sql.Identifier(name)), None))
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
    _check_repeated(target, repeated.one())
    return max(inserted.result.rowcount, 0)


def _repeated_key_sql(target: Target, ident: sql.Identifier) -> sql.Composed:
    """One key that a session stage table holds more than once, if any."""
    key = sql.SQL(", ").join(map(sql.Identifier, target.key))
    return sql.SQL(
        "select row({key})::text from {t} group by {key} having count(*) > 1 limit 1"
    ).format(key=key, t=ident)


def _check_repeated(target: Target, row: tuple[Any, ...] | None) -> None:
    if row is not None:
        raise JobError(
            f"target {target.label}: the new rows repeat the diff key ({', '.join(target.key)}): "
            f"{row[0]} appears more than once. Nothing was written.",
            sqlstate="23505",
        )


def _stage_plain_temp(
    conn: Connection,
    target: Target,
    query: str,
    params: dict[str, Any],
    ident: sql.Identifier,
    preserve: bool,
) -> tuple[tuple[str, ...], int]:
    """:func:`stage` of compiled SQL text into a new temp table on the driver
    connection: its column names (planned with LIMIT 0), then the table, the
    load, the key and ``ANALYZE`` in one round trip. A repeated or NULL key
    fails the transaction (nothing is written before a stage)."""
    (probe,) = send(conn, (_probe_sql(query), params))
    names = probe.columns or ()
    columns = _check_columns(target, names, "the new rows' SQL")
    with _key_errors(target):
        _, inserted, *_ = send(
            conn,
            (_create_sql(target, ident, columns, preserve), None),
            (_insert_sql(ident, names, query), params),
            (_add_key_sql(target, ident), None),
            *((statement, None) for statement in analyze_statements(ident, target.key)),
        )
    return columns, max(inserted.rowcount, 0)


@contextmanager
def _key_errors(target: Target) -> Iterator[None]:
    """Duplicate or NULL keys, as :func:`stage` reports them (from psycopg,
    or wrapped by SQLAlchemy)."""
    key = ", ".join(target.key)
    try:
        yield
    except (psycopg.errors.UniqueViolation, psycopg.errors.NotNullViolation, DBAPIError) as exc:
        orig = exc.orig if isinstance(exc, DBAPIError) else exc
        if isinstance(orig, psycopg.errors.UniqueViolation):
            detail = orig.diag.message_detail or ""
            raise JobError(
                f"target {target.label}: the new rows repeat the diff key ({key}): {detail} "
                f"Nothing was written.",
                sqlstate=orig.sqlstate,
            ) from exc
        if isinstance(orig, psycopg.errors.NotNullViolation) and orig.diag.column_name in set(
            target.key
        ):
            raise JobError(
                f"target {target.label}: a new row has NULL in the diff key ({key}), column "
                f"{orig.diag.column_name}. Nothing was written.",
                sqlstate=orig.sqlstate,
            ) from exc
        raise


# -- SQL sources -------------------------------------------------------------
def _strip(query: str) -> str:
    query = query.strip()
    while query.endswith(";"):
        query = query[:-1].rstrip()
    if not query:
        raise ConfigError("compute: empty SQL")
    return query


def _bind(clause: TextClause, params: Mapping[str, Any] | None) -> dict[str, Any]:
    # Pass only the binds the SQL declares: a queue job offers ``:keys`` to
    # SQL that may join the keys' temp table instead.
    declared = set(clause._bindparams)
    return {k: v for k, v in (params or {}).items() if k in declared}


def _query_names(
    conn: Connection, clause: TextClause, params: Mapping[str, Any] | None
) -> tuple[str, ...]:
    # Planning the query once more with LIMIT 0 is the portable way to learn
    # its column names; it reads no rows.
    sub = clause.columns().subquery("pgjobs_source")
    probe: Select[Any] = select(literal_column("*")).select_from(sub).limit(0)
    return tuple(conn.execute(probe, _bind(clause, params)).keys())


def check_sql(conn: Connection, target: Target, query: str) -> tuple[str, ...]:
    """Plan the SQL text ``query`` (LIMIT 0, no row computed) and check its
    columns against ``target`` as :func:`stage` will; returns the staged
    columns. The registry validates config-declared SQL with it before any run."""
    return _check_columns(
        target, _query_names(conn, text(_strip(query)), None), "the new rows' SQL"
    )


def _insert_select(
    conn: Connection,
    name: str,
    names: Sequence[str],
    query: Any,
    params: dict[str, Any],
    keyed: Target | None = None,
) -> int:
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
        with _key_errors(keyed):
            result = conn.execute(statement, params, execution_options=options)
    else:
        result = conn.execute(statement, params, execution_options=options)
    if result.rowcount >= 0:
        return int(result.rowcount)
    counted = execute(conn, sql.SQL("select count(*) from {}").format(sql.Identifier(name)))
    row = counted.fetchone()
    return int(row[0]) if row else 0


def _check_columns(target: Target, names: Sequence[str], what: str) -> tuple[str, ...]:
    duplicates = sorted({n for n in names if list(names).count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"target {target.label}: {what} repeats column(s) {', '.join(duplicates)}"
        )
    unknown = [n for n in names if n not in target.types]
    if unknown:
        raise ConfigError(
            f"target {target.label}: {what} returns column(s) {', '.join(unknown)} that the target "
            f"does not have or pgjobs does not write (generated/identity); writable: "
            f"{', '.join(target.columns)}"
        )
    given = set(names)
    required = list(target.key)
    for parent in target.parents:
        required.extend(parent.columns)
    missing = [c for c in dict.fromkeys(required) if c not in given]
    if missing:
        raise ConfigError(
            f"target {target.label}: {what} lacks column(s) {', '.join(missing)} (the diff key and "
            f"every parent's columns are required)"
        )
    return tuple(c for c in target.columns if c in given)


# -- Python rows ---------------------------------------------------------------
def _python_rows(
    target: Target, first: object, rest: Iterator[Any]
) -> tuple[tuple[str, ...], Iterator[Sequence[Any]]]:
    if first is None:
        return target.columns, iter(())
    if isinstance(first, Mapping):
        columns = _check_columns(target, tuple(first.keys()), "the new rows")

        def mapped() -> Iterator[Sequence[Any]]:
            for row in itertools.chain((first,), rest):
                try:
                    yield tuple(row[c] for c in columns)
                except KeyError as exc:
                    raise JobError(
                        f"target {target.label}: a new row lacks column {exc.args[0]!r}: {row!r}"
                    ) from None
                except TypeError:
                    raise JobError(
                        f"target {target.label}: expected every new row as a mapping, got {row!r}"
                    ) from None

        return columns, mapped()
    if isinstance(first, str | bytes) or not isinstance(first, Sequence):
        raise ConfigError(
            f"target {target.label}: a new row must be a tuple in the order "
            f"({', '.join(target.columns)}) or a mapping; got {first!r}"
        )
    if len(first) != len(target.columns):
        raise ConfigError(
            f"target {target.label}: a new row has {len(first)} values; rows given as tuples need "
            f"one per writable column, in this order: {', '.join(target.columns)}"
        )
    return target.columns, itertools.chain((first,), rest)


def _copy(
    conn: Connection,
    target: Target,
    ident: sql.Identifier,
    columns: Sequence[str],
    rows: Iterator[Sequence[Any]],
) -> int:
    pg = driver(conn)
    oids = [target.types[c].copy_oid for c in columns]
    binary = all(_dumps(pg, oid, pq.Format.BINARY) for oid in oids)
    if not binary:
        oids = [oid if _dumps(pg, oid, pq.Format.TEXT) else _TEXT_OID for oid in oids]
    statement = sql.SQL("copy {} ({}) from stdin {}").format(
        ident,
        sql.SQL(", ").join(map(sql.Identifier, columns)),
        sql.SQL("(format binary)" if binary else ""),
    )
    count = 0
    with pg.cursor() as cur:
        cur.adapters.register_dumper(None, _NumericBinaryDumper if binary else _NumericTextDumper)
        with cur.copy(statement) as copy:
            copy.set_types(oids)
            row: Sequence[Any] = ()
            try:
                for row in rows:
                    copy.write_row(row)
                    count += 1
            except (TypeError, ValueError, psycopg.DataError) as exc:
                types = ", ".join(f"{c} {target.types[c].type}" for c in columns)
                raise JobError(
                    f"target {target.label}: cannot send new row {count + 1} {tuple(row)!r} as "
                    f"({types}): {exc}"
                ) from exc
    return count


class _NumericBinaryDumper(Dumper):
    """psycopg's binary numeric dumper, also taking floats (as their shortest
    decimal repr), which rows computed in Python often carry."""

    format = pq.Format.BINARY
    oid = _NUMERIC_OID

    def dump(self, obj: Any) -> Buffer | None:
        if isinstance(obj, float):
            obj = Decimal(repr(obj))
        if isinstance(obj, Decimal):
            return dump_decimal_to_numeric_binary(obj)
        if isinstance(obj, int) and not isinstance(obj, bool):
            return dump_int_to_numeric_binary(obj)
        raise TypeError(f"cannot dump {type(obj).__name__} as numeric")


class _NumericTextDumper(Dumper):
    """The same for text ``COPY``."""

    format = pq.Format.TEXT
    oid = _NUMERIC_OID

    def dump(self, obj: Any) -> Buffer | None:
        if isinstance(obj, float):
            obj = Decimal(repr(obj))
        if isinstance(obj, Decimal):
            return b"NaN" if obj.is_nan() else str(obj).encode()
        if isinstance(obj, int) and not isinstance(obj, bool):
            return str(obj).encode()
        raise TypeError(f"cannot dump {type(obj).__name__} as numeric")


def _dumps(pg: psycopg.Connection[Any], oid: int, fmt: pq.Format) -> bool:
    try:
        pg.adapters.get_dumper_by_oid(oid, fmt)
    except psycopg.ProgrammingError:
        return False
    return True


# -- the temp table --------------------------------------------------------------
def _create(
    conn: Connection, target: Target, ident: sql.Identifier, columns: Sequence[str], preserve: bool
) -> None:
    # Copying the target's own column types (CREATE TABLE AS ... WITH NO DATA
    # plans but reads nothing) means every comparison later is type for type,
    # with no type name ever spelled out in SQL.
    execute(conn, _create_sql(target, ident, columns, preserve))


def _create_sql(
    target: Target, ident: sql.Identifier, columns: Sequence[str], preserve: bool
) -> sql.Composed:
    return sql.SQL("create temp table {} on commit {} as select {} from {} with no data").format(
        ident,
        sql.SQL("preserve rows" if preserve else "drop"),
        sql.SQL(", ").join(map(sql.Identifier, columns)),
        target.ident,
    )


def _add_key_sql(target: Target, ident: sql.Identifier) -> sql.Composed:
    # The primary key is built after the load (one sorted build is cheaper
    # than maintaining the index row by row) and is what rejects duplicates.
    return sql.SQL("alter table {} add primary key ({})").format(
        ident, sql.SQL(", ").join(map(sql.Identifier, target.key))
    )


def _add_key(conn: Connection, target: Target, ident: sql.Identifier) -> None:
    with _key_errors(target), driver(conn).transaction():
        execute(conn, _add_key_sql(target, ident))


__all__ = ["ANALYZE_ROWS", "Staged", "session_name", "stage", "temp_name"]
