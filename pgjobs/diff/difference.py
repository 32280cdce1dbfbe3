"""Step 1 of the diff writer: the difference, materialized into a temp
table (one keyed full join of the staged rows against the target), with the
set of parent keys each parent table must keep alive for it. No row lock.

A CTE has no statistics: every later statement reads materialized,
analyzed tables (why, and the figures: ``docs/DESIGN.md``, "The diff
writer"). Chunked writes number each row's chunk here, in parent-key order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import one_statement
from ..errors import JobError
from ..staging import ANALYZE_ROWS
from ..target import ParentRef
from .parents import need_sql, parent_tables_sql
from .plan import (
    JIT_BACK,
    JIT_OFF,
    Plan,
    analyze_later,
    create_sql,
    create_temp,
    equal,
    estimated_rows_sql,
    idents,
    index_name,
    not_null,
    run,
    run_all,
)


@dataclass(frozen=True, slots=True)
class Chunks:
    """How the difference is cut into chunks: ``size`` parents a chunk, or
    (``by_rows``) parents summing to about ``size`` rows of the difference."""

    size: int
    by_rows: bool = False


def build_difference(
    conn: Connection, plan: Plan, chunks: Chunks | None
) -> tuple[dict[str, int], float]:
    """Fill the difference table (and, for session tables, create the
    parent sets), with each row's chunk number when ``chunks``; returns its
    rows by op and the target's estimated size."""
    target_side, outside = _target_side(plan)
    body: sql.Composable = _difference_sql(plan, target_side)
    # Statistics for what later plans filter and join on: op, key, parent
    # columns (new and old), chunk; not the values.
    analyzed = ["op", *plan.difference_key]
    analyzed += [plan.new[c] for p in plan.target.parents for c in p.columns]
    analyzed += list(plan.old.values())
    if plan.session:
        return _session_difference(conn, plan, body, outside, analyzed)
    if chunks:
        body = _with_chunks(plan, body, chunks)
        analyzed.append("chunk")
    create_temp(conn, plan, plan.difference, body)
    if chunks:
        run(conn, sql.SQL("create index on {} (chunk)").format(plan.difference))
    if plan.self_ref is not None:
        run(
            conn,
            sql.SQL("create index on {} ({})").format(plan.difference, idents(plan.difference_key)),
        )
    analyze_later(conn, plan.difference, list(dict.fromkeys(analyzed)))
    row = run(conn, _counts_sql(plan, outside)).one()
    assert row is not None
    return _counted(plan, row)


def _target_side(plan: Plan) -> tuple[sql.Composable, sql.Composable]:
    """The target's rows the difference compares with (all, or the scope's),
    aliased ``t``; and the count of staged rows outside the scope."""
    t = plan.target
    target_cols = list(dict.fromkeys([*plan.key, *plan.values, *plan.old]))
    if plan.scope is None:
        whole = sql.SQL("(select {} from {}) as t").format(idents(target_cols), t.ident)
        return whole, sql.SQL("0")
    scope = plan.scope.columns
    rows = plan.scope.rows
    target_side: sql.Composable
    if plan.scope.target_filter is not None:
        # The scope's rows are those the filter (a key range) selects: read
        # through the target's index over it; the keys table only bounds
        # the new rows (``outside``). A join from the keys table was a
        # nested loop of one probe per key (the table is not analyzed).
        target_side = sql.SQL("(select {} from {} where {}) as t").format(
            idents(target_cols), t.ident, plan.scope.target_filter
        )
    elif rows is not None and rows < ANALYZE_ROWS and t.indexed(scope):
        # A few keys: one index probe each (OFFSET 0 keeps the subquery
        # a parameterized scan), never a scan of the whole target, which
        # the estimate of an unanalyzed keys table can lead to.
        target_side = sql.SQL(
            "(select x.* from {keys} as k cross join lateral"
            " (select {cols} from {t} as y where {on} offset 0) as x) as t"
        ).format(
            keys=plan.scope.keys,
            cols=idents(target_cols, "y"),
            t=t.ident,
            on=equal("y", scope, "k", scope),
        )
    else:
        target_side = sql.SQL("(select {} from {} where ({}) in (select {} from {})) as t").format(
            idents(target_cols), t.ident, idents(scope), idents(scope), plan.scope.keys
        )
    outside = sql.SQL(
        "(select count(*) from {} as s where not exists (select from {} as k where {}))"
    ).format(plan.staged.table, plan.scope.keys, equal("s", scope, "k", scope))
    return target_side, outside


def _difference_sql(plan: Plan, target_side: sql.Composable) -> sql.Composed:
    """The difference: a keyed full join of the staged rows (``s``) with the
    target's (``t``), one row per key that is inserted, updated or deleted."""
    key = plan.key
    op = sql.SQL("case when {t_k} is null then 'i' when {s_k} is null then 'd' {upd} end").format(
        t_k=sql.Identifier("t", key[0]),
        s_k=sql.Identifier("s", key[0]),
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
        selected.append(sql.SQL("{} as {}").format(expr, sql.Identifier(plan.new[name])))
    for name, old_name in plan.old.items():
        selected.append(
            sql.SQL("{} as {}").format(sql.Identifier("t", name), sql.Identifier(old_name))
        )
    return sql.SQL(
        "select * from (select {sel} from {stage} as s full join {target_side} on {on}) as x "
        "where op is not null"
    ).format(
        sel=sql.SQL(", ").join(selected),
        stage=plan.staged.table,
        target_side=target_side,
        on=equal("s", key, "t", key),
    )


def _session_difference(
    conn: Connection,
    plan: Plan,
    body: sql.Composable,
    outside: sql.Composable,
    analyzed: list[str],
) -> tuple[dict[str, int], float]:
    """The difference into session tables, in one round trip: the tables
    (created if missing), emptied, the difference, its counts and the parent
    keys each parent table must keep alive."""
    tables: list[sql.Composable] = [
        create_sql(plan, plan.difference, sql.SQL("{} with no data").format(body))
    ]
    if plan.self_ref is not None:
        # resolving self-references looks rows of the difference up by key
        tables.append(
            sql.SQL("create index if not exists {} on {} ({})").format(
                index_name(plan.difference), plan.difference, idents(plan.difference_key)
            )
        )
    tables += parent_tables_sql(plan)
    tables += [sql.SQL("delete from {}").format(ident) for ident in plan.session_tables()]
    # the tables' preparation is one statement (a DO block), then the difference
    statements = one_statement(tables)
    statements.append(sql.SQL("insert into {} {}").format(plan.difference, body))
    statements.append(_counts_sql(plan, outside))
    statements += [need_sql(plan, i, None) for i in range(len(plan.parents))]
    # JIT only around this statement: see JIT_OFF
    results = run_all(conn, [*JIT_OFF, *statements, JIT_BACK])[len(JIT_OFF) : -1]
    first = len(statements) - len(plan.parents) - 2
    rows = results[first].rowcount
    counted = results[first + 1].rows
    plan.needs = [r.rowcount for r in results[first + 2 :]]
    # A small difference is planned from its size (and its passes use
    # keyed plans): ANALYZE costs more than it saves there.
    plan.analyzed = rows >= ANALYZE_ROWS
    if plan.analyzed:
        analyze_later(conn, plan.difference, list(dict.fromkeys(analyzed)))
        for ident in plan.need:
            analyze_later(conn, ident)
    assert counted is not None
    return _counted(plan, counted[0])


def _counts_sql(plan: Plan, outside: sql.Composable) -> sql.Composed:
    return sql.SQL(
        "select {outside}, count(*) filter (where op = 'i'), count(*) filter (where op = 'u'),"
        " count(*) filter (where op = 'd'), ({estimate}) from {d}"
    ).format(outside=outside, estimate=estimated_rows_sql(plan.target), d=plan.difference)


def _counted(plan: Plan, row: tuple[Any, ...]) -> tuple[dict[str, int], float]:
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


def _chunk_parent(plan: Plan) -> ParentRef | None:
    """The parent whose key order drives the chunks: one whose columns lead the
    diff key if there is one (rows then come in key order too), else the first."""
    for p in plan.parents:
        if tuple(plan.key[: len(p.columns)]) == p.columns:
            return p
    return plan.parents[0] if plan.parents else None


def _with_chunks(plan: Plan, body: sql.Composable, chunks: Chunks) -> sql.Composable:
    # Each row gets a chunk number: (rank of its chunk parent) / N, the rank
    # taken over the distinct parents (a small sort, not one of every row);
    # by rows, (rows of the parents before it) / N, so that a chunk holds
    # whole parents and about N rows. A row's chunk parent is the new one
    # (inserts, updates) or the old one (deletes). Rows with no such parent
    # are chunked N at a time by key, with negative numbers, after the
    # others. (This CTE is only the body of CREATE TABLE AS; the table is
    # analyzed before anything plans on it.)
    key_in_difference = plan.difference_key
    n = sql.Literal(chunks.size)
    parent = _chunk_parent(plan)
    if parent is None:
        return sql.SQL(
            "select x.*, (row_number() over (order by {k}) - 1) / {n} as chunk from ({body}) as x"
        ).format(k=idents(key_in_difference, "x"), n=n, body=body)
    p = [f"p{j}" for j in range(len(parent.columns))]
    pexprs = sql.SQL(", ").join(
        sql.SQL("case when x.op = 'd' then {} else {} end as {}").format(
            sql.Identifier("x", plan.old[c]), sql.Identifier("x", plan.new[c]), sql.Identifier(pj)
        )
        for c, pj in zip(parent.columns, p, strict=True)
    )
    d_cols = sql.SQL(", ").join(
        sql.Identifier("y", c) for c in ["op", *plan.new.values(), *plan.old.values()]
    )
    numbered = (
        sql.SQL(
            "m as (select {p}, coalesce(sum(q.n_rows) over (order by {p} rows between"
            " unbounded preceding and 1 preceding), 0)::bigint / {n} as chunk"
            " from (select {p}, count(*) as n_rows from y where {p_nn} group by {p}) as q) "
        )
        if chunks.by_rows
        else sql.SQL(
            "m as (select {p}, (row_number() over (order by {p}) - 1) / {n} as chunk "
            "      from (select distinct {p} from y where {p_nn}) as q) "
        )
    ).format(p=idents(p), n=n, p_nn=not_null(None, p))
    return sql.SQL(
        "with y as materialized (select x.*, {pexprs} from ({body}) as x), "
        "{numbered}"
        "select {d_cols}, m.chunk from y join m on {on} "
        "union all "
        "select {d_cols}, -1 - (row_number() over (order by {yk}) - 1) / {n} from y "
        "where not ({yp_nn})"
    ).format(
        pexprs=pexprs,
        body=body,
        numbered=numbered,
        n=n,
        d_cols=d_cols,
        on=equal("y", p, "m", p),
        yk=idents(key_in_difference, "y"),
        yp_nn=not_null("y", p),
    )


__all__ = [
    "Chunks",
    "build_difference",
]
