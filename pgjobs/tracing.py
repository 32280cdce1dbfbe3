"""OpenTelemetry spans for runs, where ``opentelemetry-api`` is installed
(the ``tracing`` extra; pgjobs does not depend on it).

:class:`Tracing` turns each :class:`~pgjobs.RunResult` that ran or failed
into a span ``pgjobs run <job>`` from the run's start to its end, with the
run's figures as attributes (``pgjobs.job``, ``pgjobs.outcome``,
``pgjobs.rows.inserted``, ...; an error status for a failure) and one
child span per phase: ``compute``, ``write`` and ``row_locks``. The runner
measures phases as durations, not instants: the children are laid out in
the order they happen (compute, then write, the row-lock window at the
end of the write), which is exact for a recompute and a summary for a
queue job that wrote in sub-batches. Ticks that changed nothing make no
span. Feed it a scheduler's results::

    tracing = pgjobs.tracing.Tracing()          # the global tracer provider
    scheduler = pgjobs.Scheduler(jobs, url, on_result=tracing.observe)

Spans go wherever the application's OpenTelemetry SDK sends them; with
the API alone they are no-ops. ``pgjobs run`` traces when the API is
installed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from .errors import PgJobsError
from .results import Outcome, RunResult

try:
    from opentelemetry import trace
except ImportError:  # pragma: no cover - installed in tests
    trace = None  # type: ignore[assignment]


def available() -> bool:
    """True when ``opentelemetry-api`` can be imported."""
    return trace is not None


def _ns(value: datetime) -> int:
    return int(value.timestamp() * 1_000_000_000)


class Tracing:
    """Spans for runs, from ``tracer_provider`` (default: the global one)."""

    def __init__(self, tracer_provider: Any = None) -> None:
        if trace is None:
            raise PgJobsError(
                "pgjobs.tracing needs opentelemetry-api: pip install 'pgjobs-derived[tracing]'"
            )
        self.tracer = trace.get_tracer("pgjobs", tracer_provider=tracer_provider)

    def observe(self, result: RunResult) -> None:
        """One span (and its phases) for a run that ran or failed."""
        assert trace is not None
        if result.outcome not in (Outcome.RAN, Outcome.FAILED):
            return
        s = result.stats
        attributes: dict[str, Any] = {
            "pgjobs.job": result.job,
            "pgjobs.outcome": str(result.outcome),
        }
        if result.outcome is Outcome.RAN:
            attributes.update(
                {
                    "pgjobs.rows.inserted": s.inserted,
                    "pgjobs.rows.updated": s.updated,
                    "pgjobs.rows.deleted": s.deleted,
                    "pgjobs.rows.skipped": s.skipped_missing_parent,
                    "pgjobs.rows.deferred": int(result.detail.get("rows_deferred", 0) or 0),
                    "pgjobs.items": result.items,
                    "pgjobs.failed_items": result.failed_items,
                }
            )
        if result.sqlstate:
            attributes["db.response.status_code"] = result.sqlstate
        if result.run_id is not None:
            attributes["pgjobs.run_id"] = result.run_id
        span = self.tracer.start_span(
            f"pgjobs run {result.job}",
            kind=trace.SpanKind.INTERNAL,
            start_time=_ns(result.started_at),
            attributes=attributes,
        )
        if result.outcome is Outcome.FAILED:
            span.set_status(trace.Status(trace.StatusCode.ERROR, result.error or "failed"))
        else:
            context = trace.set_span_in_context(span)
            start = result.started_at
            compute_end = start + timedelta(seconds=result.compute_seconds)
            write_end = compute_end + timedelta(seconds=result.write_seconds)
            locks = min(result.lock_seconds, result.write_seconds or result.lock_seconds)
            for name, begin, end in (
                ("compute", start, compute_end),
                ("write", compute_end, write_end),
                ("row_locks", write_end - timedelta(seconds=locks), write_end),
            ):
                if end > begin:
                    child = self.tracer.start_span(name, context=context, start_time=_ns(begin))
                    child.end(end_time=_ns(end))
        span.end(end_time=_ns(result.finished_at))


__all__ = ["Tracing", "available"]
