"""The stage tables themselves: their names, the DDL that makes them, the
check of the new rows' columns against the target, and how a repeated or
NULL diff key is reported. Both loaders (:mod:`.query`, :mod:`.rows`)
build on this; read :mod:`pgjobs.staging` first.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from .._pg import driver, execute
from ..errors import ConfigError, JobError
from ..target import Target

_names = itertools.count(1)


def temp_name(purpose: str) -> str:
    """A temp table name unique in this process (and so in any session of it)."""
    return f"pgjobs_{purpose}_{next(_names)}"


def session_name(target: Target, purpose: str, shape: Sequence[object]) -> str:
    """The name of a session temp table for ``target`` and a ``shape`` (what
    determines its columns and their types): ``pgjobs_s<digest>_<purpose>``.
    A change of the target's columns or types gives another name."""
    types = [(c, target.types[c].type_oid, target.types[c].type) for c in target.columns]
    digest = hashlib.sha1(repr((target.oid, types, target.key, tuple(shape))).encode())
    return f"pgjobs_s{digest.hexdigest()[:16]}_{purpose}"


# -- the columns -----------------------------------------------------------------
def check_columns(target: Target, names: Sequence[str], what: str) -> tuple[str, ...]:
    """The target columns ``names`` provide, in target order; :class:`ConfigError`
    for a repeated or unknown column, or a missing key or parent column."""
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


def check_coverage(
    target: Target, given: Sequence[str], maintained: Sequence[str] | None, what: str
) -> None:
    """The new rows must give every writable column of the target, or, when
    the job names the columns it maintains, those: else a :class:`ConfigError`
    naming the missing ones (a column left out would never be maintained,
    and every run would call it unchanged)."""
    wanted = target.columns if maintained is None else maintained
    unknown = [c for c in wanted if c not in target.types]
    if unknown:
        raise ConfigError(
            f"target {target.label}: columns names column(s) {', '.join(unknown)} that the "
            f"target does not have or pgjobs does not write; writable: {', '.join(target.columns)}"
        )
    missing = [c for c in wanted if c not in set(given)]
    if missing:
        hint = (
            "name the columns the job maintains (columns = [...]) to leave the others alone"
            if maintained is None
            else "they are among the job's columns"
        )
        raise ConfigError(
            f"target {target.label}: {what} lack column(s) {', '.join(missing)}; {hint}"
        )


# -- the key -----------------------------------------------------------------------
@contextmanager
def key_errors(target: Target) -> Iterator[None]:
    """Duplicate or NULL keys, as :func:`~pgjobs.staging.stage` reports them
    (from psycopg, or wrapped by SQLAlchemy)."""
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


def repeated_key_sql(target: Target, ident: sql.Identifier) -> sql.Composed:
    """One key that a session stage table holds more than once, if any."""
    key = sql.SQL(", ").join(map(sql.Identifier, target.key))
    return sql.SQL(
        "select row({key})::text from {t} group by {key} having count(*) > 1 limit 1"
    ).format(key=key, t=ident)


def check_repeated(target: Target, row: tuple[Any, ...] | None) -> None:
    """:class:`JobError` when :func:`repeated_key_sql` found a key."""
    if row is not None:
        raise JobError(
            f"target {target.label}: the new rows repeat the diff key ({', '.join(target.key)}): "
            f"{row[0]} appears more than once. Nothing was written.",
            sqlstate="23505",
        )


# -- a temp table per load ------------------------------------------------------------
def create(
    conn: Connection, target: Target, ident: sql.Identifier, columns: Sequence[str], preserve: bool
) -> None:
    # Copying the target's own column types (CREATE TABLE AS ... WITH NO DATA
    # plans but reads nothing) means every comparison later is type for type,
    # with no type name ever spelled out in SQL.
    execute(conn, create_sql(target, ident, columns, preserve))


def create_sql(
    target: Target, ident: sql.Identifier, columns: Sequence[str], preserve: bool
) -> sql.Composed:
    return sql.SQL("create temp table {} on commit {} as select {} from {} with no data").format(
        ident,
        sql.SQL("preserve rows" if preserve else "drop"),
        sql.SQL(", ").join(map(sql.Identifier, columns)),
        target.ident,
    )


def add_key_sql(target: Target, ident: sql.Identifier) -> sql.Composed:
    # The primary key is built after the load (one sorted build is cheaper
    # than maintaining the index row by row) and is what rejects duplicates.
    return sql.SQL("alter table {} add primary key ({})").format(
        ident, sql.SQL(", ").join(map(sql.Identifier, target.key))
    )


def add_key(conn: Connection, target: Target, ident: sql.Identifier) -> None:
    with key_errors(target), driver(conn).transaction():
        execute(conn, add_key_sql(target, ident))


# -- the session tables ------------------------------------------------------------------
def prepare_session(conn: Connection, target: Target, columns: Sequence[str]) -> str:
    """Create the session stage table for ``columns`` if this session has none
    yet (idempotent DDL: a savepoint rolled back may have taken it away), and
    empty it; one round trip."""
    name = session_name(target, "stage", columns)
    execute(conn, sql.SQL("; ").join(prepare_statements(target, name, columns)))
    return name


def prepare_statements(target: Target, name: str, columns: Sequence[str]) -> list[sql.Composed]:
    # No index: PostgreSQL truncates a session's ON COMMIT DELETE ROWS tables
    # at every commit of a transaction that used a temp table, and rebuilds
    # each of their indexes then, TOAST indexes included (a catalog update
    # each, 0.5-1 ms here, per commit, used or not): a queue tick's commit
    # took 2.9 ms with them, 0.46 ms without. The key is checked by
    # repeated_key_sql.
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


__all__ = [
    "add_key",
    "add_key_sql",
    "check_columns",
    "check_coverage",
    "check_repeated",
    "create",
    "create_sql",
    "key_errors",
    "prepare_session",
    "prepare_statements",
    "repeated_key_sql",
    "session_name",
    "temp_name",
]
