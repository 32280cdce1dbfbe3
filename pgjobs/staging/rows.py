"""Staging new rows given as Python rows (tuples or mappings), loaded with
psycopg's ``COPY``: binary with the column types set, or text when a column's
type has no binary dumper. Read :mod:`pgjobs.staging` first; the figures
behind binary ``COPY`` are in ``docs/DESIGN.md``, "Staging".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.types.numeric import dump_decimal_to_numeric_binary, dump_int_to_numeric_binary
from sqlalchemy.engine import Connection

from .._pg import driver
from ..errors import ConfigError, JobError
from ..target import Target
from .table import check_columns

#: psycopg's type OID for ``text``: what a value of a type psycopg cannot
#: dump in binary is sent as, in a text ``COPY``
_TEXT_OID = 25
_NUMERIC_OID = 1700


def python_rows(
    target: Target, first: object, rest: Iterator[Any]
) -> tuple[tuple[str, ...], Iterator[Sequence[Any]]]:
    """The columns the rows provide (from ``first``) and the rows as tuples in
    that order; :class:`ConfigError` when ``first`` is neither a tuple of one
    value per writable column nor a mapping."""
    if first is None:
        return target.columns, iter(())
    if isinstance(first, Mapping):
        columns = check_columns(target, tuple(first.keys()), "the new rows")

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


def copy_rows(
    conn: Connection,
    target: Target,
    ident: sql.Identifier,
    columns: Sequence[str],
    rows: Iterator[Sequence[Any]],
) -> int:
    """``COPY`` ``rows`` into ``ident``; the rows sent."""
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


__all__ = [
    "copy_rows",
    "python_rows",
]
