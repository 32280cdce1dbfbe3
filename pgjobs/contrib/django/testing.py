"""Test helpers for Django projects: run the queued items now, assert that
a job's table has no drift. For ``TransactionTestCase`` (and pytest-django's
``@pytest.mark.django_db(transaction=True)``): pgjobs works on connections
of its own, which see committed data only, so the test's writes must be
committed; inside ``TestCase``'s transaction the helpers refuse, saying so.

::

    from pgjobs.contrib.django.testing import PgJobsTestMixin

    class ScoresTest(PgJobsTestMixin, TransactionTestCase):
        def test_scores(self):
            Exam.objects.create(...)            # a trigger or enqueue() queues it
            self.run_pending_jobs()
            self.assertNoDrift("exam-scores")

    @pytest.mark.django_db(transaction=True)
    def test_scores():
        reset()                                 # pgjobs' tables, emptied
        ...
        run_pending()
        assert_no_drift("exam-scores")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...api import check, run_once
from ...results import Outcome, RunResult
from .conf import Settings, load
from .host import engine, preset

#: ticks of one job run_pending() makes at most (a queue that never drains is a bug)
MAX_TICKS = 1_000


def _settings() -> Settings:
    from django.db import connections

    settings = load()
    if connections[settings.using].in_atomic_block:
        raise RuntimeError(
            "pgjobs' test helpers run on connections of their own, which do not see this"
            " test's uncommitted writes: use TransactionTestCase (pytest-django:"
            " @pytest.mark.django_db(transaction=True)), or commit first"
        )
    return settings


#: pgjobs' tables that :func:`reset` empties (``schema_version`` stays)
TABLES = ("queue", "job_state", "run", "mark", "flow_worker", "scheduler")


def reset() -> None:
    """Empty pgjobs' tables: its queue, job states and runs.
    ``TransactionTestCase`` empties the project's tables between tests, not
    these (Django does not manage them); :class:`PgJobsTestMixin` calls
    this before each test."""
    from django.db import connections
    from psycopg import sql

    settings = _settings()
    tables = sql.SQL(", ").join(sql.Identifier(settings.config.schema, name) for name in TABLES)
    with connections[settings.using].cursor() as cursor:
        cursor.execute(sql.SQL("truncate {}").format(tables).as_string(None))


def run_pending(*jobs: str, max_ticks: int = MAX_TICKS) -> list[RunResult]:
    """Run the queue jobs ``jobs`` (default: every enabled queue job) until
    none has a due item, each tick as ``manage.py pgjobs once`` runs it;
    the results, in order. A failed tick raises ``AssertionError`` naming
    it (an item failing is retried later, not now: its tick is ``ran``
    with ``failed_items``)."""
    settings = _settings()
    given = preset(settings)
    registry = given.registry(given.config)
    names = list(jobs) or [j.name for j in registry.jobs(enabled_only=True) if j.kind == "queue"]
    results: list[RunResult] = []
    with engine(settings) as made:
        for name in names:
            job = registry.get(name)
            for _ in range(max_ticks):
                result = run_once(
                    job,
                    made,
                    namespace=given.config.namespace,
                    schema=given.config.schema,
                    force=True,
                )
                results.append(result)
                if result.outcome is Outcome.FAILED:
                    raise AssertionError(f"pgjobs: {name}: the tick failed: {result.error}")
                if result.outcome is not Outcome.RAN or (job.kind != "queue"):
                    break
            else:
                raise AssertionError(f"pgjobs: {name}: still has items after {max_ticks} ticks")
    return results


def assert_no_drift(job: str, *, keys: Sequence[Any] | None = None) -> None:
    """Fail when a recompute of ``job`` (a queue job: of its items ``keys``)
    would write anything now, naming the first rows it would change."""
    settings = _settings()
    given = preset(settings)
    registry = given.registry(given.config)
    with engine(settings) as made:
        found = check(registry.get(job), made, keys=keys, schema=given.config.schema)
    if found.drift:
        samples = {kind: [s.key for s in rows] for kind, rows in found.samples.items() if rows}
        raise AssertionError(
            f"pgjobs: {job}: drift in {found.target}: +{found.inserted} ~{found.updated}"
            f" -{found.deleted} rows; first keys: {samples}"
        )


class PgJobsTestMixin:
    """:func:`run_pending` and :func:`assert_no_drift` as methods of a
    ``TransactionTestCase``, and pgjobs' tables emptied before each test
    (:func:`reset`)."""

    def setUp(self) -> None:
        reset()
        super().setUp()  # type: ignore[misc]

    def run_pending_jobs(self, *jobs: str) -> list[RunResult]:
        return run_pending(*jobs)

    def assertNoDrift(self, job: str, *, keys: Sequence[Any] | None = None) -> None:
        assert_no_drift(job, keys=keys)


__all__ = ["MAX_TICKS", "TABLES", "PgJobsTestMixin", "assert_no_drift", "reset", "run_pending"]
