"""The body of a sliced :class:`~pgjobs.RecomputeJob` (one with a ``scope``):
the run goes slice by slice, each slice its own short transaction.

A tick joins the job's run in progress, or starts one (:mod:`.progress`),
then takes slices until none is free: each claims the next free pieces
(consecutive, one key range), computes their keys' new rows
(:mod:`.compute`), diffs them against the target's rows of the same keys
(a scoped diff: the keys of the new rows and of the target's rows in the
range, so vanished keys are deleted) and writes them with the diff writer's
guarantees, flow's exclusion included, in chunks of about
:data:`WRITE_ROWS` rows, each its own transaction under the group's write
lock (``ctx.checkpoint``: the group's queue workers get in between), the
last one marking the pieces done; then the job's ``slice_pause``, outside
any transaction, before the next slice. The slice that does the run's last piece
records the run with the sums of every slice; a tick that finds the rest
taken by other processes ends ``busy``, saying that it joined. The
reasons: ``docs/DESIGN.md``, "Slices"; the figures: ``docs/slices.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import execute, later, send
from ..diff import DiffWriter, Scope, WriteResult
from ..errors import ConfigError
from ..flow import FlowPlan, WorkersChanged, prune_query
from ..jobs import Locks, RecomputeJob, RunContext
from ..locking import TRY_XACT_SQL, WAIT_XACT_SQL, lock_name, recompute_lock_name
from ..recompute import Prepared, RecomputeBody, _Flow, run_recompute
from ..results import DiffStats, Execution
from ..scoping import KeyRange, range_condition
from ..staging import Staged, check_coverage
from ..target import Target, describe, reflect_target
from .compute import SliceCompute
from .cut import MAX_PIECES, key_source
from .progress import Piece, Runs

log = logging.getLogger(__name__)

#: the keys a slice's diff covers (the scope's keys of its new rows and of
#: the target's rows in its range), dropped at the slice's commit
KEYS_TABLE = "pgjobs_slice_keys"
#: how much a slice may grow or shrink from one to the next
GROWTH = 4.0
#: a cron job's run starts over after this long without a slice (it has no interval)
CRON_FRESH = timedelta(days=1)
#: rows of a slice's difference written per transaction (whole parents, about
#: this many rows; at most the job's ``chunk_rows``): the group's write lock is
#: held for one such write and its commit, a few milliseconds, and the queue
#: workers of the group get in between two of them (a slice's whole write,
#: 40-260 ms here, made their keys wait as long: ``docs/slices.md``)
WRITE_ROWS = 500
#: with several processes, a slice takes at most this share of the pieces
#: left per process (1 / (SHARE * processes); 0: no bound)
SHARE = 2
#: before each write, how long a slice lets the group's queue workers go
#: first: it tries the write lock every millisecond for up to this long (a
#: try is not queued, so a worker's next tick does not wait behind it; a
#: waiting request would hold it back for one whole write), then waits in
#: line (and the workers step aside for it)
WRITE_YIELD = 0.02

_told_pooled: set[str] = set()


class SlicedBody(RecomputeBody):
    """How the runner runs a sliced :class:`~pgjobs.RecomputeJob`: as a
    recompute (the same work check, prefetch and next run), with the group's
    recompute lock shared and slices in place of one snapshot."""

    def locks(self, job: RecomputeJob, ctx: RunContext) -> Locks:
        return Locks.RECOMPUTE_SHARED

    def chunked(self, job: RecomputeJob, ctx: RunContext) -> bool:
        return True

    def execute(
        self, conn: Connection, job: RecomputeJob, ctx: RunContext, prefetched: Prepared
    ) -> Execution:
        if ctx.checkpoint is None:
            # behind a transaction pooler: no commit part-way, one snapshot
            if job.name not in _told_pooled:
                _told_pooled.add(job.name)
                log.warning(
                    "pgjobs: %s: runs unsliced: it cannot commit slice by slice here", job.name
                )
            return run_recompute(conn, job, ctx, prefetched)
        try:
            return run_sliced(conn, job, ctx, prefetched)
        except WorkersChanged as exc:
            log.warning("pgjobs: %s: gives up this tick and tries again: %s", job.name, exc)
            return Execution(busy=True, detail={"flow": "changed", "flow_reason": str(exc)})


SLICED = SlicedBody()


def check_scope(job: RecomputeJob, target: Target) -> None:
    """The scope's columns are the target's (a clear error otherwise)."""
    missing = [c for c in job.scope if c not in target.types and c not in target.key]
    if missing:
        raise ConfigError(
            f"RecomputeJob {job.name!r}: scope: {target.label} has no column(s)"
            f" {', '.join(missing)}, got {list(job.scope)!r}"
        )
    if target.self_reference is not None:
        raise ConfigError(
            f"RecomputeJob {job.name!r}: scope: {target.label} references itself, and a slice"
            " could write rows that point at another slice's: set sliced = false"
        )


def fresh_for(job: RecomputeJob) -> timedelta:
    """How long a run may go without a slice and still be resumed: the job's
    interval (a day for a cron job). An older run starts over: its slices
    saw the sources too long ago to be joined with new ones."""
    return job.interval or CRON_FRESH


def run_sliced(
    conn: Connection, job: RecomputeJob, ctx: RunContext, prepared: Prepared
) -> Execution:
    """The sliced run (module docstring), inside the tick's transaction;
    ``ctx.checkpoint`` commits each slice."""
    assert ctx.checkpoint is not None
    target = reflect_target(
        conn, job.target, key=job.key, parents=job.parents, prefetched=prepared.fingerprint
    )
    check_scope(job, target)
    source = key_source(target, job.scope)
    compute = SliceCompute(conn, job, target, source)
    report = compute.check(conn)  # refuses a slice that would compute every key
    runs = Runs(conn, ctx.schema, job.name, job.group or job.name, ctx.worker)
    group = job.group or job.name
    run = runs.join_or_start(
        source, job.scope, fresh_for(job), recompute_lock_name(ctx.namespace, group)
    )
    if run is None:
        return Execution(busy=True, detail={"sliced": "another job of the group runs sliced"})
    ctx.checkpoint()  # the run's pieces committed: other processes may join it
    plan = prepared.plan
    write_lock = lock_name(ctx.namespace, job.group or job.name)
    count, mine, rows_mine, written = 1, 0, 0, 0
    ctx.report("slices", run.done, run.pieces)
    while True:
        started = time.perf_counter()
        pieces = runs.claim(run.id, count)
        if not pieces:
            # the pieces left are other processes' slices under way: theirs
            # is the run's end, and its record
            if mine:
                log.info(
                    "pgjobs: %s: joined its sliced run: %d slice(s) and %d new row(s) here;"
                    " the process doing the last one records the run",
                    job.name,
                    mine,
                    rows_mine,
                )
            joined = {"joined": True, "slices_here": mine, "rows_here": rows_mine}
            return Execution(busy=True, detail={"sliced": joined})
        how = KeyRange(low=pieces[0].low, high=pieces[-1].high)
        committed: dict[str, int] = {}  # what the slice's chunks added to the run
        done_slice = _slice(
            conn,
            job,
            ctx,
            target,
            plan,
            compute,
            how,
            write_lock,
            between=partial(_between, runs, run.id, pieces, committed),
        )
        seconds = time.perf_counter() - started
        stats = done_slice.result.stats
        sums = {
            # (what the slice's chunks committed before is in the run already)
            "inserted": stats.inserted - committed.get("inserted", 0),
            "updated": stats.updated - committed.get("updated", 0),
            "deleted": stats.deleted - committed.get("deleted", 0),
            "skipped": stats.skipped_missing_parent - committed.get("skipped", 0),
            "unchanged": stats.unchanged,
            "excluded": int(done_slice.result.detail.get("excluded", 0)),
            "deferred": done_slice.result.deferred,
            "compute_seconds": done_slice.compute_seconds,
            "write_seconds": done_slice.result.write_seconds,
            "lock_seconds": done_slice.result.lock_seconds,
        }
        done, total = runs.done(run.id, pieces, done_slice.staged.rows, seconds, sums)
        if done_slice.flow is not None and (done >= total or runs.processes == 1):
            # The marks the slice's S0 covers, with its commit: only when no
            # other slice of the run, whose S0 may be older and need them, is
            # under way (a slice that starts later takes a later S0)
            done_slice.flow.prune()
        mine += 1
        rows_mine += done_slice.staged.rows
        written += stats.inserted + stats.updated + stats.deleted
        ctx.report("slice-rows", written, None)
        if done >= total:
            ctx.report("slices", done, total)
            return _finished(runs, run.id, target, plan, report, mine)
        count = _next_count(count, seconds, job.slice_target, done_slice, job.chunk_rows)
        if SHARE and runs.processes > 1:
            # shared: slices shrink towards the run's end, so that the
            # processes end together, not one alone for a whole slice
            count = max(1, min(count, (total - done) // (SHARE * runs.processes)))
        # committed; then the pause, outside any transaction (slice_pause)
        ctx.checkpoint(rest=job.slice_pause * seconds)
        ctx.report("slices", done, total)


def _between(
    runs: Runs, run_id: int, pieces: list[Piece], committed: dict[str, int], stats: DiffStats
) -> None:
    """Before a commit inside a slice: its pieces kept its own (the first
    time), and the rows its chunks wrote since the last one added to the run
    (``stats``: the slice's so far; ``committed``: what is added already),
    so that a slice failing later leaves the run's sums true."""
    if not committed:
        runs.hold(run_id, pieces)
    now = {
        "inserted": stats.inserted,
        "updated": stats.updated,
        "deleted": stats.deleted,
        "skipped": stats.skipped_missing_parent,
    }
    runs.add(run_id, {k: v - committed.get(k, 0) for k, v in now.items()})
    committed.update(now)


class _Done:
    __slots__ = ("chunked", "compute_seconds", "flow", "result", "staged")

    def __init__(
        self,
        staged: Staged,
        result: WriteResult,
        compute_seconds: float,
        flow: _Flow | None,
        chunked: bool,
    ) -> None:
        self.staged, self.result, self.compute_seconds = staged, result, compute_seconds
        self.flow, self.chunked = flow, chunked


def _slice(
    conn: Connection,
    job: RecomputeJob,
    ctx: RunContext,
    target: Target,
    plan: FlowPlan,
    compute: SliceCompute,
    how: KeyRange,
    write_lock: str,
    *,
    between: Callable[[DiffStats], None],
) -> _Done:
    """One slice: its snapshot (with flow, S0), the new rows of its keys and
    the scoped diff, in the caller's transaction; then the writes, in
    chunks of about :data:`WRITE_ROWS` rows, each under the group's write
    lock to its commit (``ctx.checkpoint``), the last one left open for the
    caller's commit. ``between`` is called before each of those commits
    with what the slice wrote so far (:func:`_between`). Without flow but
    with queue workers of the target, one transaction and the write lock
    from its start: a worker's write between the compute and the writes
    would be overwritten."""
    checkpoint = ctx.checkpoint
    assert checkpoint is not None
    flow = None
    chunked = plan.flows or plan.state == "no workers"
    if plan.flows:
        flow = _Flow.start(conn, job, ctx, target, plan)
        # the records no recompute will read again (as an unsliced run does)
        ctx.before_commit.append(prune_query(ctx.schema, target.label))
    elif not chunked:
        later(conn, WAIT_XACT_SQL, (write_lock,))
    started = time.perf_counter()
    staged, _ = compute.stage(conn, how, preserve=chunked)
    check_coverage(target, staged.columns, job.columns, "the new rows")
    keys = keys_table(conn, target, job.scope, staged, how)
    compute_seconds = time.perf_counter() - started
    scope = Scope(
        columns=job.scope,
        keys=sql.Identifier(KEYS_TABLE),
        rows=keys,
        target_filter=target_range(job.scope, how),
    )
    rows = min(WRITE_ROWS, job.chunk_rows) if chunked else None
    with DiffWriter(conn, target, staged, scope=scope, chunk_rows=rows) as writer:
        for n, chunk in enumerate(writer.chunks):
            if n:
                between(writer.totals.written.stats)
                checkpoint()  # the chunk so far, and the write lock given back
            if chunked:
                # the write lock for this write (with flow, its exclusion
                # takes it again: granted at once); no queue worker of the
                # target is known otherwise, and another job of the group
                # may hold it
                write_lock_now(conn, write_lock)
            if flow is not None:
                flow.exclude(writer, chunk)
            writer.write_chunk(chunk)
        result = writer.finish()
    if chunked:
        later(conn, sql.SQL("drop table if exists {}").format(staged.table))
    return _Done(staged, result, compute_seconds, flow, chunked)


def write_lock_now(conn: Connection, write_lock: str) -> None:
    """The group's write lock, exclusively, to the transaction's end: tried
    for up to :data:`WRITE_YIELD`, then waited for (under ``lock_timeout``)."""
    deadline = time.monotonic() + WRITE_YIELD
    while True:
        (tried,) = send(conn, (TRY_XACT_SQL, (write_lock,)))
        if tried.scalar():
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    send(conn, (WAIT_XACT_SQL, (write_lock,)))


def target_range(scope: tuple[str, ...], how: KeyRange) -> sql.Composable:
    """The slice's key range on the target's columns, its values inlined."""
    where, _ = range_condition([sql.Identifier(c) for c in scope], how, literal=True)
    return where


def keys_table(
    conn: Connection, target: Target, scope: tuple[str, ...], staged: Staged, how: KeyRange
) -> int:
    """The slice's keys: those of its new rows in its range (a new row
    outside it fails the slice, naming it: a keyed compute's rows must be
    its keys'); their count. The target's rows are read by the range itself
    (:func:`target_range`), so a key whose new rows vanished is deleted."""
    cols = sql.SQL(", ").join(map(sql.Identifier, scope))
    where, params = range_condition([sql.Identifier(c) for c in scope], how)
    made = execute(
        conn,
        sql.SQL(
            "create temp table {k} on commit drop as select distinct {cols} from {s} where {where}"
        ).format(k=sql.Identifier(KEYS_TABLE), cols=cols, s=staged.table, where=where),
        params,
    )
    return max(made.rowcount, 0)


def _next_count(count: int, seconds: float, target: float, done: _Done, chunk_rows: int) -> int:
    """The next slice's pieces: about ``target`` seconds at this slice's pace,
    within a factor :data:`GROWTH` of this one; and, for a slice written in
    one transaction, no larger than makes a difference of about
    ``chunk_rows`` rows (the chunk bound of an unsliced run: how long a
    user's delete may wait for a slice's row locks). A slice written in
    chunks has that bound chunk by chunk."""
    pace = target / max(seconds, 1e-3)
    wanted = count * min(GROWTH, max(1 / GROWTH, pace))
    planned = sum(done.result.detail.get("planned", {}).values())
    if not done.chunked and planned > chunk_rows:
        wanted = min(wanted, count * chunk_rows / planned)
    return max(1, min(MAX_PIECES, int(wanted)))


def _finished(
    runs: Runs,
    run_id: int,
    target: Target,
    plan: FlowPlan,
    report: Any,
    mine: int,
) -> Execution:
    """The run's last slice: the sums of every slice, for its record."""
    summary = runs.finish(run_id)
    stats = DiffStats(
        inserted=int(summary["inserted"]),
        updated=int(summary["updated"]),
        deleted=int(summary["deleted"]),
        skipped_missing_parent=int(summary["skipped"]),
        unchanged=int(summary["unchanged"]),
    )
    sliced = {
        "slices": summary["slices"],
        "pieces": summary["pieces"],
        "processes": summary["processes"],
        "resumed": summary["resumed"],
        "slices_here": mine,
        "run_started_at": summary["started_at"].isoformat(),
    }
    detail: dict[str, Any] = {
        "target": describe(target),
        "flow": plan.state,
        "sliced": sliced,
        "excluded": int(summary["excluded"]),
        "deferred": int(summary["deferred"]),
    }
    if report is not None and report.warnings:
        detail["plan_warnings"] = list(report.warnings)
    return Execution(
        stats=stats,
        compute_seconds=float(summary["compute_seconds"]),
        write_seconds=float(summary["write_seconds"]),
        lock_seconds=float(summary["lock_seconds"]),
        detail=detail,
    )


__all__ = [
    "KEYS_TABLE",
    "SLICED",
    "SlicedBody",
    "check_scope",
    "fresh_for",
    "keys_table",
    "run_sliced",
    "target_range",
    "write_lock_now",
]
