"""How a sliced run cuts its scope's key space into pieces.

The keys are read from the scope's parent table when the scope columns are
the target's reference to one (its foreign key, or a declared parent):
that table holds every key there is, including keys whose derived rows do
not exist yet. Otherwise from the target itself: a key that only the
sources hold (no derived row yet) still falls in some piece, since the
first and the last are open at their ends. A small table is read whole, in
key order; a large one is sampled row by row (``TABLESAMPLE BERNOULLI``: a
block sample, ``SYSTEM``, gave pieces of 100 to 20,000 keys) and sorted: the
pieces are then about equal, not exactly. Bounds are kept as text (the
keys' own text form) and compared as the columns' type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import execute
from ..target import Target

#: keys of the key table a piece aims at: a slice takes one piece or many,
#: so a piece is the smallest slice
PIECE_KEYS = 1_000
#: at most this many pieces a run (progress rows)
MAX_PIECES = 4_096
#: up to this many rows, the key table is read whole; above, sampled
EXACT_ROWS = 300_000
#: how many keys a sample aims at
SAMPLE_KEYS = 200_000

Bound = tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class KeySource:
    """The table the keys are read from and its columns, in the scope's order."""

    table: sql.Identifier
    label: str
    columns: tuple[str, ...]


def key_source(target: Target, scope: Sequence[str]) -> KeySource:
    """The scope's parent table (its columns matched to the scope's), else the target."""
    for parent in target.parents:
        if parent.self_reference or set(parent.columns) != set(scope):
            continue
        by_column = dict(zip(parent.columns, parent.parent_columns, strict=True))
        return KeySource(
            table=parent.ident,
            label=".".join(parent.table),
            columns=tuple(by_column[c] for c in scope),
        )
    return KeySource(table=target.ident, label=target.label, columns=tuple(scope))


def cut(conn: Connection, source: KeySource) -> list[Bound]:
    """The bounds between pieces, ascending and distinct: ``n`` bounds make
    ``n + 1`` pieces, the first open below, the last open above."""
    (estimate,) = execute(
        conn,
        sql.SQL("select greatest(reltuples, 0)::float8 from pg_class where oid = %s::regclass"),
        [source.table.as_string(None)],
    ).fetchone() or (0.0,)
    cols = sql.SQL(", ").join(map(sql.Identifier, source.columns))
    # ordered by the table's columns, qualified: a bare name in ORDER BY
    # names the output column, the text, whose order is another
    by = sql.SQL(", ").join(sql.Identifier("k", c) for c in source.columns)
    texts = sql.SQL(", ").join(
        sql.SQL("{}::text").format(sql.Identifier("k", c)) for c in source.columns
    )
    if estimate <= EXACT_ROWS:
        # the table's statistics may be old: count it (a small table)
        (rows,) = execute(
            conn, sql.SQL("select count(*) from {}").format(source.table)
        ).fetchone() or (0,)
        pieces = _pieces(rows)
        if pieces <= 1:
            return []
        step = max(1, rows // pieces)
        found = execute(
            conn,
            sql.SQL(
                "select {texts} from (select {cols}, row_number() over (order by {cols}) as pgjobs_n"
                " from {t}) as k where pgjobs_n > 1 and (pgjobs_n - 1) %% %s = 0 order by {by}"
            ).format(texts=texts, cols=cols, by=by, t=source.table),
            [step],
        ).fetchall()
        # each bound is the first key of a piece after the first
        bounds = [tuple(r) for r in found][: pieces - 1]
    else:
        pieces = _pieces(int(estimate))
        percent = min(100.0, 100.0 * SAMPLE_KEYS / estimate)
        # every step-th key of the sample, picked by the server: the client
        # holds the bounds only, not the sample (its memory stays flat)
        found = execute(
            conn,
            sql.SQL(
                "select {texts} from (select {cols}, row_number() over (order by {cols}) as pgjobs_n,"
                " count(*) over () as pgjobs_of from {t} tablesample bernoulli (%s)) as k"
                " where pgjobs_n > 1 and (pgjobs_n - 1) %% greatest(1, pgjobs_of / %s) = 0"
                " order by {by}"
            ).format(texts=texts, cols=cols, by=by, t=source.table),
            [percent, pieces],
        ).fetchall()
        bounds = [tuple(r) for r in found][: pieces - 1]
    # a key repeated (the target's rows of one key) makes one bound
    return list(dict.fromkeys(bounds))


def _pieces(rows: int) -> int:
    return max(1, min(MAX_PIECES, rows // PIECE_KEYS))


__all__ = [
    "EXACT_ROWS",
    "MAX_PIECES",
    "PIECE_KEYS",
    "SAMPLE_KEYS",
    "Bound",
    "KeySource",
    "cut",
    "key_source",
]
