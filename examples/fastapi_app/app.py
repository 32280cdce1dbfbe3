"""pgjobs embedded in an async FastAPI application.

* The application is async: its handlers use an ``AsyncEngine`` on psycopg
  (``create_async_engine("postgresql+psycopg://...")``).
* The scheduler starts and stops with the app: ``pgjobs.lifespan(...)``
  inside the app's own lifespan. pgjobs installs no signal handler and
  configures no logging: uvicorn (or whatever serves the app) owns both.
  Shutdown waits for a running job's transaction to commit or roll back,
  off the event loop.
* A request handler writes and enqueues in one transaction
  (``await pgjobs.enqueue_async(conn, ...)`` on the request's
  ``AsyncConnection``): the worker sees the change, or the item not at all.
* ``GET /jobs/status`` serves the jobs' status as JSON; ``/pgjobs/`` the status page.

Run it (``pip install -e '.[asyncio]' fastapi uvicorn`` in the checkout:
the distribution ``pgjobs-derived`` with SQLAlchemy's asyncio)::

    psql "$DATABASE" -f schema.sql
    PGJOBS_DATABASE_URL="$DATABASE" uvicorn app:app
    curl -X POST localhost:8000/authors/1/posts \
         -H 'content-type: application/json' -d '{"title": "hi"}'
    curl localhost:8000/jobs/status
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import create_async_engine

import pgjobs
import pgjobs.web

CONFIG = Path(__file__).with_name("pgjobs.toml")


class LastRuns:
    """The latest result of each job in this process, fed by the scheduler's
    ``on_result`` (called from its worker threads, hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, pgjobs.RunResult] = {}
        self._last_ran: dict[str, pgjobs.RunResult] = {}
        self._ticks: dict[str, int] = {}

    def __call__(self, result: pgjobs.RunResult) -> None:
        with self._lock:
            self._last[result.job] = result
            self._ticks[result.job] = self._ticks.get(result.job, 0) + 1
            if result.outcome is pgjobs.Outcome.RAN:
                self._last_ran[result.job] = result

    def snapshot(
        self,
    ) -> tuple[dict[str, pgjobs.RunResult], dict[str, pgjobs.RunResult], dict[str, int]]:
        with self._lock:
            return dict(self._last), dict(self._last_ran), dict(self._ticks)


class NewPost(BaseModel):
    title: str


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def create_app(database: str | None = None) -> FastAPI:
    """The application; ``database`` defaults to ``$PGJOBS_DATABASE_URL``."""
    last_runs = LastRuns()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        url = database or os.environ.get("PGJOBS_DATABASE_URL")
        if not url:
            raise RuntimeError("set PGJOBS_DATABASE_URL (or pass create_app(database=...))")
        # The application's own engine, async, for its request handlers.
        engine = create_async_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            # Starts pgjobs' scheduler (checking the jobs against the database
            # first) and shuts it down when the app stops. Its state,
            # {"pgjobs": scheduler}, becomes request.state.pgjobs.
            async with pgjobs.lifespan(CONFIG, database=url, on_result=last_runs) as state:
                yield {"engine": engine, **state}
        finally:
            await engine.dispose()

    app = FastAPI(title="pgjobs FastAPI example", lifespan=lifespan)
    app.mount("/pgjobs", pgjobs.web.asgi_app())  # the status page, of the lifespan's scheduler

    @app.post("/authors/{author_id}/posts", status_code=201)
    async def add_post(author_id: int, post: NewPost, request: Request) -> dict[str, Any]:
        """Add a post and enqueue its author for the stats worker, atomically:
        the insert and the queue entry commit together, or neither does."""
        try:
            async with request.state.engine.begin() as conn:
                result = await conn.execute(
                    text("insert into post (author_id, title) values (:a, :t) returning id"),
                    {"a": author_id, "t": post.title},
                )
                post_id = result.scalar_one()
                await pgjobs.enqueue_async(conn, "author-stats-worker", [author_id])
        except IntegrityError as exc:
            raise HTTPException(status_code=404, detail=f"no author {author_id}") from exc
        return {"id": post_id, "author_id": author_id}

    @app.get("/authors/{author_id}/stats")
    async def author_stats(author_id: int, request: Request) -> dict[str, Any]:
        """The derived row, as the jobs last wrote it."""
        async with request.state.engine.connect() as conn:
            result = await conn.execute(
                text("select posts, last_post_at from author_stats where author_id = :a"),
                {"a": author_id},
            )
            row = result.first()
        if row is None:
            raise HTTPException(status_code=404, detail=f"no stats for author {author_id} yet")
        return {"author_id": author_id, "posts": row.posts, "last_post_at": row.last_post_at}

    @app.get("/jobs/status")
    async def jobs_status(request: Request) -> dict[str, Any]:
        """Each job: schedule, this process's latest tick, the latest run that
        wrote, and its queue (depth, due, retrying, dead, oldest age)."""
        scheduler: pgjobs.Scheduler = request.state.pgjobs
        async with request.state.engine.connect() as conn:
            stats = await pgjobs.queue_stats_async(conn, schema=scheduler.runner.store.schema)
        queues = {q.job: q for q in stats}
        last, last_ran, ticks = last_runs.snapshot()
        jobs = []
        for name, job in sorted(scheduler.jobs.items()):
            result, ran, queue = last.get(name), last_ran.get(name), queues.get(name)
            jobs.append(
                {
                    "job": name,
                    "kind": job.kind,
                    "group": job.group,
                    "schedule": job.schedule,
                    "ticks": ticks.get(name, 0),
                    "last_outcome": None if result is None else str(result.outcome),
                    "last_at": None if result is None else result.finished_at,
                    "last_error": None if result is None else result.error,
                    "last_ran_at": None if ran is None else ran.finished_at,
                    "rows_changed": None
                    if ran is None
                    else {
                        "inserted": ran.stats.inserted,
                        "updated": ran.stats.updated,
                        "deleted": ran.stats.deleted,
                    },
                    "queue": None
                    if queue is None
                    else {
                        "depth": queue.depth,
                        "due": queue.due,
                        "retrying": queue.retrying,
                        "dead": queue.dead,
                        "oldest_age_seconds": _seconds(queue.oldest_age),
                    },
                }
            )
        return {"running": scheduler.running, "jobs": jobs}

    return app


app = create_app()
