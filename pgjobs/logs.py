"""What pgjobs logs, and how it reads: one line per run that did something
(a queue job: one line a minute), a line when a job starts and stops
backing off, the same fields as JSON.

The runner calls :func:`ran`, :func:`failed` and :func:`quiet`; each logs
one human line and attaches its fields to the record (``record.pgjobs``)::

    exam-scores ran in 0.42 s: +12 ~340 -3, 5 skipped (parent gone), row locks 18 ms
    exam-scores failed after 0.10 s: ForeignKeyViolation: ... (SQLSTATE 23503)
    exam-scores backing off for 1h: next attempt at 2025-05-01 13:34:56 UTC
    exam-scores no longer backing off: ran after 3 failures
    exam-worker: 48,211 items in 1,532 ticks in the last 60 s, lag p50 5.7 ms p95 6.5 ms, ...

A queue job's ticks come by the hundred a second under load: each one's
line is DEBUG, and :data:`SUMMARY` writes one INFO line per queue job a
minute (items, ticks, lag p50/p95, failed items, the xmin horizon if held:
:mod:`pgjobs.horizon`). Failures, backoffs, recomputes and state changes
stay at INFO or above.

:class:`TextFormatter` shows the logger's name once (the library's older
messages begin with ``pgjobs:`` themselves; the formatter drops that).
:class:`JsonFormatter` writes one JSON object a line, for log shippers. The
library configures no logging: the CLI, or the host application, does.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .durations import format_duration
from .results import Outcome, RunResult

#: the attribute of a log record that holds the event's fields
FIELDS = "pgjobs"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def _ms(value: float) -> str:
    ms = value * 1000
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def fields(result: RunResult) -> dict[str, Any]:
    """A run's figures as JSON-ready fields (the same for every event)."""
    s = result.stats
    out: dict[str, Any] = {
        "job": result.job,
        "outcome": str(result.outcome),
        "seconds": round(result.seconds, 6),
    }
    if result.outcome is Outcome.RAN:
        out.update(
            inserted=s.inserted,
            updated=s.updated,
            deleted=s.deleted,
            skipped_parent_gone=s.skipped_missing_parent,
            unchanged=s.unchanged,
            deferred=int(result.detail.get("rows_deferred", 0) or 0),
            compute_seconds=round(result.compute_seconds, 6),
            write_seconds=round(result.write_seconds, 6),
            lock_seconds=round(result.lock_seconds, 6),
        )
        if result.items or result.failed_items or "claimed" in result.detail:
            out.update(items=result.items, failed_items=result.failed_items)
    if result.error is not None:
        out["error"] = result.error
    if result.sqlstate is not None:
        out["sqlstate"] = result.sqlstate
    if result.next_attempt_at is not None:
        out["next_attempt_at"] = result.next_attempt_at.isoformat()
    if result.run_id is not None:
        out["run_id"] = result.run_id
    return out


def run_line(result: RunResult) -> str:
    """``exam-scores ran in 0.42 s: +12 ~340 -3, 5 skipped (parent gone), row locks 18 ms``"""
    s = result.stats
    parts = [f"+{s.inserted:,} ~{s.updated:,} -{s.deleted:,}"]
    if result.items or result.failed_items or "claimed" in result.detail:
        parts.insert(0, _plural(result.items, "item"))
    if s.skipped_missing_parent:
        parts.append(f"{s.skipped_missing_parent:,} skipped (parent gone)")
    deferred = int(result.detail.get("rows_deferred", 0) or 0)
    if deferred:
        parts.append(f"{deferred:,} deferred (parent busy)")
    gone = int(result.detail.get("parent_gone", 0) or 0)
    if gone:
        parts.append(f"{_plural(gone, 'item')} dropped (parent gone)")
    if result.failed_items:
        parts.append(f"{_plural(result.failed_items, 'item')} failed")
    if result.lock_seconds > 0:
        parts.append(f"row locks {_ms(result.lock_seconds)}")
    return f"{result.job} ran in {_seconds(result.seconds)}: {', '.join(parts)}"


def failure_line(result: RunResult, failures: int = 1) -> str:
    """``exam-scores failed after 0.10 s: <error> (SQLSTATE 23503)``"""
    again = f" again ({failures} in a row)" if failures > 1 else ""
    state = f" (SQLSTATE {result.sqlstate})" if result.sqlstate else ""
    # one line: PostgreSQL's LINE/caret detail is in the JSON field and the traceback
    error = (result.error or "").strip().splitlines()[0] if result.error else "?"
    return f"{result.job} failed{again} after {_seconds(result.seconds)}: {error}{state}"


def backoff_line(result: RunResult, failures: int = 1) -> str:
    """``exam-scores backing off for 1h: next attempt at 2025-05-01 13:34:56 UTC``"""
    wait = ""
    if result.next_attempt_at is not None:
        delta = result.next_attempt_at - result.finished_at
        wait = f" for {format_duration(max(delta, timedelta(0)))}"
    head = "backing off" if failures <= 1 else "still backing off"
    return f"{result.job} {head}{wait}: next attempt at {_when(result.next_attempt_at)}"


def recovered_line(result: RunResult, failures: int) -> str:
    """``exam-scores no longer backing off: ran after 3 failures``"""
    return f"{result.job} no longer backing off: ran after {_plural(failures, 'failure')}"


def quiet_line(result: RunResult) -> str:
    """A tick that changed nothing: ``exam-worker: idle (no work)``."""
    why = {
        Outcome.IDLE: "idle (no work)",
        Outcome.BUSY: "busy (another transaction holds the group lock)",
        Outcome.NOT_DUE: f"not due until {_when(result.next_attempt_at)}",
        Outcome.BACKING_OFF: f"backing off until {_when(result.next_attempt_at)}",
        Outcome.PAUSED: f"paused (pgjobs resume {result.job} resumes it)",
    }.get(result.outcome, str(result.outcome))
    sliced = (result.detail or {}).get("sliced")
    if result.outcome is Outcome.BUSY and isinstance(sliced, dict) and sliced.get("joined"):
        why = (
            f"busy (joined its sliced run: {sliced.get('slices_here', 0)} slice(s) here;"
            " the last piece is another process's, which records the run)"
        )
    return f"{result.job}: {why}"


def _log(logger: logging.Logger, level: int, message: str, data: dict[str, Any], **kw: Any) -> None:
    if logger.isEnabledFor(level):
        # "%s" so that a % in a job name or an error is not read as a format
        # stacklevel: the record names the line that called ran()/failed()/quiet()
        logger.log(level, "%s", message, extra={FIELDS: data}, stacklevel=3, **kw)


def ran(logger: logging.Logger, result: RunResult, *, previous_failures: int = 0) -> None:
    """Log a run that committed (INFO; a queue tick at DEBUG, counted in its
    job's summary line); after failures, first say that the job no longer
    backs off."""
    if previous_failures > 0:
        _log(
            logger,
            logging.INFO,
            recovered_line(result, previous_failures),
            {"event": "backoff_end", "job": result.job, "failures": previous_failures},
        )
    if "claimed" not in result.detail:
        _log(logger, logging.INFO, run_line(result), {"event": "ran", **fields(result)})
        return
    _log(logger, logging.DEBUG, run_line(result), {"event": "ran", **fields(result)})
    if logger.isEnabledFor(logging.INFO):  # nobody reads the summary: nothing kept
        SUMMARY.add(logger, result)


# -- a queue job's minute ------------------------------------------------------------
#: how often a queue job's summary line is written (seconds)
SUMMARY_EVERY = 60.0


def _quantile(values: list[float], q: float) -> float | None:
    """Nearest rank of sorted ``values``."""
    if not values:
        return None
    return values[min(len(values), max(1, math.ceil(q * len(values)))) - 1]


@dataclass(kw_only=True, slots=True)
class _Window:
    started: float
    ticks: int = 0
    items: int = 0
    failed_items: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    lags: list[float] = field(default_factory=list)


class QueueSummary:
    """Each queue job's ticks since its last summary line: :meth:`add` each
    tick that ran; the line is written by the first tick :data:`SUMMARY_EVERY`
    seconds after the window's first, or by :meth:`flush` (a scheduler's
    heartbeat calls it, so that the last minute of a burst is written too).
    :meth:`set_horizon` gives the xmin horizon to name while it is held."""

    def __init__(
        self, every: float = SUMMARY_EVERY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every = every
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._loggers: dict[str, logging.Logger] = {}
        self._horizon: tuple[str, Mapping[str, Any]] | None = None

    def set_horizon(self, text: str | None, data: Mapping[str, Any] | None = None) -> None:
        """The holder of the xmin horizon as a phrase and as fields (``None``: not held)."""
        self._horizon = None if text is None else (text, dict(data or {}))

    def add(self, logger: logging.Logger, result: RunResult) -> None:
        now = self.clock()
        with self._lock:
            window = self._windows.get(result.job)
            if window is None:
                window = self._windows[result.job] = _Window(started=now)
            self._loggers[result.job] = logger
            window.ticks += 1
            window.items += result.items
            window.failed_items += result.failed_items
            window.inserted += result.stats.inserted
            window.updated += result.stats.updated
            window.deleted += result.stats.deleted
            window.lags.extend(result.queue_lag)
            due = now - window.started >= self.every
            if due:
                del self._windows[result.job]
        if due:
            self._write(logger, result.job, window, now)

    def flush(self, *, force: bool = False) -> None:
        """Write the lines of the windows a minute old (``force``: all of them)."""
        now = self.clock()
        with self._lock:
            done = {
                job: w for job, w in self._windows.items() if force or now - w.started >= self.every
            }
            for job in done:
                del self._windows[job]
        for job, window in done.items():
            self._write(self._loggers[job], job, window, now)

    def _write(self, logger: logging.Logger, job: str, w: _Window, now: float) -> None:
        lags = sorted(w.lags)
        p50, p95 = _quantile(lags, 0.5), _quantile(lags, 0.95)
        seconds = max(now - w.started, 0.0)
        parts = [
            f"{_plural(w.items, 'item')} in {_plural(w.ticks, 'tick')}"
            f" in the last {round(seconds)} s"
        ]
        if p50 is not None and p95 is not None:
            parts.append(f"lag p50 {_ms(p50)} p95 {_ms(p95)}")
        parts.append(f"+{w.inserted:,} ~{w.updated:,} -{w.deleted:,}")
        parts.append(f"{_plural(w.failed_items, 'item')} failed")
        data: dict[str, Any] = {
            "event": "queue_summary",
            "job": job,
            "seconds": round(seconds, 3),
            "ticks": w.ticks,
            "items": w.items,
            "failed_items": w.failed_items,
            "inserted": w.inserted,
            "updated": w.updated,
            "deleted": w.deleted,
            "lag_p50_seconds": None if p50 is None else round(p50, 6),
            "lag_p95_seconds": None if p95 is None else round(p95, 6),
        }
        horizon = self._horizon
        if horizon is not None:
            parts.append(f"xmin horizon held by {horizon[0]}")
            data["horizon"] = horizon[1]
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", f"{job}: {', '.join(parts)}", extra={FIELDS: data})


#: the process's queue summaries (every runner's queue ticks)
SUMMARY = QueueSummary()


def failed(
    logger: logging.Logger, result: RunResult, *, failures: int, exc: BaseException | None = None
) -> None:
    """Log a failure (ERROR; the traceback when the logger shows DEBUG) and
    the backoff it starts or extends (WARNING)."""
    data = {"event": "failed", "failures": failures, **fields(result)}
    trace = exc if exc is not None and logger.isEnabledFor(logging.DEBUG) else None
    _log(logger, logging.ERROR, failure_line(result, failures), data, exc_info=trace)
    if result.next_attempt_at is not None:
        _log(
            logger,
            logging.WARNING,
            backoff_line(result, failures),
            {
                "event": "backoff_start" if failures <= 1 else "backoff_extended",
                "job": result.job,
                "failures": failures,
                "next_attempt_at": result.next_attempt_at.isoformat(),
            },
        )


def quiet(logger: logging.Logger, result: RunResult) -> None:
    """Log a tick that changed nothing, at DEBUG (``pgjobs run -v``)."""
    _log(logger, logging.DEBUG, quiet_line(result), {"event": "tick", **fields(result)})


# -- formatters ------------------------------------------------------------------
def _message(record: logging.LogRecord) -> str:
    message = record.getMessage()
    if record.name.split(".")[0] == "pgjobs" and message.startswith("pgjobs: "):
        message = message[len("pgjobs: ") :]
    return message


class TextFormatter(logging.Formatter):
    """``2025-05-01 12:00:00 INFO pgjobs.runner: exam-scores ran in ...``:
    the logger's name once, the message without a ``pgjobs:`` of its own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _message(record)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message``,
    then the event's fields (``event``, ``job``, ``inserted``, ...), and
    ``exception`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _message(record),
        }
        data = getattr(record, FIELDS, None)
        if isinstance(data, dict):
            out.update((k, v) for k, v in data.items() if k not in ("time", "level", "logger"))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


__all__ = [
    "FIELDS",
    "SUMMARY",
    "SUMMARY_EVERY",
    "JsonFormatter",
    "QueueSummary",
    "TextFormatter",
    "backoff_line",
    "failed",
    "failure_line",
    "fields",
    "quiet",
    "quiet_line",
    "ran",
    "recovered_line",
    "run_line",
]
