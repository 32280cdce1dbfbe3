"""What the status page shows (:mod:`pgjobs.web`): the jobs, queues, dead
items and recent runs, read from pgjobs' tables in one read-only
transaction with a statement timeout, as plain views for rendering."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg import sql

from ._pg import driver, execute, set_local
from .heartbeat import read_schedulers
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
    #: the schedulers' heartbeats (:func:`pgjobs.heartbeat.read_schedulers`)
    schedulers: list[dict[str, Any]] = field(default_factory=list)


def _dicts(cursor: Any) -> list[dict[str, Any]]:
    names = [d.name for d in cursor.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def read(source: Source, *, job: str | None = None, runs: int = RUNS) -> Snapshot:
    """Everything the page shows (one job's, with ``job``), read-only."""
    with source.engine.connect() as conn, conn.begin():
        execute(conn, *set_local({"transaction_read_only": "on", "statement_timeout": "5000ms"}))
        label = source.database_label()
        t = {n: sql.Identifier(source.schema, n) for n in ("queue", "run", "job_state")}
        row = execute(
            conn,
            "select now(), to_regclass(%s) is not null",
            (t["job_state"].as_string(driver(conn)),),
        ).fetchone()
        assert row is not None
        now, installed = row
        if not installed:  # reading installs nothing
            return Snapshot(now=now, installed=False, database=label, jobs=_views(source, {}))
        only = sql.SQL("") if job is None else sql.SQL("where job = %(job)s")
        states = {
            r["job"]: r
            for r in _dicts(
                execute(
                    conn, sql.SQL("select * from {} {}").format(t["job_state"], only), {"job": job}
                )
            )
        }
        names = [job] if job is not None else list(dict.fromkeys([*source.jobs, *states]))
        # each job's last run and last run that ran: one index probe per job
        # (a DISTINCT ON over the whole run log sorts all of it: 0.45 s at 100k runs)
        latest = sql.SQL(
            "select r.* from unnest(%(names)s::text[]) as j(job), lateral (select * from {run} r"
            " where r.job = j.job {ran} order by r.started_at desc, r.id desc limit 1) r"
        )
        last, last_ran, last_checked = (
            {
                r["job"]: r
                for r in _dicts(
                    execute(conn, latest.format(run=t["run"], ran=sql.SQL(ran)), {"names": names})
                )
            }
            for ran in ("", "and r.outcome = 'ran'", "and r.outcome = 'checked'")
        )
        params = {"job": job, "runs": runs, "dead": DEAD_ITEMS}
        since = {
            r["job"]: r["since"]
            for r in _dicts(
                execute(
                    conn,
                    sql.SQL(
                        "select r.job, min(r.started_at) as since from {run} r join {state} s"
                        " on s.job = r.job where s.failures > 0 and r.outcome = 'failed' and"
                        " r.started_at > coalesce(s.last_success_at, '-infinity') group by r.job"
                    ).format(run=t["run"], state=t["job_state"]),
                )
            )
        }
        queues = [
            QueueView(**r)
            for r in _dicts(
                execute(
                    conn,
                    sql.SQL(
                        "select job, count(*) filter (where dead_at is null) as depth,"
                        " count(*) filter (where dead_at is null and not_before <= now()) as due,"
                        " count(*) filter (where dead_at is null and attempts > 0) as retrying,"
                        " count(*) filter (where dead_at is not null) as dead,"
                        " extract(epoch from now() - min(enqueued_at) filter"
                        " (where dead_at is null and not_before <= now()))::float8"
                        " as oldest_due_seconds from {} {} group by job order by job"
                    ).format(t["queue"], only),
                    params,
                )
            )
        ]
        dead = _dicts(
            execute(
                conn,
                sql.SQL(
                    "select job, key::text as key, attempts, dead_at, last_error from {}"
                    " where dead_at is not null {} order by dead_at desc limit %(dead)s"
                ).format(t["queue"], sql.SQL("") if job is None else sql.SQL("and job = %(job)s")),
                params,
            )
        )
        recent = _dicts(
            execute(
                conn,
                sql.SQL(
                    "select id, job, outcome, started_at, finished_at, compute_ms, write_ms,"
                    " lock_ms, inserted, updated, deleted, skipped_missing_parent, unchanged,"
                    " items, failed_items, error, sqlstate, worker, detail from {} {}"
                    " order by started_at desc, id desc limit %(runs)s"
                ).format(t["run"], only),
                params,
            )
        )
        schedulers = read_schedulers(conn, source.schema) if job is None else []
    by_queue = {q.job: q for q in queues}
    views = _views(source, states, last, last_ran, since, by_queue, last_checked)
    return Snapshot(
        now=now,
        installed=True,
        database=label,
        jobs=views,
        queues=queues,
        dead=dead,
        runs=recent,
        schedulers=schedulers,
    )


def _views(
    source: Source,
    states: Mapping[str, dict[str, Any]],
    last: Mapping[str, dict[str, Any]] | None = None,
    last_ran: Mapping[str, dict[str, Any]] | None = None,
    since: Mapping[str, datetime] | None = None,
    queues: Mapping[str, QueueView] | None = None,
    last_checked: Mapping[str, dict[str, Any]] | None = None,
) -> list[JobView]:
    last, last_ran, since, queues = last or {}, last_ran or {}, since or {}, queues or {}
    last_checked = last_checked or {}
    names = [*source.jobs, *sorted(set(states) - set(source.jobs))]
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
                state=dict(states.get(name, {})),
                last=dict(last.get(name, {})),
                last_ran=dict(last_ran.get(name, {})),
                last_checked=dict(last_checked.get(name, {})),
                failing_since=since.get(name),
                queue=queues.get(name)
                if name in queues or job is None or job.kind != "queue"
                else QueueView(
                    job=name, depth=0, due=0, retrying=0, dead=0, oldest_due_seconds=None
                ),
            )
        )
    return views


# -- HTML, escaped by construction -------------------------------------------------------
