"""Drift: what a recompute would write, seen without writing anything.

:func:`check_on` runs a job's compute, stages the new rows and takes the
difference against the target exactly as a recompute does
(:mod:`pgjobs.staging`, :mod:`pgjobs.diff`), then stops before the diff
writer's step 2: no parent is locked ``FOR KEY SHARE``, no row of the target
is written, no advisory lock is taken, and the transaction is rolled back.
A parent that is gone is found by a plain read instead of the lock, so a
user's delete never waits for a check (it takes no lock a delete needs).

What it reports is the :class:`~pgjobs.DiffStats` a recompute would write
now, with a sample of keys for each kind of change. Rows of items that are
queued (or claimed by a worker right now: a claimed entry stays in the queue
until its worker commits) are counted apart, in :attr:`CheckResult.on_the_way`:
a worker is about to write them, they are not drift. For a queue job,
``keys`` limits the check to those items (a scoped difference, as a worker
takes it). A sliced recompute (``docs/slices.md``) is checked slice by
slice, each slice in a short transaction of its own, and the slices that
drifted are named by their key ranges.

Why not a read-only transaction: PostgreSQL (15, 16 and 18, tried here)
refuses ``CREATE TEMP TABLE`` in a ``transaction_read_only`` transaction,
though it allows writing temp tables that exist; staging and the difference
create theirs. So the check's transaction is read-write, always rolled
back, and before the rollback it reads ``pg_locks`` for itself: a lock
stronger than ``AccessShareLock`` on any table that is not a temp table or
a catalog (a write, or a row lock: ``FOR KEY SHARE`` takes ``RowShareLock``),
or any advisory lock, fails the check. That covers a compute that writes,
too. ``docs/drift.md`` is the user's page; ``docs/DESIGN.md``, "Drift", the
reasons.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection, Engine

from ._pg import connection_lost, driver, first_line, send, set_local, sqlstate_of
from .deadline import DEFAULT_CALL_TIMEOUT, bound_for_use, bounded
from .diff.difference import build_difference
from .diff.plan import Plan, Scope, equal, idents, not_null
from .errors import ConfigError, JobError
from .jobs import Job, QueueJob, RecomputeJob
from .queue import key_json, queue_table
from .records import tick_bound
from .results import DiffStats, Outcome, RunResult
from .scoping import KeyRange
from .slices.body import KEYS_TABLE as SLICE_KEYS
from .slices.body import check_scope, keys_table, target_range
from .slices.compute import SliceCompute
from .slices.cut import Bound, cut, key_source
from .staging import Staged, check_coverage, stage
from .store import Store
from .target import Target, reflect_target
from .worker.statements import KEYS_TABLE

log = logging.getLogger(__name__)

#: keys sampled for each kind of change, by default
SAMPLE = 5
#: the kinds of change, as :class:`~pgjobs.DiffStats` names them; and the rows
#: of items on their way
KINDS = ("inserted", "updated", "deleted", "skipped_missing_parent")
ON_THE_WAY = "on_the_way"


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One row of a kind of change: its diff key, and its values as the
    target holds them (``old``) and as a recompute would write them
    (``new``); ``None`` where there is no such row. ``changed``: for an
    update, the columns whose values differ."""

    key: Mapping[str, Any]
    old: Mapping[str, Any] | None = None
    new: Mapping[str, Any] | None = None
    changed: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": dict(self.key)}
        if self.old is not None:
            out["old"] = dict(self.old)
        if self.new is not None:
            out["new"] = dict(self.new)
        if self.changed:
            out["changed"] = list(self.changed)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """What :func:`pgjobs.check` found: what a recompute (or, with ``keys``,
    a worker's scoped diff) would write now, and nothing was written.

    ``stats`` is drift: rows a recompute would insert, update or delete, and
    the rows it would skip because their parent is gone; ``unchanged`` the
    new rows the target already holds. ``on_the_way`` counts, apart, the
    rows of items that are queued or in flight (a worker writes them next).
    ``samples`` holds, per kind (:data:`KINDS`, and ``"on_the_way"``), the
    first rows in key order.

    >>> result = pgjobs.check("exam-scores", "postgresql://localhost/app")
    >>> result.drift, result.inserted, [s.key for s in result.samples["inserted"]]
    """

    job: str
    target: str
    stats: DiffStats
    on_the_way: DiffStats = field(default_factory=DiffStats)
    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    started_at: datetime
    finished_at: datetime
    compute_seconds: float = 0.0
    diff_seconds: float = 0.0
    staged_rows: int = 0
    #: the items checked (a queue job's ``keys``); ``None``: the whole target
    keys: tuple[tuple[Any, ...], ...] | None = None
    #: a sliced job's check (``docs/slices.md``), one short transaction a
    #: slice: how many slices, and the key range and figures of each slice
    #: that drifted (``low`` included, ``high`` excluded, as text; ``None``:
    #: open)
    slices: int | None = None
    drifted: tuple[dict[str, Any], ...] = ()

    @property
    def inserted(self) -> int:
        return self.stats.inserted

    @property
    def updated(self) -> int:
        return self.stats.updated

    @property
    def deleted(self) -> int:
        return self.stats.deleted

    @property
    def skipped_missing_parent(self) -> int:
        return self.stats.skipped_missing_parent

    @property
    def unchanged(self) -> int:
        return self.stats.unchanged

    @property
    def drift(self) -> bool:
        """A recompute would write something: rows inserted, updated or
        deleted (skipped rows are not in the target, and stay out)."""
        return self.stats.changed > 0

    @property
    def seconds(self) -> float:
        return (self.finished_at - self.started_at).total_seconds()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the figures at the top level, with ``job``."""
        s, w = self.stats, self.on_the_way
        return {
            "job": self.job,
            "target": self.target,
            "drift": self.drift,
            "inserted": s.inserted,
            "updated": s.updated,
            "deleted": s.deleted,
            "skipped_missing_parent": s.skipped_missing_parent,
            "unchanged": s.unchanged,
            "on_the_way": {
                "inserted": w.inserted,
                "updated": w.updated,
                "deleted": w.deleted,
                "skipped_missing_parent": w.skipped_missing_parent,
            },
            "samples": {k: [x.as_dict() for x in v] for k, v in self.samples.items()},
            "keys": None if self.keys is None else [list(k) for k in self.keys],
            "slices": self.slices,
            "drifted_slices": list(self.drifted),
            "staged_rows": self.staged_rows,
            "started_at": self.started_at.isoformat(),
            "seconds": round(self.seconds, 6),
            "compute_seconds": round(self.compute_seconds, 6),
            "diff_seconds": round(self.diff_seconds, 6),
        }

    def headline(self) -> str:
        """One line: the job, whether it drifted, and what a recompute (or,
        for a queue job's items, a run of those items) would write."""
        s = self.stats
        scope = f" ({len(self.keys)} item(s))" if self.keys is not None else ""
        # A queue job's check is its scoped diff: no recompute is involved.
        writer = "a recompute" if self.keys is None else "a run of these items"
        figures = (
            f"insert {s.inserted:,}, update {s.updated:,}, delete {s.deleted:,},"
            f" skip {s.skipped_missing_parent:,} (parent gone); unchanged {s.unchanged:,}"
        )
        head = "drift" if self.drift else "no drift"
        if self.slices is not None:
            scope = f" ({len(self.drifted)} of {self.slices} slices drifted)"
        return f"{self.job}{scope}: {head}: {writer} would {figures} [{self.seconds:.2f}s]"

    def run_result(self, *, error: str | None = None) -> RunResult:
        """This check as a run record (outcome ``checked``), its samples in
        ``detail["check"]`` as JSON would carry them."""
        detail = json.loads(json.dumps(self.as_dict(), default=str))
        return RunResult(
            job=self.job,
            outcome=Outcome.CHECKED,
            started_at=self.started_at,
            finished_at=self.finished_at,
            stats=self.stats,
            compute_seconds=self.compute_seconds,
            write_seconds=self.diff_seconds,
            error=error,
            detail={"check": detail},
        )


def check_on(
    conn: Connection,
    job: Job,
    *,
    keys: Sequence[Any] | None = None,
    sample: int = SAMPLE,
    workers: Iterable[QueueJob] = (),
    schema: str = "pgjobs",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> CheckResult:
    """Check ``job`` on ``conn`` (not in a transaction); see the module
    docstring. ``keys``: a queue job's items (scalars for a one-column
    scope, tuples for a composite one); required for a queue job, refused
    for a recompute. ``workers``: the queue jobs whose queued items are on
    their way to this target (a queue job checked by keys counts its own).
    Each round trip has the deadline of the job's ticks (``tick_bound``:
    its ``lock_timeout`` + ``statement_timeout`` + ``call_timeout``), not
    the bookkeeping bound the connection came with: the compute may take
    as long as the job's own ticks; the connection's bound afterwards."""
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        raise ConfigError(f"sample: expected a count of keys (0 or more), got {sample!r}")
    if isinstance(job, QueueJob):
        if not keys:
            raise ConfigError(f"{job.name}: a queue job is checked for some items: give keys")
        if job.claim is not None:
            raise ConfigError(f"{job.name}: a queue of the plugin's own: its items are unknown")
        workers = [job]
    elif isinstance(job, RecomputeJob):
        if keys:
            raise ConfigError(f"{job.name}: keys are for a queue job; a recompute checks it all")
    else:
        raise ConfigError(f"{job.name}: a {job.kind} job has no derived table to check")
    started = datetime.now(UTC)
    if isinstance(job, RecomputeJob) and job.slices:
        with bounded(conn, tick_bound(job, call_timeout)):
            return _check_sliced(conn, job, sample, list(workers), schema, started)
    with bounded(conn, tick_bound(job, call_timeout)), conn.begin() as trans:
        try:
            return _Check(conn, job, sample, list(workers), schema).run(keys, started)
        finally:
            trans.rollback()


def _check_sliced(
    conn: Connection,
    job: RecomputeJob,
    sample: int,
    workers: list[QueueJob],
    schema: str,
    started: datetime,
) -> CheckResult:
    """A sliced job's check, slice by slice as its runs go (``docs/slices.md``):
    the key space cut in a first short transaction (with the plan check),
    then each slice's check in a transaction of its own, rolled back, its
    size adapted to ``slice_seconds``, the job's ``slice_pause`` between
    them. No snapshot is held across slices,
    so the figures add up instants, as a sliced run does."""
    with conn.begin() as trans:
        try:
            send(conn, set_local(_settings(job)))
            target = reflect_target(conn, job.target, key=job.key, parents=job.parents)
            check_scope(job, target)
            source = key_source(target, job.scope)
            compute = SliceCompute(conn, job, target, source)
            compute.check(conn)
            bounds = cut(conn, source)
        finally:
            trans.rollback()
    edges: list[Bound | None] = [None, *bounds, None]
    totals, on_the_way = DiffStats(), DiffStats()
    samples: dict[str, tuple[Sample, ...]] = {}
    drifted: list[dict[str, Any]] = []
    compute_seconds = diff_seconds = 0.0
    staged_rows = slices = 0
    first, count = 0, 1
    while first < len(edges) - 1:
        last = min(first + count, len(edges) - 1)
        how = KeyRange(low=edges[first], high=edges[last])
        clock = time.perf_counter()
        with conn.begin() as trans:
            try:
                one = _Check(conn, job, sample, workers, schema).run_slice(
                    compute, target, how, started
                )
            finally:
                trans.rollback()
        seconds = time.perf_counter() - clock
        slices += 1
        totals, on_the_way = totals + one.stats, on_the_way + one.on_the_way
        compute_seconds += one.compute_seconds
        diff_seconds += one.diff_seconds
        staged_rows += one.staged_rows
        for kind, found in one.samples.items():
            samples[kind] = (samples.get(kind, ()) + found)[:sample]
        if one.drift:
            drifted.append(
                {
                    "low": None if how.low is None else list(how.low),
                    "high": None if how.high is None else list(how.high),
                    "inserted": one.inserted,
                    "updated": one.updated,
                    "deleted": one.deleted,
                }
            )
        pace = job.slice_target / max(seconds, 1e-3)
        first, count = last, max(1, int(count * min(4.0, max(0.25, pace))))
        if job.slice_pause and first < len(edges) - 1:
            time.sleep(job.slice_pause * seconds)  # as a run's slices rest (no transaction open)
    return CheckResult(
        job=job.name,
        target=target.label,
        stats=totals,
        on_the_way=on_the_way,
        samples=samples,
        started_at=started,
        finished_at=datetime.now(UTC),
        compute_seconds=compute_seconds,
        diff_seconds=diff_seconds,
        staged_rows=staged_rows,
        slices=slices,
        drifted=tuple(drifted),
    )


def _settings(job: Job) -> dict[str, str]:
    values = {}
    for name in ("lock_timeout", "statement_timeout"):
        value = getattr(job, name)
        assert isinstance(value, timedelta)
        values[name] = f"{int(value.total_seconds() * 1000)}ms"
    values["client_connection_check_interval"] = "1000ms"
    return values


#: the check's first statement: its snapshot (S0), and whether the queue is installed
_START = "select pg_current_snapshot()::text, to_regclass(%s) is not null"


class _Check:
    """One check, inside its transaction (rolled back by the caller)."""

    def __init__(
        self,
        conn: Connection,
        job: RecomputeJob | QueueJob,
        sample: int,
        workers: list[QueueJob],
        schema: str,
    ) -> None:
        self.conn, self.job, self.sample, self.schema = conn, job, sample, schema
        self.workers = [w for w in workers if w.claim is None]
        #: the check's snapshot at its start, as text
        self.s0 = ""

    def _start(self) -> None:
        """S0: what a worker committed after it, the check's compute may not
        have seen (flow's marks say which keys); and whether pgjobs' tables
        are there at all (a check needs none of them)."""
        conn = self.conn
        _, first = send(
            conn,
            set_local(_settings(self.job)),
            (_START, (queue_table(self.schema).as_string(driver(conn)),)),
        )
        row = first.one()
        assert row is not None
        self.s0 = str(row[0])
        if not row[1]:
            self.workers = []

    def _classify(
        self, plan: Plan, counts: Mapping[str, int], staged: Staged
    ) -> tuple[DiffStats, DiffStats, dict[str, tuple[Sample, ...]]]:
        """The difference's figures, the rows of queued items apart, and the
        samples where there is something to show."""
        found = _Classified(self, plan)
        stats, on_the_way = found.counts(counts, staged)
        busy = stats.changed + stats.skipped_missing_parent + on_the_way.changed
        return stats, on_the_way, found.samples() if self.sample and busy else {}

    def run(self, keys: Sequence[Any] | None, started: datetime) -> CheckResult:
        conn, job = self.conn, self.job
        # S0: what a worker committed after it, the check's compute may not
        # have seen (flow's marks say which keys); and whether pgjobs' tables
        # are there at all (a check needs none of them)
        self._start()
        target = reflect_target(conn, job.target, key=job.key, parents=job.parents)
        clock = time.perf_counter()
        scope: Scope | None = None
        typed: tuple[tuple[Any, ...], ...] | None = None
        if isinstance(job, QueueJob):
            assert keys is not None
            typed, scope = self._keys(target, job, keys)
            params = {"keys": [k[0] for k in typed]}
            for n, column in enumerate(job.scope):
                params[f"keys_{column}"] = [k[n] for k in typed]
            compute = job.compute
            source = compute if isinstance(compute, str) else compute(conn, list(typed))
            staged = stage(conn, target, source, params=params)
        else:
            source = job.compute if isinstance(job.compute, str) else job.compute(conn)
            staged = stage(conn, target, source)
        check_coverage(target, staged.columns, job.columns, "the new rows")
        compute_seconds = time.perf_counter() - clock
        clock = time.perf_counter()
        plan = Plan(target, staged, scope, preserve=False)
        counts, _ = build_difference(conn, plan, None)
        stats, on_the_way, samples = self._classify(plan, counts, staged)
        diff_seconds = time.perf_counter() - clock
        _audit(conn, job.name)
        return CheckResult(
            job=job.name,
            target=target.label,
            stats=stats,
            on_the_way=on_the_way,
            samples=samples,
            started_at=started,
            finished_at=datetime.now(UTC),
            compute_seconds=compute_seconds,
            diff_seconds=diff_seconds,
            staged_rows=staged.rows,
            keys=typed,
        )

    def run_slice(
        self, compute: SliceCompute, target: Target, how: KeyRange, started: datetime
    ) -> CheckResult:
        """One slice of a sliced job's check, in the caller's transaction:
        the slice's new rows, and the difference scoped to its keys."""
        conn, job = self.conn, self.job
        self._start()
        clock = time.perf_counter()
        staged, _ = compute.stage(conn, how)
        check_coverage(target, staged.columns, job.columns, "the new rows")
        keys = keys_table(conn, target, compute.scope, staged, how)
        compute_seconds = time.perf_counter() - clock
        clock = time.perf_counter()
        scope = Scope(
            columns=compute.scope,
            keys=sql.Identifier(SLICE_KEYS),
            rows=keys,
            target_filter=target_range(compute.scope, how),
        )
        plan = Plan(target, staged, scope, preserve=False)
        counts, _ = build_difference(conn, plan, None)
        stats, on_the_way, samples = self._classify(plan, counts, staged)
        _audit(conn, job.name)
        return CheckResult(
            job=job.name,
            target=target.label,
            stats=stats,
            on_the_way=on_the_way,
            samples=samples,
            started_at=started,
            finished_at=datetime.now(UTC),
            compute_seconds=compute_seconds,
            diff_seconds=time.perf_counter() - clock,
            staged_rows=staged.rows,
        )

    def _keys(
        self, target: Target, job: QueueJob, keys: Sequence[Any]
    ) -> tuple[tuple[tuple[Any, ...], ...], Scope]:
        """The items into ``pgjobs_keys`` (the table a worker's compute may
        join), typed like the target's scope columns; the keys as loaded."""
        missing = [c for c in job.scope if c not in target.types]
        if missing:
            raise ConfigError(f"{job.name}: scope: {target.label} has no column(s) {missing}")
        items = [key_json(k, len(job.scope)) for k in keys]
        table, cols = sql.Identifier(KEYS_TABLE), idents(job.scope)
        typed = sql.SQL("jsonb_populate_record(null::pg_temp.{}, jsonb_build_object({}))").format(
            table,
            sql.SQL(", ").join(
                sql.SQL("{}, i.item::jsonb -> {}").format(sql.Literal(c), sql.Literal(n))
                for n, c in enumerate(job.scope)
            ),
        )
        _, _, loaded = send(
            self.conn,
            (sql.SQL("drop table if exists pg_temp.{}").format(table), None),
            (
                sql.SQL(
                    "create temp table {t} on commit drop as select {cols} from {target}"
                    " with no data"
                ).format(t=table, cols=cols, target=target.ident),
                None,
            ),
            (
                sql.SQL(
                    "insert into pg_temp.{t} ({cols}) select distinct t.* from"
                    " unnest(%s::text[]) as i(item), lateral {typed} as t returning {cols}"
                ).format(t=table, cols=cols, typed=typed),
                (items,),
            ),
        )
        rows = tuple(sorted((tuple(r) for r in loaded.all()), key=repr))
        return rows, Scope(columns=job.scope, keys=table, rows=len(rows))


class _Classified:
    """The rows of the difference by kind: what a recompute would do with
    each (insert, update, delete, skip for a gone parent), and whether its
    item is on its way (queued or in flight)."""

    def __init__(self, check: _Check, plan: Plan) -> None:
        self.check, self.plan, self.conn = check, plan, check.conn
        key = plan.difference_key
        dead: list[sql.Composable] = []
        for p in plan.parents:
            new = [plan.new[c] for c in p.columns]
            # a plain read where the writer locks FOR KEY SHARE: gone is gone
            dead.append(
                sql.SQL("({nn} and not exists (select from {parent} as p where {on}))").format(
                    nn=not_null("d", new),
                    parent=p.ident,
                    on=equal("p", p.parent_columns, "d", new),
                )
            )
        gone = (
            sql.SQL("(d.op <> 'd' and ({}))").format(sql.SQL(" or ").join(dead))
            if dead
            else sql.SQL("false")
        )
        self.ctes, onway = self._on_the_way(plan)
        # present: a row planned as an update whose new parent is gone; a
        # recompute deletes the target's row (when it is still there)
        self.ctes.append(
            sql.SQL(
                "x as (select d.*, case when {gone} then 'skipped_missing_parent'"
                " when d.op = 'i' then 'inserted' when d.op = 'u' then 'updated'"
                " else 'deleted' end as pgjobs_kind, {onway} as pgjobs_onway,"
                " (d.op = 'u' and {gone} and exists (select from {t} as t where {same}))"
                " as pgjobs_present from {d} as d)"
            ).format(
                gone=gone,
                onway=onway,
                t=plan.target.ident,
                same=equal("t", plan.key, "d", key),
                d=plan.difference,
            )
        )

    def _on_the_way(self, plan: Plan) -> tuple[list[sql.Composable], sql.Composable]:
        """CTEs of the queued items of each worker (typed like the target's
        columns), and the test that a row of the difference is one of them,
        or of an item a worker rewrote since the check began."""
        ctes: list[sql.Composable] = []
        tests: list[sql.Composable] = []
        queue = queue_table(self.check.schema)
        for n, worker in enumerate(self.check.workers):
            if not all(c in plan.new or c in plan.old for c in worker.scope):
                continue
            name = sql.Identifier(f"pgjobs_w{n}")
            ctes.append(
                sql.SQL(
                    "{name} as materialized (select {cols} from {q} as q, lateral"
                    " jsonb_populate_record(null::{t}, jsonb_build_object({obj})) as r"
                    " where q.job = {job} and q.dead_at is null)"
                ).format(
                    name=name,
                    cols=idents(worker.scope, "r"),
                    q=queue,
                    t=plan.target.ident,
                    obj=sql.SQL(", ").join(
                        sql.SQL("{}, q.key -> {}").format(sql.Literal(c), sql.Literal(i))
                        for i, c in enumerate(worker.scope)
                    ),
                    job=sql.Literal(worker.name),
                )
            )
            values = sql.SQL(", ").join(_scope_value(plan, c) for c in worker.scope)
            tests.append(
                sql.SQL("exists (select from {name} as w where ({cols}) = ({values}))").format(
                    name=name, cols=idents(worker.scope, "w"), values=values
                )
            )
            if worker.flow:
                # rewritten by a worker that committed after the check began
                # (its mark not visible in S0): the compute may have read the
                # item before the change that worker wrote
                tests.append(
                    sql.SQL(
                        "exists (select from {marks} as m where m.target = {label}"
                        " and m.key = jsonb_build_array({values})"
                        " and not pg_visible_in_snapshot(m.xid, {s0}::pg_snapshot))"
                    ).format(
                        marks=sql.Identifier(self.check.schema, "mark"),
                        label=sql.Literal(plan.target.label),
                        values=values,
                        s0=sql.Literal(self.check.s0),
                    )
                )
        test = sql.SQL("({})").format(sql.SQL(" or ").join(tests)) if tests else sql.SQL("false")
        return ctes, test

    def _with(self) -> sql.Composable:
        return sql.SQL("with {} ").format(sql.SQL(", ").join(self.ctes))

    def counts(self, by_op: Mapping[str, int], staged: Staged) -> tuple[DiffStats, DiffStats]:
        """(drift, on its way), as a recompute would count them."""
        (rows,) = send(
            self.conn,
            (
                sql.SQL(
                    "{w} select pgjobs_onway, pgjobs_kind, count(*),"
                    " count(*) filter (where pgjobs_present) from x group by 1, 2"
                ).format(w=self._with()),
                None,
            ),
        )
        figures: dict[bool, dict[str, int]] = {False: {}, True: {}}
        for onway, kind, n, present in rows.all():
            side = figures[bool(onway)]
            side[str(kind)] = int(n)
            side["present"] = side.get("present", 0) + int(present)
        # unchanged: the staged rows the target holds as they are (not in
        # the difference), as the writer counts them
        unchanged = staged.rows - by_op["i"] - by_op["u"]
        return _stats(figures[False], unchanged), _stats(figures[True], 0)

    def samples(self) -> dict[str, tuple[Sample, ...]]:
        """The first rows of each kind in key order, with the target's values."""
        plan = self.plan
        key = plan.difference_key
        label = sql.SQL("case when pgjobs_onway then 'on_the_way' else pgjobs_kind end")
        statement = sql.SQL(
            "{w}, y as (select x.*, {label} as pgjobs_label, row_number() over"
            " (partition by {label} order by {k}) as pgjobs_n from x)"
            " select y.pgjobs_label, y.op::text, {new}, t is not null, {old}"
            " from y left join {t} as t on {same} where y.pgjobs_n <= {n}"
            " order by y.pgjobs_label, {yk}"
        ).format(
            w=self._with(),
            label=label,
            k=idents(key),
            new=idents([plan.new[c] for c in plan.columns], "y"),
            old=idents(plan.columns, "t"),
            t=plan.target.ident,
            same=equal("t", plan.key, "y", key),
            n=sql.Literal(self.check.sample),
            yk=idents(key, "y"),
        )
        (rows,) = send(self.conn, (statement, None))
        columns, width = plan.columns, len(plan.columns)
        out: dict[str, list[Sample]] = {}
        for row in rows.all():
            kind, op = str(row[0]), str(row[1])
            new = dict(zip(columns, row[2 : 2 + width], strict=True))
            old = dict(zip(columns, row[3 + width :], strict=True)) if row[2 + width] else None
            changed = (
                tuple(c for c in plan.values if old[c] != new[c])
                if op == "u" and old is not None
                else ()
            )
            out.setdefault(kind, []).append(
                Sample(
                    key={k: new[k] for k in plan.key},
                    old=old,
                    new=None if op == "d" else new,
                    changed=changed,
                )
            )
        return {k: tuple(v) for k, v in out.items()}


def _scope_value(plan: Plan, column: str) -> sql.Composable:
    """A scope column's value in a row of the difference (aliased ``d``): the
    new one, else (a row to delete) the old one, as flow's exclusion takes it."""
    new = sql.Identifier("d", plan.new[column]) if column in plan.new else None
    old = sql.Identifier("d", plan.old[column]) if column in plan.old else None
    if new is not None and old is not None and column not in plan.key:
        return sql.SQL("coalesce({}, {})").format(new, old)
    value = new if new is not None else old
    assert value is not None
    return value


def _stats(found: Mapping[str, int], unchanged: int) -> DiffStats:
    # an update whose new parent is gone: skipped, and the target's row deleted
    return DiffStats(
        inserted=found.get("inserted", 0),
        updated=found.get("updated", 0),
        deleted=found.get("deleted", 0) + found.get("present", 0),
        skipped_missing_parent=found.get("skipped_missing_parent", 0),
        unchanged=unchanged,
    )


#: what the check's transaction holds beyond reading: a lock stronger than
#: AccessShareLock on a table that is neither a temp table nor a catalog (a
#: write, or a row lock), or an advisory lock
_AUDIT = """
select coalesce(c.oid::regclass::text, l.locktype), l.mode from pg_locks as l
left join pg_class as c on c.oid = l.relation
where l.pid = pg_backend_pid() and (
    l.locktype = 'advisory'
    or (l.locktype = 'relation' and l.mode <> 'AccessShareLock'
        and c.oid >= 16384 and c.relpersistence <> 't'))
order by 1, 2
"""


def _audit(conn: Connection, job: str) -> None:
    held = driver(conn).execute(_AUDIT).fetchall()
    if held:
        taken = ", ".join(f"{mode} on {what}" for what, mode in held)
        raise JobError(
            f"{job}: the check's transaction took {taken}: a check writes nothing and locks no"
            " row (does the compute write?). Rolled back; nothing was written."
        )


def workers_of(job: Job, jobs: Iterable[Job]) -> list[QueueJob]:
    """The queue jobs (of pgjobs' built-in queue) among ``jobs`` that write
    ``job``'s target: their queued items are on their way to it."""
    target = getattr(job, "target", None)
    if not target:
        return []
    name = target.split(".")[-1]
    return [
        j
        for j in jobs
        if isinstance(j, QueueJob)
        and j.claim is None
        and (j.target == target or j.target.split(".")[-1] == name)
    ]


# -- scheduled verification (verify_every) -------------------------------------------
_LAST_CHECK = "select max(started_at) from {} where job = %s and outcome = 'checked'"


def verify(
    engine: Engine,
    store: Store,
    job: RecomputeJob,
    *,
    workers: Iterable[QueueJob] = (),
    worker: str = "",
    sample: int = SAMPLE,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> RunResult | None:
    """One scheduled verification of ``job`` (``verify_every``): the check,
    recorded in the run log as ``checked`` with its figures and samples, so
    that an alert on drift needs no write to the target. ``None`` when
    another process checked the job less than (nine tenths of) an interval
    ago. A check that fails is recorded too (outcome ``checked``, with its
    error), without touching the job's state or backoff. Its bookkeeping
    round trips have the deadline ``call_timeout`` (the runner's), the
    check those of the job's ticks (:func:`check_on`)."""
    interval = job.verify_interval
    assert interval is not None
    with engine.connect() as conn:
        bound_for_use(conn, call_timeout)
        with conn.begin():
            row = (
                driver(conn)
                .execute(sql.SQL(_LAST_CHECK).format(store.table("run")), (job.name,))
                .fetchone()
            )
            last = row[0] if row else None
        if last is not None and datetime.now(UTC) - last < interval * 0.9:
            return None
        started = datetime.now(UTC)
        try:
            result = check_on(
                conn,
                job,
                workers=workers,
                sample=sample,
                schema=store.schema,
                call_timeout=call_timeout,
            )
            record = result.run_result()
        except Exception as exc:
            if connection_lost(exc):
                raise
            log.warning("pgjobs: %s: the check failed: %s", job.name, first_line(exc))
            record = RunResult(
                job=job.name,
                outcome=Outcome.CHECKED,
                started_at=started,
                finished_at=datetime.now(UTC),
                error=first_line(exc),
                sqlstate=sqlstate_of(exc),
                detail={"check": {"error": first_line(exc)}},
            )
        else:
            # One line per scheduled check: drift is a warning, agreement news.
            level = logging.WARNING if result.drift else logging.INFO
            log.log(level, "pgjobs: %s", result.headline())
        with conn.begin():
            run_id = store.insert_run(conn, record, worker)
    return replace(record, run_id=run_id)


__all__ = [
    "KINDS",
    "ON_THE_WAY",
    "SAMPLE",
    "CheckResult",
    "Sample",
    "check_on",
    "verify",
    "workers_of",
]
