"""The diff writer's plan: the names of its temp tables, the columns of the
difference table, and the SQL helpers every step composes with.

Read :mod:`pgjobs.diff` first; the steps are :mod:`.difference`,
:mod:`.parents` and :mod:`.rows`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import Params, Result, analyze_statements, later, send, swap_settings
from ..errors import ConfigError
from ..staging import Staged, session_name, temp_name
from ..target import Target


@dataclass(frozen=True, kw_only=True, slots=True)
class Scope:
    """Limits a diff to some items' rows (queue jobs).

    ``keys`` is a temp table with one row per item, its columns named like
    the target's ``columns``; the diff covers the target rows whose
    ``columns`` match a row of it, and every staged row must lie within it.
    """

    columns: tuple[str, ...]
    keys: sql.Identifier
    #: how many rows ``keys`` holds, when the caller knows: a small scope
    #: (under 1,000 keys) is read from the target by one index probe per key
    rows: int | None = None
    #: the caller already holds, in this transaction, ``FOR KEY SHARE`` on
    #: the row of every parent whose columns are all scope columns, for every
    #: key in ``keys`` (a queue job locks its items' parents when it claims
    #: them): those parents are not locked again. Every row a scoped diff
    #: writes lies within its scope, so each parent key such a row needs is
    #: one of those held.
    parents_locked: bool = False
    #: a condition on the target's own columns that selects exactly the
    #: target's rows in scope (a sliced run's key range, its values inlined:
    #: the session's statements carry no parameters). The target's side of
    #: the difference is then read by it alone, through the target's index
    #: over the range, and ``keys`` only bounds the new rows (those outside
    #: it are refused as always): with a join from the keys table the
    #: planner walked the target's index from its first key (merge join) or
    #: probed it once per key (nested loop), and a slice near the end of 10 M
    #: rows read most of them
    target_filter: sql.Composable | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.parents_locked, bool):
            raise ConfigError(f"Scope.parents_locked: expected a bool, got {self.parents_locked!r}")
        if not self.columns or not all(isinstance(c, str) and c for c in self.columns):
            raise ConfigError(f"Scope.columns: expected column names, got {self.columns!r}")
        if not isinstance(self.keys, sql.Identifier):
            raise ConfigError(f"Scope.keys: expected a psycopg sql.Identifier, got {self.keys!r}")
        if self.rows is not None and (
            not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 0
        ):
            raise ConfigError(f"Scope.rows: expected a count of keys, got {self.rows!r}")


def idents(names: Sequence[str], prefix: str | None = None) -> sql.Composed:
    if prefix is None:
        return sql.SQL(", ").join(sql.Identifier(n) for n in names)
    return sql.SQL(", ").join(sql.Identifier(prefix, n) for n in names)


def equal(left: str, lcols: Sequence[str], right: str, rcols: Sequence[str]) -> sql.Composed:
    return sql.SQL(" and ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, a), sql.Identifier(right, b))
        for a, b in zip(lcols, rcols, strict=True)
    )


def not_null(alias: str | None, cols: Sequence[str]) -> sql.Composed:
    return sql.SQL(" and ").join(
        sql.SQL("{} is not null").format(sql.Identifier(alias, c) if alias else sql.Identifier(c))
        for c in cols
    )


class Plan:
    """Names of the temp tables and the mapping of columns onto them.

    The difference table (:attr:`difference`) names its columns by position:
    ``op`` (``'i'``, ``'u'`` or ``'d'``), the new value of each staged column
    as ``c0..`` (:attr:`new` maps a target column to its name there), the old
    value of each parent column as ``f0..`` (:attr:`old`); so no target
    column name can collide with them.
    """

    def __init__(self, target: Target, staged: Staged, scope: Scope | None, preserve: bool) -> None:
        # Session tables: one set per target shape, kept for the session
        # (ON COMMIT DELETE ROWS) and emptied per call, instead of ~7 temp
        # tables created and dropped per call (catalog writes: most of a
        # small diff's cost). Chunked writes keep their own tables across
        # commits (ON COMMIT PRESERVE ROWS) and drop them at the end.
        self.session = not preserve
        self.target = target
        self.staged = staged
        self.scope = scope
        self.preserve = preserve
        self.columns = staged.columns
        self.new = {name: f"c{i}" for i, name in enumerate(self.columns)}
        self.key = target.key
        self.values = tuple(c for c in self.columns if c not in set(self.key))
        fk_cols = list(dict.fromkeys(c for p in target.parents for c in p.columns))
        self.old = {name: f"f{i}" for i, name in enumerate(fk_cols)}
        self.parents = [p for p in target.parents if not p.self_reference]
        self.self_ref = target.self_reference
        shape = (self.columns, tuple(self.old))

        def name(purpose: str, i: int | None = None) -> sql.Identifier:
            if self.session:
                nth = "" if i is None else str(i)
                return sql.Identifier(session_name(target, purpose + nth, shape))
            # (_drop_leftovers recognizes these names)
            return sql.Identifier(temp_name(purpose))

        self.difference = name("diff")
        self.bad = name("bad")
        self.need = [name("need", i) for i, _ in enumerate(self.parents)]
        self.alive = [name("alive", i) for i, _ in enumerate(self.parents)]
        self.gone = [name("gone", i) for i, _ in enumerate(self.parents)]
        #: the size of each ``need`` table, once filled with the difference
        self.needs: list[int] | None = None
        #: rows were dropped from the difference after ``need`` was filled
        self.refill_needs = False
        #: the difference was analyzed (and so are the sets derived from it)
        self.analyzed = True
        self.temps: list[sql.Identifier] = []
        for p in target.parents:
            missing = [c for c in p.columns if c not in self.new]
            if missing:
                raise ConfigError(
                    f"target {target.label}: the new rows lack parent column(s) "
                    f"{', '.join(missing)} of {p.label}"
                )
        if scope is not None:
            bad_scope = [c for c in scope.columns if c not in self.new]
            if bad_scope:
                raise ConfigError(
                    f"target {target.label}: scope column(s) {', '.join(bad_scope)} are not among "
                    f"the new rows' columns"
                )

    @property
    def on_commit(self) -> sql.SQL:
        return sql.SQL("preserve rows" if self.preserve else "drop")

    def session_tables(self) -> list[sql.Identifier]:
        return [self.difference, *self.need, *self.alive, *self.gone, self.bad]

    @property
    def difference_key(self) -> list[str]:
        """The key's columns in the difference table."""
        return [self.new[k] for k in self.key]

    def distinct(
        self, left: str, lcols: Sequence[str], right: str, rcols: Sequence[str]
    ) -> sql.Composable:
        """``row(left) IS DISTINCT FROM row(right)`` over the value columns."""
        parts_l: list[sql.Composable] = []
        parts_r: list[sql.Composable] = []
        for name, a, b in zip(self.values, lcols, rcols, strict=True):
            la, rb = sql.Identifier(left, a), sql.Identifier(right, b)
            if self.target.types[name].comparable:
                parts_l.append(la)
                parts_r.append(rb)
            else:
                parts_l.append(sql.SQL("{}::text").format(la))
                parts_r.append(sql.SQL("{}::text").format(rb))
        return sql.SQL("row({}) is distinct from row({})").format(
            sql.SQL(", ").join(parts_l), sql.SQL(", ").join(parts_r)
        )


def count(conn: Connection, query: sql.Composable, params: Sequence[Any] | None = None) -> int:
    row = run(conn, query, params).one()
    return int(row[0]) if row and row[0] is not None else 0


def create_temp(conn: Connection, plan: Plan, ident: sql.Identifier, body: sql.Composable) -> None:
    run(conn, create_sql(plan, ident, body))
    plan.temps.append(ident)


def create_sql(plan: Plan, ident: sql.Identifier, body: sql.Composable) -> sql.Composed:
    if plan.session and ident in plan.session_tables():
        # idempotent: the table may exist from an earlier call of this
        # session, or not (never created, or its creation rolled back)
        return sql.SQL("create temp table if not exists {} on commit delete rows as {}").format(
            ident, body
        )
    return sql.SQL("create temp table {} on commit {} as {}").format(ident, plan.on_commit, body)


def analyze_now(conn: Connection, *tables: sql.Identifier) -> None:
    for table in tables:
        run_all(conn, analyze_statements(table))


def analyze_later(conn: Connection, table: sql.Identifier, columns: Sequence[str] = ()) -> None:
    """``ANALYZE table`` (see :func:`pgjobs._pg.analyze_statements`), sent with
    the next round trip."""
    for statement in analyze_statements(table, columns):
        later(conn, statement)


def index_name(table: sql.Identifier) -> sql.Identifier:
    name = table.as_string(None).strip('"')
    return sql.Identifier(f"{name}_key")


def chunk_filter(alias: str | None, chunk: int | None) -> sql.Composable:
    if chunk is None:
        return sql.SQL("true")
    col = sql.Identifier(alias, "chunk") if alias else sql.Identifier("chunk")
    return sql.SQL("{} = {}").format(col, sql.Literal(chunk))


# -- round trips (see pgjobs._pg.send) --------------------------------------------------------
def run(conn: Connection, query: sql.Composable, params: Params = None) -> Result:
    """``query`` after what is queued, in one round trip."""
    return send(conn, (query, params))[0]


def run_all(conn: Connection, statements: Sequence[sql.Composable]) -> list[Result]:
    """``statements`` (no parameters) after what is queued, in one round trip."""
    return send(conn, *((statement, None) for statement in statements))


# -- plan steering ---------------------------------------------------------------------------
#: below this share of the target's rows, a pass is written with keyed plans
KEYED_FRACTION = 0.05

# a plain table, or the leaves of a partitioned one (pg_partition_tree lists
# nothing for a plain table)
_ESTIMATED_ROWS = """
select coalesce(sum(greatest(c.reltuples, 0)), 0)::float8 from pg_class c
where (c.oid = %(oid)s and c.relkind = 'r')
   or c.oid in (select relid from pg_partition_tree(%(oid)s::oid) where isleaf)
"""


def keyed_pass(rows_in_pass: int, target_rows: float) -> bool:
    """Whether a pass of ``rows_in_pass`` difference rows is written with
    keyed plans, given the target's estimated row count."""
    return rows_in_pass < KEYED_FRACTION * target_rows


def estimated_rows_sql(target: Target) -> sql.Composed:
    if not target.partitioned:
        # one pg_class probe by oid (the OR below makes it a scan of pg_class)
        return sql.SQL(
            "select greatest(c.reltuples, 0)::float8 from pg_class c where c.oid = {oid}"
        ).format(oid=sql.Literal(target.oid))
    return sql.SQL(_ESTIMATED_ROWS.replace("%(oid)s", "{oid}")).format(oid=sql.Literal(target.oid))


_KEYED_ON, _KEYED_OFF = swap_settings({"enable_hashjoin": "off", "enable_mergejoin": "off"})
# JIT compiles a statement whose estimated cost passes jit_above_cost, and an
# estimate from an unanalyzed temp table can: some 10 ms of compiling for a
# statement that runs in one. Off while a session difference is taken (the
# one statement planned on an unanalyzed keys table); the writes, planned on
# the difference, keep the server's setting.
JIT_OFF, JIT_BACK = swap_settings({"jit": "off"})


@contextmanager
def keyed_plans(conn: Connection, on: bool) -> Iterator[None]:
    """Within the block, plan joins as nested loops over indexes (when ``on``).

    Used only around the locking pass and the writes of a pass that touches
    few of the target's rows; the previous settings (kept in two settings of
    pgjobs' own) come back after it. Both changes go out with the next
    statement, not in round trips of their own.
    """
    if not on:
        yield
        return
    for statement in _KEYED_ON:
        later(conn, statement)
    try:
        yield
    finally:
        later(conn, _KEYED_OFF)


__all__ = [
    "KEYED_FRACTION",
    "Plan",
    "Scope",
    "analyze_later",
    "analyze_now",
    "chunk_filter",
    "count",
    "create_sql",
    "create_temp",
    "equal",
    "estimated_rows_sql",
    "idents",
    "index_name",
    "keyed_pass",
    "keyed_plans",
    "not_null",
    "run",
    "run_all",
]
