"""What a run produces: :class:`DiffStats`, :class:`RunResult` and the outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """How one tick of a job ended."""

    RAN = "ran"  #: the job ran and committed
    IDLE = "idle"  #: ``has_work`` said there was nothing to do; no lock was taken
    BUSY = "busy"  #: another transaction holds the group lock; nothing was done
    BACKING_OFF = "backing_off"  #: the job failed recently and waits for ``next_attempt_at``
    NOT_DUE = "not_due"  #: it ran less than one interval ago (here or on another replica)
    FAILED = "failed"  #: the job raised; its transaction was rolled back
    #: a verification (``verify_every``, :func:`pgjobs.check`) that wrote nothing;
    #: its figures are what a recompute would write
    CHECKED = "checked"
    PAUSED = "paused"  #: the job is paused (``pgjobs pause``); nothing was done
    #: a shutdown deadline cancelled the run's statement; rolled back, not a
    #: failure (no backoff)
    CANCELLED = "cancelled"
    #: the connection was lost under the tick (the server shut the session
    #: down, a failover, a deadline passed, a read-only server): rolled back,
    #: retried within seconds on a fresh connection, without the job's backoff
    INTERRUPTED = "interrupted"
    #: a lock timeout, a deadlock, a serialization failure, an operator's
    #: cancel or a stale cached plan rolled the run back: retried within
    #: seconds, without the job's backoff, unless it goes on for 10 minutes
    TRANSIENT = "transient"


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffStats:
    """What the diff writer did to the target table."""

    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    skipped_missing_parent: int = 0
    unchanged: int = 0

    @property
    def changed(self) -> int:
        """Rows written: inserted + updated + deleted."""
        return self.inserted + self.updated + self.deleted

    def __add__(self, other: DiffStats) -> DiffStats:
        return DiffStats(
            inserted=self.inserted + other.inserted,
            updated=self.updated + other.updated,
            deleted=self.deleted + other.deleted,
            skipped_missing_parent=self.skipped_missing_parent + other.skipped_missing_parent,
            unchanged=self.unchanged + other.unchanged,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Execution:
    """What a job's body reports back to the runner (internal to job kinds)."""

    stats: DiffStats = field(default_factory=DiffStats)
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
    lock_seconds: float = 0.0  #: time from the first row lock to the end of the writes
    items: int = 0  #: queue items processed (queue jobs)
    failed_items: int = 0  #: queue items that failed and were isolated (queue jobs)
    detail: dict[str, Any] = field(default_factory=dict)
    #: per processed queue item, seconds from its enqueue to the end of the writes
    queue_lag: tuple[float, ...] = ()
    #: the body found nothing to do after all (another worker took the items
    #: the work check saw): the runner rolls back and ends the tick ``idle``
    idle: bool = False
    #: items were left queued for a lock someone else holds (a parent, a
    #: derived row, the entry itself): the runner asks for the tick again
    #: within seconds
    retry_soon: bool = False
    #: the body gave up without writing (a recompute whose queue workers
    #: changed while it ran with flow): the runner rolls back and ends the
    #: tick ``busy``, to be retried soon
    busy: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """The result of one tick of a job (:func:`pgjobs.run_once`)."""

    job: str
    outcome: Outcome
    started_at: datetime
    finished_at: datetime
    stats: DiffStats = field(default_factory=DiffStats)
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
    lock_seconds: float = 0.0
    items: int = 0
    failed_items: int = 0
    error: str | None = None
    sqlstate: str | None = None
    next_attempt_at: datetime | None = None
    #: for a ``busy`` periodic job: try again after this rather than a full
    #: interval; for ``interrupted`` and ``transient`` runs, and a queue tick
    #: that left items for a lock someone holds: the next try, within seconds
    retry_after: timedelta | None = None
    run_id: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    #: per processed queue item, seconds from its enqueue to the end of the
    #: writes (for metrics; not stored in the run log)
    queue_lag: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        """Wall time of the tick."""
        return (self.finished_at - self.started_at).total_seconds()

    @property
    def slices(self) -> int | None:
        """A sliced run's slices, over every process that took part (the
        record of the run's last slice); ``None`` for any other run."""
        sliced = self.detail.get("sliced")
        return int(sliced["slices"]) if isinstance(sliced, dict) and "slices" in sliced else None

    @property
    def processes(self) -> list[str]:
        """The processes (``host:pid``) that did a sliced run's slices."""
        sliced = self.detail.get("sliced")
        return list(sliced.get("processes", ())) if isinstance(sliced, dict) else []

    @property
    def resumed(self) -> bool:
        """A sliced run that a tick took up after the ticks working on it had
        stopped (a crash, a failure, a shutdown)."""
        sliced = self.detail.get("sliced")
        return bool(sliced.get("resumed")) if isinstance(sliced, dict) else False

    @property
    def ok(self) -> bool:
        """Everything but ``failed``, ``interrupted`` and ``transient``."""
        return self.outcome not in (Outcome.FAILED, Outcome.INTERRUPTED, Outcome.TRANSIENT)


__all__ = [
    "DiffStats",
    "Execution",
    "Outcome",
    "RunResult",
]
