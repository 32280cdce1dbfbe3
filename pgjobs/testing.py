"""Helpers for testing pgjobs and plugins against a real PostgreSQL.

* :func:`find_server_url` finds a server: ``$PGJOBS_TEST_DSN``, else
  testcontainers where a Docker engine answers, else an embedded PostgreSQL
  (the ``embedded`` extra), else it fails saying how to get one. Never skips.
* :func:`fresh_database` creates a database of its own for one test, and
  drops it afterwards.
* :func:`run_tick` runs one tick of a job against a given engine or
  connection and returns its :class:`~pgjobs.RunResult`.
* :func:`run_sql` runs SQL text as written (a schema, fixtures) and commits.
* :func:`assert_no_drift` asserts that a target's recompute and its queue
  workers' incremental path agree (:func:`pgjobs.check` finds nothing).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection, Engine, make_url

from .database import normalize_url
from .drift import CheckResult
from .errors import PgJobsError
from .jobs import Job, QueueJob, RecomputeJob
from .results import RunResult

ENV_DSN = "PGJOBS_TEST_DSN"

HOW_TO_GET_ONE = (
    "pgjobs tests need a real PostgreSQL and found none. Provide one of:\n"
    f"  * ${ENV_DSN}=postgresql://user@host:5432/dbname (a server you run; preferred as root)\n"
    "  * a running Docker engine (testcontainers starts postgres:16)\n"
    "  * pip install 'pgjobs-derived[embedded]' (an embedded PostgreSQL in a temporary directory)"
)


def _docker_answers(timeout: float = 3.0) -> bool:
    """True when a Docker engine answers a ping within ``timeout`` seconds."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host[len("unix://") :]
            if not os.path.exists(path):
                return False
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
                s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
                return b"200 OK" in s.recv(1024)
        if host.startswith("tcp://"):
            hostport = host[len("tcp://") :]
            name, _, port = hostport.partition(":")
            with socket.create_connection((name, int(port or 2375)), timeout=timeout) as s:
                s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
                return b"200 OK" in s.recv(1024)
    except OSError:
        return False
    return False


@contextlib.contextmanager
def find_server_url(dsn: str | None = None) -> Iterator[str]:
    """Yield a ``postgresql+psycopg://`` URL of a server the caller may create
    databases on; stops whatever it started when the block ends."""
    dsn = dsn or os.environ.get(ENV_DSN)
    if dsn:
        yield normalize_url(dsn)
        return
    if _docker_answers():  # pragma: no cover - needs a Docker engine
        from testcontainers.community.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver="psycopg") as container:  # pragma: no cover
            yield container.get_connection_url()
        return  # pragma: no cover
    from .embedded import embedded_server, import_pgserver

    try:
        import_pgserver()
    except ImportError as exc:
        raise PgJobsError(HOW_TO_GET_ONE) from exc
    # Outside the try: an ImportError raised by the caller's block is theirs.
    with embedded_server() as url:
        yield url


@contextlib.contextmanager
def fresh_database(server_url: str, *, prefix: str = "pgjobs_test") -> Iterator[str]:
    """Create an empty database on ``server_url``, yield its URL, drop it."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            raw: Any = conn.connection.driver_connection
            raw.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
        try:
            yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                raw = conn.connection.driver_connection
                raw.execute(
                    sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
                )
    finally:
        admin.dispose()


def run_sql(engine: Engine, statements: str) -> None:
    """Run ``statements`` (one or several, separated by ``;``) as written, with
    no bind-parameter parsing (a ``:name`` stays as it is), and commit."""
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        assert isinstance(pg, psycopg.Connection)
        # bytes: psycopg types a query given as str as a literal string
        pg.execute(statements.encode())
        pg.commit()


def run_tick(job: Job, database: Engine | Connection | str, **options: Any) -> RunResult:
    """Run one tick of ``job`` the way the scheduler would, and return the
    :class:`~pgjobs.RunResult` to inspect::

        result = run_tick(my_job, engine)
        assert result.outcome == "ran" and result.stats.inserted == 3

    ``database`` may be a connection not inside a transaction; ``options``
    go to :class:`~pgjobs.Runner` (``namespace``, ``schema``, ``clock``).
    """
    from .runner import Runner

    force = options.pop("force", False)
    if isinstance(database, Connection):
        runner = Runner(database.engine, **options)
        runner.store.ensure(database)
        return runner.tick_on(database, job, force=force)
    with Runner(database, **options) as runner:
        return runner.tick(job, force=force)


#: ticks of each worker :func:`assert_no_drift` runs at most to drain its queue
DRAIN_TICKS = 1000


def assert_no_drift(
    job: Job,
    database: Engine | str,
    *,
    workers: Iterable[QueueJob] = (),
    drain: bool = True,
    sample: int = 5,
) -> CheckResult:
    """Assert that ``job``'s recompute and the incremental path of its queue
    ``workers`` agree: after a scenario (your writes, your enqueues, your
    workers' ticks), what a recompute would write now is nothing. With
    ``drain``, each worker first runs until its queue is empty (at most
    :data:`DRAIN_TICKS` ticks; a failed tick fails the assertion). Rows of
    items still queued then count against it: they would be on their way,
    not agreement. Returns the :class:`~pgjobs.CheckResult`; raises
    ``AssertionError`` with the figures and the sampled keys (old and new
    values of updated rows) otherwise::

        enqueue_and_change_things(engine)
        assert_no_drift(SCORES_RECOMPUTE, engine, workers=[SCORES_WORKER])
    """
    from .api import check
    from .drift_text import summary
    from .results import Outcome

    if not isinstance(job, RecomputeJob):
        raise TypeError(
            f"assert_no_drift: expected the RecomputeJob of the target (with its queue jobs as"
            f" workers=[...]), got {type(job).__name__} {job.name!r}"
        )
    workers = list(workers)
    if drain:
        for worker in workers:
            for _ in range(DRAIN_TICKS):
                result = run_tick(worker, database, force=True)
                if result.outcome is Outcome.FAILED:
                    raise AssertionError(f"{worker.name}: a tick failed: {result.error}")
                if result.outcome is Outcome.IDLE:
                    break
            else:
                raise AssertionError(f"{worker.name}: still busy after {DRAIN_TICKS} ticks")
    found = check(job, database, workers=workers, sample=sample)
    way = found.on_the_way
    if found.drift or way.changed or way.skipped_missing_parent:
        raise AssertionError("the incremental path and the recompute disagree:\n" + summary(found))
    return found


__all__ = [
    "DRAIN_TICKS",
    "ENV_DSN",
    "HOW_TO_GET_ONE",
    "assert_no_drift",
    "find_server_url",
    "fresh_database",
    "run_sql",
    "run_tick",
]
