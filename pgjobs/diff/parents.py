"""Step 2 of the diff writer: the parents of every row to be written,
``FOR KEY SHARE SKIP LOCKED``, in key order, before any derived row.

A parent some transaction holds is never waited for while holding others:
the writer gives back every parent lock, waits with nothing held, tries
once more, and defers what is still busy to the next run. A parent that is
gone skips its rows (never a 23503). What must be skipped or deferred goes
into the ``bad`` table the row writes leave out. The lock order and why it
prevents deadlocks: ``docs/DESIGN.md``, "The diff writer".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import flush, later
from ..staging import temp_name
from ..target import ParentRef
from .plan import (
    Plan,
    analyze_later,
    analyze_now,
    chunk_filter,
    count,
    create_sql,
    create_temp,
    equal,
    idents,
    index_name,
    keyed_plans,
    not_null,
    run,
    run_all,
)

log = logging.getLogger(__name__)

#: Busy parents waited for, one by one with nothing held, before the retry.
_MAX_WAITS = 8


@dataclass(kw_only=True)
class Locked:
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


def need_sql(plan: Plan, i: int, chunk: int | None) -> sql.Composed:
    """Fill ``need`` of parent ``i``: the parent keys this pass's rows need
    (new values of inserts and updates, old values of updates and deletes)."""
    p = plan.parents[i]
    n = [f"n{j}" for j in range(len(p.columns))]
    new = [plan.new[c] for c in p.columns]
    old = [plan.old[c] for c in p.columns]
    where = chunk_filter(None, chunk)
    return sql.SQL(
        "insert into {need} ({n}) "
        "select {new} from {d} where op <> 'd' and {where} and {new_nn} "
        "union "
        "select {old} from {d} where op <> 'i' and {where} and {old_nn}"
    ).format(
        need=plan.need[i],
        n=idents(n),
        new=idents(new),
        old=idents(old),
        d=plan.difference,
        where=where,
        new_nn=not_null(None, new),
        old_nn=not_null(None, old),
    )


def _fill_need(conn: Connection, plan: Plan, i: int, chunk: int | None) -> int:
    """Fill ``need`` of parent ``i`` for this pass; returns its size."""
    if chunk is not None or plan.refill_needs:
        later(conn, sql.SQL("truncate {}").format(plan.need[i]))
    # the table is empty (new, emptied per call, or truncated here): the
    # insert's row count is its size
    count = run(conn, need_sql(plan, i, chunk)).rowcount
    if plan.analyzed:
        analyze_later(conn, plan.need[i])
    return int(count)


def parent_tables_sql(plan: Plan) -> list[sql.Composable]:
    """Creating the parent sets (``need``, ``alive``, ``gone`` per parent
    table) and ``bad``, all shaped after ``d``."""
    out: list[sql.Composable] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        cols = sql.SQL(", ").join(
            sql.SQL("{} as {}").format(sql.Identifier(plan.new[c]), sql.Identifier(nj))
            for c, nj in zip(p.columns, n, strict=True)
        )
        for ident in (plan.need[i], plan.alive[i]):
            out.append(
                create_sql(
                    plan,
                    ident,
                    sql.SQL("select {} from {} with no data").format(cols, plan.difference),
                )
            )
        # busy: false = the parent is gone, true = another transaction holds it
        out.append(
            create_sql(
                plan,
                plan.gone[i],
                sql.SQL("select {}, false as busy from {} with no data").format(
                    cols, plan.difference
                ),
            )
        )
    key_in_difference = plan.difference_key
    out.append(
        create_sql(
            plan,
            plan.bad,
            # op: the row's op in the difference; NULL for an unchanged staged row
            sql.SQL("select {}, false as defer, op from {} with no data").format(
                idents(key_in_difference), plan.difference
            ),
        )
    )
    # Looked up by key from every write statement that leaves bad rows out.
    # A session table gets its index only while it holds many rows (see
    # _index_bad): PostgreSQL rebuilds the indexes of a session's ON COMMIT
    # DELETE ROWS tables at every commit that used a temp table.
    if not plan.session:
        out.append(sql.SQL("create index on {} ({})").format(plan.bad, idents(key_in_difference)))
    return out


#: a session ``bad`` table with this many rows is indexed for the writes
_BAD_INDEX_ROWS = 64


@contextmanager
def index_bad(conn: Connection, plan: Plan, rows: int) -> Iterator[None]:
    """Within the block, a session ``bad`` table of many rows has an index on
    the key (dropped after it: kept, it would be rebuilt at every commit)."""
    if not plan.session or rows < _BAD_INDEX_ROWS:
        yield
        return
    index = index_name(plan.bad)
    # goes out with the writes
    later(
        conn,
        sql.SQL("create index if not exists {} on {} ({})").format(
            index, plan.bad, idents(plan.difference_key)
        ),
    )
    yield
    later(conn, sql.SQL("drop index if exists {}").format(index))


def create_parent_tables(conn: Connection, plan: Plan) -> None:
    if plan.session:
        return  # created with the difference
    run_all(conn, parent_tables_sql(plan))
    plan.temps += [*plan.need, *plan.alive, *plan.gone, plan.bad]


def _lock_pass(
    conn: Connection, plan: Plan, needs: list[int], keyed: bool
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
        with keyed_plans(conn, keyed):
            got = _lock_statement(conn, plan, i, n)
        if got == needs[i]:
            out.append((0, 0))
            continue
        # Missing: gone (deleted and committed) or busy (locked by another
        # transaction, most likely deleting it right now).
        # The missing keys, and how many of them are busy: one round trip.
        busy = count(
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
                n=idents(n),
                parent=p.ident,
                pcp=idents(p.parent_columns, "p"),
                mn=idents(n, "m"),
                need=plan.need[i],
                alive=plan.alive[i],
            ),
        )
        out.append((needs[i] - got, busy))
    return out


def _held(plan: Plan, parent: ParentRef) -> bool:
    """Does the caller hold this parent's needed rows already (see
    :attr:`Scope.parents_locked`)?"""
    scope = plan.scope
    return (
        scope is not None
        and scope.parents_locked
        and bool(parent.columns)
        and set(parent.columns) <= set(scope.columns)
    )


def _lock_statement(conn: Connection, plan: Plan, i: int, n: list[str]) -> int:
    """``FOR KEY SHARE SKIP LOCKED`` the needed parents of parent table ``i``
    into its ``alive`` table; returns how many were locked."""
    p = plan.parents[i]
    got = run(
        conn,
        sql.SQL(
            "insert into {alive} ({n}) select {pc} from {parent} as p "
            "where ({pcp}) in (select {n} from {need}) order by {pcp} "
            "for key share of p skip locked"
        ).format(
            alive=plan.alive[i],
            n=idents(n),
            pc=idents(p.parent_columns, "p"),
            pcp=idents(p.parent_columns, "p"),
            parent=p.ident,
            need=plan.need[i],
        ),
    ).rowcount
    return int(got)


def _busy_keys(conn: Connection, plan: Plan) -> list[tuple[int, tuple[Any, ...]]]:
    """Up to ``_MAX_WAITS`` busy parents, as (parent index, key values)."""
    found: list[tuple[int, tuple[Any, ...]]] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        rows = run(
            conn,
            sql.SQL("select {} from {} where busy limit {}").format(
                idents(n), plan.gone[i], sql.Literal(_MAX_WAITS - len(found))
            ),
        ).all()
        found.extend((i, tuple(r)) for r in rows)
        if len(found) >= _MAX_WAITS:
            break
    return found


def _wait_for_busy(conn: Connection, plan: Plan, busy: list[tuple[int, tuple[Any, ...]]]) -> int:
    """Wait, holding no row lock, for the transactions holding ``busy``
    parents (each up to ``lock_timeout``; the first timeout ends the waiting);
    returns how many were waited for. Each lock is given back at once: the
    retry takes all parents again."""
    waited = 0
    for i, values in busy:
        p = plan.parents[i]
        waited += 1
        run(conn, _SAVEPOINT_WAIT)
        try:
            run(
                conn,
                sql.SQL("select from {} as p where ({}) = ({}) for key share of p").format(
                    p.ident,
                    idents(p.parent_columns, "p"),
                    sql.SQL(", ").join(sql.Placeholder() * len(values)),
                ),
                values,
            )
        except psycopg.errors.LockNotAvailable:
            run_all(conn, _ROLLBACK_WAIT)
            log.info(
                "pgjobs: %s: parent %s %s still held after lock_timeout; its rows are deferred",
                plan.target.label,
                p.label,
                values,
            )
            return waited
        run_all(conn, _ROLLBACK_WAIT)
    return waited


_SAVEPOINT_WAIT = sql.SQL("savepoint pgjobs_wait")
_ROLLBACK_WAIT = [
    sql.SQL("rollback to savepoint pgjobs_wait"),
    sql.SQL("release savepoint pgjobs_wait"),
]
_SAVEPOINT_PARENTS = sql.SQL("savepoint pgjobs_parents")
_ROLLBACK_PARENTS = sql.SQL("rollback to savepoint pgjobs_parents")
_RELEASE_PARENTS = sql.SQL("release savepoint pgjobs_parents")


def lock_parents(
    conn: Connection, plan: Plan, chunk: int | None, wait_busy: bool, keyed: bool
) -> Locked:
    """Lock this pass's parents (step 2) and fill the ``bad`` table with the
    rows that must be skipped (a needed parent is gone) or deferred (busy)."""
    result = Locked(since=time.perf_counter())
    if chunk is not None:
        # the previous chunk's sets; emptied before any row lock is taken
        run(
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
        flush(conn)
        # Row locks taken after a savepoint are released by rolling back to it.
        later(conn, _SAVEPOINT_PARENTS)
        result.since = time.perf_counter()
        passes = _lock_pass(conn, plan, needs, keyed)
        if any(busy for _, busy in passes) and wait_busy:
            # Never wait holding parent locks: give them all back, wait for the
            # busy parents with nothing held, then lock again, once.
            busy_keys = _busy_keys(conn, plan)
            run(conn, _ROLLBACK_PARENTS)
            result.waits = _wait_for_busy(conn, plan, busy_keys)
            result.since = time.perf_counter()
            passes = _lock_pass(conn, plan, needs, keyed)
        later(conn, _RELEASE_PARENTS)
        result.busy = sum(busy for _, busy in passes)
        result.dead = sum(missing - busy for missing, busy in passes)
        if result.busy or result.dead:
            _mark_bad(conn, plan, chunk)
    if plan.self_ref is not None:
        _resolve_self_reference(conn, plan)
    if result.busy or result.dead or plan.self_ref is not None:
        _count_bad(conn, plan, chunk, result)
    return result


def _count_bad(conn: Connection, plan: Plan, chunk: int | None, result: Locked) -> None:
    """What the ``bad`` table holds, in one query (the writes need it)."""
    row = run(
        conn,
        sql.SQL(
            "select count(*), coalesce(sum((not defer)::int), 0), "
            "coalesce(sum((defer and op is distinct from 'd')::int), 0), "
            "coalesce(sum((defer and op = 'd')::int), 0), "
            "(select count(*) from {bad} as bad join {d} as d on {on} "
            " where d.op = 'u' and {where}) "
            "from {bad}"
        ).format(
            bad=plan.bad,
            d=plan.difference,
            on=equal("bad", plan.difference_key, "d", plan.difference_key),
            where=chunk_filter("d", chunk),
        ),
    ).one()
    assert row is not None
    result.bad, result.skipped, result.deferred, result.deferred_deletes, result.bad_updates = (
        int(v) for v in row
    )


def _mark_bad(conn: Connection, plan: Plan, chunk: int | None) -> None:
    key_in_difference = plan.difference_key
    parts: list[sql.Composable] = []
    for i, p in enumerate(plan.parents):
        n = [f"n{j}" for j in range(len(p.columns))]
        new = [plan.new[c] for c in p.columns]
        old = [plan.old[c] for c in p.columns]
        # New parents: gone -> skip, busy -> defer. Old parents: only busy
        # matters (a gone old parent took its rows with it).
        parts.append(
            sql.SQL(
                "select {dk}, g.busy, d.op from {d} as d join {gone} as g on {on} "
                "where d.op <> 'd' and {w}"
            ).format(
                dk=idents(key_in_difference, "d"),
                d=plan.difference,
                gone=plan.gone[i],
                on=equal("d", new, "g", n),
                w=chunk_filter("d", chunk),
            )
        )
        parts.append(
            sql.SQL(
                "select {dk}, true, d.op from {d} as d join {gone} as g on {on} "
                "where d.op <> 'i' and g.busy and {w}"
            ).format(
                dk=idents(key_in_difference, "d"),
                d=plan.difference,
                gone=plan.gone[i],
                on=equal("d", old, "g", n),
                w=chunk_filter("d", chunk),
            )
        )
    # Sent with the next statement (the count of bad rows): one round trip.
    later(
        conn,
        sql.SQL(
            "insert into {bad} select {k}, bool_or(defer), min(op) from ({u}) as bad ({k}, defer, op) "
            "group by {k}"
        ).format(bad=plan.bad, k=idents(key_in_difference), u=sql.SQL(" union all ").join(parts)),
    )
    if plan.analyzed:
        analyze_later(conn, plan.bad)


def _resolve_self_reference(conn: Connection, plan: Plan) -> None:
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
    # the self-reference columns, ordered like the key they point at
    fk = [ref.columns[ref.parent_columns.index(k)] for k in plan.key]
    loop_free = sql.SQL("row({}) is distinct from row({})").format(
        idents(fk, "s"), idents(plan.key, "s")
    )
    locked = _lock_outside_self_parents(conn, plan, fk, loop_free)
    statement = _orphans_sql(plan, fk, loop_free, locked)
    while run(conn, statement).rowcount:
        pass
    analyze_now(conn, plan.bad)


def _lock_outside_self_parents(
    conn: Connection, plan: Plan, fk: list[str], loop_free: sql.Composable
) -> sql.Identifier:
    """Existing self-parents outside the staged rows (scoped diffs), locked
    ``FOR KEY SHARE SKIP LOCKED`` into a temp table, which is returned; one
    that is busy defers its children."""
    key, staged = plan.key, plan.staged.table
    outside = sql.Identifier(temp_name("selfparents"))
    create_temp(
        conn,
        plan,
        outside,
        sql.SQL(
            "select distinct {fk} from {s} as s where {nn} and {lf} "
            "and not exists (select from {s} as o where {on})"
        ).format(
            fk=idents(fk, "s"),
            s=staged,
            nn=not_null("s", fk),
            lf=loop_free,
            on=equal("o", key, "s", fk),
        ),
    )
    locked = sql.Identifier(temp_name("selflocked"))
    create_temp(
        conn,
        plan,
        locked,
        sql.SQL(
            "select {k} from {t} as t where ({k}) in (select * from {o}) order by {k} "
            "for key share of t skip locked"
        ).format(k=idents(key, "t"), t=plan.target.ident, o=outside),
    )
    return locked


def _orphans_sql(
    plan: Plan, fk: list[str], loop_free: sql.Composable, locked: sql.Identifier
) -> sql.Composed:
    """Put into ``bad`` the staged rows (``s``) whose self-parent will not be
    there: skipped, or deferred when that parent is busy."""
    key, staged, target = plan.key, plan.staged.table, plan.target
    key_in_difference = plan.difference_key
    existing = sql.SQL("exists (select from {t} as x where {on})").format(
        t=target.ident, on=equal("x", key, "s", fk)
    )
    # Rows to be deleted by this diff are not alive as parents.
    deleted = sql.SQL("exists (select from {d} as dd where dd.op = 'd' and {on})").format(
        d=plan.difference, on=equal("dd", key_in_difference, "s", fk)
    )
    in_stage_ok = sql.SQL(
        "exists (select from {s} as p where {on} "
        "and not exists (select from {bad} as bad where {bon}))"
    ).format(
        s=staged,
        on=equal("p", key, "s", fk),
        bad=plan.bad,
        bon=equal("bad", key_in_difference, "p", key),
    )
    locked_ok = sql.SQL("exists (select from {l} as l where {on})").format(
        l=locked, on=equal("l", key, "s", fk)
    )
    parent_defer = sql.SQL(
        "coalesce((select bad.defer from {bad} as bad where {on}), {existing} and not {locked_ok})"
    ).format(
        bad=plan.bad,
        on=equal("bad", key_in_difference, "s", fk),
        existing=existing,
        locked_ok=locked_ok,
    )
    return sql.SQL(
        "insert into {bad} ({key}, defer, op) "
        "select {sk}, {parent_defer}, "
        "(select dd.op from {d} as dd where {dd_on}) from {s} as s "
        "where {nn} and {lf} and not exists (select from {bad} as bad where {bon}) "
        "and not ({in_stage_ok} or ({locked_ok} and not {deleted}))"
    ).format(
        bad=plan.bad,
        key=idents(key_in_difference),
        sk=idents(key, "s"),
        parent_defer=parent_defer,
        s=staged,
        nn=not_null("s", fk),
        lf=loop_free,
        bon=equal("bad", key_in_difference, "s", key),
        d=plan.difference,
        dd_on=equal("dd", key_in_difference, "s", key),
        in_stage_ok=in_stage_ok,
        locked_ok=locked_ok,
        deleted=deleted,
    )


__all__ = [
    "Locked",
    "create_parent_tables",
    "index_bad",
    "lock_parents",
    "need_sql",
    "parent_tables_sql",
]
