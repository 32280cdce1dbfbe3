"""What ticks leave behind in ``job_state`` and the run log, for the runner
(:mod:`pgjobs.runner`): a failed run and the state it puts its job in, and
the counts of the ticks that changed nothing (``idle``, ``busy``,
``not_due``, ``backing_off``), kept per job until the next write; and the
interruptions of each job (:class:`Interruptions`: runs cut off because the
connection went away), with the short retry delay of their own."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import later
from .results import RunResult
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
    through again; the ones in between at DEBUG."""

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
            long = not streak.told_long and now - since >= LONG_INTERRUPTION
            streak.told_long = streak.told_long or long
            first = not streak.told and not quiet
            streak.told = streak.told or first
        delay = float(min(RETRY_FIRST * 2.0 ** (count - 1), RETRY_MAX))
        if first:
            log.warning(
                "pgjobs: %s: interrupted (%s); not a failure of the job: retrying in %.1f s"
                " on a fresh connection",
                job,
                why,
                delay,
            )
        elif long:
            log.warning(
                "pgjobs: %s: interrupted %d times over %.0f s (last: %s); still retrying"
                " every %.0f s at most",
                job,
                count,
                now - since,
                why,
                RETRY_MAX,
            )
        else:
            log.debug("pgjobs: %s: interrupted again (%s), retrying in %.1f s", job, why, delay)
        return delay

    def clear(self, job: str) -> None:
        """A tick of ``job`` got through: the next interruption starts afresh."""
        if job not in self._streaks:
            return
        with self._lock:
            streak = self._streaks.pop(job, None)
        if streak is not None and (streak.told or streak.told_long):
            log.warning(
                "pgjobs: %s: gets through again, after %d interruption(s) over %.1f s",
                job,
                streak.count,
                time.monotonic() - streak.since,
            )

    def streak(self, job: str) -> tuple[int, float] | None:
        """(interruptions, seconds since the first) of ``job``'s current streak."""
        with self._lock:
            streak = self._streaks.get(job)
            return None if streak is None else (streak.count, time.monotonic() - streak.since)


__all__ = ["Failure", "Interruptions", "QuietTicks"]
