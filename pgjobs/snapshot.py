"""What the status page shows (:mod:`pgjobs.web`): the jobs, queues, dead
items, recent runs and a horizon held too long, read by :func:`pgjobs.readmodel.read_status` (the
read ``pgjobs status`` and the metrics share) in one read-only transaction
with a statement timeout, as plain views for rendering."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .horizon import Horizon, held_past
from .readmodel import QueueStats, StatusRead, read_status
from .serve import Source

#: runs listed on the overview and on a job's page
RUNS = 40
JOB_RUNS = 100
DEAD_ITEMS = 50


# -- what the page reads ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class QueueView:
    job: str
    depth: int
    due: int
    retrying: int
    dead: int
    oldest_due_seconds: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class JobView:
    name: str
    kind: str
    group: str
    schedule: str
    registered: bool
    description: str | None = None
    target: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)
    last_ran: dict[str, Any] = field(default_factory=dict)
    #: the last verification (``pgjobs check`` recorded, ``verify_every``)
    last_checked: dict[str, Any] = field(default_factory=dict)
    failing_since: datetime | None = None
    queue: QueueView | None = None
    #: its sliced run in progress (``docs/slices.md``), if any
    sliced: dict[str, Any] = field(default_factory=dict)
    #: runs rolled back by a lock timeout, a deadlock, ... since the last success
    transient: int = 0

    @property
    def failures(self) -> int:
        return int(self.state.get("failures") or 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """What one page shows, read in one transaction."""

    now: datetime
    installed: bool
    database: str
    jobs: list[JobView] = field(default_factory=list)
    queues: list[QueueView] = field(default_factory=list)
    dead: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: the schedulers' heartbeats (:func:`pgjobs.heartbeat.schedulers_query`)
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    #: the database's oldest snapshot or transaction (:mod:`pgjobs.horizon`)
    horizon: Horizon | None = None
    #: whether it is held past the source's ``horizon_warning``
    horizon_held: bool = False


def read(source: Source, *, job: str | None = None, runs: int = RUNS) -> Snapshot:
    """Everything the page shows (one job's, with ``job``), read-only
    through :func:`pgjobs.readmodel.read_status`."""
    with source.engine.connect() as conn, conn.begin():
        found = read_status(
            conn,
            source.schema,
            jobs=list(source.jobs),
            job=job,
            runs=runs,
            dead=DEAD_ITEMS,
            statement_timeout=5.0,
        )
    label = source.database_label()
    held = held_past(found.horizon, source.horizon_warning)
    if not found.installed:  # reading installs nothing
        return Snapshot(
            now=found.now,
            installed=False,
            database=label,
            jobs=_views(source, found),
            horizon=found.horizon,
            horizon_held=held,
        )
    return Snapshot(
        now=found.now,
        installed=True,
        database=label,
        jobs=_views(source, found),
        queues=[_queue_view(q) for q in found.queues],
        dead=found.dead,
        runs=found.runs,
        schedulers=found.schedulers,
        horizon=found.horizon,
        horizon_held=held,
    )


def _queue_view(q: QueueStats) -> QueueView:
    due = q.oldest_due_age
    return QueueView(
        job=q.job,
        depth=q.depth,
        due=q.due,
        retrying=q.retrying,
        dead=q.dead,
        oldest_due_seconds=None if due is None else due.total_seconds(),
    )


def _views(source: Source, found: StatusRead) -> list[JobView]:
    queues = {q.job: _queue_view(q) for q in found.queues}
    names = [*source.jobs, *sorted(set(found.states) - set(source.jobs))]
    views = []
    for name in names:
        job = source.jobs.get(name)
        views.append(
            JobView(
                name=name,
                kind=job.kind if job is not None else "-",
                group=(job.group or name) if job is not None else "-",
                schedule=job.schedule if job is not None else "-",
                registered=job is not None,
                description=getattr(job, "description", None),
                target=getattr(job, "target", None),
                state=dict(found.states.get(name, {})),
                last=dict(found.last.get(name, {})),
                last_ran=dict(found.last_ran.get(name, {})),
                last_checked=dict(found.last_checked.get(name, {})),
                failing_since=found.failing_since.get(name),
                sliced=dict(found.sliced.get(name, {})),
                transient=found.transient.get(name, 0),
                queue=queues.get(name)
                if name in queues or job is None or job.kind != "queue"
                else QueueView(
                    job=name, depth=0, due=0, retrying=0, dead=0, oldest_due_seconds=None
                ),
            )
        )
    return views


__all__ = [
    "DEAD_ITEMS",
    "JOB_RUNS",
    "RUNS",
    "JobView",
    "QueueView",
    "Snapshot",
    "read",
]
