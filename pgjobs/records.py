"""What ticks leave behind in ``job_state`` and the run log, for the runner
(:mod:`pgjobs.runner`): a failed run and the state it puts its job in, and
the counts of the ticks that changed nothing (``idle``, ``busy``,
``not_due``, ``backing_off``, ``paused``), kept per job until the next
write; the interruptions of each job (:class:`Interruptions`: runs cut off
because the connection went away, :func:`interruption` tells them from
failures), with the short retry delay of their own; the writes that outlive
a tick (:class:`Ledger`), which never wait for a synchronous standby; and a
run that a shutdown deadline cancelled."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import (
    connection_lost,
    driver_error,
    first_line,
    later,
    send,
    set_local,
    sqlstate_of,
)
from .deadline import exceeded
from .jobs import Job
from .results import Outcome, RunResult
from .store import Store


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed run and the state it puts its job in."""

    result: RunResult
    failures: int
    started_at: datetime

    def state_query(self, store: Store) -> tuple[sql.Composed, dict[str, Any]]:
        result = self.result
        assert result.next_attempt_at is not None and result.error is not None
        return store.failure_query(
            result.job,
            started_at=self.started_at,
            failures=self.failures,
            next_attempt_at=result.next_attempt_at,
            error=result.error,
            sqlstate=result.sqlstate,
        )


class QuietTicks:
    """Ticks that changed nothing, counted per job and outcome until they are
    written to ``job_state`` (with the job's next run record, or by
    :meth:`Runner.flush`): each used to write a row to the run log, and
    with wake-ups reaching every replica, every enqueue would log one per
    replica."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        self._last: dict[str, tuple[datetime, str]] = {}

    def count(self, result: RunResult) -> None:
        with self._lock:
            counts = self._counts.setdefault(result.job, {})
            counts[str(result.outcome)] = counts.get(str(result.outcome), 0) + 1
            self._last[result.job] = (result.finished_at, str(result.outcome))

    def take(self, job: str) -> tuple[dict[str, int], tuple[datetime, str]] | None:
        with self._lock:
            counts = self._counts.pop(job, None)
            last = self._last.pop(job, None)
        return None if counts is None or last is None else (counts, last)

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._counts)

    def queue_for(self, conn: Connection, job: str) -> None:
        """Queue the job's counts for the next round trip (a run record's)."""
        taken = self.take(job)
        if taken is not None:
            counts, (at, outcome) = taken
            later(conn, *self.store.quiet_query(job, counts, at, outcome))


log = logging.getLogger("pgjobs.runner")

#: pgjobs' own writes (failures, run records, tick counts, migrations) commit
#: durably on this server without waiting for a synchronous standby: a
#: commit waiting for one kept the old primary from shutting down for 60 s
#: in a switchover (``docs/failover.md``)
LOCAL_COMMIT = {"synchronous_commit": "local"}
#: the statement that sets :data:`LOCAL_COMMIT`, to queue in a bookkeeping transaction
LOCAL_COMMIT_SQL = set_local(LOCAL_COMMIT)
#: interrupted runs kept at most, while they cannot be written
LATE_MAX = 100


def tick_bound(job: Job, call_timeout: float) -> float:
    """Seconds: the deadline of each round trip of ``job``'s ticks, its
    ``lock_timeout`` + ``statement_timeout`` (what the server itself allows
    a statement) + ``call_timeout`` as a margin; 0 (none) for a job without
    a ``statement_timeout``."""
    lock, statement = job.lock_timeout, job.statement_timeout
    assert isinstance(lock, timedelta) and isinstance(statement, timedelta)
    if statement <= timedelta(0):
        return 0.0
    return lock.total_seconds() + statement.total_seconds() + call_timeout


def interruption(exc: BaseException, conn: Connection) -> tuple[str, str] | None:
    """(SQLSTATE, one line) when ``exc`` cut a run off without being the
    job's fault: the connection is gone (class 08, 57P01-57P05, closed
    under it), a deadline passed, or the server is a standby (a read-only
    server, 25006: the URL reached a demoted primary or only a standby),
    or a statement pgjobs prepared is gone (26000, see :mod:`pgjobs._wire`).
    ``None``: the job's own failure."""
    if exceeded(exc):
        return "08006", f"no answer within the deadline: {first_line(exc)}"
    if _read_only_server(conn):
        return "25006", f"read-only server (SQLSTATE 25006): {first_line(exc)}"
    if connection_lost(exc):
        state = sqlstate_of(exc) or "08006"
        return state, f"{first_line(exc)} (SQLSTATE {state})"
    if sqlstate_of(exc) == "26000":
        # a statement pgjobs prepared is gone from the session (DISCARD ALL
        # or DEALLOCATE ALL by someone else): prepared again next time
        return "26000", f"{first_line(exc)} (SQLSTATE 26000)"
    return None


def _read_only_server(conn: Connection) -> bool:
    """Is ``conn``'s server a hot standby, or read-only by default? Both
    are reported by the server itself (PostgreSQL 14+): no round trip."""
    if conn.invalidated or conn.closed:
        return False
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection) or raw.closed:
        return False
    return "on" in (
        raw.info.parameter_status("in_hot_standby"),
        raw.info.parameter_status("default_transaction_read_only"),
    )


#: the first retry after an interruption, doubling up to :data:`RETRY_MAX`
RETRY_FIRST = 0.5
#: the longest wait between two retries of an interrupted job, in seconds:
#: never the job's failure backoff (a failover is not the job's fault)
RETRY_MAX = 8.0
#: interruptions that go on this long (seconds, none getting through) are
#: said once more, louder
LONG_INTERRUPTION = 60.0


@dataclass(slots=True)
class _Streak:
    count: int
    since: float
    last: str
    told: bool = False
    told_long: bool = False


class Interruptions:
    """Per job, the interruptions since its last tick that got through: how
    long to wait before the next retry (:data:`RETRY_FIRST` doubling to
    :data:`RETRY_MAX`), and the log lines: one at the first, one when they
    have gone on for :data:`LONG_INTERRUPTION`, one when a tick gets
    through again; the ones in between at DEBUG. (:class:`Transients` is
    the same for a lock timeout, a deadlock and their kin.)"""

    #: the first delay, doubling up to :attr:`most`; said louder after :attr:`long`
    first = RETRY_FIRST
    most = RETRY_MAX
    long = LONG_INTERRUPTION

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streaks: dict[str, _Streak] = {}

    def note(self, job: str, why: str, *, quiet: bool = False) -> float:
        """Count an interruption of ``job`` (``why``: one line); the seconds
        to wait before trying it again. ``quiet``: a tick that could not
        start (the scheduler says once that the database is away), not
        logged on its own."""
        now = time.monotonic()
        with self._lock:
            streak = self._streaks.get(job)
            if streak is None:
                streak = self._streaks[job] = _Streak(0, now, why)
            streak.count += 1
            streak.last = why
            count, since = streak.count, streak.since
            long = not streak.told_long and now - since >= self.long
            streak.told_long = streak.told_long or long
            first = not streak.told and not quiet
            streak.told = streak.told or first
        delay = float(min(self.first * 2.0 ** (count - 1), self.most))
        if first:
            self._say_first(job, why, delay)
        elif long:
            self._say_long(job, why, count, now - since)
        else:
            log.debug("pgjobs: %s: %s again (%s), retrying in %.1f s", job, self.word, why, delay)
        return delay

    #: what one of them is called in the log lines
    word = "interrupted"

    def _say_first(self, job: str, why: str, delay: float) -> None:
        log.warning(
            "pgjobs: %s: interrupted (%s); not a failure of the job: retrying in %.1f s"
            " on a fresh connection",
            job,
            why,
            delay,
        )

    def _say_long(self, job: str, why: str, count: int, seconds: float) -> None:
        log.warning(
            "pgjobs: %s: interrupted %d times over %.0f s (last: %s); still retrying"
            " every %.0f s at most",
            job,
            count,
            seconds,
            why,
            self.most,
        )

    def _say_clear(self, job: str, count: int, seconds: float) -> None:
        log.warning(
            "pgjobs: %s: gets through again, after %d interruption(s) over %.1f s",
            job,
            count,
            seconds,
        )

    def clear(self, job: str) -> None:
        """A tick of ``job`` got through: the next interruption starts afresh."""
        if job not in self._streaks:
            return
        with self._lock:
            streak = self._streaks.pop(job, None)
        if streak is not None and (streak.told or streak.told_long):
            self._say_clear(job, streak.count, time.monotonic() - streak.since)

    def streak(self, job: str) -> tuple[int, float] | None:
        """(interruptions, seconds since the first) of ``job``'s current streak."""
        with self._lock:
            streak = self._streaks.get(job)
            return None if streak is None else (streak.count, time.monotonic() - streak.since)


#: the first retry after a transient failure, doubling up to :data:`TRANSIENT_MAX`
TRANSIENT_FIRST = 1.0
#: the longest wait between two retries of a job failing transiently, in seconds
TRANSIENT_MAX = 30.0
#: transient failures that go on this long (seconds, none getting through)
#: are the job's failure: the next one backs the job off (``docs/operate.md``)
TRANSIENT_BOUND = 600.0


class Transients(Interruptions):
    """Per job, the transient failures since its last tick that got
    through (:func:`transient`: a lock timeout, a deadlock, a serialization
    failure, an operator's cancel, a cached plan gone stale): retried after
    :data:`TRANSIENT_FIRST` doubling to :data:`TRANSIENT_MAX`, never the
    job's backoff, until they have gone on for :data:`TRANSIENT_BOUND`
    (:meth:`persisting`). One line when a streak starts, one when it ends."""

    first = TRANSIENT_FIRST
    most = TRANSIENT_MAX
    long = TRANSIENT_BOUND
    word = "transient failure"

    def persisted(self, job: str) -> bool:
        """Have ``job``'s transient failures gone on for :data:`TRANSIENT_BOUND`?
        Then the streak ends here (said once): the failure at hand is the
        job's, and backs it off."""
        with self._lock:
            streak = self._streaks.get(job)
            if streak is None or time.monotonic() - streak.since < self.long:
                return False
            del self._streaks[job]
        log.warning(
            "pgjobs: %s: %d transient failures over %.0f s (last: %s): this one is"
            " the job's failure, and backs it off",
            job,
            streak.count,
            time.monotonic() - streak.since,
            streak.last,
        )
        return True

    def _say_first(self, job: str, why: str, delay: float) -> None:
        log.warning(
            "pgjobs: %s: transient failure (%s); rolled back, not the job's backoff:"
            " retrying in %.1f s",
            job,
            why,
            delay,
        )

    def _say_clear(self, job: str, count: int, seconds: float) -> None:
        log.warning(
            "pgjobs: %s: gets through again, after %d transient failure(s) over %.1f s",
            job,
            count,
            seconds,
        )


#: the first retry of a queue tick that left items for a lock someone else
#: holds, doubling up to :data:`DEFERRED_MAX` while it goes on
DEFERRED_FIRST = 0.5
DEFERRED_MAX = 5.0


class Deferrals:
    """Per job, how many ticks in a row left items queued for a lock someone
    else holds (a parent, a derived row): the next tick comes
    :data:`DEFERRED_FIRST` later, doubling up to :data:`DEFERRED_MAX`, so
    that an item is written within seconds of the lock's release, while a
    lock held for an hour costs a tick every few seconds, not a busy loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def note(self, job: str) -> float:
        """Count one more such tick of ``job``; the seconds until the next."""
        with self._lock:
            count = self._counts[job] = self._counts.get(job, 0) + 1
        return float(min(DEFERRED_FIRST * 2.0 ** (count - 1), DEFERRED_MAX))

    def clear(self, job: str) -> None:
        if job in self._counts:
            with self._lock:
                self._counts.pop(job, None)


#: SQLSTATEs of a failure that is nobody's fault for long: a lock timeout,
#: an operator's cancel (57014, when the statement timeout cannot have
#: fired), a cached plan a DDL made stale; and class 40 (a deadlock, a
#: serialization failure)
_TRANSIENT_STATES = ("55P03", "57014", "0A000")


def transient(exc: BaseException, job: Job, seconds: float) -> tuple[str, str] | None:
    """(SQLSTATE, one line) when ``exc`` is a transient failure of a run
    that has taken ``seconds`` so far: a lock not granted within
    ``lock_timeout`` (55P03), a deadlock or a serialization failure (class
    40), a statement cancelled by someone else (57014 before the job's
    ``statement_timeout`` could have fired: a cancel after it is taken for
    the timeout, the job's own failure), a cached plan made stale by a
    DDL (0A000, "cached plan must not change result type": the connection
    is then dropped, and its statements prepared again on the next).
    ``None``: not transient."""
    state = sqlstate_of(exc)
    if state is None or not (state.startswith("40") or state in _TRANSIENT_STATES):
        return None
    if state == "57014" and _statement_timeout(exc, job, seconds):
        return None
    return state, f"{first_line(exc)} (SQLSTATE {state})"


def _statement_timeout(exc: BaseException, job: Job, seconds: float) -> bool:
    """Was the 57014 ``exc`` a statement timeout (the job's own failure: its
    SQL takes too long), not an operator's ``pg_cancel_backend``? PostgreSQL
    gives both the one SQLSTATE; only its message tells them apart, in
    English (``lc_messages``), so a run that took the job's whole
    ``statement_timeout`` counts as timed out whatever the message says."""
    diag = getattr(driver_error(exc), "diag", None)
    if "statement timeout" in (getattr(diag, "message_primary", None) or ""):
        return True
    timeout = job.statement_timeout
    assert isinstance(timeout, timedelta)
    return timeout > timedelta(0) and seconds >= timeout.total_seconds()


class Ledger:
    """pgjobs' bookkeeping writes that outlive a tick: a failure recorded
    on the tick's connection or a fresh one, an interrupted run written on
    a fresh one; what the database cannot take now (it is away, or a
    standby) is kept, and :meth:`flush` writes it (the runner calls it
    before the next tick, or after one that got through). Every write
    commits with :data:`LOCAL_COMMIT`."""

    def __init__(
        self,
        store: Store,
        worker: str,
        quiet: QuietTicks,
        connect: Callable[[], AbstractContextManager[Connection]],
    ) -> None:
        self.store = store
        self.worker = worker
        self.quiet = quiet
        #: a bounded connection of the runner's engine
        self.connect = connect
        self._lock = threading.Lock()
        #: failures that could not be written yet (the database was away), by job
        self._unrecorded: dict[str, Failure] = {}
        #: interrupted runs that could not be written yet, the last :data:`LATE_MAX`
        self._late: list[RunResult] = []

    @property
    def failures_kept(self) -> bool:
        return bool(self._unrecorded)

    @property
    def late_kept(self) -> bool:
        return bool(self._late)

    def flush(self) -> None:
        """Write the failures and interrupted runs that could not be recorded
        when they happened, and the counts of quiet ticks."""
        with self._lock:
            failures, self._unrecorded = self._unrecorded, {}
            late, self._late = self._late, []
        jobs = self.quiet.jobs()
        if not failures and not jobs and not late:
            return
        try:
            with self.connect() as conn, conn.begin():
                later(conn, *LOCAL_COMMIT_SQL)
                for failure in failures.values():
                    later(conn, *failure.state_query(self.store))
                    later(conn, *self.store.run_query(failure.result, self.worker))
                for result in late:
                    later(conn, *self.store.run_query(result, self.worker))
                for job in jobs:
                    self.quiet.queue_for(conn, job)
                send(conn)
        except Exception:
            with self._lock:
                for job, failure in failures.items():
                    self._unrecorded.setdefault(job, failure)
                self._late = [*late, *self._late][-LATE_MAX:]
            raise
        for failure in failures.values():
            log.info("pgjobs: %s: its failure is recorded now", failure.result.job)

    def record_failure(self, failure: Failure, conn: Connection) -> RunResult:
        """Write ``failure`` on ``conn`` if it still works, else on a new
        connection; else keep it and write it once the database answers
        again (:meth:`flush`, before the next tick)."""
        if not conn.invalidated:
            try:
                return self._save_failure(conn, failure)
            except Exception:
                log.debug(
                    "pgjobs: recording %s's failure on its own connection failed",
                    failure.result.job,
                    exc_info=True,
                )
        try:
            with self.connect() as other:
                return self._save_failure(other, failure)
        except Exception:
            with self._lock:
                self._unrecorded[failure.result.job] = failure
            log.warning(
                "pgjobs: %s: its failure cannot be recorded now (database unreachable);"
                " kept until it can",
                failure.result.job,
            )
            return failure.result

    def _save_failure(self, conn: Connection, failure: Failure) -> RunResult:
        with conn.begin():
            later(conn, *LOCAL_COMMIT_SQL)
            self.quiet.queue_for(conn, failure.result.job)
            _, recorded = send(
                conn,
                failure.state_query(self.store),
                self.store.run_query(failure.result, self.worker),
            )
        return replace(failure.result, run_id=int(recorded.scalar()))

    def record_run(self, result: RunResult, conn: Connection) -> RunResult:
        """Record ``result`` in the run log alone (``job_state`` untouched):
        on ``conn`` (not in a transaction) if it still works, else on a fresh
        connection; ``result`` with its ``run_id``, or as it is when neither
        could write it (a cancelled run is not kept for later)."""
        tries: list[AbstractContextManager[Connection]] = []
        if not (conn.invalidated or conn.closed):
            tries.append(contextlib.nullcontext(conn))
        for use in [*tries, self.connect()]:
            try:
                with use as c, c.begin():
                    later(c, *LOCAL_COMMIT_SQL)
                    (recorded,) = send(c, self.store.run_query(result, self.worker))
                return replace(result, run_id=int(recorded.scalar()))
            except Exception:
                log.debug(
                    "pgjobs: %s: recording its %s run failed",
                    result.job,
                    result.outcome,
                    exc_info=True,
                )
        return result

    def record_interrupted(self, result: RunResult) -> RunResult:
        """Write an interrupted run to the run log, on a fresh connection, if
        the database takes it (a standby does not: then it is kept, and
        written after the next tick that gets through); its job's state is
        left as it is."""
        try:
            with self.connect() as conn, conn.begin():
                later(conn, *LOCAL_COMMIT_SQL)
                (recorded,) = send(conn, self.store.run_query(result, self.worker))
            return replace(result, run_id=int(recorded.scalar()))
        except Exception:
            log.debug(
                "pgjobs: %s: its interrupted run is kept for later", result.job, exc_info=True
            )
            with self._lock:
                self._late = [*self._late, result][-LATE_MAX:]
            return result


def cancelled(job: str, started_at: datetime, finished_at: datetime) -> RunResult:
    """A run that a shutdown deadline cancelled (rolled back; not a failure)."""
    return RunResult(
        job=job,
        outcome=Outcome.CANCELLED,
        started_at=started_at,
        finished_at=finished_at,
        error="cancelled by the shutdown deadline; rolled back",
    )


__all__ = [
    "TRANSIENT_BOUND",
    "TRANSIENT_FIRST",
    "TRANSIENT_MAX",
    "Deferrals",
    "Failure",
    "Interruptions",
    "Ledger",
    "QuietTicks",
    "Transients",
    "cancelled",
    "interruption",
    "tick_bound",
    "transient",
]
