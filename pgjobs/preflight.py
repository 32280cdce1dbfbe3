"""Jobs set aside because they failed their pre-flight check, for the scheduler.

At :meth:`pgjobs.Scheduler.start` every recompute and queue job is checked
against the database (:func:`pgjobs.checks.check_each`: its target table,
its key, its scope columns, its SQL). A job that fails is not allowed to
stop the others (one plugin's missing table used to refuse the whole
``pgjobs run``, and with it a FastAPI application's lifespan): it is
reported in one line, recorded as a failure in ``job_state`` and the run log
(so ``pgjobs status``, the status page and the metrics show it failing,
with the reason), and backed off by its own backoff policy. When the
backoff ends, its next tick checks it again instead of running: once the
check passes (the table was created), the job runs as any other.
``pgjobs run --strict`` (``Scheduler(strict=True)``) refuses to start
instead, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from datetime import datetime

from ._pg import first_line
from .checks import check_each
from .jobs import Job
from .records import Failure
from .registry import Registered
from .results import Outcome, RunResult
from .runner import Runner

log = logging.getLogger(__name__)

#: the prefix of the error recorded for a job that failed its check
PREFIX = "pre-flight check: "


class Preflight:
    """The jobs that failed their check, each with the time of its next check."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._entries: dict[str, Registered] = {}
        #: job name -> when to check it again
        self._next: dict[str, datetime] = {}
        self._lock = threading.Lock()

    @property
    def failing(self) -> list[str]:
        with self._lock:
            return sorted(self._next)

    def check(self, entries: Iterable[Registered]) -> dict[str, Exception]:
        """Check ``entries`` (the database must answer: otherwise this raises);
        set aside and record those that fail. Returns them."""
        entries = list(entries)
        failed = check_each(self.runner.engine, entries, schema=self.runner.store.schema)
        for entry in entries:
            exc = failed.get(entry.job.name)
            if exc is not None:
                self._set_aside(entry, exc)
        return failed

    def ready(self, job: Job) -> bool:
        """May ``job`` tick now? Yes unless it is set aside; when its backoff
        is over it is checked again first (by one thread at a time)."""
        if job.name not in self._next:  # no lock: the common case is one dict probe
            return True
        with self._lock:
            due = self._next.get(job.name)
            if due is None:
                return True
            if self.runner.clock() < due:
                return False
            entry = self._entries[job.name]
            # another thread asking meanwhile waits for the next check time
            self._next[job.name] = datetime.max.replace(tzinfo=due.tzinfo)
        try:
            failed = check_each(self.runner.engine, [entry], schema=self.runner.store.schema)
        except Exception:
            with self._lock:
                self._next[job.name] = due  # the database is away: check at the next tick
            raise
        exc = failed.get(job.name)
        if exc is not None:
            self._set_aside(entry, exc)
            return False
        with self._lock:
            self._next.pop(job.name, None)
            self._entries.pop(job.name, None)
        log.warning("pgjobs: %s: passes its pre-flight check now; it runs again", job.name)
        return True

    def _set_aside(self, entry: Registered, exc: Exception) -> None:
        """Record the failure (the job's failures + 1, backed off by its policy)
        and say so in one line."""
        job, runner = entry.job, self.runner
        reason = first_line(exc)
        with runner.engine.connect() as conn:
            runner.store.ensure(conn)
            with conn.begin():
                state = runner.store.read_state(conn, job.name)
            failures = (state.failures if state is not None else 0) + 1
            now = runner.clock()
            result = RunResult(
                job=job.name,
                outcome=Outcome.FAILED,
                started_at=now,
                finished_at=now,
                error=PREFIX + reason,
                next_attempt_at=now + job.backoff_policy.delay(failures),
            )
            runner.record_failure(Failure(result=result, failures=failures, started_at=now), conn)
        assert result.next_attempt_at is not None
        with self._lock:
            self._entries[job.name] = entry
            self._next[job.name] = result.next_attempt_at
        log.error(
            "pgjobs: %s: fails its pre-flight check (%s); the other jobs run, this one is"
            " checked again at %s",
            job.name,
            reason,
            f"{result.next_attempt_at:%Y-%m-%d %H:%M:%S %Z}",
        )


__all__ = ["PREFIX", "Preflight"]
