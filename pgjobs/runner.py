"""The runner: runs jobs under the run protocol against one database.

:class:`Runner` holds what outlives a tick (the engine, the store, the
ledger of what could not be written yet, the ticks running now for a
shutdown's cancel) and starts each tick (:class:`pgjobs.steps.Tick`: the
six steps). The body of each kind is in :data:`BODIES`
(:mod:`pgjobs.recompute`, :mod:`pgjobs.worker`); any other
:class:`~pgjobs.Job` is its own body (:class:`_OwnBody`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection, Engine

from ._pg import send
from .database import resolve_engine
from .deadline import DEFAULT_CALL_TIMEOUT, bound_for_use, bounded
from .durations import Duration, parse_duration
from .errors import ConfigError
from .jobs import Body, Job, Locks, Progress, QueueJob, RecomputeJob, RunContext
from .locking import DEFAULT_NAMESPACE
from .recompute import BODY as RECOMPUTE
from .records import (
    LOCAL_COMMIT_SQL,
    Deferrals,
    Failure,
    Interruptions,
    Ledger,
    QuietTicks,
    Transients,
    tick_bound,
)
from .results import Execution, Outcome, RunResult
from .slices import SLICED
from .steps import CANCEL_TIMEOUT, Tick
from .store import DEFAULT_SCHEMA, Store
from .worker import BODY as QUEUE
from .worker.cursor import Cursors

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]

#: run records a prune deletes per transaction (:meth:`Runner.prune`)
PRUNE_BATCH = 5000

#: The body of each built-in job kind.
BODIES: dict[type[Job], Body[Any]] = {RecomputeJob: RECOMPUTE, QueueJob: QUEUE}


class _OwnBody:
    """A job kind of the user's own: the job's own methods are its body
    (their defaults: the write lock, no chunks, due one interval later)."""

    def work_query(self, job: Job, ctx: RunContext) -> tuple[sql.Composed, Sequence[Any]] | None:
        return job.work_query(ctx)

    def work_answer(self, job: Job, ctx: RunContext, row: Sequence[Any] | None) -> bool:
        return bool(row and row[0])

    def check_work(self, conn: Connection, job: Job, ctx: RunContext) -> bool:
        return job.check_work(conn, ctx)

    def locks(self, job: Job, ctx: RunContext) -> Locks:
        return job.locks(ctx)

    def chunked(self, job: Job, ctx: RunContext) -> bool:
        return job.chunked(ctx)

    def prefetch(self, conn: Connection, job: Job, ctx: RunContext) -> None:
        job.prefetch(conn, ctx)

    def execute(self, conn: Connection, job: Job, ctx: RunContext, prefetched: None) -> Execution:
        return job.execute(conn, ctx)

    def next_due(self, job: Job, started: datetime, scheduled: datetime | None) -> datetime:
        return job.next_due(started, scheduled)


_OWN = _OwnBody()


def body_of(job: Job) -> Body[Any]:
    """The body the runner runs ``job`` through (a recompute with a scope:
    slice by slice, :mod:`pgjobs.slices`)."""
    if isinstance(job, RecomputeJob) and job.slices:
        return SLICED
    for kind in type(job).__mro__:
        body = BODIES.get(kind)
        if body is not None:
            return body
    return _OWN


def utcnow() -> datetime:
    return datetime.now(UTC)


class Runner:
    """Runs jobs under the protocol against one database.

    ``database``: a URL, an :class:`~sqlalchemy.engine.Engine` or ``None`` for
    ``$PGJOBS_DATABASE_URL``. ``clock`` is injectable so that schedules can be
    simulated; every timestamp pgjobs stores comes from it. ``auto_migrate``
    false: pending migrations are not applied, the first tick refuses
    (:class:`~pgjobs.SchemaError`) until ``pgjobs migrate`` has run.
    """

    def __init__(
        self,
        database: str | Engine | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        schema: str = DEFAULT_SCHEMA,
        clock: Clock = utcnow,
        worker: str | None = None,
        auto_migrate: bool = True,
        call_timeout: Duration = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        for name, value in (("namespace", namespace), ("schema", schema)):
            if not isinstance(value, str) or not value or "\x00" in value:
                raise ConfigError(
                    f"{name}: expected a non-empty string without NUL bytes, got {value!r}"
                )
        timeout = parse_duration(call_timeout, field="call_timeout")
        if timeout <= timedelta(0):
            raise ConfigError(f"call_timeout: must be positive, got {call_timeout!r}")
        #: seconds: the deadline of each round trip of pgjobs' bookkeeping
        #: (and the margin of a tick's, see :func:`tick_bound`)
        self.call_timeout = timeout.total_seconds()
        self.engine, self._owned = resolve_engine(database, call_timeout=self.call_timeout)
        self.namespace = namespace
        self.store = Store(schema, auto_migrate=auto_migrate)
        self.clock = clock
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.quiet = QuietTicks(self.store)
        #: runs cut off by a lost connection, per job, and their retry delay
        self.interruptions = Interruptions()
        #: runs rolled back by a lock timeout, a deadlock and their kin, per
        #: job, and their retry delay (not the job's backoff)
        self.transients = Transients()
        #: queue ticks in a row that left items for a lock someone holds
        self.deferrals = Deferrals()
        #: each queue job's cursor (pgjobs/worker/cursor.py)
        self.cursors = Cursors()
        #: what ticks could not write when they happened, written later
        self.ledger = Ledger(self.store, self.worker, self.quiet, self.connect)

        #: the ticks running now, for :meth:`cancel_running`
        self._running: set[Tick] = set()
        self._running_lock = threading.Lock()

    def cancel_running(self, timeout: float = CANCEL_TIMEOUT) -> list[str]:
        """Cancel the statements of the ticks running now, on the server (a
        shutdown deadline): each rolls back and ends ``cancelled``, which is
        not a failure and starts no backoff. Returns their jobs' names. Call
        it again to cancel a tick that was between two statements.

        Returns within ``timeout`` seconds: the requests go out side by
        side, each given that long to reach the server (one that cannot be
        reached, a failed-over host, would otherwise hold the caller that
        long per tick)."""
        with self._running_lock:
            ticks = list(self._running)
        threads = [
            threading.Thread(target=tick.cancel, args=(timeout,), name="pgjobs-cancel", daemon=True)
            for tick in ticks
        ]
        end = time.monotonic() + timeout
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        return [tick.job.name for tick in ticks]

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection of the engine for pgjobs' bookkeeping: each of its
        round trips at most :attr:`call_timeout` (on an Engine of the
        user's too, where the user's own statements have no deadline)."""
        with self.engine.connect() as conn:
            bound_for_use(conn, self.call_timeout)
            yield conn

    def close(self) -> None:
        """Write what is still counted or unrecorded (if the database is
        there), and dispose of the engine if this runner created it."""
        try:
            self.flush()
        except Exception:
            log.warning("pgjobs: could not write the last tick counts on close", exc_info=True)
        if self._owned:
            self.engine.dispose()

    def flush(self) -> None:
        """Write the failures and interrupted runs that could not be recorded
        when they happened, and the counts of quiet ticks (:class:`Ledger`)."""
        self.ledger.flush()

    def record_failure(self, failure: Failure, conn: Connection) -> RunResult:
        """Write ``failure`` on ``conn`` if it still works, else on a new
        connection; else keep it for :meth:`flush` (:class:`Ledger`)."""
        return self.ledger.record_failure(failure, conn)

    def record_run(self, result: RunResult, conn: Connection) -> RunResult:
        """Write ``result`` to the run log alone (:class:`Ledger`)."""
        return self.ledger.record_run(result, conn)

    def record_interrupted(self, result: RunResult) -> RunResult:
        """Write an interrupted run to the run log, or keep it for later
        (:class:`Ledger`); its job's state is left as it is."""
        return self.ledger.record_interrupted(result)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(self) -> None:
        """Check pgjobs' schema and apply pending migrations unless
        ``auto_migrate`` is off (then refuse: :class:`~pgjobs.SchemaError`);
        the first tick does it too."""
        with self.connect() as conn:
            self._ensure(conn)

    def _ensure(self, conn: Connection) -> None:
        if self.store._ready:
            return
        # the read under this connection's bound (call_timeout); migrate()
        # gives the migrations the install bound (migrations.install_bound)
        self.store.ensure(conn)

    def tick(
        self,
        job: Job,
        *,
        progress: Progress | None = None,
        next_due: datetime | None = None,
        force: bool = False,
        run_paused: bool = False,
        woken: bool = False,
    ) -> RunResult:
        """Run one tick of ``job`` and return its :class:`RunResult`.

        ``next_due``: for cron jobs, the scheduler's next fire time (so other
        replicas know the job is done until then). ``force`` ignores the
        schedule and the backoff (never the lock); ``run_paused`` a pause
        (``pgjobs pause``), which otherwise ends the tick ``paused``.
        ``woken``: the caller knows that work just arrived (a queue job's
        enqueue notification, or a tick after one that took items): the
        round trip that checks for work before the lock is left out, and
        the job's state is read under the lock only (a queue job whose work
        check is pgjobs' own; others check as always).
        """
        if self.ledger.failures_kept:
            self.flush()
        try:
            with self.connect() as conn:
                self._ensure(conn)
                result = self.tick_on(
                    conn,
                    job,
                    progress=progress,
                    next_due=next_due,
                    force=force,
                    run_paused=run_paused,
                    woken=woken,
                )
        except Exception:
            # the database may be another one now (a failover: a primary
            # whose queue numbers went back, a standby read meanwhile):
            # every queue job reads its queue from the start again
            self.cursors.reset()
            raise
        if result.outcome is Outcome.INTERRUPTED:
            self.cursors.reset()
        if self.ledger.late_kept and result.outcome is not Outcome.INTERRUPTED:
            try:
                self.flush()
            except Exception:
                log.debug("pgjobs: the interrupted runs kept are not written yet", exc_info=True)
        return result

    def tick_on(
        self,
        conn: Connection,
        job: Job,
        *,
        progress: Progress | None = None,
        next_due: datetime | None = None,
        force: bool = False,
        run_paused: bool = False,
        woken: bool = False,
    ) -> RunResult:
        """:meth:`tick` on a connection of the caller's (not in a transaction).
        Each of its round trips has the job's deadline (:func:`tick_bound`)."""
        tick = Tick(
            self, conn, job, body_of(job), progress=progress, next_due=next_due, force=force
        )
        tick.run_paused = run_paused
        tick.woken = woken
        with self._running_lock:
            self._running.add(tick)
        try:
            with bounded(conn, tick_bound(job, self.call_timeout)):
                result = tick.run()
        finally:
            with self._running_lock:
                self._running.discard(tick)
        if result.outcome is not Outcome.INTERRUPTED:
            self.interruptions.clear(job.name)
            if result.outcome is not Outcome.TRANSIENT:
                self.transients.clear(job.name)
        return result

    def prune(self, keep: timedelta = timedelta(days=7), *, batch: int = PRUNE_BATCH) -> int:
        """Delete run records older than ``keep``, ``batch`` at a time, each
        batch in a transaction of its own (so under :attr:`call_timeout`
        each, however large the backlog: one DELETE of a week of a busy run
        log could outlast it every time, and never prune); returns how many."""
        now, deleted = self.clock(), 0
        with self.connect() as conn:
            self._ensure(conn)
            while True:
                with conn.begin():
                    send(conn, LOCAL_COMMIT_SQL)
                    done = self.store.prune(conn, keep=keep, now=now, limit=batch)
                deleted += done
                if done < batch:
                    return deleted


__all__ = ["BODIES", "PRUNE_BATCH", "Runner", "body_of"]
