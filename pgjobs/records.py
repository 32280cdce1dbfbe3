"""What ticks leave behind in ``job_state`` and the run log, for the runner
(:mod:`pgjobs.runner`): a failed run and the state it puts its job in, and
the counts of the ticks that changed nothing (``idle``, ``busy``,
``not_due``, ``backing_off``, ``paused``), kept per job until the next
write; and a run that a shutdown deadline cancelled."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection, Engine

from ._pg import later, send
from .results import Outcome, RunResult
from .store import Store

log = logging.getLogger(__name__)


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


def cancelled(job: str, started_at: datetime, finished_at: datetime) -> RunResult:
    """A run that a shutdown deadline cancelled (rolled back; not a failure)."""
    return RunResult(
        job=job,
        outcome=Outcome.CANCELLED,
        started_at=started_at,
        finished_at=finished_at,
        error="cancelled by the shutdown deadline; rolled back",
    )


def write_run(
    engine: Engine, conn: Connection, store: Store, result: RunResult, worker: str
) -> RunResult:
    """Record ``result`` in the run log alone (``job_state`` untouched), on
    ``conn`` (not in a transaction) if it still works, else on a connection
    of its own; ``result`` with its ``run_id``, or as it is when neither
    could write it."""
    for use in (conn, None):
        try:
            if use is None or use.invalidated:
                with engine.connect() as other, other.begin():
                    (recorded,) = send(other, store.run_query(result, worker))
            else:
                with use.begin():
                    (recorded,) = send(use, store.run_query(result, worker))
            return replace(result, run_id=int(recorded.scalar()))
        except Exception:
            log.debug(
                "pgjobs: %s: recording its %s run failed", result.job, result.outcome, exc_info=True
            )
    return result


__all__ = ["Failure", "QuietTicks", "cancelled", "write_run"]
