"""The diff writer: make a derived table equal to its new rows by writing
only the difference, FK-safe and without deadlocks.

:func:`write_diff` takes the target (:mod:`pgjobs.target`) and the new rows
staged in an analyzed temp table (:mod:`pgjobs.staging`), then:

1. :mod:`.difference` — the difference, materialized and analyzed; no row lock;
2. :mod:`.parents` — the parents of every row to write, ``FOR KEY SHARE``
   in key order, never waiting while holding any; gone ones skip their rows,
   busy ones defer them;
3. :mod:`.rows` — keyed delete, update, insert.

:mod:`.plan` names the temp tables and holds the SQL helpers. Chunked
writes repeat steps 2 and 3 per chunk of parents. The lock order, what the
deadlock-freedom rests on, and the measurements behind each choice are in
``docs/DESIGN.md``, "The diff writer".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import Params, flush, later
from ..errors import ConfigError
from ..results import DiffStats
from ..staging import Staged
from ..target import Target
from . import plan as planning
from .difference import Chunks, build_difference
from .parents import create_parent_tables, index_bad, lock_parents
from .plan import Plan, Scope, chunk_filter, keyed_plans, run
from .rows import Written, write_rows

log = logging.getLogger(__name__)

Progress = Callable[[str, int | None, int | None], None]


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


def write_diff(
    conn: Connection,
    target: Target,
    staged: Staged,
    *,
    scope: Scope | None = None,
    progress: Progress | None = None,
    wait_busy: bool = True,
) -> WriteResult:
    """Make ``target`` equal to ``staged`` (within ``scope``), writing only
    the difference, in the caller's transaction; see the module docstring
    for the order and why. (Writes in chunks, each committed on its own, go
    through :class:`DiffWriter`.)

    ``progress(phase, done, total)`` is called with "diff" (before the
    difference, and with its row count after), then per chunk
    (``done`` of ``total`` chunks written) "lock" (before its parents are
    locked), "rows" (parents held, before its rows) and "write" (after).

    ``wait_busy=False``: never wait for a parent another transaction holds,
    not even with nothing held; defer its rows at once (for callers that
    hold locks of their own, such as a queue worker's claimed entries).
    """
    writer = DiffWriter(conn, target, staged, scope=scope, progress=progress, wait_busy=wait_busy)
    with writer:
        for chunk in writer.chunks:
            writer.write_chunk(chunk)
        return writer.finish()


@dataclass(kw_only=True)
class _Totals:
    """What the chunks written so far did."""

    #: rows written, skipped and deferred (``Written.__add__``, ``DiffStats.__add__``)
    written: Written = field(default_factory=Written)
    busy: int = 0
    dead: int = 0
    waits: int = 0
    excluded: int = 0
    excluded_staged: int = 0
    excluded_keys: int = 0
    lock_seconds: float = 0.0
    max_chunk: float = 0.0


class DiffWriter:
    """One diff, step by step: the difference on construction (step 1, no
    row lock), then :meth:`write_chunk` for each of :attr:`chunks` (steps 2
    and 3), then :meth:`finish`. Use it as a context manager: what was
    queued for the next round trip (planner settings given back, a savepoint
    released) is still sent when a step fails, if the transaction can run it.

    ``chunk_parents``: chunks of that many parents, in parent-key order, so
    that a caller who commits after each (the recompute body,
    :mod:`pgjobs.recompute`) makes no user wait on more than one chunk. The
    trade-off is atomicity: readers see the table partly rewritten, and a
    failure keeps the chunks already committed (the next run writes the
    rest). ``chunk_rows``: chunks of whole parents with about that many rows
    of the difference each, and one pass when the whole difference has no
    more. Either way ``staged`` must survive commits (``stage(...,
    preserve=True)``). Without either, :attr:`chunks` is one pass over the
    whole difference.
    """

    def __init__(
        self,
        conn: Connection,
        target: Target,
        staged: Staged,
        *,
        scope: Scope | None = None,
        chunk_parents: int | None = None,
        chunk_rows: int | None = None,
        progress: Progress | None = None,
        wait_busy: bool = True,
    ) -> None:
        chunking = _chunking(target, staged, scope, chunk_parents, chunk_rows)
        self.started = time.perf_counter()
        self.conn = conn
        self.progress = progress
        self.wait_busy = wait_busy
        self.plan = Plan(target, staged, scope, preserve=chunking is not None)
        self.totals = _Totals()
        self._report("diff")
        self.counts, estimate = build_difference(conn, self.plan, chunking)
        self._report("diff", sum(self.counts.values()), None)  # rows of the difference
        # The target's size, for choosing keyed plans: as it is, or as it will
        # be (a first fill: an empty target, each chunk a small part of it;
        # a plan for an empty target scanned the whole parent table per chunk)
        self.target_rows = max(estimate, float(self.plan.staged.rows))
        create_parent_tables(conn, self.plan)
        #: rows of the difference by op ("i", "u", "d"), per chunk
        self.per_chunk: dict[int | None, dict[str, int]] = {None: self.counts}
        #: the chunks to write, in order (``[None]``: the whole difference at once)
        self.chunks: list[int | None] = [None]
        if chunking is not None and not (
            chunking.by_rows and sum(self.counts.values()) <= chunking.size
        ):
            self.per_chunk = _chunk_counts(conn, self.plan)
            # parent-ordered chunks first, then the rows without a chunk parent
            self.chunks = sorted(self.per_chunk, key=lambda c: (c is None or c < 0, abs(c or 0)))
        self.diff_seconds = time.perf_counter() - self.started
        self.written = 0

    def __enter__(self) -> DiffWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            with suppress(psycopg.Error):
                flush(self.conn)

    def _report(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    def write_chunk(self, chunk: int | None) -> None:
        """Steps 2 and 3 for ``chunk`` (one of :attr:`chunks`), in the
        caller's transaction. What it leaves queued (settings given back)
        goes out with the next round trip: a commit carries it."""
        conn, plan, totals = self.conn, self.plan, self.totals
        planned = self.per_chunk[chunk]
        self._report("lock", self.written, len(self.chunks))
        # A pass touching a small part of the target is written through its
        # key index (nested loops), not by scanning the whole table: the
        # planner prices cached index probes too high, and in the lock window
        # a full scan of a 500k-row target per chunk costs ten times more.
        keyed = planning.keyed_pass(sum(planned.values()), self.target_rows)
        locked = lock_parents(conn, plan, chunk, self.wait_busy, keyed)
        self._report("rows", self.written, len(self.chunks))  # parents held: the rows next
        with keyed_plans(conn, keyed), index_bad(conn, plan, locked.bad):
            written = write_rows(conn, plan, chunk, locked, planned)
        # Row locks are held from the kept locking pass on (a wait for a busy
        # parent before it held none) to the end of the writes.
        held = time.perf_counter() - locked.since
        totals.lock_seconds += held
        totals.max_chunk = max(totals.max_chunk, held)
        totals.written += written
        totals.busy += locked.busy
        totals.dead += locked.dead
        totals.waits += locked.waits
        self.written += 1
        self._report("write", self.written, len(self.chunks))

    def exclude(
        self,
        chunk: int | None,
        scope: Sequence[str],
        keys: sql.Composable,
        params: Params = None,
    ) -> int:
        """Drop from ``chunk`` of the difference (before it is written) the
        rows whose ``scope`` values, as ``jsonb_build_array`` of them, are
        among what ``keys`` (a query) returns: rows that someone else has
        rewritten since the new rows were computed (flow: the keys a queue
        worker rewrote, ``docs/DESIGN.md``). Returns how many rows."""
        plan = self.plan
        values: list[sql.Composable] = []
        for column in scope:
            new = sql.Identifier("d", plan.new[column]) if column in plan.new else None
            old = sql.Identifier("d", plan.old[column]) if column in plan.old else None
            if new is None and old is None:
                raise ConfigError(
                    f"target {plan.target.label}: the workers' scope column {column!r} is not"
                    " among the new rows' columns"
                )
            if new is not None and old is not None and column not in plan.key:
                values.append(sql.SQL("coalesce({}, {})").format(new, old))
            else:
                values.append(new if new is not None else old)  # type: ignore[arg-type]
        # (the keys' count too: how many keys were left out, for the run record)
        statement = sql.SQL(
            "with e as materialized ({keys}), x as (delete from {d} as d where {chunk}"
            " and jsonb_build_array({values}) in (select * from e) returning op)"
            " select op::text, count(*) from x group by op"
            " union all select 'keys', count(*) from e"
        ).format(
            d=plan.difference,
            chunk=chunk_filter("d", chunk),
            values=sql.SQL(", ").join(values),
            keys=keys,
        )
        dropped = 0
        for op, n in run(self.conn, statement, params).all():
            if op == "keys":
                self.totals.excluded_keys = max(self.totals.excluded_keys, int(n))
                continue
            self.per_chunk[chunk][str(op)] -= int(n)
            dropped += int(n)
            if op != "d":  # a staged row, neither written nor unchanged
                self.totals.excluded_staged += int(n)
        if dropped:
            plan.needs = None
            plan.refill_needs = True
        self.totals.excluded += dropped
        return dropped

    def finish(self) -> WriteResult:
        """Drop the writer's own temp tables and say what the diff did."""
        plan, totals = self.plan, self.totals
        if plan.temps:
            later(
                self.conn,
                sql.SQL("drop table if exists {}").format(sql.SQL(", ").join(plan.temps)),
            )
        flush(self.conn)
        done, stats = totals.written, totals.written.stats
        unchanged = (
            plan.staged.rows
            - stats.inserted
            - stats.updated
            - stats.skipped_missing_parent
            - done.deferred
            - totals.excluded_staged
        )
        deferred = done.deferred + done.deferred_deletes
        if deferred:
            log.info(
                "pgjobs: %s: %d row(s) deferred to the next run (%d parent(s) busy)",
                plan.target.label,
                deferred,
                totals.busy,
            )
        counts = self.counts
        return WriteResult(
            stats=replace(stats, unchanged=unchanged),
            write_seconds=time.perf_counter() - self.started,
            lock_seconds=totals.lock_seconds,
            diff_seconds=self.diff_seconds,
            max_chunk_lock_seconds=totals.max_chunk,
            chunks=len(self.chunks),
            deferred=deferred,
            detail={
                "planned": {"insert": counts["i"], "update": counts["u"], "delete": counts["d"]},
                "parents_gone": totals.dead,
                "parents_busy": totals.busy,
                "busy_waits": totals.waits,
                "excluded": totals.excluded,
                "excluded_keys": totals.excluded_keys,
            },
        )


def _chunking(
    target: Target,
    staged: Staged,
    scope: Scope | None,
    chunk_parents: int | None,
    chunk_rows: int | None,
) -> Chunks | None:
    if chunk_parents is None and chunk_rows is None:
        return None
    if chunk_parents is not None and chunk_rows is not None:
        raise ConfigError("chunk_parents, chunk_rows: give one of them, not both")
    name, size = ("chunk_parents", chunk_parents) if chunk_parents else ("chunk_rows", chunk_rows)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{name}: expected a positive integer, got {size!r}")
    if not staged.preserve:
        raise ConfigError(f"{name}: stage the rows with preserve=True to write in chunks")
    if target.self_reference is not None:
        raise ConfigError(
            f"target {target.label}: chunked writes are not supported on a table that "
            f"references itself (a chunk could point at rows of a later one)"
        )
    if scope is not None and scope.target_filter is None:
        # a slice's (a key range) may: its keys table is read once, here
        raise ConfigError(f"{name}: a scoped diff is written in one transaction")
    return Chunks(size, by_rows=chunk_rows is not None)


def _chunk_counts(conn: Connection, plan: Plan) -> dict[int | None, dict[str, int]]:
    """Rows of the difference by op, per chunk."""
    per_chunk: dict[int | None, dict[str, int]] = {}
    query = sql.SQL("select chunk, op, count(*) from {} group by chunk, op").format(plan.difference)
    for chunk_no, op_code, n in run(conn, query).all():
        per_chunk.setdefault(int(chunk_no), {"i": 0, "u": 0, "d": 0})[str(op_code)] = int(n)
    return per_chunk


__all__ = ["DiffWriter", "Scope", "WriteResult", "write_diff"]
