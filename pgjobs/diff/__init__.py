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
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import flush, later
from ..errors import ConfigError
from ..results import DiffStats
from ..staging import Staged
from ..target import Target
from . import plan as planning
from .difference import build_difference
from .parents import create_parent_tables, index_bad, lock_parents
from .plan import Plan, Scope, keyed_plans, run
from .rows import write_rows

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

    plan = Plan(target, staged, scope, preserve=chunk_parents is not None)
    try:
        result = _write(conn, plan, chunk_parents, checkpoint, report, wait_busy, started)
    except BaseException:
        # what was deferred (planner settings given back, a savepoint
        # released) still runs if the transaction can run it
        with suppress(psycopg.Error):
            flush(conn)
        raise
    flush(conn)
    return result


def _write(
    conn: Connection,
    plan: Plan,
    chunk_parents: int | None,
    checkpoint: Callable[[], None] | None,
    report: Progress,
    wait_busy: bool,
    started: float,
) -> WriteResult:
    target, staged = plan.target, plan.staged
    report("diff", None, None)
    counts, target_rows = build_difference(conn, plan, chunk_parents)
    create_parent_tables(conn, plan)
    per_chunk: dict[int | None, dict[str, int]] = {}
    if chunk_parents:
        for chunk_no, op_code, n in run(
            conn,
            sql.SQL("select chunk, op, count(*) from {} group by chunk, op").format(
                plan.difference
            ),
        ).all():
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
        keyed = planning.keyed_pass(sum(per_chunk[chunk].values()), target_rows)
        locked = lock_parents(conn, plan, chunk, wait_busy, keyed)
        with keyed_plans(conn, keyed), index_bad(conn, plan, locked.bad):
            written = write_rows(conn, plan, chunk, locked, per_chunk[chunk])
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
            flush(conn)
            checkpoint()

    if plan.temps:
        later(conn, sql.SQL("drop table if exists {}").format(sql.SQL(", ").join(plan.temps)))
    flush(conn)
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


__all__ = ["Scope", "WriteResult", "write_diff"]
