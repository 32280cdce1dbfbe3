"""Pre-flight checks of jobs against the database, before anything runs.

:func:`check_jobs` reflects what the diff writer will reflect, checks a
queue job's scope columns and plans a recompute's SQL text (``LIMIT 0``),
in read-only transactions that are rolled back. ``pgjobs run`` and ``pgjobs
once`` call it; :class:`~pgjobs.Scheduler` does at :meth:`start` (job by
job with :func:`check_each`, unless ``strict``: a job that fails is set
aside, see :mod:`pgjobs.preflight`). Errors
name the job's config key or its plugin (:class:`~pgjobs.registry.Registered`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.engine import Connection, Engine

from ._pg import connection_lost, error_text
from .errors import ConfigError
from .jobs import QueueJob, RecomputeJob
from .registry import Registered
from .slices.compute import keyed_text
from .staging import check_coverage, check_sql
from .target import reflect_target


def check_jobs(engine: Engine, entries: Iterable[Registered]) -> None:
    """Check the recompute and queue jobs of ``entries`` against the
    database, each in a read-only transaction that is rolled back: the
    target exists, its diff key is a primary key or NOT NULL columns with a
    unique index, declared parents exist, a queue job's scope columns, and a
    recompute's SQL text, planned with LIMIT 0 (no row computed) and its
    columns matched against the target. Raises :class:`ConfigError` naming
    the job's config key (or plugin)."""
    wanted = [e for e in entries if isinstance(e.job, RecomputeJob | QueueJob)]
    if not wanted:
        return
    with engine.connect() as conn:
        for entry in wanted:
            _check_one(conn, entry)


def check_each(engine: Engine, entries: Iterable[Registered]) -> dict[str, Exception]:
    """:func:`check_jobs`, job by job, without stopping at the first that
    fails: what each failing job's check raised, by job name (a
    :class:`ConfigError` naming its config key or plugin, or the database's
    error about that job). A database that cannot be reached raises."""
    wanted = [e for e in entries if isinstance(e.job, RecomputeJob | QueueJob)]
    failed: dict[str, Exception] = {}
    if not wanted:
        return failed
    with engine.connect() as conn:
        for entry in wanted:
            try:
                _check_one(conn, entry)
            except Exception as exc:
                if connection_lost(exc):
                    raise
                failed[entry.job.name] = exc
    return failed


def _check_one(conn: Connection, entry: Registered) -> None:
    trans = conn.begin()
    try:
        conn.exec_driver_sql("set transaction read only")
        conn.exec_driver_sql("set local statement_timeout = '15s'")
        conn.exec_driver_sql("set local lock_timeout = '5s'")
        _check_job(conn, entry)
    finally:
        trans.rollback()


def _check_job(conn: Connection, entry: Registered) -> None:
    job = entry.job
    assert isinstance(job, RecomputeJob | QueueJob)
    try:
        # The diff writer's own reflection: a missing table, a key that is not
        # NOT NULL + unique, an unknown parent fail here as they would at run time.
        target = reflect_target(conn, job.target, key=job.key, parents=job.parents)
        missing = [c for c in job.scope if c not in target.types and c not in target.key]
        if missing:
            raise ConfigError(f"scope: {job.target!r} has no column(s) {', '.join(missing)}")
    except ConfigError as exc:
        raise ConfigError(f"{entry.where}: {exc}") from None
    # A queue job's SQL may join the batch's keys table, which exists only in
    # a run; a recompute's SQL is planned (LIMIT 0: no row computed) and its
    # columns matched against the target, as staging will.
    # (SQL that binds the keys of a slice, :keys, is planned in a run only)
    if (
        isinstance(job, RecomputeJob)
        and isinstance(job.compute, str)
        and not (job.slices and keyed_text(job.compute))
    ):
        field = "sql" if entry.config is not None else "compute"
        try:
            with conn.begin_nested():
                produced = check_sql(conn, target, job.compute)
            check_coverage(target, produced, job.columns, "the new rows' SQL")
        except ConfigError as exc:
            raise ConfigError(f"{entry.key(field)}: {exc}") from None
        except Exception as exc:
            message = error_text(exc, first=True, sqlstate=True)
            raise ConfigError(f"{entry.key(field)}: the query fails: {message}") from exc


__all__ = ["check_each", "check_jobs"]
