"""The two calls most programs start with: :func:`run_once` (one tick of a
job, looked up by name in the registry if need be) and :func:`install`
(pgjobs' own tables). Both are thin: the protocol is :mod:`pgjobs.runner`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine

from .database import engine_for
from .deadline import DEFAULT_CALL_TIMEOUT
from .derived import Derived, install_triggers
from .drift import SAMPLE, CheckResult, check_on, workers_of
from .durations import Duration, parse_duration
from .errors import ConfigError
from .jobs import Job, Progress, QueueJob
from .locking import DEFAULT_NAMESPACE
from .registry import get_registry
from .results import RunResult
from .runner import Runner
from .store import DEFAULT_SCHEMA


def install(
    database: str | Engine | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    derived: Iterable[Derived] = (),
) -> None:
    """Create (or upgrade) pgjobs' own tables in ``schema``, idempotently and
    safely when several processes do it at once. The first tick does it too;
    call it before :func:`pgjobs.enqueue` in a fresh database.

    ``derived``: declarations (:class:`~pgjobs.Derived`, or
    ``registry.derived()``) whose sources' triggers to install, update or
    remove as ``pgjobs migrate`` does: each declaration is checked against
    the database first (a :class:`ConfigError` naming the key, nothing
    installed), and triggers no declaration given wants are dropped."""
    declared = list(derived)
    with Runner(database, schema=schema) as runner:
        runner.install()
        if declared:
            with runner.engine.connect() as conn:
                install_triggers(conn, declared, schema)


def run_once(
    job: Job | str,
    database: str | Engine | None = None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    schema: str = DEFAULT_SCHEMA,
    force: bool = False,
    progress: Progress | None = None,
    auto_migrate: bool = True,
) -> RunResult:
    """Run one tick of ``job`` (a job object or a registered name).

    The tick honours the job's schedule and backoff, as the scheduler's
    do: a job another tick finished less than an interval ago returns
    ``not_due`` (a queue job is due whenever it has work), one backing off
    after a failure ``backing_off``, and nothing runs. ``force=True`` runs
    it anyway, as ``pgjobs once`` always does; neither waits for the group
    lock (``busy``). ``auto_migrate=False``: pending migrations are not
    applied; the tick refuses (:class:`~pgjobs.SchemaError`) naming them.

    >>> result = pgjobs.run_once(job, database="postgresql://localhost/app")
    >>> result.outcome, result.stats
    """
    if isinstance(job, str):
        job = get_registry().get(job)
    with Runner(database, namespace=namespace, schema=schema, auto_migrate=auto_migrate) as runner:
        return runner.tick(job, force=force, progress=progress)


def check(
    job: Job | str,
    database: str | Engine | None = None,
    *,
    keys: Sequence[Any] | None = None,
    sample: int = SAMPLE,
    workers: Iterable[QueueJob] | None = None,
    schema: str = DEFAULT_SCHEMA,
    call_timeout: Duration = DEFAULT_CALL_TIMEOUT,
) -> CheckResult:
    """What a recompute of ``job`` would write now, without writing: a
    :class:`~pgjobs.drift.CheckResult` with the figures a recompute's
    :class:`~pgjobs.DiffStats` would have, and ``sample`` keys of each kind
    of change (``docs/drift.md``). No write, no row lock, no advisory lock;
    the job's ``lock_timeout`` and ``statement_timeout`` apply.

    ``job``: a job object or a registered name. A queue job is checked for
    its items ``keys`` (scalars, or tuples for a composite scope). Rows of
    items that are queued or in flight are counted apart (``on_the_way``):
    those of ``workers``, by default the queue jobs on the same target in
    the registry (for a name; none for a job object). ``call_timeout``: as
    the Runner's, the margin of the check's deadline (each of its round
    trips at most the job's ``lock_timeout`` + ``statement_timeout`` + it).

    >>> result = pgjobs.check("exam-scores", "postgresql://localhost/app")
    >>> result.drift, result.stats, result.samples.get("updated")
    """
    if isinstance(job, str):
        registry = get_registry()
        job = registry.get(job)
        if workers is None:
            workers = workers_of(job, registry.jobs())
    timeout = parse_duration(call_timeout, field="call_timeout")
    if timeout <= timedelta(0):
        raise ConfigError(f"call_timeout: must be positive, got {call_timeout!r}")
    bound = timeout.total_seconds()
    with engine_for(database, call_timeout=bound) as engine, engine.connect() as conn:
        return check_on(
            conn,
            job,
            keys=keys,
            sample=sample,
            workers=workers or (),
            schema=schema,
            call_timeout=bound,
        )


__all__ = ["check", "install", "run_once"]
