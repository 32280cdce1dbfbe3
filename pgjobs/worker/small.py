"""A small batch's write in one statement (:class:`pgjobs.diff.small.SmallDiff`):
the new rows, the scoped difference, the parents and the writes in one
round trip, with no temp table but the keys table the claim loaded.

Taken for batches of at most :data:`SMALL_KEYS` keys whose compute is SQL
text psycopg can run as it is, on a target that does not reference
itself; otherwise, and whenever the statement reports that it could not
write (a check failed, or an update found fewer rows than planned), the
general writer (:func:`pgjobs.diff.write_diff`, session temp tables) runs
instead, under the same savepoint, and says what is wrong. Where the
switch point comes from: ``docs/queue-performance.md``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import text

from .._pg import frozen, send
from ..diff import WriteResult
from ..diff.small import SmallDiff
from ..staging import check_coverage
from ..staging.query import bind, plain_sql, probe_sql, strip
from ..staging.table import check_columns
from .state import Tick, is_run_level

#: batches of up to this many keys take the one-statement write. Measured
#: (docs/queue-performance.md): at 10 keys the statement drained 1,140-1,620
#: items/s against the session tables' 790-880; at 100 it won once the
#: tables had statistics (4,450 against 3,810) and lost while a truncated
#: target refilled without them (890 against 3,650: psycopg prepares the
#: statement, and the generic plan made on the empty table scanned it).
SMALL_KEYS = 10


@dataclass(frozen=True, slots=True)
class Composed:
    """One compute text's statement, composed once (kept on the job's statements)."""

    #: the compute text as compiled for psycopg
    query: str
    columns: tuple[str, ...]
    diff: SmallDiff
    statement: sql.SQL
    #: the most keys it reads (its LIMIT: SMALL_KEYS when it was composed)
    most: int
    #: what it is executed with: no parameter when the keys are read from
    #: the keys table inside it (:func:`_keys_inlined`), else the compute's
    inlined: bool


def small_enough(t: Tick, keys: int) -> bool:
    """Would a batch of ``keys`` keys take the one-statement write?"""
    return keys <= SMALL_KEYS and t.target.self_reference is None and not t.target.partitioned


def write_small(
    t: Tick,
    items: list[str],
    source: object,
    params: dict[str, Any],
    savepoint: sql.Identifier,
    *,
    reload: bool,
) -> WriteResult | None:
    """Write the batch (its keys in the keys table) in one statement, under
    the batch's ``savepoint``; ``None`` when it took nothing (not SQL text,
    or the statement could not write: rolled back to ``savepoint``, the
    keys loaded again when they were loaded under it: ``reload``), and the
    general writer should run."""
    if not isinstance(source, str):
        return None
    started = time.perf_counter()
    ahead, t.ahead_write = t.ahead_write, None
    if ahead is not None:  # it went with the claim, which found it fits (claim.adopt_write)
        composed, row = ahead
    else:
        composed = t.statements.small_ready.get(source)
        bound: dict[str, Any] = {}  # (a statement found ready takes no parameter)
        if composed is None:
            clause = text(strip(source))
            query = plain_sql(t.conn, clause)
            if query is None:
                return None
            bound = bind(clause, params)
            composed = _composed(t, query, bound, source)
        if len(params["keys"]) > composed.most:
            return None  # (SMALL_KEYS raised since: its LIMIT would leave keys out)
        check_coverage(t.target, composed.columns, t.job.columns, "the new rows")
        try:
            (row,) = send(t.conn, (composed.statement, {} if composed.inlined else bound))
        except psycopg.DatabaseError as exc:
            if is_run_level(exc):
                raise
            # the general writer runs it again and says what failed; the
            # statement is composed again next time (the query's columns may
            # have changed under a "*")
            t.statements.small.pop(composed.query, None)
            t.statements.small_ready.pop(source, None)
            if composed.inlined and (exc.sqlstate or "").startswith("42"):
                # an error of the statement's text (class 42: "operator does not
                # exist", say), not of an item's data: the keys typed as the scope's
                # columns do not suit this compute; as parameters from now on
                t.statements.small_as_parameters.add(composed.query)
            _back(t, items, savepoint, reload)
            return None
    values = row.one()
    assert values is not None
    result = composed.diff.read(values)
    if not result.ok:
        _back(t, items, savepoint, reload)
        return None
    seconds = time.perf_counter() - started
    return WriteResult(
        stats=result.stats,
        write_seconds=seconds,
        lock_seconds=seconds,
        max_chunk_lock_seconds=seconds,
        deferred=result.deferred,
        detail={"small": True},
    )


def _back(t: Tick, items: list[str], savepoint: sql.Identifier, reload: bool) -> None:
    """Undo the statement (and the flow marks it wrote): back to the
    batch's savepoint, which stays; the keys loaded again if it undid them."""
    t.raw.execute(sql.SQL("rollback to savepoint {}").format(savepoint))
    if reload:
        t.raw.execute(t.statements.load_keys, (items,))


def _composed(t: Tick, query: str, params: dict[str, Any], source: str) -> Composed:
    """The statement for ``query`` (``source`` compiled): its columns probed
    once (planned with LIMIT 0, no row computed), then composed and kept;
    by ``source`` too when it takes no parameter."""
    cached = t.statements.small.get(query)
    if isinstance(cached, Composed):
        return cached
    (probed,) = send(t.conn, (probe_sql(query), params))
    columns = check_columns(t.target, probed.columns or (), "the new rows' SQL")
    inlined = None if query in t.statements.small_as_parameters else _keys_inlined(query, t)
    diff = SmallDiff(
        t.target,
        columns,
        t.job.scope,
        # The LIMIT is the planner's: the keys table holds at most
        # SMALL_KEYS rows here, and, never analyzed, would be taken at its
        # empty size's guess (2,550 rows), multiplying every estimate past
        # jit_above_cost on an analyzed target (JIT: some 120 ms a tick).
        keys=sql.SQL("select {} from pg_temp.{} limit {}").format(
            t.statements.scope, t.statements.keys_table, sql.Literal(SMALL_KEYS)
        ),
        source=sql.SQL(inlined if inlined is not None else query),
        held=True,
        # flow: the marks, in the same statement (docs/DESIGN.md, "Flow")
        extra=t.statements.mark_small if t.job.flow else None,
    )
    made = Composed(query, columns, diff, frozen(diff.statement), SMALL_KEYS, inlined is not None)
    if len(t.statements.small) >= 16:
        t.statements.small.clear()
        t.statements.small_ready.clear()
    t.statements.small[query] = made
    if made.inlined:
        t.statements.small_ready[source] = made
    return made


#: a psycopg placeholder of a compiled compute text, or a percent sign doubled
_PLACEHOLDER = re.compile(r"%%|%\((\w+)\)s")


def _keys_inlined(query: str, t: Tick) -> str | None:
    """``query`` (compiled for psycopg) with each of its keys parameters
    (``:keys``, ``:keys_<column>``) replaced by the array of that column
    of the keys table, which holds the batch's keys here; ``None`` when it
    has a parameter of another name.

    So the statement has no parameter, and PostgreSQL plans it once and
    keeps the plan (a generic plan, in which an array that is not a
    constant counts as 10 elements: about a small batch). With the keys as
    a parameter, it planned the statement again at each execution (custom
    plans for the one key given looked cheaper than the generic one): 1.1
    ms of planning a tick in ``queue_bench``'s trickle, against 0.5 ms of
    execution."""
    arrays = {
        f"keys_{column}": sql.SQL("array(select {} from pg_temp.{})").format(
            sql.Identifier(column), t.statements.keys_table
        )
        for column in t.job.scope
    }
    arrays["keys"] = arrays[f"keys_{t.job.scope[0]}"]
    unknown = False

    def replace(match: re.Match[str]) -> str:
        nonlocal unknown
        name = match.group(1)
        if name is None:
            return match.group(0)  # %% stays doubled: the statement is run with {}
        if name not in arrays:
            unknown = True
            return match.group(0)
        return "(" + arrays[name].as_string(None).replace("%", "%%") + ")"

    inlined = _PLACEHOLDER.sub(replace, query)
    return None if unknown else inlined


__all__ = [
    "SMALL_KEYS",
    "Composed",
    "small_enough",
    "write_small",
]
