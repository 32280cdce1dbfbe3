"""The scheduler's parts that are not APScheduler's: how many ticks are in
flight (for a shutdown's wait), a job's worker slots, the outage's two log
lines, the listener's, and whether a queue tick calls the next at once.

:class:`~pgjobs.Scheduler` (:mod:`pgjobs.scheduler`) puts them together;
they are here so that each can be read on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from ._pg import first_line, why_unavailable
from .durations import Duration, parse_duration
from .errors import ConfigError
from .jobs import Job, QueueJob
from .results import Outcome, RunResult

log = logging.getLogger("pgjobs.scheduler")


def lost_listening(exc: BaseException) -> None:
    log.warning(
        "pgjobs: not listening for enqueues (%s); the queue jobs poll until it can again",
        first_line(exc),
    )


def listening_again(server: str) -> None:
    log.warning("pgjobs: listening for enqueues again, on %s", server)


def _claimed(job: Job, result: RunResult) -> tuple[int, int]:
    """(items a queue tick claimed, of which it left queued for later)."""
    if not isinstance(job, QueueJob) or result.outcome is not Outcome.RAN:
        return 0, 0
    return int(result.detail.get("claimed", result.items)), int(result.detail.get("kept", 0))


def more_at_once(job: Job, result: RunResult, *, listening: bool = False) -> bool:
    """Is another tick due at once? After any tick that took items off the
    queue: a partial batch does not mean an empty queue when workers claim
    side by side (two read the same due items, one gets them). The tick
    that finds nothing ends it, for one work check. A lone worker
    (``workers = 1``) that claimed a partial batch while the scheduler is
    listening saw every due item it could take: what is enqueued after its
    claim wakes it again, so it skips that check (a trickle's every item
    paid a second tick for it)."""
    claimed, kept = _claimed(job, result)
    if claimed <= kept:
        return False
    partial = isinstance(job, QueueJob) and job.workers == 1 and claimed < job.batch_size
    return not (listening and partial)


#: after a shutdown deadline, the longest :meth:`~pgjobs.Scheduler.shutdown` waits
#: for the cancelled ticks to roll back, asking again every 100 ms
CANCEL_GRACE = 0.8


def deadline_of(value: Duration | None, field: str) -> timedelta | None:
    if value is None:
        return None
    deadline = parse_duration(value, field=field)
    if deadline < timedelta(0):
        raise ConfigError(f"{field}: must not be negative, got {value!r}")
    return deadline


class InFlight:
    """How many entry calls (ticks, prunes) run now; :meth:`wait` for none.
    A call entered after :meth:`~pgjobs.Scheduler.shutdown` set its stop flag sees
    the flag and returns without ticking."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    def __enter__(self) -> None:
        with self._idle:
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    def wait(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout=timeout)


class Slot:
    """One worker of a job: one tick at a time; ``again`` asks it for one more."""

    __slots__ = ("again", "running")

    def __init__(self) -> None:
        self.running = threading.Lock()
        self.again = False


class Outage:
    """One line when the database stops answering, one when it is back:
    the ticks in between are skipped without a word each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None

    def down(self, exc: BaseException) -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.warning(
            "pgjobs: the database is unreachable (%s); the jobs wait for it, trying again"
            " within seconds",
            why_unavailable(exc),
        )
        log.debug("pgjobs: the error", exc_info=exc)

    def up(self) -> None:
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning(
                "pgjobs: the database answers again, after %.1f s", time.monotonic() - since
            )


__all__ = [
    "CANCEL_GRACE",
    "InFlight",
    "Outage",
    "Slot",
    "deadline_of",
    "listening_again",
    "lost_listening",
    "more_at_once",
]
