"""One tick of one job: the run protocol's six steps, the same for every
job at every tick (:class:`Tick`; :class:`~pgjobs.Runner` starts them).

1. **Due?**  ``job_state`` says backing off, or run recently elsewhere: stop, no lock.
2. **Work?** the body's work check, read-only; nothing: ``idle``, no lock.
3. **Lock.** ``pg_try_advisory_xact_lock``, never waiting; taken: ``busy``.
   The locks are the body's choice (:class:`~pgjobs.jobs.Locks`). The state
   is read again under the lock (a replica may have run the job).
4. **Run.**  the job's ``SET LOCAL`` timeouts, then its body (which may
   commit part-way, in chunks, when it says so and no pooler is in the way).
5. **Commit** the writes with the job's new state (next due: the body's
   say) and run record.
6. **Record** any other outcome; a failure sets ``next_attempt_at = now + backoff``.

The tick decides nothing by a job's kind: its body does (:class:`~pgjobs.jobs.Body`).
Why each step is as it is: ``docs/DESIGN.md``, "The run protocol".
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Protocol

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection, RootTransaction

from . import logs
from ._pg import (
    abandon,
    connection_lost,
    driver,
    error_text,
    frozen,
    later,
    open_transaction,
    send,
    set_local,
    sqlstate_of,
)
from .database import (
    ENV_TRANSACTION_POOLING,
    application_name,
    names_itself,
    transaction_pooling,
)
from .deadline import cancel_statement
from .errors import JobError
from .jobs import RUN_SAVEPOINT, Body, Job, Locks, Progress, RunContext
from .locking import (
    TRY_XACT_BOTH_SQL,
    TRY_XACT_SHARED_SQL,
    TRY_XACT_SQL,
    WAIT_XACT_SHARED_SQL,
    WAIT_XACT_SHARED_WITHIN_SQL,
    lock_name,
    recompute_lock_name,
    release_session_lock,
    try_session_lock,
)
from .records import (
    LOCAL_COMMIT_SQL,
    Deferrals,
    Failure,
    Interruptions,
    QuietTicks,
    Transients,
    cancelled,
    interruption,
    transient,
)
from .results import Execution, Outcome, RunResult
from .store import JobState, Store
from .worker.cursor import Cursors

#: the tick logs as the runner (what operators filter on: `pgjobs.runner`)
log = logging.getLogger("pgjobs.runner")

#: the longest a shutdown's cancel request may take (connect, send, the answer)
CANCEL_TIMEOUT = 2.0


class Host(Protocol):
    """What a tick needs of its :class:`~pgjobs.Runner`."""

    namespace: str
    store: Store
    worker: str
    quiet: QuietTicks
    interruptions: Interruptions
    transients: Transients
    deferrals: Deferrals
    #: each queue job's cursor (pgjobs/worker/cursor.py)
    cursors: Cursors

    def clock(self) -> datetime: ...

    def record_failure(self, failure: Failure, conn: Connection) -> RunResult: ...

    def record_run(self, result: RunResult, conn: Connection) -> RunResult: ...

    def record_interrupted(self, result: RunResult) -> RunResult: ...


_READ_ONLY = {"transaction_read_only": "on"}


def _job_settings(job: Job) -> dict[str, str]:
    """``SET LOCAL`` values of the job's ``lock_timeout``, ``statement_timeout``
    and ``synchronous_commit``; and ``client_connection_check_interval``, so
    that the server notices a client that died in the middle of a long
    statement within a second, and lets go of its locks (otherwise they
    stay until the statement ends: up to 4.6 s measured after a SIGKILL)."""
    values = {}
    for name in ("lock_timeout", "statement_timeout"):
        value = getattr(job, name)
        assert isinstance(value, timedelta)
        values[name] = f"{int(value.total_seconds() * 1000)}ms"
    # "local", not "on": a commit waits for this server's disk, never for a
    # synchronous standby (which a failover may have taken away)
    values["synchronous_commit"] = "local" if job.synchronous_commit else "off"
    values["client_connection_check_interval"] = "1000ms"
    return values


@functools.lru_cache(maxsize=256)
def _app_name(job: str) -> str:
    return application_name(job)


def _name_session(conn: Connection, job: str) -> None:
    """Queue the session's ``application_name`` naming ``job``, for the lock's
    round trip, where the session's name is pgjobs' own (or empty) and
    names another job: at session level, so that a connection serving one
    job tick after tick sets it once. Set for each transaction (``SET
    LOCAL``), it cost 8-12 % of a drain at batch 100 (A/B, 4 rounds); a
    name the user gave is left alone (:func:`pgjobs.database.names_itself`)."""
    raw = driver(conn)
    name = _app_name(job)
    if raw.info.parameter_status("application_name") != name and names_itself(raw):
        later(conn, _NAME_SESSION, (name,))


#: a success that changes nothing in ``job_state`` but its times (a queue
#: job with no failures) is written there at most this often; the run log
#: has each one (:meth:`Tick._success_changes_state`)
SUCCESS_EVERY = timedelta(seconds=10)


def _slack(interval: timedelta | None) -> timedelta:
    """Tolerance for timer jitter: a tick that fires a hair before one interval
    has passed still counts as due (10 % of the interval, at most 1 s)."""
    if interval is None:
        return timedelta(seconds=1)
    return min(interval / 10, timedelta(seconds=1))


class Tick:
    """One tick of one job on one connection: the six steps, in order."""

    def __init__(
        self,
        runner: Host,
        conn: Connection,
        job: Job,
        body: Body[Any],
        *,
        progress: Progress | None,
        next_due: datetime | None,
        force: bool,
    ) -> None:
        self.runner = runner
        self.store = runner.store
        self.conn = conn
        self.job = job
        self.body = body
        self.next_due = next_due
        self.force = force
        self.run_paused = False
        #: work just arrived (Runner.tick's ``woken``): no work check before the lock
        self.woken = False
        #: a shutdown deadline cancelled this tick (:meth:`cancel`); once
        #: ``ending``, its statements are its own rollback and record: no more cancels
        self.cancelled = False
        self.ending = False
        self._cancel_lock = threading.Lock()
        #: set by a cancel: a checkpoint's rest ends at once
        self._resting = threading.Event()
        self.started = runner.clock()
        self.state: JobState | None = None
        self.ctx = RunContext(
            job=job,
            namespace=runner.namespace,
            schema=runner.store.schema,
            now=self.started,
            progress=progress,
            worker=runner.worker,
            queue_cursors=runner.cursors,
        )

    def run(self) -> RunResult:
        stop = self._due_and_work()
        if stop is not None:
            return stop
        if self.cancelled and self._end():  # no more cancels: its record follows
            return self._record_cancelled()
        return self._locked_run()

    def cancel(self, timeout: float = CANCEL_TIMEOUT) -> None:
        """Cancel what this tick runs now, from another thread (a shutdown
        deadline); the tick then rolls back and ends ``cancelled``. The lock
        keeps the tick from its rollback while the request is on its way (at
        most ``timeout`` seconds), so that the request cannot cancel the
        rollback or the record instead. A request still on its way (the
        lock held) is not sent again: the shutdown asks every 100 ms, and
        requests to a server that cannot be reached would queue up behind
        it, holding the tick's rollback back."""
        if not self._cancel_lock.acquire(blocking=False):
            return
        try:
            if self.ending:
                return
            self.cancelled = True
            self._resting.set()
            conn = self.conn
            raw = None if conn.invalidated or conn.closed else conn.connection.driver_connection
            if isinstance(raw, psycopg.Connection):
                cancel_statement(raw, timeout=timeout)
        finally:
            self._cancel_lock.release()

    def _end(self) -> bool:
        """From here on the tick's statements are its rollback and its record
        (no cancel reaches them); True if a shutdown cancelled it."""
        with self._cancel_lock:
            self.ending = True
            return self.cancelled

    def _record_cancelled(self) -> RunResult:
        """The run a shutdown deadline cancelled: rolled back (by the caller),
        recorded ``cancelled`` in the run log; the job's state is left as it
        was: no failure, no backoff."""
        result = cancelled(self.job.name, self.started, self.runner.clock())
        log.warning(
            "pgjobs: %s: cancelled by the shutdown deadline after %.1f s; rolled back",
            self.job.name,
            result.seconds,
        )
        return self.runner.record_run(result, self.conn)

    # -- steps 1 and 2 --------------------------------------------------------------
    def _due_and_work(self) -> RunResult | None:
        """Steps 1 and 2, no lock: the result of a tick that stops here, or
        ``None`` to go on. A woken tick whose body checks for work in one
        statement of its own skips both: what they would stop, the state
        read under the lock stops too (step 3), and a claim that finds
        nothing ends the tick ``idle``; the round trip saved is a fifth of
        a one-item tick's."""
        if self.woken and self.body.work_query(self.job, self.ctx) is not None:
            return None
        quick = self._due_and_work_at_once()
        error: Exception | None = None
        has_work = False
        if quick is not None:
            self.state, has_work = quick
            blocked = self._blocked()
        else:
            with self.conn.begin():
                self.state = self.store.read_state(self.conn, self.job.name, settings=_READ_ONLY)
                blocked = self._blocked()
                if blocked is None:
                    try:
                        has_work = self.body.check_work(self.conn, self.job, self.ctx)
                    except Exception as exc:
                        error = exc
        if blocked is not None:
            return self._blocked_result(blocked)
        if error is not None:
            return self._fail(error)
        if not has_work:
            return self._finish(Outcome.IDLE)
        return None

    def _due_and_work_at_once(self) -> tuple[JobState | None, bool] | None:
        """Steps 1 and 2 in one round trip (BEGIN, the state, the body's
        work statement, COMMIT), for jobs whose check is one statement;
        whether the job is due is decided after it (the check is an index
        probe: asking it of a job that is not due costs less than a round
        trip). ``None``: the job has no such statement, or something failed;
        the caller then takes the two steps one by one, which says what
        failed."""
        query = self.body.work_query(self.job, self.ctx)
        if query is None:
            return None
        trans = self.conn.begin()
        try:
            state, work = send(
                self.conn,
                self.store.state_query(self.job.name, settings=_READ_ONLY),
                query,
                commit=trans,
            )
            rows = work.all()
            has_work = self.body.work_answer(self.job, self.ctx, rows[0] if rows else None)
            return self.store.state_from_row(self.job.name, state.one()), has_work
        except Exception:
            abandon(self.conn, trans)
            log.debug("pgjobs: %s: the one-round-trip check failed", self.job.name, exc_info=True)
            return None

    def _blocked(self) -> Outcome | None:
        """``paused``, ``backing_off`` or ``not_due`` by the job's state, unless forced."""
        state = self.state
        if state is not None and state.paused_at is not None and not self.run_paused:
            return Outcome.PAUSED
        if self.force or state is None or state.next_attempt_at is None:
            return None
        if state.failures > 0:
            return Outcome.BACKING_OFF if self.started < state.next_attempt_at else None
        if self.started + _slack(self.job.interval) < state.next_attempt_at:
            return Outcome.NOT_DUE
        return None

    def _blocked_result(self, outcome: Outcome) -> RunResult:
        state = self.state
        if outcome is Outcome.PAUSED and state is not None:
            paused = {"paused_at": state.paused_at, "reason": state.paused_reason}
            return self._finish(outcome, detail=paused)
        return self._finish(outcome, next_attempt_at=state.next_attempt_at if state else None)

    # -- steps 3 to 5 ----------------------------------------------------------------
    def _locked_run(self) -> RunResult:
        conn, job = self.conn, self.job
        self.trans: RootTransaction = conn.begin()
        self.session_locked = False
        self.backend: int | None = None
        self.lock_names: tuple[str, ...] = ()
        #: the locks are taken shared (a sliced run's), at session level too
        self.shared = False
        committed = False
        try:
            stop = self._lock()
            if stop is not None:
                return stop
            if self.body.chunked(job, self.ctx) and self._may_chunk():
                self.ctx.checkpoint = self._checkpoint
            execution = self.body.execute(conn, job, self.ctx, self.prefetched)
            if execution.idle:
                self.trans.rollback()
                if execution.retry_soon:  # what it found, someone else holds
                    soon = timedelta(seconds=self.runner.deferrals.note(job.name))
                    return self._finish(Outcome.IDLE, retry_after=soon)
                return self._finish(Outcome.IDLE)
            if execution.busy:  # a recompute with flow gave up (pgjobs.flow), or joined
                self.trans.rollback()
                return self._finish(
                    Outcome.BUSY, retry_after=self._busy_retry(), detail=dict(execution.detail)
                )
            result = self._commit(execution)
            committed = True
        except Exception as exc:
            return self._fail_locked(exc)
        finally:
            if self.session_locked:
                self._release_session_lock()
            if not committed:
                self._after_rollback()
        logs.ran(log, result, previous_failures=self.state.failures if self.state else 0)
        self._after_commit()
        return result

    @property
    def _group(self) -> str:
        return self.job.group or self.job.name

    def _lock(self) -> RunResult | None:
        """Step 3, in one round trip: BEGIN, the lock, then (if it was taken)
        the re-check of the state under it (a replica may have run the job
        since step 1) with the job's settings, and what the body prefetches.
        Both are read-only and transaction-local: when the lock is busy they
        are rolled back. Returns the result of a tick that stops here."""
        statement, self.lock_names = self._lock_statement()
        waits = statement == WAIT_XACT_SHARED_SQL
        if waits:
            timeout = self.job.lock_timeout
            assert isinstance(timeout, timedelta)
            wait = min(timeout, FLOW_WAIT) if timeout > timedelta(0) else FLOW_WAIT
            # the wait's bound set in the same statement, before the lock
            lock = later(
                self.conn,
                WAIT_XACT_SHARED_WITHIN_SQL,
                (f"{int(wait.total_seconds() * 1000)}ms", *self.lock_names),
            )
        else:
            lock = later(self.conn, statement, self.lock_names)
        _name_session(self.conn, self.job.name)
        state = later(
            self.conn, *self.store.state_query(self.job.name, settings=_job_settings(self.job))
        )
        # what the body does, it does under this savepoint: should it fail,
        # the failure is recorded in this transaction, the lock still held;
        # what it prefetches too (a queue job's claim, on speculation)
        later(self.conn, _SAVEPOINT_RUN)
        self.prefetched = self.body.prefetch(self.conn, self.job, self.ctx)
        try:
            send(self.conn)
        except psycopg.errors.LockNotAvailable:
            if not waits or lock.result is not None:
                raise
            self.trans.rollback()  # a recompute wrote longer than FLOW_WAIT
            return self._finish(Outcome.BUSY, retry_after=self._busy_retry())
        assert lock.result is not None and state.result is not None
        if not lock.result.scalar():
            self.trans.rollback()
            return self._finish(Outcome.BUSY, retry_after=self._busy_retry())
        self.state = self.store.state_from_row(self.job.name, state.result.one())
        blocked = self._blocked()
        if blocked is not None:
            self.trans.rollback()
            return self._blocked_result(blocked)
        return None

    def _lock_statement(self) -> tuple[str, tuple[str, ...]]:
        """The statement taking the locks the body asks for (:class:`Locks`;
        ``docs/DESIGN.md``, "Flow"), and their names."""
        namespace, group = self.runner.namespace, self._group
        write = lock_name(namespace, group)
        locks = self.body.locks(self.job, self.ctx)
        if locks is Locks.SHARED_WRITE:
            # waited for, briefly: a recompute holds it exclusively only for
            # one chunk at a time, and a worker that queues gets in between
            # two chunks (a try would find the next chunk's request queued)
            return WAIT_XACT_SHARED_SQL, (write,)
        if locks is Locks.RECOMPUTE:
            return TRY_XACT_SQL, (recompute_lock_name(namespace, group),)
        if locks is Locks.RECOMPUTE_AND_WRITE:
            return TRY_XACT_BOTH_SQL, (recompute_lock_name(namespace, group), write)
        if locks is Locks.RECOMPUTE_SHARED:
            self.shared = True
            return TRY_XACT_SHARED_SQL, (recompute_lock_name(namespace, group),)
        return TRY_XACT_SQL, (write,)

    def _may_chunk(self) -> bool:
        """Chunks hold the group's lock at session level and temp tables
        across commits: not behind a transaction pooler, where the next
        transaction may run in another server session."""
        if not transaction_pooling():
            return True
        name = self.job.name
        if name not in _told_unchunked:
            _told_unchunked.add(name)
            log.warning(
                "pgjobs: %s: behind a transaction pooler ($%s) it writes in one transaction,"
                " however large the difference",
                name,
                ENV_TRANSACTION_POOLING,
            )
        return False

    def _checkpoint(self, *, rest: float = 0.0) -> None:
        """Commit what is written so far, rest ``rest`` seconds outside any
        transaction (a sliced run's ``slice_pause``), and go on in a new
        transaction with the job's settings and its savepoint (chunked
        writes); a tick that a shutdown deadline cancelled meanwhile (the
        cancel ends the rest at once) stops there, ``cancelled``. The first one
        takes the group's lock at session level too, which keeps the group
        across the commits (this session holds it already, in the
        transaction: it is granted at once). Each one checks that the
        transaction before it ran in the same server session."""
        if not self.session_locked:
            for name in self.lock_names:
                self.backend = try_session_lock(self.conn, name, shared=self.shared)
            self.session_locked = self.backend is not None
        self._queue_before_commit()
        send(self.conn, commit=self.trans)
        if rest > 0:
            self._rest(rest)
        self.trans = self.conn.begin()
        if self.cancelled:
            raise JobError(f"{self.job.name}: cancelled between two commits")
        # one round trip a chunk: the settings, the savepoint, and the check
        settings, params = set_local(_job_settings(self.job))
        later(self.conn, _SAVEPOINT_RUN)
        (now_on,) = send(self.conn, (sql.SQL("{}, pg_backend_pid()").format(settings), params))
        if self.backend is not None and (now_on.one() or (None,))[-1] != self.backend:
            raise JobError(_SESSION_CHANGED.format(name=self.job.name))

    def _rest(self, seconds: float) -> None:
        """Wait ``seconds``, or until :meth:`cancel`."""
        self._resting.wait(seconds)

    def _commit(self, execution: Execution) -> RunResult:
        """Step 5: the run record (with the success state) and COMMIT, in one
        round trip after what the body left for the commit."""
        next_attempt = self.body.next_due(self.job, self.started, self.next_due)
        retry = None
        if execution.retry_soon:
            retry = timedelta(seconds=self.runner.deferrals.note(self.job.name))
        else:
            self.runner.deferrals.clear(self.job.name)
        result = RunResult(
            job=self.job.name,
            outcome=Outcome.RAN,
            started_at=self.started,
            finished_at=self.runner.clock(),
            stats=execution.stats,
            compute_seconds=execution.compute_seconds,
            write_seconds=execution.write_seconds,
            lock_seconds=execution.lock_seconds,
            items=execution.items,
            failed_items=execution.failed_items,
            next_attempt_at=next_attempt,
            detail=dict(execution.detail),
            queue_lag=execution.queue_lag,
            retry_after=retry,
        )
        self._queue_before_commit()
        # deferred constraints are checked here, under the savepoint: a
        # violation is then a failure recorded with the lock still held
        later(self.conn, _CONSTRAINTS_NOW)
        self.runner.quiet.queue_for(self.conn, self.job.name)
        state = next_attempt if self._success_changes_state(next_attempt) else None
        (recorded,) = send(
            self.conn,
            self.store.run_query(result, self.runner.worker, success_next_attempt=state),
            commit=self.trans,
        )
        return replace(result, run_id=int(recorded.scalar()))

    def _success_changes_state(self, next_attempt: datetime) -> bool:
        """Whether this success is written to ``job_state`` (with the run
        record). Not when the state read at this tick's start says the job
        is due at once after a success anyway (a queue job: ``next_attempt``
        is this tick's start), has no failures to reset, and had a success
        recorded less than :data:`SUCCESS_EVERY` ago: then writing it would
        change only the times, and each write is one more version of the
        job's one row, which every tick reads (a held horizon keeps them
        all: 19,000 versions and 0.5-0.7 ms a read after 240 s at 800
        keys/s, in each tick). The run log has every success; a failure
        recorded late consults it (:meth:`pgjobs.store.Store.failure_query`)."""
        state = self.state
        return (
            state is None
            or state.failures > 0
            or state.last_success_at is None
            or state.next_attempt_at is None
            or next_attempt > self.started
            or state.next_attempt_at > self.started
            or self.started - state.last_success_at >= SUCCESS_EVERY
        )

    def _queue_before_commit(self) -> None:
        """What the body left for the commit goes out in its round trip."""
        statements, self.ctx.before_commit = self.ctx.before_commit, []
        for statement, params in statements:
            later(self.conn, statement, params)

    def _after_rollback(self) -> None:
        for action in self.ctx.after_rollback:
            try:
                action()
            except Exception:
                log.warning(
                    "pgjobs: %s: after its rollback: %s failed",
                    self.job.name,
                    action,
                    exc_info=True,
                )

    def _after_commit(self) -> None:
        for action in self.ctx.after_commit:
            try:
                action(self.conn)
            except Exception:
                log.warning(
                    "pgjobs: %s: after its commit: %s failed", self.job.name, action, exc_info=True
                )
                if self.conn.in_transaction():
                    self.conn.rollback()

    def _busy_retry(self) -> timedelta | None:
        job = self.job
        retry = job.busy_retry
        if not isinstance(retry, timedelta):
            return None
        if job.interval is not None and retry >= job.interval:
            return None
        # Spread over [retry/2, retry]: a fixed delay can line up with another
        # job's ticks (a 1 s job, a retry after 1 s) and lose the race every time.
        return retry * random.uniform(0.5, 1.0)

    def _release_session_lock(self) -> None:
        try:
            with self.conn.begin():
                for name in self.lock_names:
                    release_session_lock(self.conn, name, shared=self.shared)
        except Exception:
            # A pooled connection must never go back holding the group lock.
            log.warning(
                "pgjobs: could not release the session lock of %s; dropping the connection",
                self.job.name,
            )
            self.conn.invalidate()

    # -- step 6 ----------------------------------------------------------------------
    def _interrupted(self, exc: Exception, why: tuple[str, str]) -> RunResult:
        """A run cut off by a lost connection (or a standby): rolled back,
        recorded as ``interrupted`` if the database takes it, retried soon
        (``retry_after``); the job's state and backoff are left alone."""
        sqlstate, line = why
        if self._trans_open():
            abandon(self.conn, self.trans)
        delay = self.runner.interruptions.note(self.job.name, line)
        result = RunResult(
            job=self.job.name,
            outcome=Outcome.INTERRUPTED,
            started_at=self.started,
            finished_at=self.runner.clock(),
            error=error_text(exc),
            sqlstate=sqlstate,
            retry_after=timedelta(seconds=delay),
        )
        log.debug("pgjobs: %s: the interruption", self.job.name, exc_info=exc)
        return self.runner.record_interrupted(result)

    def _transient_why(self, exc: Exception) -> tuple[str, str] | None:
        """(SQLSTATE, one line) when ``exc`` is a transient failure
        (:func:`pgjobs.records.transient`) that has not gone on for the
        bound yet (then it is the job's failure)."""
        seconds = (self.runner.clock() - self.started).total_seconds()
        why = transient(exc, self.job, seconds)
        if why is None or self.runner.transients.persisted(self.job.name):
            return None
        return why

    def _transient(self, exc: Exception, why: tuple[str, str]) -> RunResult:
        """A run rolled back by a lock timeout, a deadlock, a serialization
        failure, an operator's cancel or a stale cached plan: recorded
        ``transient`` in the run log (in the job's own transaction, rolled
        back to its savepoint, when it is still there), retried within
        seconds (``retry_after``); the job's state and backoff are left
        alone. A stale cached plan (0A000) drops the connection: its
        prepared statements, psycopg's and pgjobs', go with it."""
        sqlstate, line = why
        delay = self.runner.transients.note(self.job.name, line)
        result = RunResult(
            job=self.job.name,
            outcome=Outcome.TRANSIENT,
            started_at=self.started,
            finished_at=self.runner.clock(),
            error=error_text(exc),
            sqlstate=sqlstate,
            retry_after=timedelta(seconds=delay),
        )
        log.debug("pgjobs: %s: the transient failure", self.job.name, exc_info=exc)
        locked: RootTransaction | None = getattr(self, "trans", None)  # (after step 3)
        if sqlstate == "0A000":
            if self._trans_open():
                abandon(self.conn, self.trans)
            self.conn.invalidate()
        elif locked is not None and open_transaction(self.conn):
            try:
                self.runner.quiet.queue_for(self.conn, self.job.name)
                *_, recorded = send(
                    self.conn,
                    (_ROLLBACK_RUN, None),
                    LOCAL_COMMIT_SQL,
                    self.store.run_query(result, self.runner.worker),
                    commit=locked,
                )
                return replace(result, run_id=int(recorded.scalar()))
            except Exception:
                log.debug(
                    "pgjobs: %s: recording the transient failure in its own transaction failed",
                    self.job.name,
                    exc_info=True,
                )
        if locked is not None:
            abandon(self.conn, locked)
        return self.runner.record_run(result, self.conn)

    def _trans_open(self) -> bool:
        trans: RootTransaction | None = getattr(self, "trans", None)
        return trans is not None and trans.is_active

    def _failure(self, exc: Exception) -> Failure:
        job, state = self.job, self.state
        failures = (state.failures if state else 0) + 1
        next_attempt = self.runner.clock() + job.backoff_policy.delay(failures)
        sqlstate = sqlstate_of(exc) or ("08006" if connection_lost(exc) else None)
        result = RunResult(
            job=job.name,
            outcome=Outcome.FAILED,
            started_at=self.started,
            finished_at=self.runner.clock(),
            error=error_text(exc),
            sqlstate=sqlstate,
            next_attempt_at=next_attempt,
        )
        logs.failed(log, result, failures=failures, exc=exc)
        return Failure(result=result, failures=failures, started_at=self.started)

    def _fail_locked(self, exc: Exception) -> RunResult:
        """A failure with the group lock taken: recorded in the job's own
        transaction (rolled back to its savepoint, the lock still held), so
        that no replica can start the job between the failure and its
        backoff. When that transaction is gone (the connection was lost, or
        COMMIT itself failed), so is the lock: recorded elsewhere. A tick
        that a shutdown deadline cancelled rolls back and ends ``cancelled``;
        a lost connection is no failure of the job: :meth:`_interrupted`."""
        if self._end():
            abandon(self.conn, self.trans)
            return self._record_cancelled()
        why = interruption(exc, self.conn)
        if why is not None:
            return self._interrupted(exc, why)
        why = self._transient_why(exc)
        if why is not None:
            return self._transient(exc, why)
        failure = self._failure(exc)
        if open_transaction(self.conn):
            try:
                self.runner.quiet.queue_for(self.conn, self.job.name)
                *_, recorded = send(
                    self.conn,
                    (_ROLLBACK_RUN, None),
                    LOCAL_COMMIT_SQL,
                    failure.state_query(self.store),
                    self.store.run_query(failure.result, self.runner.worker),
                    commit=self.trans,
                )
                return replace(failure.result, run_id=int(recorded.scalar()))
            except Exception:
                log.debug(
                    "pgjobs: %s: recording the failure in its own transaction failed",
                    self.job.name,
                    exc_info=True,
                )
        abandon(self.conn, self.trans)
        return self.runner.record_failure(failure, self.conn)

    def _fail(self, exc: Exception) -> RunResult:
        """A failure before the lock (the work check): recorded on its own."""
        if self._end():
            return self._record_cancelled()
        why = interruption(exc, self.conn)
        if why is not None:
            return self._interrupted(exc, why)
        why = self._transient_why(exc)
        if why is not None:
            return self._transient(exc, why)
        return self.runner.record_failure(self._failure(exc), self.conn)

    def _finish(self, outcome: Outcome, **fields: Any) -> RunResult:
        """A tick that changed nothing (idle, busy, not due, backing off):
        counted, not logged (see :class:`~pgjobs.records.QuietTicks`)."""
        result = RunResult(
            job=self.job.name,
            outcome=outcome,
            started_at=self.started,
            finished_at=self.runner.clock(),
            **fields,
        )
        self.runner.quiet.count(result)
        logs.quiet(log, result)
        return result


_SESSION_CHANGED = (
    "{name}: chunked writes need one server session across their commits, and this"
    " connection's next transaction ran in another (a transaction pooler, such as PgBouncer"
    " with pool_mode = transaction?). The chunks before it are committed; the group's"
    " session lock stays with the previous server session until the pooler closes it. Behind"
    " a transaction pooler set $" + ENV_TRANSACTION_POOLING + "=1 (chunked jobs then write in"
    " one transaction)."
)
#: jobs already told that they write in one transaction (logged once per process)
_told_unchunked: set[str] = set()

_SAVEPOINT_RUN = sql.SQL("savepoint {}").format(sql.Identifier(RUN_SAVEPOINT))
_NAME_SESSION = frozen(sql.SQL("select set_config('application_name', %s, false)"))
#: the longest a flow worker waits for the group's write lock (a recompute's
#: chunk, or its start snapshot); then ``busy``
FLOW_WAIT = timedelta(seconds=2)
_ROLLBACK_RUN = sql.SQL("rollback to savepoint {}").format(sql.Identifier(RUN_SAVEPOINT))
_CONSTRAINTS_NOW = sql.SQL("set constraints all immediate")


__all__ = ["CANCEL_TIMEOUT", "FLOW_WAIT", "Host", "Tick"]
