"""The pgjobs design: the same two jobs as a QueueJob and a RecomputeJob.

Both jobs share one lock group and are ticked by a :class:`pgjobs.Scheduler`,
the way ``pgjobs run`` and ``pgjobs.lifespan`` drive them; users enqueue with
:func:`pgjobs.enqueue` in their own transactions. Only the public API is used.
The worker's ``after`` (the status rows) also notes, for the queue lag, which
items its transaction processed; ``on_result`` stamps them once that
transaction has committed. See ``design.py`` for the interface and
``naive.py`` for the design this one replaces.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

import pgjobs

from .design import Design, Place
from .lag import XactSnapshot, current_snapshot
from .report import Scripted
from .scenario import COMPUTE_SQL, GROUP, RECOMPUTE, UPSERT_STATUS, WORKER, DemoOptions
from .users import UserDelete


class PgJobsDesign(Design):
    """The same jobs through pgjobs."""

    name = "pgjobs"
    schema_suffix = "app"

    def __init__(self, engine: Engine, opts: DemoOptions, place: Place) -> None:
        super().__init__(engine, opts, place)
        self.target = f"{place.schema}.exam_score"
        self.runner = pgjobs.Runner(engine, namespace=place.namespace, schema=place.store_schema)
        self.runner.install()
        # Items each worker thread's open transaction processed (see _after).
        self._local = threading.local()
        self.worker_job = pgjobs.QueueJob(
            name=WORKER,
            group=GROUP,
            target=self.target,
            scope=("exam_id",),
            compute=COMPUTE_SQL + " where s.exam_id = any(:keys)",
            after=self._after,
            every=opts.worker_every,
            batch_size=100,
            backoff="5s",
            description="rewrite the scores of changed exams",
        )
        self.recompute_job = pgjobs.RecomputeJob(
            name=RECOMPUTE,
            group=GROUP,
            target=self.target,
            compute=self._compute_all,
            every=opts.recompute_every,
            backoff="5s",
            busy_retry=min(1.0, opts.recompute_every / 2),
            description="rewrite every score",
        )

    def _compute_all(self, conn: Connection) -> str:
        # The expensive part: it holds no row lock (pgjobs stages the result
        # in a temp table and writes only the difference afterwards).
        conn.execute(text("select pg_sleep(:s)"), {"s": self.opts.compute_seconds})
        return COMPUTE_SQL

    def _after(self, conn: Connection, keys: list[tuple[Any, ...]], _stats: object) -> None:
        """The queue worker's ``after``: the status rows, last (the parents are
        already locked by pgjobs, the scores written). Then, for the queue
        lag, the items done and what this transaction saw committed."""
        conn.execute(text(UPSERT_STATUS), {"ids": [k[0] for k in keys]})
        self._noted().append((datetime.now(UTC), [int(k[0]) for k in keys], current_snapshot(conn)))

    def _noted(self) -> list[tuple[datetime, list[int], XactSnapshot]]:
        if not hasattr(self._local, "noted"):
            self._local.noted = []
        noted: list[tuple[datetime, list[int], XactSnapshot]] = self._local.noted
        return noted

    def enqueue(self, conn: Connection, exam: int) -> None:
        pgjobs.enqueue(conn, WORKER, [exam], schema=self.place.store_schema)

    def start_jobs(self, stop: threading.Event) -> None:
        # The scheduler `pgjobs run` and `pgjobs.lifespan` use: one APScheduler
        # entry per job, the run protocol deciding what each tick does.
        self.scheduler = pgjobs.Scheduler(
            [self.recompute_job, self.worker_job],
            self.engine,
            namespace=self.place.namespace,
            schema=self.place.store_schema,
            keep_runs=None,
            on_result=self._on_result,
        )
        self.scheduler.start()

    def _on_result(self, result: pgjobs.RunResult) -> None:
        """Called in the tick's thread, once its transaction has ended."""
        ended = time.monotonic()
        if result.job != WORKER:
            self.recompute.add_result(result)
            return
        self.worker.add_result(result)
        noted = self._noted()
        done, noted[:] = list(noted), []
        if result.outcome is not pgjobs.Outcome.RAN:
            return  # rolled back: nothing was processed
        for at, keys, snapshot in done:
            if at < result.started_at:
                continue  # left by an earlier tick that raised instead of returning
            self.lag.processed(keys, snapshot, ended)

    def stop_jobs(self) -> None:
        self.scheduler.shutdown(wait=True)

    def drain(self) -> None:
        for _ in range(1000):
            result = self.runner.tick(self.worker_job, force=True)
            if result.outcome is pgjobs.Outcome.IDLE:
                return
            self._on_result(result)
            if result.outcome is pgjobs.Outcome.FAILED:
                return

    def scripted(self) -> list[Scripted]:
        return [self._scripted_recompute(1)]

    def _scripted_recompute(self, exam: int) -> Scripted:
        """The same interleaving as the naive one: the recompute has computed
        (here: read every row, including the exam's) and pauses; a user
        deletes the exam; the recompute writes."""
        computing = threading.Event()
        go = threading.Event()

        def compute(conn: Connection) -> list[tuple[Any, ...]]:
            rows = [tuple(r) for r in conn.execute(text(COMPUTE_SQL))]
            computing.set()
            go.wait(60)
            return rows

        job = pgjobs.RecomputeJob(
            name=RECOMPUTE + ":scripted",
            group=GROUP,
            target=self.target,
            compute=compute,
            every="1h",
            backoff="1s",
        )
        results: list[pgjobs.RunResult] = []
        thread = threading.Thread(
            target=lambda: results.append(self.runner.tick(job, force=True)),
            name="pgjobs-recompute-scripted",
        )
        user = UserDelete(self.engine, exam)
        thread.start()
        try:
            computing.wait(60)
            user.start()
            user.join(timeout=30)  # it must finish while the recompute is still open
            done_during = not user.is_alive() and thread.is_alive()
        finally:
            go.set()
            thread.join()
            if user.ident is not None:
                user.join()
        if not results:
            raise pgjobs.PgJobsError("demo: the scripted recompute did not return")
        result = results[0]
        return Scripted(
            design=self.name,
            job="recompute",
            exam=exam,
            job_sqlstate=None if result.ok else (result.sqlstate or result.error or "error"),
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=done_during,
            skipped_missing_parent=result.stats.skipped_missing_parent,
        )


class PgJobsWithoutFlow(PgJobsDesign):
    """The same jobs with ``flow = False``: the recompute holds the group's
    lock from its start to its commit, and the worker is ``busy`` while it
    computes (pgjobs before flow). Run with ``--naive``, for the comparison."""

    name = "no-flow"
    schema_suffix = "noflow"
    store_suffix = "noflowjobs"

    @staticmethod
    def wanted(opts: DemoOptions) -> bool:
        return opts.naive

    def __init__(self, engine: Engine, opts: DemoOptions, place: Place) -> None:
        super().__init__(engine, opts, place)
        self.worker_job = dataclasses.replace(self.worker_job, flow=False)
        self.recompute_job = dataclasses.replace(self.recompute_job, flow=False)

    def scripted(self) -> list[Scripted]:
        return []  # the same interleaving as pgjobs': flow changes nothing in it


__all__ = [
    "PgJobsDesign",
    "PgJobsWithoutFlow",
]
