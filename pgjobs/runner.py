"""The run protocol, the same for every job at every tick.

1. **Due?**   read ``job_state``; backing off or run recently elsewhere: stop (no lock).
2. **Work?**  ``job.check_work`` in a short read-only transaction; nothing: ``idle`` (no lock).
   Where the check is one statement (``job.work_query``), steps 1 and 2 are
   one round trip.
3. **Lock.**  begin the job transaction, ``pg_try_advisory_xact_lock``; taken by
   another transaction: ``busy``, roll back at once. Re-read the state under the
   lock: a replica may have finished the job between steps 1 and 3.
4. **Run.**   ``SET LOCAL lock_timeout`` / ``statement_timeout``; ``job.execute``.
5. **Commit** the writes together with the job's new state and its run record,
   which releases the lock.
6. **Record** any other outcome in ``pgjobs.run``; a failure also sets
   ``next_attempt_at = now + backoff`` in ``pgjobs.job_state``.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection, Engine

from ._pg import Params, abandon, driver, execute, set_local
from .database import ENV_TRANSACTION_POOLING, resolve_engine, transaction_pooling
from .errors import ConfigError, JobError
from .jobs import Job
from .locking import (
    DEFAULT_NAMESPACE,
    TRY_XACT_SQL,
    lock_name,
    release_session_lock,
    try_session_lock,
)
from .results import Execution, Outcome, RunResult
from .store import DEFAULT_SCHEMA, JobState, Store

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
#: ``progress(phase, done, total)``: phases are "compute", "diff", "write", ...
Progress = Callable[[str, int | None, int | None], None]


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(kw_only=True)
class RunContext:
    """What a job's body may use besides its connection."""

    job: Job
    namespace: str
    store: Store
    now: datetime
    progress: Progress | None = None
    #: commit what is written so far and continue in a new transaction, the
    #: group still locked; only for jobs that write in chunks
    checkpoint: Callable[[], None] | None = None
    #: statements (with parameters) the runner sends right before the job's
    #: COMMIT, in the same round trip: writes whose results nobody waits for
    before_commit: list[tuple[sql.Composed, Params]] = field(default_factory=list)
    #: called once the job's transaction has committed, on its connection
    #: (outside any transaction); an error there is logged, and the run's
    #: outcome stays what it was
    after_commit: list[Callable[[Connection], None]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def report(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)


_READ_ONLY = {"transaction_read_only": "on"}
_ASYNC_COMMIT = {"synchronous_commit": "off"}


def _job_settings(job: Job) -> dict[str, str]:
    """``SET LOCAL`` values of the job's ``lock_timeout``, ``statement_timeout``
    and ``synchronous_commit``."""
    values = {}
    for name in ("lock_timeout", "statement_timeout"):
        value = getattr(job, name)
        assert isinstance(value, timedelta)
        values[name] = f"{int(value.total_seconds() * 1000)}ms"
    values["synchronous_commit"] = "on" if job.synchronous_commit else "off"
    return values


def _slack(interval: timedelta | None) -> timedelta:
    """Tolerance for timer jitter: a tick that fires a hair before one interval
    has passed still counts as due (10 % of the interval, at most 1 s)."""
    if interval is None:
        return timedelta(seconds=1)
    return min(interval / 10, timedelta(seconds=1))


def _error_text(exc: BaseException) -> str:
    # SQLAlchemy wraps the driver's error in a text of its own (the SQL again, a
    # link); the driver's error says what PostgreSQL said.
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    message = f"{type(exc).__name__}: {exc}".strip()
    return message if len(message) <= 4000 else message[:3997] + "..."


class Runner:
    """Runs jobs under the protocol against one database.

    ``database``: a URL, an :class:`~sqlalchemy.engine.Engine` or ``None`` for
    ``$PGJOBS_DATABASE_URL``. ``clock`` is injectable so that schedules can be
    simulated; every timestamp pgjobs stores comes from it.
    """

    def __init__(
        self,
        database: str | Engine | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        schema: str = DEFAULT_SCHEMA,
        clock: Clock = utcnow,
        worker: str | None = None,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(f"namespace: expected a non-empty string, got {namespace!r}")
        self.engine, self._owned = resolve_engine(database)
        self.namespace = namespace
        self.store = Store(schema)
        self.clock = clock
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"

    def close(self) -> None:
        """Dispose of the engine if this runner created it."""
        if self._owned:
            self.engine.dispose()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(self) -> None:
        """Create pgjobs' schema if it is missing (also done by the first tick)."""
        with self.engine.connect() as conn:
            self.store.ensure(conn)

    # -- the protocol ------------------------------------------------------
    def tick(
        self,
        job: Job,
        *,
        progress: Progress | None = None,
        next_due: datetime | None = None,
        force: bool = False,
    ) -> RunResult:
        """Run one tick of ``job`` and return its :class:`RunResult`.

        ``next_due``: for cron jobs, the scheduler's next fire time (so other
        replicas know the job is done until then). ``force`` ignores the
        schedule and the backoff (never the lock).
        """
        with self.engine.connect() as conn:
            self.store.ensure(conn)
            return self.tick_on(conn, job, progress=progress, next_due=next_due, force=force)

    def tick_on(
        self,
        conn: Connection,
        job: Job,
        *,
        progress: Progress | None = None,
        next_due: datetime | None = None,
        force: bool = False,
    ) -> RunResult:
        """:meth:`tick` on a connection of the caller's (not in a transaction)."""
        started = self.clock()

        def finish(outcome: Outcome, **fields: Any) -> RunResult:
            result = RunResult(
                job=job.name,
                outcome=outcome,
                started_at=started,
                finished_at=self.clock(),
                **fields,
            )
            return self._record(conn, result)

        ctx = RunContext(
            job=job, namespace=self.namespace, store=self.store, now=started, progress=progress
        )

        # 1. Due? and 2. Work? One short read-only transaction, no lock.
        quick = self._due_and_work(conn, job, ctx)
        if quick is not None:
            state, has_work = quick
            blocked = None if force else self._not_due(job, state, started)
            error: Exception | None = None
        else:
            with conn.begin():
                state = self.store.read_state(conn, job.name, settings=_READ_ONLY)
                blocked = None if force else self._not_due(job, state, started)
                if blocked is None:
                    try:
                        has_work = job.check_work(conn, ctx)
                    except Exception as exc:
                        error = exc
                    else:
                        error = None
        if blocked is not None:
            return finish(blocked, next_attempt_at=state.next_attempt_at if state else None)
        if error is not None:
            return self._fail(conn, job, state, started, error)
        if not has_work:
            return finish(Outcome.IDLE)

        # 3. Lock, never wait.
        trans = conn.begin()
        session_locked = False
        try:
            # One round trip: BEGIN, the lock, then (if it was taken) the
            # re-check of the state under it (a replica may have run the job
            # since step 1) with the job's settings. Both are read-only and
            # transaction-local: when the lock is busy they are rolled back.
            raw = driver(conn)
            with raw.pipeline():
                lock = raw.execute(
                    TRY_XACT_SQL, (lock_name(self.namespace, job.group or job.name),)
                )
                state_row = raw.execute(
                    *self.store.state_query(job.name, settings=_job_settings(job))
                )
                job.prefetch(raw, ctx)
            locked = lock.fetchone()
            if not (locked and locked[0]):
                trans.rollback()
                return finish(Outcome.BUSY, retry_after=self._busy_retry(job))
            state = self.store.state_from_row(job.name, state_row.fetchone())
            blocked = None if force else self._not_due(job, state, started)
            if blocked is not None:
                trans.rollback()
                return finish(blocked, next_attempt_at=state.next_attempt_at if state else None)

            # 4. Run.
            body = job
            if getattr(job, "chunk_parents", None) and transaction_pooling():
                body = _unchunked(job)
            elif getattr(job, "chunk_parents", None):
                session_locked = try_session_lock(conn, self.namespace, job.group or job.name)
                backend = execute(conn, "select pg_backend_pid()").fetchone()

                def checkpoint() -> None:
                    nonlocal trans
                    _send_before_commit(conn, ctx)
                    trans.commit()
                    trans = conn.begin()
                    statement, params = set_local(_job_settings(job))
                    now_on = execute(
                        conn, sql.SQL("{}, pg_backend_pid()").format(statement), params
                    ).fetchone()
                    if now_on is None or backend is None or now_on[-1] != backend[0]:
                        raise JobError(_SESSION_CHANGED.format(name=job.name))

                ctx.checkpoint = checkpoint
            execution = body.execute(conn, ctx)

            # 5. Commit the writes with the job's state and run record.
            next_attempt = self._next_after_success(job, started, next_due)
            result = self._result(job, Outcome.RAN, started, execution, next_attempt)
            # the run record (with the success state) and COMMIT: one round trip
            raw = driver(conn)
            with raw.pipeline():
                _send_before_commit(conn, ctx)
                recorded = raw.execute(
                    *self.store.run_query(result, self.worker, success_next_attempt=next_attempt)
                )
                trans.commit()
            row = recorded.fetchone()
            assert row is not None
            run_id = int(row[0])
        except Exception as exc:
            abandon(conn, trans)
            return self._fail(conn, job, state, started, exc)
        finally:
            if session_locked:
                self._release_session_lock(conn, job)
        log.info("pgjobs: %s ran in %.3fs: %s", job.name, result.seconds, result.stats)
        for action in ctx.after_commit:
            try:
                action(conn)
            except Exception:
                log.warning(
                    "pgjobs: %s: after its commit: %s failed", job.name, action, exc_info=True
                )
                if conn.in_transaction():
                    conn.rollback()
        return _with_run_id(result, run_id)

    # -- helpers -------------------------------------------------------------
    def _due_and_work(
        self, conn: Connection, job: Job, ctx: RunContext
    ) -> tuple[JobState | None, bool] | None:
        """Steps 1 and 2 in one round trip (BEGIN, the state, the job's
        :meth:`~pgjobs.jobs.Job.work_query`, COMMIT), for jobs whose check is
        one statement; whether the job is due is decided after it (the check
        is an index probe: asking it of a job that is not due costs less
        than a round trip). ``None``: the job has no such statement, or
        something failed; the caller then takes the two steps one by one,
        which says what failed."""
        query = job.work_query(ctx)
        if query is None:
            return None
        statement, params = query
        trans = conn.begin()
        try:
            raw = driver(conn)
            with raw.pipeline():
                state_cur = raw.execute(*self.store.state_query(job.name, settings=_READ_ONLY))
                work_cur = raw.execute(statement, params)
                trans.commit()
            work = work_cur.fetchone()
            return self.store.state_from_row(job.name, state_cur.fetchone()), bool(work and work[0])
        except Exception:
            abandon(conn, trans)
            log.debug("pgjobs: %s: the one-round-trip check failed", job.name, exc_info=True)
            return None

    def _not_due(self, job: Job, state: JobState | None, now: datetime) -> Outcome | None:
        if state is None or state.next_attempt_at is None:
            return None
        if state.failures > 0:
            return Outcome.BACKING_OFF if now < state.next_attempt_at else None
        if now + _slack(job.interval) < state.next_attempt_at:
            return Outcome.NOT_DUE
        return None

    def _next_after_success(
        self, job: Job, started: datetime, next_due: datetime | None
    ) -> datetime:
        if job.interval is not None:
            return started + job.interval
        return next_due if next_due is not None else started

    def _busy_retry(self, job: Job) -> timedelta | None:
        retry = job.busy_retry
        if not isinstance(retry, timedelta):
            return None
        if job.interval is not None and retry >= job.interval:
            return None
        # Spread over [retry/2, retry]: a fixed delay can line up with another
        # job's ticks (a 1 s job, a retry after 1 s) and lose the race every time.
        return retry * random.uniform(0.5, 1.0)

    def _release_session_lock(self, conn: Connection, job: Job) -> None:
        try:
            with conn.begin():
                release_session_lock(conn, self.namespace, job.group or job.name)
        except Exception:
            # A pooled connection must never go back holding the group lock.
            log.warning(
                "pgjobs: could not release the session lock of %s; dropping the connection",
                job.name,
            )
            conn.invalidate()

    def _result(
        self,
        job: Job,
        outcome: Outcome,
        started: datetime,
        ex: Execution,
        next_attempt: datetime | None,
    ) -> RunResult:
        return RunResult(
            job=job.name,
            outcome=outcome,
            started_at=started,
            finished_at=self.clock(),
            stats=ex.stats,
            compute_seconds=ex.compute_seconds,
            write_seconds=ex.write_seconds,
            lock_seconds=ex.lock_seconds,
            items=ex.items,
            failed_items=ex.failed_items,
            next_attempt_at=next_attempt,
            detail=dict(ex.detail),
        )

    def _fail(
        self, conn: Connection, job: Job, state: JobState | None, started: datetime, exc: Exception
    ) -> RunResult:
        from ._pg import sqlstate_of

        failures = (state.failures if state else 0) + 1
        next_attempt = self.clock() + job.backoff_policy.delay(failures)
        sqlstate = sqlstate_of(exc)
        error = _error_text(exc)
        log.error(
            "pgjobs: %s failed (%s), next attempt at %s",
            job.name,
            sqlstate or type(exc).__name__,
            next_attempt.isoformat(),
            exc_info=exc,
        )
        result = RunResult(
            job=job.name,
            outcome=Outcome.FAILED,
            started_at=started,
            finished_at=self.clock(),
            error=error,
            sqlstate=sqlstate,
            next_attempt_at=next_attempt,
        )

        def save(c: Connection) -> RunResult:
            with c.begin():
                self.store.record_failure(
                    c,
                    job.name,
                    started_at=started,
                    failures=failures,
                    next_attempt_at=next_attempt,
                    error=error,
                    sqlstate=sqlstate,
                )
                return _with_run_id(result, self.store.insert_run(c, result, self.worker))

        if not conn.invalidated:
            try:
                return save(conn)
            except Exception:
                log.debug("pgjobs: recording %s's failure on its own connection failed", job.name)
        # The job's connection broke with the job: record on a new one.
        with self.engine.connect() as other:
            return save(other)

    def _record(self, conn: Connection, result: RunResult) -> RunResult:
        """The run record of a tick that changed nothing (idle, busy, not due,
        backing off): BEGIN and the insert in one round trip, committed
        without waiting for the WAL flush (a crash may lose the last few such
        records, nothing else; a job's own record and state are written in
        its transaction, a failure's with a synchronous commit)."""
        with conn.begin():
            raw = driver(conn)
            with raw.pipeline():
                raw.execute(*set_local(_ASYNC_COMMIT))
                cur = raw.execute(*self.store.run_query(result, self.worker))
            row = cur.fetchone()
            assert row is not None
        return _with_run_id(result, int(row[0]))

    def prune(self, keep: timedelta = timedelta(days=7)) -> int:
        """Delete run records older than ``keep``; returns how many."""
        with self.engine.connect() as conn:
            self.store.ensure(conn)
            with conn.begin():
                return self.store.prune(conn, keep=keep, now=self.clock())


_SESSION_CHANGED = (
    "{name}: chunked writes need one server session across their commits, and this"
    " connection's next transaction ran in another (a transaction pooler, such as PgBouncer"
    " with pool_mode = transaction?). The chunks before it are committed; the group's"
    " session lock stays with the previous server session until the pooler closes it. Behind"
    " a transaction pooler set $" + ENV_TRANSACTION_POOLING + "=1 (chunked jobs then write in"
    " one transaction)."
)
#: chunked jobs already told that they run unchunked (logged once per process)
_told_unchunked: set[str] = set()


def _unchunked(job: Job) -> Job:
    """``job`` writing in one transaction: behind a transaction pooler the
    group's session lock and the chunks' temp tables would stay with a
    server session the next transaction may not run in."""
    if job.name not in _told_unchunked:
        _told_unchunked.add(job.name)
        log.warning(
            "pgjobs: %s: chunk_parents is off behind a transaction pooler ($%s):"
            " it writes in one transaction",
            job.name,
            ENV_TRANSACTION_POOLING,
        )
    return job.replace(chunk_parents=None)


def _send_before_commit(conn: Connection, ctx: RunContext) -> None:
    """Send (and forget) the statements the job left for its commit."""
    raw = driver(conn)
    statements, ctx.before_commit = ctx.before_commit, []
    for statement, params in statements:
        raw.execute(statement, params)


def _with_run_id(result: RunResult, run_id: int) -> RunResult:
    from dataclasses import replace

    return replace(result, run_id=run_id)


def install(database: str | Engine | None = None, *, schema: str = DEFAULT_SCHEMA) -> None:
    """Create (or upgrade) pgjobs' own tables in ``schema``, idempotently and
    safely when several processes do it at once. The first tick does it too;
    call it before :func:`pgjobs.enqueue` in a fresh database."""
    with Runner(database, schema=schema) as runner:
        runner.install()


def run_once(
    job: Job | str,
    database: str | Engine | None = None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    schema: str = DEFAULT_SCHEMA,
    force: bool = False,
    progress: Progress | None = None,
) -> RunResult:
    """Run one tick of ``job`` (a job object or a registered name).

    >>> result = pgjobs.run_once(job, database="postgresql://localhost/app")
    >>> result.outcome, result.stats
    """
    if isinstance(job, str):
        from .registry import get_registry

        job = get_registry().get(job)
    with Runner(database, namespace=namespace, schema=schema) as runner:
        return runner.tick(job, force=force, progress=progress)


__all__ = ["RunContext", "Runner", "install", "run_once"]
