"""Step 3 of the diff writer: the rows, matched by key (never by ``ctid``):
delete the vanished rows, update those whose values are ``IS DISTINCT
FROM`` the new ones, insert the missing ones, leaving out the rows step 2
put in the ``bad`` table. With every parent already held the order among
the three does not matter for deadlocks; a target that references itself
is written insert, update, delete, so that every foreign-key check finds
the rows it points at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from psycopg import sql
from sqlalchemy.engine import Connection

from ..results import DiffStats
from .parents import Locked
from .plan import Plan, chunk_filter, equal, idents, run, run_all


@dataclass(kw_only=True)
class Written:
    """What one pass (or, added up, a whole diff) wrote, skipped and deferred."""

    stats: DiffStats = field(default_factory=DiffStats)
    deferred: int = 0  #: staged rows deferred
    deferred_deletes: int = 0

    def __add__(self, other: Written) -> Written:
        return Written(
            stats=self.stats + other.stats,
            deferred=self.deferred + other.deferred,
            deferred_deletes=self.deferred_deletes + other.deferred_deletes,
        )


def write_rows(
    conn: Connection, plan: Plan, chunk: int | None, locked: Locked, planned: dict[str, int]
) -> Written:
    """Step 3 for one pass; ``planned``: this pass's rows in the difference by
    op, ``locked``: what step 2 found (the rows in ``bad``).

    The delete, update and insert go out in one round trip: they are the
    heart of the row-lock window, which should hold no waiting for the
    network. Only an update that finds fewer rows than planned takes another
    (see below)."""
    out = Written(
        stats=DiffStats(skipped_missing_parent=locked.skipped),
        deferred=locked.deferred,
        deferred_deletes=locked.deferred_deletes,
    )
    writes = _Writes(plan, chunk, has_bad=locked.bad > 0)
    # rows of the difference the update should find
    expected_updates = planned["u"] - locked.bad_updates
    statements = {
        "d": writes.delete() if planned["d"] or writes.has_bad else None,
        "u": writes.update() if plan.values and expected_updates else None,
        "i": writes.insert() if planned["i"] else None,
    }
    # Without a self-reference: delete, update, insert. With one, a row's
    # self-parent must exist before it is written and outlive it: inserts
    # first, deletes last.
    order = "dui" if plan.self_ref is None else "iud"
    steps = [(op, statements[op]) for op in order if statements[op] is not None]
    if not steps:
        return out
    results = run_all(conn, [statement for _, statement in steps if statement is not None])
    rows = {"d": 0, "u": 0, "i": 0}
    for (op, _), result in zip(steps, results, strict=True):
        rows[op] += result.rowcount
    if plan.values and rows["u"] < expected_updates:
        # Fewer rows than planned: some already held the new values, or
        # were deleted since the difference was taken (their old parent
        # was deleted, cascading). The latter are inserted: the target
        # must hold every new row whose parents are alive.
        rows["i"] += run(conn, writes.insert_vanished()).rowcount
    stats = replace(out.stats, inserted=rows["i"], updated=rows["u"], deleted=rows["d"])
    return replace(out, stats=stats)


class _Writes:
    """The statements of step 3 for one pass (difference rows aliased ``d``)."""

    def __init__(self, plan: Plan, chunk: int | None, *, has_bad: bool) -> None:
        self.plan = plan
        self.has_bad = has_bad
        key_in_difference = plan.difference_key
        self.where = chunk_filter("d", chunk)
        self.not_bad: sql.Composable = (
            sql.SQL("not exists (select from {} as bad where {})").format(
                plan.bad, equal("bad", key_in_difference, "d", key_in_difference)
            )
            if has_bad
            else sql.SQL("true")
        )
        self.columns = idents(plan.columns)
        self.new_values = idents([plan.new[c] for c in plan.columns], "d")
        #: a target row (``t``) and its difference row have the same key
        self.same_key = equal("t", plan.key, "d", key_in_difference)

    def delete(self) -> sql.Composable:
        plan = self.plan
        key_in_difference = plan.difference_key
        victims: sql.Composable = sql.SQL(
            "select {} from {} as d where d.op = 'd' and {} and {}"
        ).format(idents(key_in_difference, "d"), plan.difference, self.where, self.not_bad)
        if self.has_bad:
            # skipped rows that exist (an update to a dead parent; with a
            # self-reference, also unchanged rows whose self-parent is skipped)
            victims = sql.SQL("{} union all select {} from {} where not defer").format(
                victims, idents(key_in_difference), plan.bad
            )
        # The two victim sets are disjoint (bad 'd' rows are only ever
        # deferred), so a join: the victims drive, the key index finds rows.
        victim_key = [f"k{j}" for j in range(len(plan.key))]
        return sql.SQL("delete from {t} as t using ({v}) as v ({vk}) where {on}").format(
            t=plan.target.ident,
            v=victims,
            vk=idents(victim_key),
            on=equal("t", plan.key, "v", victim_key),
        )

    def update(self) -> sql.Composable:
        plan = self.plan
        sets = sql.SQL(", ").join(
            sql.SQL("{} = {}").format(sql.Identifier(v), sql.Identifier("d", plan.new[v]))
            for v in plan.values
        )
        new_values = [plan.new[v] for v in plan.values]
        # Compared again at write time: a row that already holds the new values
        # is not touched (its triggers do not fire).
        return sql.SQL(
            "update {t} as t set {sets} from {d} as d "
            "where d.op = 'u' and {on} and {where} and {nb} and {distinct}"
        ).format(
            t=plan.target.ident,
            sets=sets,
            d=plan.difference,
            on=self.same_key,
            where=self.where,
            nb=self.not_bad,
            distinct=plan.distinct("t", plan.values, "d", new_values),
        )

    def insert(self) -> sql.Composable:
        return sql.SQL(
            "insert into {t} ({cols}) select {new} from {d} as d "
            "where d.op = 'i' and {where} and {nb}"
        ).format(
            t=self.plan.target.ident,
            cols=self.columns,
            new=self.new_values,
            d=self.plan.difference,
            where=self.where,
            nb=self.not_bad,
        )

    def insert_vanished(self) -> sql.Composable:
        """Rows planned as updates whose target row is gone: inserted."""
        return sql.SQL(
            "insert into {t} ({cols}) select {new} from {d} as d "
            "where d.op = 'u' and {where} and {nb} "
            "and not exists (select from {t} as t where {on})"
        ).format(
            t=self.plan.target.ident,
            cols=self.columns,
            new=self.new_values,
            d=self.plan.difference,
            where=self.where,
            nb=self.not_bad,
            on=self.same_key,
        )


__all__ = [
    "Written",
    "write_rows",
]
