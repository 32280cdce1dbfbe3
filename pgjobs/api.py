"""The two calls most programs start with: :func:`run_once` (one tick of a
job, looked up by name in the registry if need be) and :func:`install`
(pgjobs' own tables). Both are thin: the protocol is :mod:`pgjobs.runner`.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from .jobs import Job, Progress
from .locking import DEFAULT_NAMESPACE
from .registry import get_registry
from .results import RunResult
from .runner import Runner
from .store import DEFAULT_SCHEMA


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


__all__ = ["install", "run_once"]
