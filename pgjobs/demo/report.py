"""What a demo run measured, and the summary ``pgjobs demo`` prints.

The threads of a timed run count into :class:`JobTally` and
:class:`UserTally` (thread-safe); at its end they become a
:class:`PhaseReport`, one per design, collected with the scripted
interleavings in a :class:`DemoReport`. :func:`format_report` lays the
phases side by side, one column per design, then a verdict line each.
"""

from __future__ import annotations

import math
import textwrap
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pgjobs

from .scenario import DEADLOCK, FK_VIOLATION, DemoOptions

# -- what a run measured ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class JobReport:
    """What one job did during a timed run."""

    name: str
    outcomes: dict[str, int]
    errors: dict[str, int]  #: by SQLSTATE (or exception name)
    inserted: int
    updated: int
    deleted: int
    skipped_missing_parent: int
    items: int
    compute_seconds: list[float]
    write_seconds: list[float]
    lock_seconds: list[float]

    @property
    def runs(self) -> int:
        """Ticks that did work or failed (``ran`` + ``failed``)."""
        return self.outcomes.get("ran", 0) + self.outcomes.get("failed", 0)

    @property
    def rows_written(self) -> int:
        return self.inserted + self.updated + self.deleted


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseReport:
    """One design's timed run."""

    design: str  #: "naive" or "pgjobs"
    seconds: float
    jobs: dict[str, JobReport]  #: by role: "worker", "recompute"
    deletes: int
    merges: int
    changes: int
    #: wall time of each user transaction that deleted an exam (deletes and merges)
    delete_latencies: list[float]
    #: user transactions that failed, by SQLSTATE
    user_errors: dict[str, int]
    #: derived rows differing from a from-scratch computation once the queue drained
    drift: int
    exams_left: int
    #: seconds from an item's first unprocessed enqueue commit to the commit of
    #: the worker transaction that processed it, one per processing (see lag.py)
    queue_lags: list[float] = field(default_factory=list)
    #: enqueues of exams still alive that no worker transaction processed
    unprocessed: int = 0

    def count(self, sqlstate: str) -> int:
        """Transactions (jobs' and users') that failed with ``sqlstate``."""
        return self.user_errors.get(sqlstate, 0) + sum(
            j.errors.get(sqlstate, 0) for j in self.jobs.values()
        )

    @property
    def deadlocks(self) -> int:
        return self.count(DEADLOCK)

    @property
    def fk_violations(self) -> int:
        return self.count(FK_VIOLATION)

    def latency(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the delete latencies, seconds."""
        return quantile(self.delete_latencies, q)

    def queue_lag(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the queue lags, seconds."""
        return quantile(self.queue_lags, q)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scripted:
    """One scripted interleaving: a user deletes exam ``exam`` while a job is
    between its compute and its writes."""

    design: str
    job: str  #: "recompute" or "worker"
    exam: int
    #: SQLSTATE of the job's transaction, None when it committed
    job_sqlstate: str | None
    #: SQLSTATE of the user's delete, None when it committed
    user_sqlstate: str | None
    #: wall time of the user's delete
    user_seconds: float
    #: True when the user's delete finished while the job was still open
    user_done_during_job: bool
    skipped_missing_parent: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoReport:
    """Everything :func:`format_report` prints."""

    options: DemoOptions
    where: str
    server_version: str
    phases: list[PhaseReport]
    scripted: list[Scripted]

    def phase(self, design: str) -> PhaseReport:
        for p in self.phases:
            if p.design == design:
                return p
        raise KeyError(f"no {design!r} phase in this report")


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- tallies filled by the threads ----------------------------------------------


class JobTally:
    """One job's outcomes and figures during a timed run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.inserted = self.updated = self.deleted = self.skipped = self.items = 0
        self.compute: list[float] = []
        self.write: list[float] = []
        self.row_lock: list[float] = []

    def add(
        self,
        outcome: str,
        *,
        error: str | None = None,
        inserted: int = 0,
        updated: int = 0,
        deleted: int = 0,
        skipped: int = 0,
        items: int = 0,
        compute: float | None = None,
        write: float | None = None,
        row_lock: float | None = None,
    ) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if error:
                self.errors[error] += 1
            self.inserted += inserted
            self.updated += updated
            self.deleted += deleted
            self.skipped += skipped
            self.items += items
            for values, value in (
                (self.compute, compute),
                (self.write, write),
                (self.row_lock, row_lock),
            ):
                if value is not None:
                    values.append(value)

    def add_result(self, result: pgjobs.RunResult) -> None:
        ran = result.outcome is pgjobs.Outcome.RAN
        s = result.stats
        self.add(
            str(result.outcome),
            error=(result.sqlstate or (result.error or "error").split(":")[0])
            if not result.ok
            else None,
            inserted=s.inserted,
            updated=s.updated,
            deleted=s.deleted,
            skipped=s.skipped_missing_parent,
            items=result.items,
            compute=result.compute_seconds if ran else None,
            write=result.write_seconds if ran else None,
            row_lock=result.lock_seconds if ran else None,
        )

    def report(self) -> JobReport:
        with self.lock:
            return JobReport(
                name=self.name,
                outcomes=dict(self.outcomes),
                errors=dict(self.errors),
                inserted=self.inserted,
                updated=self.updated,
                deleted=self.deleted,
                skipped_missing_parent=self.skipped,
                items=self.items,
                compute_seconds=list(self.compute),
                write_seconds=list(self.write),
                lock_seconds=list(self.row_lock),
            )


class UserTally:
    """The simulated users' operations, failures and delete latencies."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.latencies: list[float] = []

    def done(self, op: str, seconds: float | None = None) -> None:
        with self.lock:
            self.ops[op] += 1
            if seconds is not None:
                self.latencies.append(seconds)

    def failed(self, sqlstate: str, seconds: float | None = None) -> None:
        with self.lock:
            self.errors[sqlstate] += 1
            if seconds is not None:
                self.latencies.append(seconds)


# -- the summary -----------------------------------------------------------------

LAG_LEGEND = (
    "Queue lag: from an item's first enqueue commit not yet processed to the commit of the"
    " worker transaction that processed it, both as the client saw them return; an enqueue"
    " counts as processed by the first worker transaction whose snapshot saw it committed."
    " Items whose exam was deleted before they were processed are not measured; those the"
    " drain after the run processed are."
)


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def _outcomes(job: JobReport) -> str:
    order = ("ran", "failed", "busy", "idle", "not_due", "backing_off")
    parts = [f"{job.outcomes[o]} {o}" for o in order if job.outcomes.get(o)]
    return ", ".join(parts) or "none"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{n}x {s}" for s, n in sorted(errors.items())) or "none"


def _longest(values: list[float]) -> str:
    return f"{fmt_s(sum(values))} in all, longest {fmt_s(max(values, default=None))}"


def _job_rows(label: str, job: JobReport, *, worker: bool) -> list[tuple[str, str]]:
    rows = [(f"{label}: ticks", _outcomes(job))]
    if worker:
        rows.append((f"{label}: items done", f"{job.items:,}"))
    written = f"{job.rows_written:,} (+{job.inserted:,} ~{job.updated:,} -{job.deleted:,})"
    rows += [
        (f"{label}: rows written", written),
        (f"{label}: rows skipped, parent gone", f"{job.skipped_missing_parent:,}"),
        (f"{label}: compute", _longest(job.compute_seconds)),
        (f"{label}: write", _longest(job.write_seconds)),
        (f"{label}: row locks held", f"longest {fmt_s(max(job.lock_seconds, default=None))}"),
        (f"{label}: errors", _errors(job.errors)),
    ]
    return rows


def _rows(p: PhaseReport) -> list[tuple[str, str]]:
    rows = _job_rows("recompute", p.jobs["recompute"], worker=False)
    rows += _job_rows("queue worker", p.jobs["worker"], worker=True)
    rows += [
        (
            "queue lag p50 / p95 / max",
            f"{fmt_s(p.queue_lag(0.5))} / {fmt_s(p.queue_lag(0.95))} / {fmt_s(p.queue_lag(1.0))}",
        ),
        ("queue lag: items measured", f"{len(p.queue_lags):,}"),
        ("queue: enqueued, never processed", f"{p.unprocessed:,}"),
        ("users: deletes / merges / changes", f"{p.deletes:,} / {p.merges:,} / {p.changes:,}"),
        (
            "users: delete latency p50 / p99 / max",
            f"{fmt_s(p.latency(0.5))} / {fmt_s(p.latency(0.99))} / {fmt_s(p.latency(1.0))}",
        ),
        ("users: failed transactions", _errors(p.user_errors)),
        ("deadlocks (40P01), all transactions", f"{p.deadlocks}"),
        ("FK violations (23503), all transactions", f"{p.fk_violations}"),
        ("scores wrong after the queue drained", f"{p.drift:,}"),
    ]
    return rows


def _scripted_line(s: Scripted) -> str:
    who = "recompute" if s.job == "recompute" else "worker"
    user = f"the user's delete of exam {s.exam} took {fmt_s(s.user_seconds)}"
    user += f" and failed with {s.user_sqlstate}" if s.user_sqlstate else " and committed"
    if s.user_done_during_job:
        user += f", while the {who} was still open"
    job = f"the {who} failed with {s.job_sqlstate}" if s.job_sqlstate else f"the {who} committed"
    if s.skipped_missing_parent:
        job += f", skipping the deleted exam's {s.skipped_missing_parent} rows"
    return textwrap.fill(
        f"{user}; {job}.",
        width=100,
        initial_indent=f"  {s.design + ' ' + who + ':':<19}",
        subsequent_indent=" " * 21,
    )


def _table(phases: list[PhaseReport]) -> list[str]:
    """One row per figure, one column per design."""
    table = {p.design: dict(_rows(p)) for p in phases}
    labels = [label for label, _ in _rows(phases[-1])]
    width = max(len(label) for label in labels) + 2
    designs = [p.design for p in phases]
    col = max(28, *(len(v) + 2 for d in designs for v in table[d].values()))
    lines = [f"{'':<{width}}" + "".join(f"{d:<{col}}" for d in designs).rstrip()]
    for label in labels:
        lines.append(
            f"{label:<{width}}"
            + "".join(f"{table[d].get(label, ''):<{col}}" for d in designs).rstrip()
        )
    return lines


def format_report(report: DemoReport) -> str:
    """The readable summary :func:`pgjobs.demo.main` prints."""
    o = report.options
    lines = [
        "",
        f"pgjobs demo — on {report.where}, PostgreSQL {report.server_version}",
        f"{o.exams:,} exams x {o.students} derived scores (FK to exam, on delete cascade)"
        " + a status row each;",
        f"recompute every {o.recompute_every:g} s with a {o.compute_seconds:g} s computation,"
        f" queue worker every {o.worker_every:g} s;",
        f"{o.users} user thread(s) deleting/merging every {o.user_pause:g} s"
        f" and one changing every {o.change_pause:g} s; {o.seconds:g} s per design.",
        "",
    ]
    if report.scripted:
        lines.append(
            "Scripted interleaving (a user deletes an exam between a job's compute and its writes):"
        )
        lines += [_scripted_line(s) for s in report.scripted]
        lines.append("")
    lines += _table(report.phases)
    lines += ["", textwrap.fill(LAG_LEGEND, width=100), ""]
    lines += [_verdict(p) for p in report.phases]
    return "\n".join(lines)


def _verdict(p: PhaseReport) -> str:
    failed = Counter(p.user_errors)
    for job in p.jobs.values():
        failed.update(job.errors)
    others = {s: n for s, n in failed.items() if s not in (DEADLOCK, FK_VIOLATION)}
    waited = f"user deletes waited up to {fmt_s(p.latency(1.0))}"
    exact = (
        "the scores are exact after the queue drained"
        if p.drift == 0
        else f"{p.drift:,} scores are wrong after the queue drained"
    )
    if not failed:
        clean = "no deadlock, no FK violation, no failed transaction"
        return f"{p.design}: {clean}; {waited}; {exact}."
    parts = [f"{p.deadlocks} deadlock(s)", f"{p.fk_violations} FK violation(s)"]
    if others:
        parts.append(f"{sum(others.values())} other failed transaction(s) ({_errors(others)})")
    return f"{p.design}: {', '.join(parts)}; {waited}; {exact}."


def healthy(report: DemoReport) -> bool:
    """pgjobs ran both jobs with no deadlock, no FK violation and exact scores."""
    p = report.phase("pgjobs")
    ran = all(j.outcomes.get("ran", 0) > 0 for j in p.jobs.values())
    return ran and p.deadlocks == 0 and p.fk_violations == 0 and p.drift == 0


__all__ = [
    "LAG_LEGEND",
    "DemoReport",
    "JobReport",
    "JobTally",
    "PhaseReport",
    "Scripted",
    "UserTally",
    "fmt_s",
    "format_report",
    "healthy",
    "quantile",
]
