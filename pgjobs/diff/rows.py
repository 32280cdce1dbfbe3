"""Step 3 of the diff writer: the rows, matched by key (never by ``ctid``):
delete the vanished rows, update those whose values are ``IS DISTINCT
FROM`` the new ones, insert the missing ones, leaving out the rows step 2
put in the ``bad`` table. With every parent already held the order among
the three does not matter for deadlocks; a target that references itself
is written insert, update, delete, so that every foreign-key check finds
the rows it points at.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql
from sqlalchemy.engine import Connection

from .parents import Locked
from .plan import Plan, chunk_filter, equal, idents, run, run_all


@dataclass(kw_only=True)
class Written:
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    skipped: int = 0
    deferred: int = 0  #: staged rows deferred
    deferred_deletes: int = 0


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
        skipped=locked.skipped,
        deferred=locked.deferred,
        deferred_deletes=locked.deferred_deletes,
    )
    t = plan.target
    key_cols = plan.difference_key
    key = plan.key
    has_bad = locked.bad > 0
    where = chunk_filter("d", chunk)
    not_bad: sql.Composable = (
        sql.SQL("not exists (select from {} as bad where {})").format(
            plan.bad, equal("bad", key_cols, "d", key_cols)
        )
        if has_bad
        else sql.SQL("true")
    )
    columns = idents(plan.columns)
    d_columns = idents([plan.new[c] for c in plan.columns], "d")

    def delete() -> sql.Composable | None:
        if not planned["d"] and not has_bad:
            return None
        victims: sql.Composable = sql.SQL(
            "select {} from {} as d where d.op = 'd' and {} and {}"
        ).format(idents(key_cols, "d"), plan.difference, where, not_bad)
        if has_bad:
            # skipped rows that exist (an update to a dead parent; with a
            # self-reference, also unchanged rows whose self-parent is skipped)
            victims = sql.SQL("{} union all select {} from {} where not defer").format(
                victims, idents(key_cols), plan.bad
            )
        # The two victim sets are disjoint (bad 'd' rows are only ever
        # deferred), so a join: the victims drive, the key index finds rows.
        vk = [f"k{j}" for j in range(len(key))]
        return sql.SQL("delete from {t} as t using ({v}) as v ({vk}) where {on}").format(
            t=t.ident, v=victims, vk=idents(vk), on=equal("t", key, "v", vk)
        )

    # rows of the difference the update should find
    expected_updates = planned["u"] - locked.bad_updates

    def update() -> sql.Composable | None:
        if not plan.values or not expected_updates:
            return None
        sets = sql.SQL(", ").join(
            sql.SQL("{} = {}").format(sql.Identifier(v), sql.Identifier("d", plan.new[v]))
            for v in plan.values
        )
        vc = [plan.new[v] for v in plan.values]
        # Compared again at write time: a row that already holds the new values
        # is not touched (its triggers do not fire).
        return sql.SQL(
            "update {t} as t set {sets} from {d} as d "
            "where d.op = 'u' and {on} and {where} and {nb} and {distinct}"
        ).format(
            t=t.ident,
            sets=sets,
            d=plan.difference,
            on=equal("t", key, "d", key_cols),
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
        ).format(t=t.ident, cols=columns, dc=d_columns, d=plan.difference, where=where, nb=not_bad)

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
    counts = run_all(conn, [statement for _, statement in steps])
    for (op, _), result in zip(steps, counts, strict=True):
        if op == "d":
            out.deleted += result.rowcount
        elif op == "u":
            out.updated += result.rowcount
        else:
            out.inserted += result.rowcount
    if plan.values and out.updated < expected_updates:
        # Fewer rows than planned: some already held the new values, or
        # were deleted since the difference was taken (their old parent
        # was deleted, cascading). The latter are inserted: the target
        # must hold every new row whose parents are alive.
        out.inserted += run(
            conn,
            sql.SQL(
                "insert into {t} ({cols}) select {dc} from {d} as d "
                "where d.op = 'u' and {where} and {nb} "
                "and not exists (select from {t} as t where {on})"
            ).format(
                t=t.ident,
                cols=columns,
                dc=d_columns,
                d=plan.difference,
                where=where,
                nb=not_bad,
                on=equal("t", key, "d", key_cols),
            ),
        ).rowcount
    return out
