"""A small scoped diff in one statement: the new rows, the difference with
the target, its parents ``FOR KEY SHARE SKIP LOCKED`` in key order, and
the writes, without a temp table of its own.

The diff writer's session tables (:mod:`.difference`, :mod:`.parents`)
are the right tool for many rows: statistics, indexes, a retry that waits
for a busy parent. For the handful of keys a queue tick takes from a
trickle they cost more than the work: some 30 statements, several round
trips, and a commit that truncates every such table. This statement does
what :func:`pgjobs.diff.write_diff` does with ``wait_busy=False`` on a
scope, step for step, as materialized CTEs read in order by its last
select: the checks (every new row within the scope, keys present and
unique), each parent table's needed keys locked (the first reads of
``miss<i>``, parent table by parent table, each in key order), which rows
are skipped (a parent gone) or deferred (a parent busy), then delete,
update, insert. It refuses nothing itself: when a check fails, or the
update finds fewer rows than planned, it writes nothing, or the caller
rolls it back, and the caller runs the general writer, which says what is
wrong with the words it always used (``docs/queue-performance.md``).

Not for a target that references itself (the general writer resolves
such rows step by step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from ..results import DiffStats
from ..staging import Staged
from ..target import Target
from .plan import Plan, Scope, equal, idents, not_null


@dataclass(frozen=True, slots=True)
class SmallResult:
    """What the statement did, or ``ok=False``: it wrote nothing, or must be
    rolled back (the general writer should run instead)."""

    ok: bool
    stats: DiffStats
    #: rows left as they were because a parent was busy (staged and deletes)
    deferred: int


class SmallDiff:
    """The statement for one target, scope and shape of new rows
    (:attr:`statement`), composed once; :meth:`read` reads its one row.

    ``keys``: a query of the scope's values (columns named like the scope);
    ``source``: the new rows' query, whose columns are ``columns`` (target
    columns; they are cast to the target's types, as a staged row is).
    ``held``: the caller holds ``FOR KEY SHARE`` on every parent whose
    columns are all scope columns (see :attr:`Scope.parents_locked`).
    ``extra``: a data-modifying statement of the caller's (``... returning
    1``) to run in the same statement, before the parents are locked; it
    may read ``k`` (a queue worker's flow marks)."""

    def __init__(
        self,
        target: Target,
        columns: Sequence[str],
        scope: Sequence[str],
        keys: sql.Composable,
        source: sql.Composable,
        *,
        held: bool,
        extra: sql.Composable | None = None,
    ) -> None:
        if target.self_reference is not None:
            raise ValueError("SmallDiff: a target that references itself takes the general writer")
        staged = Staged(table=sql.Identifier("s"), name="s", columns=tuple(columns), rows=0)
        plan = Plan(target, staged, Scope(columns=tuple(scope), keys=sql.Identifier("k")), False)
        self.plan = plan
        self.parents = [
            p for p in plan.parents if not (held and p.columns and set(p.columns) <= set(scope))
        ]
        ctes: list[sql.Composable] = [
            sql.SQL("k as materialized ({})").format(keys),
            sql.SQL("s as materialized (select {} from ({}) as q)").format(
                sql.SQL(", ").join(
                    sql.SQL("cast({} as {}) as {}").format(
                        sql.Identifier("q", c), sql.SQL(target.types[c].type), sql.Identifier(c)
                    )
                    for c in plan.columns
                ),
                source,
            ),
            self._checks(scope),
            sql.SQL("t as materialized ({})").format(self._target_side(scope)),
            sql.SQL("d as materialized ({})").format(self._difference()),
        ]
        if extra is not None:
            ctes.append(sql.SQL("extra as ({})").format(extra))
        for i in range(len(self.parents)):
            ctes += self._parent(i)
        ctes.append(sql.SQL("bad as materialized ({})").format(self._bad()))
        ctes += self._writes()
        counts = [
            sql.SQL("(select count(*) from {})").format(sql.Identifier(f"miss{i}"))
            for i in range(len(self.parents))
        ]
        if extra is not None:
            counts.insert(0, sql.SQL("(select count(*) from extra)").format())
        self.statement = sql.SQL(
            "with {ctes} select (select ok from chk), (select n from chk), {locks}"
            " (select count(*) filter (where not defer) from bad),"
            " (select count(*) filter (where defer and op is distinct from 'd') from bad),"
            " (select count(*) filter (where defer and op = 'd') from bad),"
            " (select count(*) from d where op = 'u'"
            "  and not exists (select from bad where {bad_key})),"
            " (select count(*) from ({victims}) as v),"
            " (select count(*) from del), (select count(*) from upd), (select count(*) from ins)"
        ).format(
            ctes=sql.SQL(", ").join(ctes),
            locks=sql.SQL("").join(sql.SQL("{}, ").format(c) for c in counts),
            bad_key=equal("bad", plan.difference_key, "d", plan.difference_key),
            victims=self.victims,
        )
        self.columns_read = 2 + len(counts) + 8

    # -- the parts ---------------------------------------------------------------------
    @property
    def victim(self) -> sql.Composed:
        """Is ``d``'s row one to delete? The difference's deletes not left
        out, and the skipped rows that exist (an update to a dead parent)."""
        dk = self.plan.difference_key
        on = equal("bad", dk, "d", dk)
        return sql.SQL(
            "d.pgjobs_tid is not null and ((d.op = 'd' and not exists (select from bad where {on}))"
            " or exists (select from bad where {on} and not bad.defer))"
        ).format(on=on)

    @property
    def victims(self) -> sql.Composed:
        """Where the rows to delete are (their row versions)."""
        return sql.SQL("select d.pgjobs_tid from d where {}").format(self.victim)

    def _checks(self, scope: Sequence[str]) -> sql.Composed:
        """``chk``: ``ok`` (every new row within the scope, its key present
        and unique) and ``n``, the new rows."""
        key = self.plan.key
        return sql.SQL(
            "chk as materialized (select n = 0 or (outside = 0 and nulls = 0 and repeated = 0)"
            " as ok, n from (select (select count(*) from s) as n,"
            " (select count(*) from s where not ({nn})) as nulls,"
            # an anti join (hashed), not a subplan per row
            " (select count(*) from s where not exists (select from k where {in_scope}))"
            " as outside,"
            " (select count(*) from (select from s group by {key} having count(*) > 1) as r)"
            " as repeated) as c)"
        ).format(
            nn=not_null("s", key),
            in_scope=equal("k", scope, "s", scope),
            key=idents(key),
        )

    def _target_side(self, scope: Sequence[str]) -> sql.Composed:
        """The target's rows within the scope: one index probe per key where
        an index serves it (OFFSET 0 keeps the probe a parameterized scan)."""
        plan, t = self.plan, self.plan.target
        cols = list(dict.fromkeys([*plan.key, *plan.values, *plan.old]))
        if t.indexed(scope):
            return sql.SQL(
                "select x.* from k cross join lateral"
                " (select {cols}, y.ctid as pgjobs_tid from {t} as y where {on} offset 0) as x"
            ).format(cols=idents(cols, "y"), t=t.ident, on=equal("y", scope, "k", scope))
        return sql.SQL(
            "select {cols}, ctid as pgjobs_tid from {t} where ({sc}) in (select {sc} from k)"
        ).format(cols=idents(cols), t=t.ident, sc=idents(scope))

    def _difference(self) -> sql.Composed:
        """A keyed full join of the new rows (``s``) with the target's (``t``):
        op, the new values ``c<n>``, the old parent values ``f<n>``."""
        plan = self.plan
        key = plan.key
        op = sql.SQL(
            "case when {t_k} is null then 'i' when {s_k} is null then 'd' {upd} end"
        ).format(
            t_k=sql.Identifier("t", key[0]),
            s_k=sql.Identifier("s", key[0]),
            upd=sql.SQL("when {} then 'u'").format(
                plan.distinct("t", plan.values, "s", plan.values)
            )
            if plan.values
            else sql.SQL(""),
        )
        selected: list[sql.Composable] = [sql.SQL("{} as op").format(op)]
        for name in plan.columns:
            expr: sql.Composable = sql.Identifier("s", name)
            if name in key:
                expr = sql.SQL("coalesce({}, {})").format(expr, sql.Identifier("t", name))
            selected.append(sql.SQL("{} as {}").format(expr, sql.Identifier(plan.new[name])))
        for name, old_name in plan.old.items():
            selected.append(
                sql.SQL("{} as {}").format(sql.Identifier("t", name), sql.Identifier(old_name))
            )
        # where the target row is: the writes find it by it (see _writes)
        selected.append(sql.SQL("t.pgjobs_tid"))
        return sql.SQL(
            "select * from (select {sel} from s full join t on {on}) as x"
            " where op is not null and (select ok from chk)"
        ).format(sel=sql.SQL(", ").join(selected), on=equal("s", key, "t", key))

    def _parent(self, i: int) -> list[sql.Composable]:
        """``need<i>`` (the parent keys the rows need: new values of inserts
        and updates, old values of updates and deletes), ``alive<i>`` (those
        locked), ``miss<i>`` (the others, and whether each still exists:
        busy, held by another transaction, or gone)."""
        plan, p = self.plan, self.parents[i]
        n = [f"n{j}" for j in range(len(p.columns))]
        new = [plan.new[c] for c in p.columns]
        old = [plan.old[c] for c in p.columns]
        need, alive, miss = (sql.Identifier(f"{x}{i}") for x in ("need", "alive", "miss"))
        return [
            sql.SQL(
                "{need} ({n}) as materialized (select {new} from d where op <> 'd' and {new_nn}"
                " union select {old} from d where op <> 'i' and {old_nn})"
            ).format(
                need=need,
                n=idents(n),
                new=idents(new),
                old=idents(old),
                new_nn=not_null(None, new),
                old_nn=not_null(None, old),
            ),
            sql.SQL(
                "{alive} as materialized (select {pc} from {parent} as p"
                " where ({pc}) in (select * from {need}) order by {pc}"
                " for key share of p skip locked)"
            ).format(alive=alive, pc=idents(p.parent_columns, "p"), parent=p.ident, need=need),
            sql.SQL(
                "{miss} as materialized (select m.*, exists (select from {parent} as p"
                " where ({pc}) = ({mn})) as busy from (select * from {need}"
                " except select * from {alive}) as m)"
            ).format(
                miss=miss,
                parent=p.ident,
                pc=idents(p.parent_columns, "p"),
                mn=idents(n, "m"),
                need=need,
                alive=alive,
            ),
        ]

    def _bad(self) -> sql.Composable:
        """Rows of the difference to leave out: a new parent missing (gone:
        skipped, busy: deferred), an old parent busy (deferred)."""
        plan = self.plan
        dk = plan.difference_key
        parts: list[sql.Composable] = []
        for i, p in enumerate(self.parents):
            n = [f"n{j}" for j in range(len(p.columns))]
            miss = sql.Identifier(f"miss{i}")
            new = [plan.new[c] for c in p.columns]
            old = [plan.old[c] for c in p.columns]
            parts.append(
                sql.SQL(
                    "select {dk}, g.busy, d.op from d join {miss} as g on {on} where d.op <> 'd'"
                ).format(dk=idents(dk, "d"), miss=miss, on=equal("d", new, "g", n))
            )
            parts.append(
                sql.SQL(
                    "select {dk}, true, d.op from d join {miss} as g on {on}"
                    " where d.op <> 'i' and g.busy"
                ).format(dk=idents(dk, "d"), miss=miss, on=equal("d", old, "g", n))
            )
        if not parts:
            return sql.SQL("select {}, false as defer, op from d where false").format(idents(dk))
        return sql.SQL(
            "select {k}, bool_or(defer) as defer, min(op) as op"
            " from ({u}) as bad ({k}, defer, op) group by {k}"
        ).format(k=idents(dk), u=sql.SQL(" union all ").join(parts))

    def _writes(self) -> list[sql.Composable]:
        """``del``, ``upd``, ``ins``: the rows, matched by key, the left-out
        ones left out; the skipped rows that exist are deleted."""
        plan = self.plan
        dk = plan.difference_key
        t = plan.target.ident
        not_bad = sql.SQL("not exists (select from bad where {})").format(equal("bad", dk, "d", dk))
        # The target rows are found by the row versions the statement read
        # (``ctid = any(array(...))``: a TID scan), never by a join the
        # planner may turn into a scan of the whole target: its estimate of
        # a target that grew since its last ANALYZE (truncated, refilled) can
        # be any size. A row updated meanwhile by another transaction is not
        # found so; the counts then fall short of the plan, and the caller
        # takes the general writer (see read).
        # ... and by key as well: a row version is unique in one table only,
        # and a partition or an inheritance child of the target may hold
        # another row at the same one
        delete = sql.SQL(
            "del as (delete from {t} as t where t.ctid = any(array({victims}))"
            " and exists (select from d where d.pgjobs_tid = t.ctid and {on} and {victim})"
            " returning 1)"
        ).format(t=t, victims=self.victims, on=equal("t", plan.key, "d", dk), victim=self.victim)
        if plan.values:
            sets = sql.SQL(", ").join(
                sql.SQL("{} = {}").format(sql.Identifier(v), sql.Identifier("d", plan.new[v]))
                for v in plan.values
            )
            update = sql.SQL(
                "upd as (update {t} as t set {sets} from d"
                " where t.ctid = any(array(select d.pgjobs_tid from d where d.op = 'u' and {nb}))"
                " and d.op = 'u' and {on} and {nb} and {distinct} returning 1)"
            ).format(
                t=t,
                sets=sets,
                on=equal("t", plan.key, "d", dk),
                nb=not_bad,
                distinct=plan.distinct("t", plan.values, "d", [plan.new[v] for v in plan.values]),
            )
        else:
            update = sql.SQL("upd as (select 1 where false)").format()
        insert = sql.SQL(
            "ins as (insert into {t} ({cols}) select {new} from d where d.op = 'i' and {nb}"
            " returning 1)"
        ).format(
            t=t,
            cols=idents(plan.columns),
            new=idents([plan.new[c] for c in plan.columns], "d"),
            nb=not_bad,
        )
        return [delete, update, insert]

    # -- its answer ------------------------------------------------------------------------
    def read(self, row: Sequence[Any]) -> SmallResult:
        """The statement's one row as a :class:`SmallResult`."""
        ok, staged = bool(row[0]), int(row[1])
        rest = [int(v) for v in row[self.columns_read - 8 :]]
        skipped, deferred, deferred_deletes, expected_updates, expected_deletes = rest[:5]
        deleted, updated, inserted = rest[5:]
        if not ok or updated < expected_updates or deleted < expected_deletes:
            # a check failed (nothing was written), or rows planned as
            # updates or deletes were not where the statement read them
            # (another transaction changed them; the general writer finds
            # them by key): the caller rolls back and runs the general writer
            return SmallResult(ok=False, stats=DiffStats(), deferred=0)
        stats = DiffStats(
            inserted=inserted,
            updated=updated,
            deleted=deleted,
            skipped_missing_parent=skipped,
            unchanged=staged - inserted - updated - skipped - deferred,
        )
        return SmallResult(ok=True, stats=stats, deferred=deferred + deferred_deletes)


__all__ = [
    "SmallDiff",
    "SmallResult",
]
