"""pgjobs' own tables: job state, the run log and the queue.

The schema (``pgjobs`` unless configured) is created on first use by
numbered migrations in ``pgjobs/sql/NNN_*.sql`` (:mod:`pgjobs.migrations`),
safely when several processes start at once. :class:`Store` reads and writes the job state and
the run records, each statement also given as a query to send with others
in one round trip (``state_query``, ``run_query``). The queue's API is
:mod:`pgjobs.queue`. How the runner uses these tables, and why
installation is the one place pgjobs waits for a lock: ``docs/DESIGN.md``,
"The run protocol".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb
from sqlalchemy.engine import Connection

from . import migrations
from ._pg import execute, frozen, send, set_local
from .results import RunResult

DEFAULT_SCHEMA = "pgjobs"

#: tick outcomes that change nothing: counted in ``job_state``, not logged
QUIET_OUTCOMES = ("idle", "busy", "not_due", "backing_off", "paused")


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)


@dataclass(frozen=True, slots=True)
class JobState:
    job: str
    next_attempt_at: datetime | None
    failures: int
    last_success_at: datetime | None = None
    last_failure_at: datetime | None = None
    last_error: str | None = None
    #: since when the job is paused (``pgjobs pause``), else ``None``
    paused_at: datetime | None = None
    paused_reason: str | None = None


class Store:
    """Reads and writes pgjobs' tables in ``schema``."""

    def __init__(self, schema: str = DEFAULT_SCHEMA, *, auto_migrate: bool = True) -> None:
        self.schema = schema
        #: apply pending migrations at the first :meth:`ensure` (else refuse)
        self.auto_migrate = auto_migrate
        self._ready = False
        #: statements sent tick after tick, composed once (by kind)
        self._composed: dict[tuple[Any, ...], sql.SQL] = {}

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    # -- installation ------------------------------------------------------
    def ensure(self, conn: Connection) -> None:
        """Check the schema against this code and apply what is pending
        (:func:`pgjobs.migrations.ensure`); cheap after the first call."""
        if self._ready:
            return
        migrations.ensure(conn, self.schema, auto_migrate=self.auto_migrate)
        self._ready = True

    # -- job state ---------------------------------------------------------
    def read_state(
        self, conn: Connection, job: str, *, settings: Mapping[str, str] | None = None
    ) -> JobState | None:
        """The job's persisted state; ``settings`` are set for the current
        transaction in the same round trip (``transaction_read_only``,
        ``lock_timeout``, ...)."""
        # (a transaction's BEGIN travels with it: see pgjobs._pg.send)
        (row,) = send(conn, self.state_query(job, settings=settings))
        return self.state_from_row(job, row.one())

    def state_query(
        self, job: str, *, settings: Mapping[str, str] | None = None
    ) -> tuple[sql.SQL, list[Any]]:
        """:meth:`read_state`'s statement and parameters, to send with others
        (composed once per number of settings)."""
        given = settings or {}
        # set_local's parameters, without composing its statement again
        params = [part for item in given.items() for part in item]
        query = self._composed.get(("state", len(params)))
        if query is None:
            cfg, _ = set_local(given)
            query = self._composed[("state", len(params))] = frozen(
                sql.SQL(
                    "select s.job, s.next_attempt_at, s.failures, s.last_success_at,"
                    " s.last_failure_at, s.last_error, s.paused_at, s.paused_reason"
                    " from ({}) cfg left join {} s on s.job = %s"
                ).format(cfg, self.table("job_state"))
            )
        return query, [*params, job]

    @staticmethod
    def state_from_row(job: str, row: Sequence[Any] | None) -> JobState | None:
        if row is None or row[0] is None:
            return None
        return JobState(job, row[1], row[2], row[3], row[4], row[5], row[6], row[7])

    def failure_query(
        self,
        job: str,
        *,
        started_at: datetime,
        failures: int,
        next_attempt_at: datetime,
        error: str,
        sqlstate: str | None,
    ) -> tuple[sql.Composed, dict[str, Any]]:
        """The statement that records a failure in ``job_state`` (backoff
        until ``next_attempt_at``). A failure recorded late (its connection
        was lost) changes nothing when the job has succeeded since it
        started: by ``job_state``, or by the run log, which has the
        successes a queue job does not write to ``job_state`` (one in
        ``SUCCESS_EVERY``, :mod:`pgjobs.steps`): a probe of its (job,
        started_at) index from the failure's start."""
        query = sql.SQL(
            "insert into {state} as s (job, next_attempt_at, failures, last_started_at,"
            " last_failure_at, last_error, last_sqlstate, updated_at)"
            " values (%(job)s, %(next)s, %(failures)s, %(started)s, %(started)s, %(error)s,"
            " %(sqlstate)s, %(started)s)"
            " on conflict (job) do update set next_attempt_at = excluded.next_attempt_at,"
            " failures = excluded.failures, last_started_at = excluded.last_started_at,"
            " last_failure_at = excluded.last_failure_at, last_error = excluded.last_error,"
            " last_sqlstate = excluded.last_sqlstate, updated_at = excluded.updated_at"
            " where (s.last_success_at is null or s.last_success_at < excluded.last_started_at)"
            " and not exists (select from {run} as r where r.job = excluded.job"
            " and r.started_at >= excluded.last_started_at and r.outcome = 'ran')"
        ).format(state=self.table("job_state"), run=self.table("run"))
        params = {
            "job": job,
            "next": next_attempt_at,
            "failures": failures,
            "started": started_at,
            "error": error,
            "sqlstate": sqlstate,
        }
        return query, params

    def quiet_query(
        self, job: str, counts: Mapping[str, int], last_at: datetime, last_outcome: str
    ) -> tuple[sql.Composed, dict[str, Any]]:
        """The statement that adds ``counts`` (ticks by quiet outcome: idle,
        busy, not_due, backing_off, paused) to the job's state."""
        query = sql.SQL(
            "insert into {} as s (job, idle_ticks, busy_ticks, not_due_ticks, backing_off_ticks,"
            " paused_ticks, last_quiet_at, last_quiet_outcome) values (%(job)s, %(idle)s,"
            " %(busy)s, %(not_due)s, %(backing_off)s, %(paused)s, %(at)s, %(outcome)s)"
            " on conflict (job) do update set idle_ticks = s.idle_ticks + excluded.idle_ticks,"
            " busy_ticks = s.busy_ticks + excluded.busy_ticks,"
            " not_due_ticks = s.not_due_ticks + excluded.not_due_ticks,"
            " backing_off_ticks = s.backing_off_ticks + excluded.backing_off_ticks,"
            " paused_ticks = s.paused_ticks + excluded.paused_ticks,"
            " last_quiet_at = greatest(s.last_quiet_at, excluded.last_quiet_at),"
            " last_quiet_outcome = case when s.last_quiet_at > excluded.last_quiet_at"
            " then s.last_quiet_outcome else excluded.last_quiet_outcome end"
        ).format(self.table("job_state"))
        params: dict[str, Any] = {name: counts.get(name, 0) for name in QUIET_OUTCOMES}
        params.update(job=job, at=last_at, outcome=last_outcome)
        return query, params

    # -- run log -----------------------------------------------------------
    def insert_run(
        self,
        conn: Connection,
        result: RunResult,
        worker: str,
        *,
        success_next_attempt: datetime | None = None,
    ) -> int:
        """Record ``result`` in the run log. With ``success_next_attempt``, also
        record a success in ``job_state`` (failures reset), in the same statement."""
        row = execute(
            conn, *self.run_query(result, worker, success_next_attempt=success_next_attempt)
        ).fetchone()
        assert row is not None
        return int(row[0])

    def run_query(
        self, result: RunResult, worker: str, *, success_next_attempt: datetime | None = None
    ) -> tuple[sql.SQL, dict[str, Any]]:
        """:meth:`insert_run`'s statement and parameters (it returns the id)."""
        s = result.stats
        params = {
            "job": result.job,
            "outcome": str(result.outcome),
            "started": result.started_at,
            "finished": result.finished_at,
            "compute_ms": result.compute_seconds * 1000,
            "write_ms": result.write_seconds * 1000,
            "lock_ms": result.lock_seconds * 1000,
            "inserted": s.inserted,
            "updated": s.updated,
            "deleted": s.deleted,
            "skipped": s.skipped_missing_parent,
            "unchanged": s.unchanged,
            "items": result.items,
            "failed_items": result.failed_items,
            "error": result.error,
            "sqlstate": result.sqlstate,
            "worker": worker,
            "detail": Jsonb(result.detail, dumps=_dumps) if result.detail else None,
            "next": success_next_attempt,
        }
        kind = ("run", success_next_attempt is not None)
        known = self._composed.get(kind)
        if known is not None:
            return known, params
        insert = sql.SQL(
            "insert into {} (job, outcome, started_at, finished_at, compute_ms, write_ms,"
            " lock_ms, inserted, updated, deleted, skipped_missing_parent, unchanged, items,"
            " failed_items, error, sqlstate, worker, detail) values (%(job)s, %(outcome)s,"
            " %(started)s, %(finished)s, %(compute_ms)s, %(write_ms)s, %(lock_ms)s,"
            " %(inserted)s, %(updated)s, %(deleted)s, %(skipped)s, %(unchanged)s, %(items)s,"
            " %(failed_items)s, %(error)s, %(sqlstate)s, %(worker)s, %(detail)s) returning id"
        ).format(self.table("run"))
        if success_next_attempt is not None:
            insert = sql.SQL(
                "with state as (insert into {} as s (job, next_attempt_at, failures,"
                " last_started_at, last_success_at, updated_at) values (%(job)s, %(next)s, 0,"
                " %(started)s, %(started)s, %(started)s)"
                " on conflict (job) do update set next_attempt_at = excluded.next_attempt_at,"
                " failures = 0, last_started_at = excluded.last_started_at,"
                " last_success_at = excluded.last_success_at, updated_at = excluded.updated_at) {}"
            ).format(self.table("job_state"), insert)
        made = self._composed[kind] = frozen(insert)
        return made, params

    def prune(
        self, conn: Connection, *, keep: timedelta, now: datetime, limit: int | None = None
    ) -> int:
        """Delete runs that started more than ``keep`` before ``now``, the
        oldest ``limit`` of them at most (all: ``None``); how many."""
        if limit is None:
            query = sql.SQL("delete from {} where started_at < %s").format(self.table("run"))
            return execute(conn, query, (now - keep,)).rowcount
        # the oldest first, through run_started_idx: each batch reads what it deletes
        query = sql.SQL(
            "delete from {t} where id in (select id from {t} where started_at < %s"
            " order by started_at limit %s)"
        ).format(t=self.table("run"))
        return execute(conn, query, (now - keep, limit)).rowcount


__all__ = [
    "DEFAULT_SCHEMA",
    "QUIET_OUTCOMES",
    "JobState",
    "Store",
]
