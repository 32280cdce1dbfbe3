"""The diff writer: make a derived table equal to its new rows by writing
only the difference, FK-safe and without deadlocks.

A run has two phases.

**Compute** (:func:`run_recompute`): ``job.compute`` produces the new rows,
which :func:`~pgjobs.staging.stage` loads into an analyzed temp table. Only
the group's advisory lock is held; no row of the target or of its parents
is locked, so users delete and merge parents freely meanwhile.

**Write** (:func:`write_diff`), in this order, and the order is the point:

1. *The difference*, materialized into a temp table (one keyed full join of
   the staged rows against the target), together with the set of parent
   keys each parent table must keep alive for it. Still no row lock. A CTE
   has no statistics: the recipe that computed the difference in a CTE got
   a 1-row estimate against 500,000 rows, nested loops, and 30 s writes;
   every later statement here reads materialized tables, ``ANALYZE``d from
   1,000 rows on (below that, the planner's estimate from a table's size
   serves, and a pass touching few target rows uses keyed plans anyway).

   Unchunked writes use *session tables*: one set per target shape, kept
   by the connection (``ON COMMIT DELETE ROWS``), created idempotently (a
   rollback may have taken them away) and emptied per call, so that a small
   diff costs no DDL; the difference, its counts and the parent sets are
   then one round trip. A scoped diff of few keys (``Scope.rows``) reads
   the target by one index probe per key.
2. *The parents*, ``FOR KEY SHARE``, in key order, before any derived row
   is touched: the parents of every row to be inserted or updated (new
   values) and of every row to be updated or deleted (old values). A user's
   delete or merge of a parent takes the parent ``FOR UPDATE`` first, then
   cascades to the derived rows; taking the parents first is the same
   order, so neither side can hold a derived row the other waits for while
   waiting for a parent the other holds. Deletes need their parents locked
   too, not because the parent must exist but for that serialization: a
   cascade that started on a parent we did not lock could hold some of its
   derived rows while we hold others.

   The lock is taken with ``SKIP LOCKED``, so the writer never *waits* for a
   parent while holding anything: a parent some transaction holds ``FOR
   UPDATE`` (it is being deleted, or merged) is not waited for in place.
   The writer releases every parent lock (rollback to a savepoint), waits
   for that transaction with no row lock held (up to ``lock_timeout``), and
   tries once more. Whatever is still busy then is *deferred*: the rows
   depending on it are left as they are for this run (counted in
   ``detail["deferred"]``), and the next run writes them. So the writer
   cannot take part in a deadlock even with users that lock several parents
   in arbitrary order, and no user waits on the writer for longer than its
   lock-and-write window.

   A parent deleted meanwhile returns no row: rows that need it are
   *skipped* (``DiffStats.skipped_missing_parent``) instead of failing with
   23503, and an existing row with that key is deleted (the target must
   equal the new rows minus those of dead parents). A NULL foreign key (any
   column NULL, as ``MATCH SIMPLE`` has it) needs no parent.
3. *The rows*, matched by key (never by ``ctid``, which changes under
   updates and partition moves): delete the vanished rows, update the rows
   whose values are ``IS DISTINCT FROM`` the new ones (json and other types
   without a proper ``=`` compared as text), insert the missing ones. Row
   triggers therefore fire only for rows that change. With every parent
   already held, the order among the three does not matter for deadlocks;
   deleting first frees the values of other unique constraints for the
   rows inserted after. A target that references itself is written insert,
   update, delete instead, so that every foreign-key check finds the rows
   it points at.

Steps 2 and 3 of a pass that touches few of the target's rows (under 5 %)
are planned as nested loops over the key index: the planner prices cached
index probes high enough to scan a 500k-row target for 5,000 keys, and
inside the lock window that costs ten times more.

Chunked writes (``chunk_parents``) repeat steps 2 and 3 per chunk of parents
(in parent-key order) and commit after each, so that no user waits longer
than one chunk; the price is atomicity: readers can see the table half
written, and a failure leaves the chunks before it committed (the next run
finishes the work). Off by default.

What the deadlock-freedom rests on: other transactions reach the target's
rows only through their parents (a cascading delete, a merge that deletes a
parent) and jobs of the same group, which the group lock serializes. A user
transaction that updates derived rows directly, or a self-reference whose
``ON DELETE CASCADE`` carries a delete from one parent's rows into rows of
other parents, can still meet the writer on a derived row.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import Params, analyze, driver, swap_settings
from ._pg import execute as _execute
from .errors import ConfigError, JobError
from .results import DiffStats, Execution
from .staging import ANALYZE_ROWS, Staged, session_name, stage, temp_name
from .target import ParentRef, Target, describe, reflect_target

if TYPE_CHECKING:
    from .jobs import RecomputeJob
    from .runner import RunContext

log = logging.getLogger(__name__)

Progress = Callable[[str, int | None, int | None], None]

#: Busy parents waited for, one by one with nothing held, before the retry.
_MAX_WAITS = 8


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


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteResult:
    """What :func:`write_diff` did."""

    stats: DiffStats
    #: the whole write phase: difference, parent locks, writes
    write_seconds: float
    #: from the first row lock to the end of the writes (summed over chunks)
    lock_seconds: float
    #: seconds spent computing the difference (no row lock held)
    diff_seconds: float = 0.0
    #: the longest single chunk's row-lock time (= lock_seconds when not chunked)
    max_chunk_lock_seconds: float = 0.0
    chunks: int = 1
    #: rows left as they were because a parent was busy (written next run)
    deferred: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


# -- round trips ------------------------------------------------------------------------
#: Statements without parameters or results that matter (savepoint release,
#: planner settings) waiting to go out with the next statement, per driver
#: connection: one round trip instead of two.
_pending: weakref.WeakKeyDictionary[psycopg.Connection[Any], list[sql.Composable]] = (
    weakref.WeakKeyDictionary()
)


def _defer(conn: Connection, statement: sql.Composable) -> None:
    """Send ``statement`` with the next one (in order, before it)."""
    _pending.setdefault(driver(conn), []).append(statement)


def execute(
    conn: Connection, query: sql.Composable | str, params: Params = None
) -> psycopg.Cursor[Any]:
    """Run ``query`` after the deferred statements; without parameters, in the
    same round trip. The cursor is on ``query``'s result."""
    pg = driver(conn)
    waiting = _pending.pop(pg, None)
    if not waiting:
        return _execute(conn, query, params)
    statement = sql.SQL(query) if isinstance(query, str) else query
    if params is not None:
        _execute(conn, sql.SQL("; ").join(waiting))
        return _execute(conn, statement, params)
    cur = _execute(conn, sql.SQL("; ").join([*waiting, statement]))
    while cur.nextset():
        pass
    return cur


def _flush(conn: Connection) -> None:
    """Send what is deferred now (if the transaction can still run it)."""
    pg = driver(conn)
    waiting = _pending.pop(pg, None)
    if waiting and pg.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        _execute(conn, sql.SQL("; ").join(waiting))


def _multi(
    conn: Connection, statements: Sequence[sql.Composable]
) -> list[tuple[int, list[tuple[Any, ...]] | None]]:
    """Run ``statements`` (no parameters, one SQL statement each) in one
    round trip; per statement, its row count and, for a query, its rows."""
    waiting = _pending.pop(driver(conn), None) or []
    cur = _execute(conn, sql.SQL("; ").join([*waiting, *statements]))
    out: list[tuple[int, list[tuple[Any, ...]] | None]] = []
    while True:
        out.append((cur.rowcount, cur.fetchall() if cur.description else None))
        if not cur.nextset():
            break
    return out[-len(statements) :]


# -- SQL composition helpers ---------------------------------------------------------
def _ids(names: Sequence[str], prefix: str | None = None) -> sql.Composed:
    if prefix is None:
        return sql.SQL(", ").join(sql.Identifier(n) for n in names)
    return sql.SQL(", ").join(sql.Identifier(prefix, n) for n in names)


def _eq(left: str, lcols: Sequence[str], right: str, rcols: Sequence[str]) -> sql.Composed:
    return sql.SQL(" and ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, a), sql.Identifier(right, b))
        for a, b in zip(lcols, rcols, strict=True)
    )


def _not_null(alias: str | None, cols: Sequence[str]) -> sql.Composed:
    return sql.SQL(" and ").join(
        sql.SQL("{} is not null").format(sql.Identifier(alias, c) if alias else sql.Identifier(c))
        for c in cols
    )


class _Plan:
    """Names of the temp tables and the mapping of columns onto them.

    The difference table ``d`` names its columns positionally (``op``, the
    staged columns as ``c0..``, the old values of parent columns as
    ``f0..``), so no target column name can collide with them.
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
        self.c = {name: f"c{i}" for i, name in enumerate(self.columns)}
        self.key = target.key
        self.values = tuple(c for c in self.columns if c not in set(self.key))
        fk_cols = list(dict.fromkeys(c for p in target.parents for c in p.columns))
        self.f = {name: f"f{i}" for i, name in enumerate(fk_cols)}
        self.parents = [p for p in target.parents if not p.self_reference]
        self.self_ref = target.self_reference
        shape = (self.columns, tuple(self.f))

        def name(purpose: str, i: int | None = None) -> sql.Identifier:
            if self.session:
                nth = "" if i is None else str(i)
                return sql.Identifier(session_name(target, purpose + nth, shape))
            # (_drop_leftovers recognizes these names)
            return sql.Identifier(temp_name(purpose))

        self.d = name("diff")
        self.bad = name("bad")
        self.need = [name("need", i) for i, _ in enumerate(self.parents)]
        self.alive = [name("alive", i) for i, _ in enumerate(self.parents)]
        self.gone = [name("gone", i) for i, _ in enumerate(self.parents)]
        #: the size of each ``need`` table, once filled with the difference
        self.needs: list[int] | None = None
        #: the difference was analyzed (and so are the sets derived from it)
        self.analyzed = True
        self.temps: list[sql.Identifier] = []
        for p in target.parents:
            missing = [c for c in p.columns if c not in self.c]
            if missing:
                raise ConfigError(
                    f"target {target.label}: the new rows lack parent column(s) "
                    f"{', '.join(missing)} of {p.label}"
                )
        if scope is not None:
            bad_scope = [c for c in scope.columns if c not in self.c]
            if bad_scope:
                raise ConfigError(
                    f"target {target.label}: scope column(s) {', '.join(bad_scope)} are not among "
                    f"the new rows' columns"
                )

    @property
    def on_commit(self) -> sql.SQL:
        return sql.SQL("preserve rows" if self.preserve else "drop")

    def session_tables(self) -> list[sql.Identifier]:
        return [self.d, *self.need, *self.alive, *self.gone, self.bad]

    def kc(self) -> list[str]:
        """The key's columns in ``d``."""
        return [self.c[k] for k in self.key]

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


def _count(conn: Connection, query: sql.Composable, params: Sequence[Any] | None = None) -> int:
    row = execute(conn, query, params).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _create_temp(
    conn: Connection, plan: _Plan, ident: sql.Identifier, body: sql.Composable
) -> None:
    execute(conn, _create_sql(plan, ident, body))
    plan.temps.append(ident)


def _create_sql(plan: _Plan, ident: sql.Identifier, body: sql.Composable) -> sql.Composed:
    if plan.session and ident in plan.session_tables():
        # idempotent: the table may exist from an earlier call of this
        # session, or not (never created, or its creation rolled back)
        return sql.SQL("create temp table if not exists {} on commit delete rows as {}").format(
            ident, body
        )
    return sql.SQL("create temp table {} on commit {} as {}").format(ident, plan.on_commit, body)


def _analyze(conn: Connection, *idents: sql.Identifier) -> None:
    for ident in idents:
        execute(conn, analyze(ident))


# -- step 1: the difference ------------------------------------------------------------
def _build_diff(
    conn: Connection, plan: _Plan, chunk_parents: int | None
) -> tuple[dict[str, int], float]:
    """Fill the difference table ``d`` (and, for session tables, create the
    parent sets); returns its rows by op and the target's estimated size."""
    target = t = plan.target
    s = plan.staged
    key = plan.key
    target_cols = list(dict.fromkeys([*key, *plan.values, *plan.f]))
    target_side: sql.Composable
    outside: sql.Composable = sql.SQL("0")
    if plan.scope is None:
        target_side = sql.SQL("(select {} from {}) as t").format(_ids(target_cols), t.ident)
    else:
        sc = plan.scope.columns
        rows = plan.scope.rows
        if rows is not None and rows < ANALYZE_ROWS and t.indexed(sc):
            # A few keys: one index probe each (OFFSET 0 keeps the subquery
            # a parameterized scan), never a scan of the whole target, which
            # the estimate of an unanalyzed keys table can lead to.
            target_side = sql.SQL(
                "(select x.* from {keys} as k cross join lateral"
                " (select {cols} from {t} as y where {on} offset 0) as x) as t"
            ).format(
                keys=plan.scope.keys,
                cols=_ids(target_cols, "y"),
                t=t.ident,
                on=_eq("y", sc, "k", sc),
            )
        else:
            target_side = sql.SQL(
                "(select {} from {} where ({}) in (select {} from {})) as t"
            ).format(_ids(target_cols), t.ident, _ids(sc), _ids(sc), plan.scope.keys)
        outside = sql.SQL(
            "(select count(*) from {} as s where not exists (select from {} as k where {}))"
        ).format(s.table, plan.scope.keys, _eq("s", sc, "k", sc))

    first_key = key[0]
    op = sql.SQL("case when {t_k} is null then 'i' when {s_k} is null then 'd' {upd} end").format(
        t_k=sql.Identifier("t", first_key),
        s_k=sql.Identifier("s", first_key),
        upd=sql.SQL("when {} then 'u'").format(plan.distinct("t", plan.values, "s", plan.values))
        if plan.values
        else sql.SQL(""),
    )
    # "char", not text: a table with a varlena column gets a TOAST table and
    # its index, which PostgreSQL rebuilds at every commit for a session's ON
    # COMMIT DELETE ROWS tables (about 1 ms a table here).
    selected: list[sql.Composable] = [sql.SQL('({})::"char" as op').format(op)]
    for name in plan.columns:
        expr: sql.Composable
        if name in key:
            expr = sql.SQL("coalesce({}, {})").format(
                sql.Identifier("s", name), sql.Identifier("t", name)
            )
        else:
            expr = sql.Identifier("s", name)
        selected.append(sql.SQL("{} as {}").format(expr, sql.Identifier(plan.c[name])))
    for name, fname in plan.f.items():
        selected.append(
            sql.SQL("{} as {}").format(sql.Identifier("t", name), sql.Identifier(fname))
        )

    body: sql.Composable = sql.SQL(
        "select * from (select {sel} from {stage} as s full join {target_side} on {on}) as x "
        "where op is not null"
    ).format(
        sel=sql.SQL(", ").join(selected),
        stage=s.table,
        target_side=target_side,
        on=_eq("s", key, "t", key),
    )
    # Statistics for what later plans filter and join on: op, key, parent
    # columns (new and old), chunk; not the values.
    analyzed = ["op", *plan.kc()]
    analyzed += [plan.c[c] for p in target.parents for c in p.columns]
    analyzed += list(plan.f.values())
    if plan.session:
        # One round trip: the session tables (created if missing), emptied,
        # and the difference.
        statements: list[sql.Composable] = [
            _create_sql(plan, plan.d, sql.SQL("{} with no data").format(body))
        ]
        if plan.self_ref is not None:
            # resolving self-references looks rows of the difference up by key
            statements.append(
                sql.SQL("create index if not exists {} on {} ({})").format(
                    _index_name(plan.d), plan.d, _ids(plan.kc())
                )
            )
        statements += _parent_tables_sql(plan)
        statements += [sql.SQL("delete from {}").format(ident) for ident in plan.session_tables()]
        statements.append(sql.SQL("insert into {} {}").format(plan.d, body))
        # ... and what needs nothing but the difference: its counts, the
        # parent keys each parent table must keep alive
        statements.append(_counts_sql(plan, outside))
        statements += [_need_sql(plan, i, None) for i in range(len(plan.parents))]
        # JIT only around this statement: see _JIT_OFF
        results = _multi(conn, [*_JIT_OFF, *statements, _JIT_BACK])[len(_JIT_OFF) : -1]
        first = len(statements) - len(plan.parents) - 2
        rows = results[first][0]
        counted = results[first + 1][1]
        plan.needs = [n for n, _ in results[first + 2 :]]
        # A small difference is planned from its size (and its passes use
        # keyed plans): ANALYZE costs more than it saves there.
        plan.analyzed = rows >= ANALYZE_ROWS
        if plan.analyzed:
            _defer(conn, analyze(plan.d, list(dict.fromkeys(analyzed))))
            for ident in plan.need:
                _defer(conn, analyze(ident))
        assert counted is not None
        return _counted(plan, counted[0])
    else:
        if chunk_parents:
            body = _with_chunks(plan, body, chunk_parents)
            analyzed.append("chunk")
        _create_temp(conn, plan, plan.d, body)
        if chunk_parents:
            execute(conn, sql.SQL("create index on {} (chunk)").format(plan.d))
        if plan.self_ref is not None:
            execute(conn, sql.SQL("create index on {} ({})").format(plan.d, _ids(plan.kc())))
    _defer(conn, analyze(plan.d, list(dict.fromkeys(analyzed))))
    row = execute(conn, _counts_sql(plan, outside)).fetchone()
    assert row is not None
    return _counted(plan, row)


def _counts_sql(plan: _Plan, outside: sql.Composable) -> sql.Composed:
    return sql.SQL(
        "select {outside}, count(*) filter (where op = 'i'), count(*) filter (where op = 'u'),"
        " count(*) filter (where op = 'd'), ({estimate}) from {d}"
    ).format(outside=outside, estimate=_estimated_rows_sql(plan.target), d=plan.d)


def _counted(plan: _Plan, row: tuple[Any, ...]) -> tuple[dict[str, int], float]:
    """(rows by op, the target's estimated size) from the counts query; a
    scoped diff with new rows outside its scope is refused here."""
    t = plan.target
    if row[0]:
        assert plan.scope is not None
        raise JobError(
            f"target {t.label}: {row[0]} new row(s) lie outside the scope "
            f"({', '.join(plan.scope.columns)}) of this diff. Nothing was written."
        )
    counts = {"i": int(row[1]), "u": int(row[2]), "d": int(row[3])}
    return counts, float(row[4] or 0.0)


def _index_name(table: sql.Identifier) -> sql.Identifier:
    name = table.as_string(None).strip('"')
    return sql.Identifier(f"{name}_key")


def _chunk_parent(plan: _Plan) -> ParentRef | None:
    """The parent whose key order drives the chunks: one whose columns lead the
    diff key if there is one (rows then come in key order too), else the first."""
    for p in plan.parents:
        if tuple(plan.key[: len(p.columns)]) == p.columns:
            return p
    return plan.parents[0] if plan.parents else None


def _with_chunks(plan: _Plan, body: sql.Composable, chunk_parents: int) -> sql.Composable:
    # Each row gets a chunk number: (rank of its chunk parent) / N, the rank
    # taken over the distinct parents (a small sort, not one of every row).
    # A row's chunk parent is the new one (inserts, updates) or the old one
    # (deletes). Rows with no such parent are chunked N at a time by key,
    # with negative numbers, after the others. (This CTE is only the body of
    # CREATE TABLE AS; the table is analyzed before anything plans on it.)
    kc = plan.kc()
    n = sql.Literal(chunk_parents)
    parent = _chunk_parent(plan)
    if parent is None:
        return sql.SQL(
            "select x.*, (row_number() over (order by {k}) - 1) / {n} as chunk from ({body}) as x"
        ).format(k=_ids(kc, "x"), n=n, body=body)
    p = [f"p{j}" for j in range(len(parent.columns))]
    pexprs = sql.SQL(", ").join(
        sql.SQL("case when x.op = 'd' then {} else {} end as {}").format(
            sql.Identifier("x", plan.f[c]), sql.Identifier("x", plan.c[c]), sql.Identifier(pj)
        )
        for c, pj in zip(parent.columns, p, strict=True)
    )
    d_cols = sql.SQL(", ").join(
        sql.Identifier("y", c) for c in ["op", *plan.c.values(), *plan.f.values()]
    )
    return sql.SQL(
        "with y as materialized (select x.*, {pexprs} from ({body}) as x), "
        "m as (select {p}, (row_number() over (order by {p}) - 1) / {n} as chunk "
        "      from (select distinct {p} from y where {p_nn}) as q) "
        "select {d_cols}, m.chunk from y join m on {on} "
        "union all "
        "select {d_cols}, -1 - (row_number() over (order by {yk}) - 1) / {n} from y "
        "where not ({yp_nn})"
    ).format(
        pexprs=pexprs,
        body=body,
        p=_ids(p),
        n=n,
        p_nn=_not_null(None, p),
        d_cols=d_cols,
        on=_eq("y", p, "m", p),
        yk=_ids(kc, "y"),
        yp_nn=_not_null("y", p),
    )


# -- plan steering ----------------------------------------------------------------------
#: below this share of the target's rows, a pass is written with keyed plans
_KEYED_FRACTION = 0.05

# a plain table, or the leaves of a partitioned one (pg_partition_tree lists
# nothing for a plain table)
_ESTIMATED_ROWS = """
select coalesce(sum(greatest(c.reltuples, 0)), 0)::float8 from pg_class c
where (c.oid = %(oid)s and c.relkind = 'r')
   or c.oid in (select relid from pg_partition_tree(%(oid)s::oid) where isleaf)
"""


def _keyed_pass(rows_in_pass: int, target_rows: float) -> bool:
    """Whether a pass of ``rows_in_pass`` difference rows is written with
    keyed plans, given the target's estimated row count."""
    return rows_in_pass < _KEYED_FRACTION * target_rows


def _estimated_rows_sql(target: Target) -> sql.Composed:
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
_JIT_OFF, _JIT_BACK = swap_settings({"jit": "off"})


@contextmanager
def _keyed_plans(conn: Connection, on: bool) -> Iterator[None]:
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
        _defer(conn, statement)
    try:
        yield
    finally:
        _defer(conn, _KEYED_OFF)


# -- step 2: the parents -----------------------------------------------------------------
@dataclass(kw_only=True)
class _Locked:
    busy: int = 0  #: parents deferred because another transaction held them
    dead: int = 0  #: parents gone
    waits: int = 0
    bad: int = 0  #: rows skipped or deferred (in the bad table)
    #: of those: skipped (a parent gone), deferred (a parent busy; staged rows
    #: and deletes), and rows of the difference planned as updates
    skipped: int = 0
    deferred: int = 0
    deferred_deletes: int = 0
    bad_updates: int = 0
    #: when the locking pass that was kept began (row locks held from then on)
    since: float = 0.0


def _chunk_filter(alias: str | None, chunk: int | None) -> sql.Composable:
    if chunk is None:
        return sql.SQL("true")
    col = sql.Identifier(alias, "chunk") if alias else sql.Identifier("chunk")
    return sql.SQL("{} = {}").format(col, sql.Literal(chunk))


def _need_sql(plan: _Plan, i: int, chunk: int | None) -> sql.Composed:
    """Fill ``need`` of parent ``i``: the parent keys this pass's rows need
    (new values of inserts and updates, old values of updates and deletes)."""
    p = plan.parents[i]
    n = [f"n{j}" for j in range(len(p.columns))]
    new = [plan.c[c] for c in p.columns]
    old = [plan.f[c] for c in p.columns]
    where = _chunk_filter(None, chunk)
    return sql.SQL(
        "insert into {need} ({n}) "
        "select {new} from {d} where op <> 'd' and {where} and {new_nn} "
        "union "
        "select {old} from {d} where op <> 'i' and {where} and {old_nn}"
    ).format(
        need=plan.need[i],
        n=_ids(n),
        new=_ids(new),
        old=_ids(old),
        d=plan.d,
        where=where,
        new_nn=_not_null(None, new),
        old_nn=_not_null(None, old),
    )


def _fill_need(conn: Connection, plan: _Plan, i: int, chunk: int | None) -> int:
    """Fill ``need`` of parent ``i`` for this pass; returns its size."""
    if chunk is not None:
        _defer(conn, sql.SQL("truncate {}").format(plan.need[i]))
    # the table is empty (new, emptied per call, or truncated per chunk): the
    # insert's row count is its size
    count = execute(conn, _need_sql(plan, i, chunk)).rowcount
    if plan.analyzed:
        _defer(conn, analyze(plan.need[i]))
    return int(count)


def _parent_tables_sql(plan: _Plan) -> list[sql.Composable]:
    """Creating the parent sets (``need``, ``alive``, ``gone`` per parent
    table) and ``bad``, all shaped after ``d``."""
    out: list[sql.Composable] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        cols = sql.SQL(", ").join(
            sql.SQL("{} as {}").format(sql.Identifier(plan.c[c]), sql.Identifier(nj))
            for c, nj in zip(p.columns, n, strict=True)
        )
        for ident in (plan.need[i], plan.alive[i]):
            out.append(
                _create_sql(
                    plan, ident, sql.SQL("select {} from {} with no data").format(cols, plan.d)
                )
            )
        # busy: false = the parent is gone, true = another transaction holds it
        out.append(
            _create_sql(
                plan,
                plan.gone[i],
                sql.SQL("select {}, false as busy from {} with no data").format(cols, plan.d),
            )
        )
    kc = plan.kc()
    out.append(
        _create_sql(
            plan,
            plan.bad,
            # op: the row's op in the difference; NULL for an unchanged staged row
            sql.SQL("select {}, false as defer, op from {} with no data").format(_ids(kc), plan.d),
        )
    )
    # Looked up by key from every write statement that leaves bad rows out.
    # A session table gets its index only while it holds many rows (see
    # _index_bad): PostgreSQL rebuilds the indexes of a session's ON COMMIT
    # DELETE ROWS tables at every commit that used a temp table.
    if not plan.session:
        out.append(sql.SQL("create index on {} ({})").format(plan.bad, _ids(kc)))
    return out


#: a session ``bad`` table with this many rows is indexed for the writes
_BAD_INDEX_ROWS = 64


@contextmanager
def _index_bad(conn: Connection, plan: _Plan, rows: int) -> Iterator[None]:
    """Within the block, a session ``bad`` table of many rows has an index on
    the key (dropped after it: kept, it would be rebuilt at every commit)."""
    if not plan.session or rows < _BAD_INDEX_ROWS:
        yield
        return
    index = _index_name(plan.bad)
    # goes out with the writes
    _defer(
        conn,
        sql.SQL("create index if not exists {} on {} ({})").format(
            index, plan.bad, _ids(plan.kc())
        ),
    )
    yield
    _defer(conn, sql.SQL("drop index if exists {}").format(index))


def _create_parent_tables(conn: Connection, plan: _Plan) -> None:
    if plan.session:
        return  # created with the difference
    _multi(conn, _parent_tables_sql(plan))
    plan.temps += [*plan.need, *plan.alive, *plan.gone, plan.bad]


def _lock_pass(
    conn: Connection, plan: _Plan, needs: list[int], keyed: bool
) -> list[tuple[int, int]]:
    """One locking pass over every parent table, never waiting. Returns, per
    parent table, how many needed parents were not locked and how many of
    those are busy (held by another transaction) rather than gone."""
    out: list[tuple[int, int]] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        if needs[i] == 0 or _held(plan, p):
            out.append((0, 0))
            continue
        # Key order: with SKIP LOCKED it cannot matter for deadlocks, but it is
        # the order a user locking several parents would use, and it keeps
        # this pass's footprint on the parent table sequential.
        with _keyed_plans(conn, keyed):
            got = _lock_statement(conn, plan, i, n)
        if got == needs[i]:
            out.append((0, 0))
            continue
        # Missing: gone (deleted and committed) or busy (locked by another
        # transaction, most likely deleting it right now).
        # The missing keys, and how many of them are busy: one round trip.
        busy = _count(
            conn,
            sql.SQL(
                # a probe per missing key (a LATERAL ... LIMIT 1 is never
                # turned into a hash of the whole parent table)
                "with g as (insert into {gone} ({n}, busy) "
                "select m.*, x.found is not null "
                "from (select {n} from {need} except select {n} from {alive}) as m "
                "left join lateral (select true as found from {parent} as p "
                "                   where ({pcp}) = ({mn}) limit 1) as x on true "
                "returning busy) "
                "select count(*) filter (where busy) from g"
            ).format(
                gone=plan.gone[i],
                n=_ids(n),
                parent=p.ident,
                pcp=_ids(p.parent_columns, "p"),
                mn=_ids(n, "m"),
                need=plan.need[i],
                alive=plan.alive[i],
            ),
        )
        out.append((needs[i] - got, busy))
    return out


def _held(plan: _Plan, parent: ParentRef) -> bool:
    """Does the caller hold this parent's needed rows already (see
    :attr:`Scope.parents_locked`)?"""
    scope = plan.scope
    return (
        scope is not None
        and scope.parents_locked
        and bool(parent.columns)
        and set(parent.columns) <= set(scope.columns)
    )


def _lock_statement(conn: Connection, plan: _Plan, i: int, n: list[str]) -> int:
    """``FOR KEY SHARE SKIP LOCKED`` the needed parents of parent table ``i``
    into its ``alive`` table; returns how many were locked."""
    p = plan.parents[i]
    got = execute(
        conn,
        sql.SQL(
            "insert into {alive} ({n}) select {pc} from {parent} as p "
            "where ({pcp}) in (select {n} from {need}) order by {pcp} "
            "for key share of p skip locked"
        ).format(
            alive=plan.alive[i],
            n=_ids(n),
            pc=_ids(p.parent_columns, "p"),
            pcp=_ids(p.parent_columns, "p"),
            parent=p.ident,
            need=plan.need[i],
        ),
    ).rowcount
    return int(got)


def _busy_keys(conn: Connection, plan: _Plan) -> list[tuple[int, tuple[Any, ...]]]:
    """Up to ``_MAX_WAITS`` busy parents, as (parent index, key values)."""
    found: list[tuple[int, tuple[Any, ...]]] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        rows = execute(
            conn,
            sql.SQL("select {} from {} where busy limit {}").format(
                _ids(n), plan.gone[i], sql.Literal(_MAX_WAITS - len(found))
            ),
        ).fetchall()
        found.extend((i, tuple(r)) for r in rows)
        if len(found) >= _MAX_WAITS:
            break
    return found


def _wait_for_busy(conn: Connection, plan: _Plan, busy: list[tuple[int, tuple[Any, ...]]]) -> int:
    """Wait, holding no row lock, for the transactions holding ``busy``
    parents (each up to ``lock_timeout``; the first timeout ends the waiting);
    returns how many were waited for. Each lock is given back at once: the
    retry takes all parents again."""
    waited = 0
    for i, values in busy:
        p = plan.parents[i]
        waited += 1
        execute(conn, _SAVEPOINT_WAIT)
        try:
            execute(
                conn,
                sql.SQL("select from {} as p where ({}) = ({}) for key share of p").format(
                    p.ident,
                    _ids(p.parent_columns, "p"),
                    sql.SQL(", ").join(sql.Placeholder() * len(values)),
                ),
                values,
            )
        except psycopg.errors.LockNotAvailable:
            execute(conn, _ROLLBACK_WAIT)
            log.info(
                "pgjobs: %s: parent %s %s still held after lock_timeout; its rows are deferred",
                plan.target.label,
                p.label,
                values,
            )
            return waited
        execute(conn, _ROLLBACK_WAIT)
    return waited


_SAVEPOINT_WAIT = sql.SQL("savepoint pgjobs_wait")
_ROLLBACK_WAIT = sql.SQL("rollback to savepoint pgjobs_wait; release savepoint pgjobs_wait")
_SAVEPOINT_PARENTS = sql.SQL("savepoint pgjobs_parents")
_ROLLBACK_PARENTS = sql.SQL("rollback to savepoint pgjobs_parents")
_RELEASE_PARENTS = sql.SQL("release savepoint pgjobs_parents")


def _lock_parents(
    conn: Connection, plan: _Plan, chunk: int | None, wait_busy: bool, keyed: bool
) -> _Locked:
    """Lock this pass's parents (step 2) and fill the ``bad`` table with the
    rows that must be skipped (a needed parent is gone) or deferred (busy)."""
    result = _Locked(since=time.perf_counter())
    if chunk is not None:
        # the previous chunk's sets; emptied before any row lock is taken
        execute(
            conn,
            sql.SQL("truncate {}").format(sql.SQL(", ").join([*plan.alive, *plan.gone, plan.bad])),
        )
    if plan.parents:
        if plan.needs is not None and chunk is None:
            needs = plan.needs  # filled with the difference
        else:
            needs = [_fill_need(conn, plan, i, chunk) for i in range(len(plan.parents))]
        # What is deferred so far (ANALYZE of the difference) takes no row
        # lock: sent now, so that the lock window measures only the window.
        _flush(conn)
        # Row locks taken after a savepoint are released by rolling back to it.
        _defer(conn, _SAVEPOINT_PARENTS)
        result.since = time.perf_counter()
        passes = _lock_pass(conn, plan, needs, keyed)
        if any(busy for _, busy in passes) and wait_busy:
            # Never wait holding parent locks: give them all back, wait for the
            # busy parents with nothing held, then lock again, once.
            busy_keys = _busy_keys(conn, plan)
            execute(conn, _ROLLBACK_PARENTS)
            result.waits = _wait_for_busy(conn, plan, busy_keys)
            result.since = time.perf_counter()
            passes = _lock_pass(conn, plan, needs, keyed)
        _defer(conn, _RELEASE_PARENTS)
        result.busy = sum(busy for _, busy in passes)
        result.dead = sum(missing - busy for missing, busy in passes)
        if result.busy or result.dead:
            _mark_bad(conn, plan, chunk)
    if plan.self_ref is not None:
        _resolve_self_reference(conn, plan)
    if result.busy or result.dead or plan.self_ref is not None:
        _count_bad(conn, plan, chunk, result)
    return result


def _count_bad(conn: Connection, plan: _Plan, chunk: int | None, result: _Locked) -> None:
    """What the ``bad`` table holds, in one query (the writes need it)."""
    row = execute(
        conn,
        sql.SQL(
            "select count(*), coalesce(sum((not defer)::int), 0), "
            "coalesce(sum((defer and op is distinct from 'd')::int), 0), "
            "coalesce(sum((defer and op = 'd')::int), 0), "
            "(select count(*) from {bad} as b join {d} as d on {on} "
            " where d.op = 'u' and {where}) "
            "from {bad}"
        ).format(
            bad=plan.bad,
            d=plan.d,
            on=_eq("b", plan.kc(), "d", plan.kc()),
            where=_chunk_filter("d", chunk),
        ),
    ).fetchone()
    assert row is not None
    result.bad, result.skipped, result.deferred, result.deferred_deletes, result.bad_updates = (
        int(v) for v in row
    )


def _mark_bad(conn: Connection, plan: _Plan, chunk: int | None) -> None:
    kc = plan.kc()
    parts: list[sql.Composable] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        new = [plan.c[c] for c in p.columns]
        old = [plan.f[c] for c in p.columns]
        # New parents: gone -> skip, busy -> defer. Old parents: only busy
        # matters (a gone old parent took its rows with it).
        parts.append(
            sql.SQL(
                "select {dk}, g.busy, d.op from {d} as d join {gone} as g on {on} "
                "where d.op <> 'd' and {w}"
            ).format(
                dk=_ids(kc, "d"),
                d=plan.d,
                gone=plan.gone[i],
                on=_eq("d", new, "g", n),
                w=_chunk_filter("d", chunk),
            )
        )
        parts.append(
            sql.SQL(
                "select {dk}, true, d.op from {d} as d join {gone} as g on {on} "
                "where d.op <> 'i' and g.busy and {w}"
            ).format(
                dk=_ids(kc, "d"),
                d=plan.d,
                gone=plan.gone[i],
                on=_eq("d", old, "g", n),
                w=_chunk_filter("d", chunk),
            )
        )
    # Sent with the next statement (the count of bad rows): one round trip.
    _defer(
        conn,
        sql.SQL(
            "insert into {bad} select {k}, bool_or(defer), min(op) from ({u}) as b ({k}, defer, op) "
            "group by {k}"
        ).format(bad=plan.bad, k=_ids(kc), u=sql.SQL(" union all ").join(parts)),
    )
    if plan.analyzed:
        _defer(conn, analyze(plan.bad))


def _resolve_self_reference(conn: Connection, plan: _Plan) -> None:
    """Skip rows whose self-parent will not exist when the writes are done.

    A staged row's self-parent is alive when it is a staged row that is not
    itself skipped, or (scoped diffs) an existing row outside the scope,
    which the writer locks ``FOR KEY SHARE`` like any parent. Skipping a row
    can orphan others, so this repeats until nothing changes. Unchanged
    staged rows take part too: one whose self-parent is skipped is skipped
    (and deleted) as well.
    """
    ref = plan.self_ref
    assert ref is not None
    t = plan.target
    s = plan.staged.table
    kc = plan.kc()
    key = plan.key
    # the self-reference columns, ordered like the key they point at
    fk = [ref.columns[ref.parent_columns.index(k)] for k in key]
    loop_free = sql.SQL("row({}) is distinct from row({})").format(_ids(fk, "s"), _ids(key, "s"))
    # Existing self-parents outside the staged rows (scoped diffs): lock them,
    # never waiting; one that is busy defers its children.
    outside = sql.Identifier(temp_name("selfparents"))
    _create_temp(
        conn,
        plan,
        outside,
        sql.SQL(
            "select distinct {fk} from {s} as s where {nn} and {lf} "
            "and not exists (select from {s} as o where {on})"
        ).format(
            fk=_ids(fk, "s"), s=s, nn=_not_null("s", fk), lf=loop_free, on=_eq("o", key, "s", fk)
        ),
    )
    locked = sql.Identifier(temp_name("selflocked"))
    _create_temp(
        conn,
        plan,
        locked,
        sql.SQL(
            "select {k} from {t} as t where ({k}) in (select * from {o}) order by {k} "
            "for key share of t skip locked"
        ).format(k=_ids(key, "t"), t=t.ident, o=outside),
    )
    existing = sql.SQL("exists (select from {t} as x where {on})").format(
        t=t.ident, on=_eq("x", key, "s", fk)
    )
    # Rows to be deleted by this diff are not alive as parents.
    deleted = sql.SQL("exists (select from {d} as dd where dd.op = 'd' and {on})").format(
        d=plan.d, on=_eq("dd", kc, "s", fk)
    )
    in_stage_ok = sql.SQL(
        "exists (select from {s} as p where {on} "
        "and not exists (select from {bad} as b where {bon}))"
    ).format(s=s, on=_eq("p", key, "s", fk), bad=plan.bad, bon=_eq("b", kc, "p", key))
    locked_ok = sql.SQL("exists (select from {l} as l where {on})").format(
        l=locked, on=_eq("l", key, "s", fk)
    )
    parent_defer = sql.SQL(
        "coalesce((select b.defer from {bad} as b where {on}), {existing} and not {locked_ok})"
    ).format(bad=plan.bad, on=_eq("b", kc, "s", fk), existing=existing, locked_ok=locked_ok)
    statement = sql.SQL(
        "insert into {bad} ({kc}, defer, op) "
        "select {sk}, {parent_defer}, "
        "(select dd.op from {d} as dd where {dd_on}) from {s} as s "
        "where {nn} and {lf} and not exists (select from {bad} as b where {bon}) "
        "and not ({in_stage_ok} or ({locked_ok} and not {deleted}))"
    ).format(
        bad=plan.bad,
        kc=_ids(kc),
        sk=_ids(key, "s"),
        parent_defer=parent_defer,
        s=s,
        nn=_not_null("s", fk),
        lf=loop_free,
        bon=_eq("b", kc, "s", key),
        d=plan.d,
        dd_on=_eq("dd", kc, "s", key),
        in_stage_ok=in_stage_ok,
        locked_ok=locked_ok,
        deleted=deleted,
    )
    while execute(conn, statement).rowcount:
        pass
    _analyze(conn, plan.bad)


# -- step 3: the rows -----------------------------------------------------------------------
@dataclass(kw_only=True)
class _Written:
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    skipped: int = 0
    deferred: int = 0  #: staged rows deferred
    deferred_deletes: int = 0


def _write_rows(
    conn: Connection, plan: _Plan, chunk: int | None, locked: _Locked, planned: dict[str, int]
) -> _Written:
    """Step 3 for one pass; ``planned``: this pass's rows in the difference by
    op, ``locked``: what step 2 found (the rows in ``bad``).

    The delete, update and insert go out in one round trip: they are the
    heart of the row-lock window, which should hold no waiting for the
    network. Only an update that finds fewer rows than planned takes another
    (see below)."""
    out = _Written(
        skipped=locked.skipped,
        deferred=locked.deferred,
        deferred_deletes=locked.deferred_deletes,
    )
    t = plan.target
    kc = plan.kc()
    key = plan.key
    has_bad = locked.bad > 0
    where = _chunk_filter("d", chunk)
    not_bad: sql.Composable = (
        sql.SQL("not exists (select from {} as b where {})").format(plan.bad, _eq("b", kc, "d", kc))
        if has_bad
        else sql.SQL("true")
    )
    columns = _ids(plan.columns)
    d_columns = _ids([plan.c[c] for c in plan.columns], "d")

    def delete() -> sql.Composable | None:
        if not planned["d"] and not has_bad:
            return None
        victims: sql.Composable = sql.SQL(
            "select {} from {} as d where d.op = 'd' and {} and {}"
        ).format(_ids(kc, "d"), plan.d, where, not_bad)
        if has_bad:
            # skipped rows that exist (an update to a dead parent; with a
            # self-reference, also unchanged rows whose self-parent is skipped)
            victims = sql.SQL("{} union all select {} from {} where not defer").format(
                victims, _ids(kc), plan.bad
            )
        # The two victim sets are disjoint (bad 'd' rows are only ever
        # deferred), so a join: the victims drive, the key index finds rows.
        vk = [f"k{j}" for j in range(len(key))]
        return sql.SQL("delete from {t} as t using ({v}) as v ({vk}) where {on}").format(
            t=t.ident, v=victims, vk=_ids(vk), on=_eq("t", key, "v", vk)
        )

    # rows of the difference the update should find
    expected_updates = planned["u"] - locked.bad_updates

    def update() -> sql.Composable | None:
        if not plan.values or not expected_updates:
            return None
        sets = sql.SQL(", ").join(
            sql.SQL("{} = {}").format(sql.Identifier(v), sql.Identifier("d", plan.c[v]))
            for v in plan.values
        )
        vc = [plan.c[v] for v in plan.values]
        # Compared again at write time: a row that already holds the new values
        # is not touched (its triggers do not fire).
        return sql.SQL(
            "update {t} as t set {sets} from {d} as d "
            "where d.op = 'u' and {on} and {where} and {nb} and {distinct}"
        ).format(
            t=t.ident,
            sets=sets,
            d=plan.d,
            on=_eq("t", key, "d", kc),
            where=where,
            nb=not_bad,
            distinct=plan.distinct("t", plan.values, "d", vc),
        )

    def insert() -> sql.Composable | None:
        if not planned["i"]:
            return None
        return sql.SQL(
            "insert into {t} ({cols}) select {dc} from {d} as d "
            "where d.op = 'i' and {where} and {nb}"
        ).format(t=t.ident, cols=columns, dc=d_columns, d=plan.d, where=where, nb=not_bad)

    # Without a self-reference: delete, update, insert. With one, a row's
    # self-parent must exist before it is written and outlive it: inserts
    # first, deletes last.
    order = (
        (("d", delete), ("u", update), ("i", insert))
        if plan.self_ref is None
        else (("i", insert), ("u", update), ("d", delete))
    )
    steps = [(op, statement) for op, make in order if (statement := make()) is not None]
    if not steps:
        return out
    counts = _multi(conn, [statement for _, statement in steps])
    for (op, _), (rowcount, _) in zip(steps, counts, strict=True):
        if op == "d":
            out.deleted += rowcount
        elif op == "u":
            out.updated += rowcount
        else:
            out.inserted += rowcount
    if plan.values and out.updated < expected_updates:
        # Fewer rows than planned: some already held the new values, or
        # were deleted since the difference was taken (their old parent
        # was deleted, cascading). The latter are inserted: the target
        # must hold every new row whose parents are alive.
        out.inserted += execute(
            conn,
            sql.SQL(
                "insert into {t} ({cols}) select {dc} from {d} as d "
                "where d.op = 'u' and {where} and {nb} "
                "and not exists (select from {t} as t where {on})"
            ).format(
                t=t.ident,
                cols=columns,
                dc=d_columns,
                d=plan.d,
                where=where,
                nb=not_bad,
                on=_eq("t", key, "d", kc),
            ),
        ).rowcount
    return out


# -- the writer --------------------------------------------------------------------------
def write_diff(
    conn: Connection,
    target: Target,
    staged: Staged,
    *,
    scope: Scope | None = None,
    chunk_parents: int | None = None,
    checkpoint: Callable[[], None] | None = None,
    progress: Progress | None = None,
    wait_busy: bool = True,
) -> WriteResult:
    """Make ``target`` equal to ``staged`` (within ``scope``), writing only
    the difference; see the module docstring for the order and why.

    ``chunk_parents``: write in chunks of that many parents (in parent-key
    order) and call ``checkpoint()`` — which must commit and begin a new
    transaction — after each, so that no user waits on more than one chunk.
    The trade-off is atomicity: each chunk commits on its own, readers see
    the table partly rewritten, and a failure keeps the chunks already
    committed (the next run writes the rest). ``staged`` must then survive
    commits (``stage(..., preserve=True)``). Off by default.

    ``progress(phase, done, total)`` is called with "diff", "lock" (before
    each chunk's first row lock) and "write".

    ``wait_busy=False``: never wait for a parent another transaction holds,
    not even with nothing held; defer its rows at once (for callers that
    hold locks of their own, such as a queue worker's claimed entries).
    """
    started = time.perf_counter()

    def report(phase: str, done: int | None = None, total: int | None = None) -> None:
        if progress is not None:
            progress(phase, done, total)

    if chunk_parents is not None:
        if (
            not isinstance(chunk_parents, int)
            or isinstance(chunk_parents, bool)
            or chunk_parents < 1
        ):
            raise ConfigError(f"chunk_parents: expected a positive integer, got {chunk_parents!r}")
        if checkpoint is None:
            raise ConfigError("chunk_parents: chunked writes need a checkpoint (commit and begin)")
        if not staged.preserve:
            raise ConfigError("chunk_parents: stage the rows with preserve=True to write in chunks")
        if target.self_reference is not None:
            raise ConfigError(
                f"target {target.label}: chunked writes are not supported on a table that "
                f"references itself (a chunk could point at rows of a later one)"
            )
        if scope is not None:
            raise ConfigError("chunk_parents: a scoped diff is written in one transaction")

    plan = _Plan(target, staged, scope, preserve=chunk_parents is not None)
    try:
        result = _write(conn, plan, chunk_parents, checkpoint, report, wait_busy, started)
    except BaseException:
        # what was deferred (planner settings given back, a savepoint
        # released) still runs if the transaction can run it
        with suppress(psycopg.Error):
            _flush(conn)
        raise
    _flush(conn)
    return result


def _write(
    conn: Connection,
    plan: _Plan,
    chunk_parents: int | None,
    checkpoint: Callable[[], None] | None,
    report: Progress,
    wait_busy: bool,
    started: float,
) -> WriteResult:
    target, staged = plan.target, plan.staged
    report("diff", None, None)
    counts, target_rows = _build_diff(conn, plan, chunk_parents)
    _create_parent_tables(conn, plan)
    per_chunk: dict[int | None, dict[str, int]] = {}
    if chunk_parents:
        for chunk_no, op_code, n in execute(
            conn,
            sql.SQL("select chunk, op, count(*) from {} group by chunk, op").format(plan.d),
        ):
            per_chunk.setdefault(int(chunk_no), {"i": 0, "u": 0, "d": 0})[str(op_code)] = int(n)
        # parent-ordered chunks first, then the rows without a chunk parent
        chunks: list[int | None] = sorted(
            per_chunk, key=lambda c: (c is None or c < 0, abs(c or 0))
        )
    else:
        per_chunk[None] = counts
        chunks = [None]
    diff_seconds = time.perf_counter() - started

    inserted = updated = deleted = skipped = deferred = deferred_deletes = 0
    lock_seconds = max_chunk = 0.0
    busy = dead = waits = 0
    for n, chunk in enumerate(chunks):
        report("lock", n, len(chunks))
        # A pass touching a small part of the target is written through its
        # key index (nested loops), not by scanning the whole table: the
        # planner prices cached index probes too high, and in the lock window
        # a full scan of a 500k-row target per chunk costs ten times more.
        keyed = _keyed_pass(sum(per_chunk[chunk].values()), target_rows)
        locked = _lock_parents(conn, plan, chunk, wait_busy, keyed)
        with _keyed_plans(conn, keyed), _index_bad(conn, plan, locked.bad):
            written = _write_rows(conn, plan, chunk, locked, per_chunk[chunk])
        # Row locks are held from the kept locking pass on (a wait for a busy
        # parent before it held none) to the end of the writes.
        held = time.perf_counter() - locked.since
        lock_seconds += held
        max_chunk = max(max_chunk, held)
        inserted += written.inserted
        updated += written.updated
        deleted += written.deleted
        skipped += written.skipped
        deferred += written.deferred
        deferred_deletes += written.deferred_deletes
        busy += locked.busy
        dead += locked.dead
        waits += locked.waits
        report("write", n + 1, len(chunks))
        if chunk_parents and n + 1 < len(chunks):
            assert checkpoint is not None
            _flush(conn)
            checkpoint()

    if plan.temps:
        _defer(conn, sql.SQL("drop table if exists {}").format(sql.SQL(", ").join(plan.temps)))
    _flush(conn)
    unchanged = staged.rows - inserted - updated - skipped - deferred
    stats = DiffStats(
        inserted=inserted,
        updated=updated,
        deleted=deleted,
        skipped_missing_parent=skipped,
        unchanged=unchanged,
    )
    if deferred or deferred_deletes:
        log.info(
            "pgjobs: %s: %d row(s) deferred to the next run (%d parent(s) busy)",
            target.label,
            deferred + deferred_deletes,
            busy,
        )
    return WriteResult(
        stats=stats,
        write_seconds=time.perf_counter() - started,
        lock_seconds=lock_seconds,
        diff_seconds=diff_seconds,
        max_chunk_lock_seconds=max_chunk,
        chunks=len(chunks),
        deferred=deferred + deferred_deletes,
        detail={
            "planned": {"insert": counts["i"], "update": counts["u"], "delete": counts["d"]},
            "parents_gone": dead,
            "parents_busy": busy,
            "busy_waits": waits,
        },
    )


# -- the recompute job ---------------------------------------------------------------------
_LEFTOVERS = """
select c.relname from pg_class c
where c.relnamespace = pg_my_temp_schema() and c.relkind = 'r'
  and c.relname ~ '^pgjobs_(stage|diff|need|alive|gone|bad|selfparents|selflocked)_[0-9]+$'
"""


def _drop_leftovers(conn: Connection) -> None:
    """Drop the temp tables a failed chunked run left in this session.

    Chunked runs keep theirs across commits (``ON COMMIT PRESERVE ROWS``) and
    drop them at the end; a run that failed half-way cannot, and a pooled
    connection would carry them on. At the start of a recompute's
    transaction any such table is a leftover: the others are dropped at
    commit."""
    names = [r[0] for r in execute(conn, _LEFTOVERS).fetchall()]
    if names:
        execute(
            conn,
            sql.SQL("drop table if exists {}").format(
                sql.SQL(", ").join(sql.Identifier(n) for n in names)
            ),
        )
        log.info("pgjobs: dropped %d temp table(s) left by a failed chunked run", len(names))


def run_recompute(conn: Connection, job: RecomputeJob, ctx: RunContext) -> Execution:
    """The body of a :class:`~pgjobs.RecomputeJob`: compute and stage the new
    rows holding no row lock, then :func:`write_diff`. Runs inside the job's
    transaction with the group lock held."""
    started = time.perf_counter()
    chunked = job.chunk_parents is not None
    if chunked and ctx.checkpoint is None:
        raise JobError(
            f"RecomputeJob {job.name!r}: chunk_parents needs a runner that can checkpoint"
        )
    if chunked:
        _drop_leftovers(conn)
    target = reflect_target(
        conn,
        job.target,
        key=job.key,
        parents=job.parents,
        prefetched=ctx.extra.pop("fingerprint", None),
    )
    ctx.report("compute", None, None)
    source = job.compute if isinstance(job.compute, str) else job.compute(conn)
    ctx.report("stage", None, None)
    staged = stage(conn, target, source, preserve=chunked)
    ctx.report("stage", staged.rows, staged.rows)
    compute_seconds = time.perf_counter() - started
    result = write_diff(
        conn,
        target,
        staged,
        chunk_parents=job.chunk_parents,
        checkpoint=ctx.checkpoint,
        progress=ctx.progress,
    )
    if chunked:
        execute(conn, sql.SQL("drop table if exists {}").format(staged.table))
    detail = {
        "target": describe(target),
        "staged_rows": staged.rows,
        "diff_seconds": round(result.diff_seconds, 6),
        "chunks": result.chunks,
        "max_chunk_lock_seconds": round(result.max_chunk_lock_seconds, 6),
        "deferred": result.deferred,
        **result.detail,
    }
    return Execution(
        stats=result.stats,
        compute_seconds=compute_seconds,
        write_seconds=result.write_seconds,
        lock_seconds=result.lock_seconds,
        detail=detail,
    )


__all__ = [
    "Scope",
    "Staged",
    "Target",
    "WriteResult",
    "reflect_target",
    "run_recompute",
    "stage",
    "write_diff",
]
