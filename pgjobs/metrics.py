"""Prometheus metrics (the ``metrics`` extra: ``pip install 'pgjobs-derived[metrics]'``).

Two kinds of figures:

* what this process's ticks did, counted as they end (feed
  :meth:`Metrics.observe` every :class:`~pgjobs.RunResult`; a scheduler's
  ``on_result`` does, once :meth:`Metrics.bind` is called):

  ==========================================  ===================================
  ``pgjobs_runs_total{job,outcome}``          ticks by outcome: ran, failed,
                                              interrupted, transient, idle, busy,
                                              not_due, backing_off, paused,
                                              cancelled, checked
  ``pgjobs_run_duration_seconds{job}``        wall time of the runs that ran or failed
  ``pgjobs_run_phase_seconds{job,phase}``     compute, write, row_locks (first row
                                              lock to the end of the writes)
  ``pgjobs_rows_total{job,change}``           inserted, updated, deleted,
                                              skipped (parent gone), deferred
  ``pgjobs_queue_items_total{job,result}``    processed, failed, parent_gone,
                                              locked
  ``pgjobs_queue_lag_seconds{job}``           enqueue to processed, per item
  ``pgjobs_repaired_rows_total{job,change}``  rows a recompute wrote on a target
                                              that queue workers maintain: what
                                              the queue path missed (inserted,
                                              updated, deleted)
  ==========================================  ===================================

* what the database says, read at scrape time in one statement (cached for
  ``cache_seconds``), so that every replica reports the same truth:
  ``pgjobs_queue_depth``, ``pgjobs_queue_due``, ``pgjobs_queue_retrying``,
  ``pgjobs_queue_dead``, ``pgjobs_queue_oldest_due_age_seconds``,
  ``pgjobs_job_failures`` (consecutive), ``pgjobs_job_backing_off`` (0/1),
  ``pgjobs_job_last_success_timestamp_seconds``, ``pgjobs_job_paused``
  (0/1), ``pgjobs_job_paused_since_timestamp_seconds``, all by ``job``;
  the last check of each recompute (``verify_every``, ``docs/drift.md``):
  ``pgjobs_drift_rows{job,change}`` (what a recompute would write then:
  inserted, updated, deleted, skipped), ``pgjobs_drift_on_the_way_rows``
  (rows of queued items, apart), ``pgjobs_check_timestamp_seconds`` and
  ``pgjobs_check_failed`` (0/1); ``pgjobs_schedulers{state}`` (``live``,
  ``quiet``: by their heartbeats); ``pgjobs_horizon_age_seconds`` and
  ``pgjobs_horizon_xid_age``: how long the database's oldest snapshot or
  transaction has been held, and how many transactions began since (0 when
  none; :mod:`pgjobs.horizon`); a sliced run in progress
  (``docs/slices.md``): ``pgjobs_slices_done``, ``pgjobs_slices_total``
  (pieces) and ``pgjobs_slices_written_rows``; and ``pgjobs_database_up``
  (0 when that read failed).

Labels are the job's name and fixed words: the series grow with the number
of jobs, nothing else. pgjobs registers nothing in ``prometheus_client``'s
global registry: a :class:`Metrics` has a ``CollectorRegistry`` of its own
unless given one::

    metrics = pgjobs.metrics.Metrics()
    app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml", on_result=metrics.observe))
    app.mount("/metrics", metrics.asgi_app())   # finds the lifespan's scheduler

``pgjobs run --metrics 127.0.0.1:9100`` serves ``/metrics`` itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from .drift import workers_of
from .errors import PgJobsError
from .readmodel import StatusRead, read_status
from .results import Outcome, RunResult
from .serve import ASGIApp, Request, Response, Source, WSGIApp, asgi, wsgi

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise PgJobsError(
        "pgjobs.metrics needs prometheus-client: pip install 'pgjobs-derived[metrics]'"
    ) from exc

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)

#: seconds; row-lock windows are milliseconds, recomputes minutes
BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
#: seconds from enqueue to processed: from a wake-up (ms) to a backlog (hours)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

OUTCOMES = tuple(str(o) for o in Outcome)
CHANGES = ("inserted", "updated", "deleted", "skipped", "deferred")
ITEM_RESULTS = ("processed", "failed", "parent_gone", "locked")
REPAIRS = ("inserted", "updated", "deleted")
DRIFT = (
    ("inserted", "inserted"),
    ("updated", "updated"),
    ("deleted", "deleted"),
    ("skipped", "skipped_missing_parent"),
)


class Metrics:
    """pgjobs' metrics in ``registry`` (a new ``CollectorRegistry`` unless
    given). :meth:`observe` counts a tick; :meth:`bind` reads the database
    of a scheduler (or :class:`~pgjobs.serve.Source`) at scrape time and
    makes the scheduler feed :meth:`observe`. ``process`` adds
    ``prometheus_client``'s ``process_*`` figures (``pgjobs run`` does)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        cache_seconds: float = 5.0,
        statement_timeout: float = 5.0,
        process: bool = False,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process:  # the process's CPU, memory and file descriptors (process_*)
            ProcessCollector(registry=r)
        self.runs = Counter(
            "pgjobs_runs",
            "Ticks of each job by outcome (ran, failed, interrupted, transient, idle, busy,"
            " not_due, backing_off, paused, cancelled, checked).",
            ["job", "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "pgjobs_run_duration_seconds",
            "Wall time of each run that ran or failed.",
            ["job"],
            buckets=BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "pgjobs_run_phase_seconds",
            "Phases of each run that ran: compute (no row locks), write, and row_locks"
            " (from the first row lock to the end of the writes).",
            ["job", "phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.rows = Counter(
            "pgjobs_rows",
            "Rows of the target table: inserted, updated, deleted; skipped (their parent"
            " was gone) and deferred (their parent was locked by a user).",
            ["job", "change"],
            registry=r,
        )
        self.items = Counter(
            "pgjobs_queue_items",
            "Queue items taken by the worker: processed, failed, parent_gone (dropped),"
            " locked (left queued for a lock someone holds).",
            ["job", "result"],
            registry=r,
        )
        self.lag = Histogram(
            "pgjobs_queue_lag_seconds",
            "Seconds from an item's enqueue to the end of the writes that processed it.",
            ["job"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.repaired = Counter(
            "pgjobs_repaired_rows",
            "Rows a recompute wrote on a target that queue workers maintain (inserted,"
            " updated, deleted): what the queue path missed.",
            ["job", "change"],
            registry=r,
        )
        #: recomputes whose target queue workers maintain (known once bound)
        self._maintained: set[str] = set()
        self.database = _DatabaseCollector(cache_seconds, statement_timeout)
        r.register(self.database)
        self._bound: set[int] = set()
        self._lock = threading.Lock()

    # -- what ticks did ----------------------------------------------------------------
    def observe(self, result: RunResult) -> None:
        """Count one tick (a scheduler's ``on_result``)."""
        job = result.job
        self.runs.labels(job, str(result.outcome)).inc()
        if result.outcome not in (Outcome.RAN, Outcome.FAILED):
            return
        self.duration.labels(job).observe(max(result.seconds, 0.0))
        if result.outcome is not Outcome.RAN:
            return
        self.phase.labels(job, "compute").observe(result.compute_seconds)
        self.phase.labels(job, "write").observe(result.write_seconds)
        self.phase.labels(job, "row_locks").observe(result.lock_seconds)
        s, detail = result.stats, result.detail
        for change, n in (
            ("inserted", s.inserted),
            ("updated", s.updated),
            ("deleted", s.deleted),
            ("skipped", s.skipped_missing_parent),
            ("deferred", int(detail.get("rows_deferred", 0) or 0)),
        ):
            if n:
                self.rows.labels(job, change).inc(n)
        if job in self._maintained:
            for change, n in (
                ("inserted", s.inserted),
                ("updated", s.updated),
                ("deleted", s.deleted),
            ):
                if n:
                    self.repaired.labels(job, change).inc(n)
        for name, n in (
            ("processed", result.items),
            ("failed", result.failed_items),
            ("parent_gone", int(detail.get("parent_gone", 0) or 0)),
            # left queued for a lock someone holds (not failed: retried soon)
            ("locked", int(detail.get("locked", 0) or 0)),
        ):
            if n:
                self.items.labels(job, name).inc(n)
        lag = self.lag.labels(job)
        for seconds in result.queue_lag:
            lag.observe(max(seconds, 0.0))

    def _declare(self, source: Source) -> None:
        """The counters of the known jobs, at zero (a counter that appears
        only at its first increment hides that increment from ``rate()``).
        Histograms appear with their first observation: declared empty, ten
        jobs' took a cached scrape from 7 ms to 29 ms for nothing."""
        for name, job in source.jobs.items():
            for outcome in OUTCOMES:
                self.runs.labels(name, outcome)
            for change in CHANGES:
                self.rows.labels(name, change)
            if job.kind == "queue":
                for result in ITEM_RESULTS:
                    self.items.labels(name, result)
            if job.kind == "recompute" and workers_of(job, source.jobs.values()):
                self._maintained.add(name)
                for change in REPAIRS:
                    self.repaired.labels(name, change)

    # -- what the database says --------------------------------------------------------
    def bind(self, target: Scheduler | Source) -> Metrics:
        """Read ``target``'s database at scrape time; a scheduler's ticks
        are counted from now on (its ``on_result`` is chained, once)."""
        source = Source.of(target)
        self.database.source = source
        self._declare(source)
        if isinstance(target, Source):
            return self
        with self._lock:
            if id(target) in self._bound:
                return self
            self._bound.add(id(target))
        previous: Callable[[RunResult], None] | None = getattr(target, "on_result", None)
        if previous is not None and previous == self.observe:
            return self  # its on_result is this object's observe already
        if previous is None:
            target.on_result = self.observe
        else:

            def both(result: RunResult) -> None:
                try:
                    previous(result)
                finally:
                    self.observe(result)

            target.on_result = both
        return self

    # -- exposition -----------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def _handler(self, source: Source, request: Request) -> Response:
        if self.database.source is None:
            self.database.source = source
        return Response(200, self.exposition(), content_type=CONTENT_TYPE_LATEST)

    def asgi_app(self, source: Scheduler | Source | None = None) -> ASGIApp:
        """An ASGI app serving :meth:`exposition` (mount it at ``/metrics``).

        With no ``source``, the scheduler of the app's :func:`pgjobs.lifespan`
        is bound on the first scrape; its ticks before that are not counted,
        so pass ``on_result=metrics.observe`` to the lifespan as well (or
        bind the scheduler yourself) to count them all.
        """
        return asgi(self._handler, source, on_source=self.bind)

    def wsgi_app(self, source: Scheduler | Source) -> WSGIApp:
        """A WSGI app serving :meth:`exposition` (``pgjobs run --metrics``)."""
        self.bind(source)
        return wsgi(self._handler, source)


@dataclass(frozen=True, slots=True)
class _Row:
    job: str
    failures: int | None
    backing_off: bool | None
    last_success: float | None
    queued: bool
    depth: int
    due: int
    retrying: int
    dead: int
    oldest_due: float
    paused_since: float | None = None


class _DatabaseCollector(Collector):
    """The queue and job-state gauges, read at scrape time (one statement,
    read-only, with a statement timeout), cached for ``cache_seconds``."""

    def __init__(self, cache_seconds: float, statement_timeout: float) -> None:
        self.source: Source | None = None
        self.cache_seconds = cache_seconds
        self.statement_timeout = statement_timeout
        self._lock = threading.Lock()
        self._cached: tuple[float, list[_Row] | None] | None = None
        #: each recompute's last check: (job, figures by change, on their way, at, failed)
        self.checks: list[tuple[str, dict[str, int], dict[str, int], float, bool]] = []
        #: live and gone-quiet schedulers (pgjobs.heartbeat), read with the rows
        self.schedulers: tuple[int, int] = (0, 0)
        #: the oldest snapshot's age in seconds and in transactions (pgjobs.horizon)
        self.horizon: tuple[float, int] = (0.0, 0)
        #: each sliced run in progress: (job, pieces done, pieces, rows written)
        self.sliced: list[tuple[str, int, int, int]] = []

    def describe(self) -> list[Metric]:
        return []  # the families depend on the database: nothing to check at registration

    def read(self) -> list[_Row] | None:
        """The rows (cached), or ``None`` when the database did not answer."""
        source = self.source
        if source is None:
            return []
        with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.cache_seconds:
                return self._cached[1]
            rows: list[_Row] | None
            try:
                with source.engine.connect() as conn, conn.begin():
                    found = read_status(
                        conn,
                        source.schema,
                        jobs=list(source.jobs),
                        history=False,  # the gauges show no run but the last check
                        statement_timeout=self.statement_timeout,
                    )
                if not found.installed:
                    raise PgJobsError(f"pgjobs' tables are not installed in {source.schema!r}")
                rows = _rows(found)
                self.checks = _last_checks(found, source)
                self.sliced = [
                    (job, int(r["done"]), int(r["pieces"]), int(r["written"]))
                    for job, r in sorted(found.sliced.items())
                ]
                live = sum(1 for b in found.schedulers if b["live"])
                self.schedulers = (live, len(found.schedulers) - live)
                held = found.horizon
                self.horizon = (
                    (0.0, 0) if held is None else (held.held.total_seconds(), held.xid_age)
                )
            except Exception:
                log.warning(
                    "pgjobs: metrics: could not read the queue and job states", exc_info=True
                )
                rows = None
            self._cached = (time.monotonic(), rows)
            return rows

    def _schedulers_family(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "pgjobs_schedulers",
            "Schedulers on the database by heartbeat: live, or quiet (not seen for 3 heartbeats).",
            labels=["state"],
        )
        family.add_metric(["live"], self.schedulers[0])
        family.add_metric(["quiet"], self.schedulers[1])
        return family

    def collect(self) -> Iterator[Metric]:
        source = self.source
        if source is None:
            return
        rows = self.read()
        up = GaugeMetricFamily(
            "pgjobs_database_up",
            "1 when the scrape-time read of pgjobs' tables succeeded, else 0.",
            value=0 if rows is None else 1,
        )
        yield up
        if rows is None:
            return
        yield self._schedulers_family()
        yield GaugeMetricFamily(
            "pgjobs_horizon_age_seconds",
            "How long the database's oldest snapshot or transaction has been held (0: none).",
            value=self.horizon[0],
        )
        yield GaugeMetricFamily(
            "pgjobs_horizon_xid_age",
            "Transactions begun since the database's oldest snapshot or transaction.",
            value=self.horizon[1],
        )
        by_job = {r.job: r for r in rows}
        yield from _queue_families(source, rows)
        states = _gauges(
            [
                ("pgjobs_job_failures", "Consecutive failures of the job (0 after a success)."),
                (
                    "pgjobs_job_backing_off",
                    "1 while the job waits out its backoff after a failure.",
                ),
                (
                    "pgjobs_job_last_success_timestamp_seconds",
                    "When the job last ran successfully (Unix time).",
                ),
                ("pgjobs_job_paused", "1 while the job is paused (pgjobs pause), else 0."),
                (
                    "pgjobs_job_paused_since_timestamp_seconds",
                    "Since when the job is paused (Unix time); absent when it is not.",
                ),
            ]
        )
        names = [*source.jobs, *sorted(r.job for r in rows if r.job not in source.jobs)]
        for name in names:
            row = by_job.get(name)
            paused = row.paused_since if row is not None else None
            states[3].add_metric([name], 0 if paused is None else 1)
            if paused is not None:
                states[4].add_metric([name], paused)
            if row is None or row.failures is None:
                if name in source.jobs:
                    states[0].add_metric([name], 0)
                    states[1].add_metric([name], 0)
                continue
            states[0].add_metric([name], row.failures)
            states[1].add_metric([name], 1 if row.failures > 0 and row.backing_off else 0)
            if row.last_success is not None:
                states[2].add_metric([name], row.last_success)
        yield from states
        yield from _check_gauges(self.checks)
        yield from _sliced_gauges(self.sliced)


def _sliced_gauges(sliced: Sequence[tuple[str, int, int, int]]) -> list[GaugeMetricFamily]:
    """A sliced run in progress (``docs/slices.md``): absent when none is."""
    families = _gauges(
        [
            ("pgjobs_slices_done", "Pieces done of the job's sliced run in progress."),
            ("pgjobs_slices_total", "Pieces of the job's sliced run in progress."),
            ("pgjobs_slices_written_rows", "Rows its slices have written so far."),
        ]
    )
    for job, done, pieces, written in sliced:
        for family, value in zip(families, (done, pieces, written), strict=True):
            family.add_metric([job], value)
    return families


def _queue_families(source: Source, rows: Sequence[_Row]) -> list[GaugeMetricFamily]:
    """The queue gauges, per job of the built-in queue."""
    by_job = {r.job: r for r in rows}
    # jobs of the built-in queue: every known one (an empty queue is 0),
    # and any other job the table holds items for
    queue_jobs = [
        name
        for name, job in source.jobs.items()
        if job.kind == "queue" and getattr(job, "claim", None) is None
    ]
    queue_jobs += sorted(r.job for r in rows if r.queued and r.job not in source.jobs)
    families = _gauges(
        [
            ("pgjobs_queue_depth", "Live items in the job's queue (due or waiting to retry)."),
            ("pgjobs_queue_due", "Live items that may be claimed now."),
            ("pgjobs_queue_retrying", "Live items that failed and wait for another attempt."),
            ("pgjobs_queue_dead", "Parked items (failed max_attempts times)."),
            (
                "pgjobs_queue_oldest_due_age_seconds",
                "Age of the oldest due item since its enqueue (0 when none is due).",
            ),
        ]
    )
    for name in queue_jobs:
        row = by_job.get(name)
        values = (
            (0, 0, 0, 0, 0.0)
            if row is None or not row.queued
            else (row.depth, row.due, row.retrying, row.dead, row.oldest_due)
        )
        for family, value in zip(families, values, strict=True):
            family.add_metric([name], value)
    return families


def _epoch(when: datetime | None) -> float | None:
    return None if when is None else when.timestamp()


def _rows(found: StatusRead) -> list[_Row]:
    """The gauges' rows: every job with a state or a queue, by name."""
    queues = {q.job: q for q in found.queues}
    rows = []
    for job in sorted({*found.states, *queues}):
        state, q = found.states.get(job, {}), queues.get(job)
        due = None if q is None else q.oldest_due_age
        next_attempt = state.get("next_attempt_at")
        rows.append(
            _Row(
                job=job,
                failures=state.get("failures"),
                backing_off=None if not state else bool(next_attempt and next_attempt > found.now),
                last_success=_epoch(state.get("last_success_at")),
                queued=q is not None,
                depth=0 if q is None else q.depth,
                due=0 if q is None else q.due,
                retrying=0 if q is None else q.retrying,
                dead=0 if q is None else q.dead,
                oldest_due=0.0 if due is None else due.total_seconds(),
                paused_since=_epoch(state.get("paused_at")),
            )
        )
    return rows


def _last_checks(
    found: StatusRead, source: Source
) -> list[tuple[str, dict[str, int], dict[str, int], float, bool]]:
    """Each recompute's last check, from the read model's last checked runs."""
    out = []
    for job in sorted(n for n, j in source.jobs.items() if j.kind == "recompute"):
        run = found.last_checked.get(job)
        if run is None:
            continue
        figures = {k: run[k] for k in ("inserted", "updated", "deleted", "skipped_missing_parent")}
        way = ((run.get("detail") or {}).get("check") or {}).get("on_the_way") or {}
        on_the_way = {k: int(way.get(k, 0) or 0) for k in figures}
        out.append(
            (job, figures, on_the_way, run["started_at"].timestamp(), run["error"] is not None)
        )
    return out


def _check_gauges(
    checks: Sequence[tuple[str, dict[str, int], dict[str, int], float, bool]],
) -> Iterator[Metric]:
    drift = GaugeMetricFamily(
        "pgjobs_drift_rows",
        "The last check's figures: rows a recompute would write then (inserted, updated,"
        " deleted) or skip (parent gone).",
        labels=["job", "change"],
    )
    way = GaugeMetricFamily(
        "pgjobs_drift_on_the_way_rows",
        "The last check's rows of items queued or in flight (not drift).",
        labels=["job", "change"],
    )
    at, failed = _gauges(
        [
            ("pgjobs_check_timestamp_seconds", "When the job's last check started (Unix time)."),
            ("pgjobs_check_failed", "1 when the job's last check failed, else 0."),
        ]
    )
    for job, figures, on_the_way, started, error in checks:
        for label, name in DRIFT:
            drift.add_metric([job, label], figures[name])
            way.add_metric([job, label], on_the_way[name])
        at.add_metric([job], started)
        failed.add_metric([job], 1 if error else 0)
    yield from (drift, way, at, failed)


def _gauges(specs: Sequence[tuple[str, str]]) -> list[GaugeMetricFamily]:
    return [GaugeMetricFamily(name, doc, labels=["job"]) for name, doc in specs]


__all__ = ["BUCKETS", "LAG_BUCKETS", "Metrics"]
