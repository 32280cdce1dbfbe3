"""Async applications enqueue in their own transaction, on a real PostgreSQL:
SQLAlchemy's ``AsyncConnection`` (an async engine on psycopg) and psycopg's
``AsyncConnection``. A change and its enqueue rolled back leave nothing
queued; committed, the worker processes them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

import pgjobs

pytestmark = pytest.mark.anyio

SCHEMA = """
create table author (id int primary key, name text not null);
create table post (
    id bigserial primary key,
    author_id int not null references author (id) on delete cascade,
    title text not null
);
create table author_stats (
    author_id int primary key references author (id) on delete cascade,
    posts int not null
);
insert into author (id, name) select g, 'author ' || g from generate_series(1, 5) g;
"""

JOB = pgjobs.QueueJob(
    name="author-stats-worker",
    group="authors",
    target="author_stats",
    scope=("author_id",),
    compute="select a.id as author_id, count(p.id)::int as posts from author a"
    " left join post p on p.author_id = a.id where a.id = any(:keys) group by a.id",
    every="1s",
)

INSERT = "insert into post (author_id, title) values (%s, %s)"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def db(engine: Any) -> Any:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    return engine


def _url(engine: Any, driver: str) -> str:
    return make_url(engine.url).set(drivername=driver).render_as_string(hide_password=False)


@asynccontextmanager
async def sqlalchemy_transaction(engine: Any) -> AsyncIterator[Any]:
    """An ``AsyncConnection`` of an async engine on psycopg, in a transaction
    the test commits or rolls back itself."""
    aengine = create_async_engine(_url(engine, "postgresql+psycopg"))
    try:
        async with aengine.connect() as conn:
            yield conn
    finally:
        await aengine.dispose()


@asynccontextmanager
async def psycopg_transaction(engine: Any) -> AsyncIterator[Any]:
    conn = await psycopg.AsyncConnection.connect(_url(engine, "postgresql"))
    try:
        yield conn
    finally:
        await conn.close()


async def insert_post(conn: Any, author: int, title: str) -> None:
    """The application's change, on whichever kind of connection."""
    if isinstance(conn, psycopg.AsyncConnection):
        await conn.execute(INSERT, (author, title))
    else:
        await conn.execute(
            text("insert into post (author_id, title) values (:a, :t)"), {"a": author, "t": title}
        )


KINDS: dict[str, Callable[[Any], AbstractAsyncContextManager[Any]]] = {
    "sqlalchemy": sqlalchemy_transaction,
    "psycopg": psycopg_transaction,
}


def queued(engine: Any) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(text("select job, key::text from pgjobs.queue order by 1, 2"))
        return [tuple(r) for r in rows]


def stats(engine: Any) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("select author_id, posts from author_stats")).all())


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_a_change_and_its_enqueue_rolled_back_leave_nothing_queued(db: Any, kind: str):
    async with KINDS[kind](db) as conn:
        await insert_post(conn, 1, "draft")
        assert await pgjobs.enqueue_async(conn, JOB, [1]) == 1
        # inside the caller's transaction: it sees its own entry
        [seen] = await pgjobs.queue_stats_async(conn)
        assert (seen.job, seen.depth) == (JOB.name, 1)
        await conn.rollback()
        assert await pgjobs.queue_stats_async(conn) == []
        await conn.rollback()  # end the read's transaction too
    assert queued(db) == []
    result = pgjobs.run_once(JOB, database=db)
    assert result.outcome is pgjobs.Outcome.IDLE
    assert stats(db) == {}


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_a_change_and_its_enqueue_committed_are_processed(db: Any, kind: str):
    async with KINDS[kind](db) as conn:
        await insert_post(conn, 2, "hello")
        await insert_post(conn, 2, "again")
        assert await pgjobs.enqueue_async(conn, JOB, [2, 2]) == 1  # one entry per key
        # Uncommitted: a worker tick now finds nothing to do.
        assert pgjobs.run_once(JOB, database=db).outcome is pgjobs.Outcome.IDLE
        await conn.commit()
    assert queued(db) == [(JOB.name, "[2]")]
    result = pgjobs.run_once(JOB, database=db)
    assert result.outcome is pgjobs.Outcome.RAN, result.error
    assert (result.items, result.stats.inserted) == (1, 1)
    assert stats(db) == {2: 2}
    assert queued(db) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_a_pending_entry_enqueued_again_is_locked_until_commit(db: Any, kind: str):
    # The entry is pending already; the application changes the author again
    # and enqueues it again. Until it commits, a worker must not consume the
    # entry (it would compute without the uncommitted change and drop it).
    with db.begin() as sync:
        pgjobs.enqueue(sync, JOB, [3])
    async with KINDS[kind](db) as conn:
        await insert_post(conn, 3, "late")
        assert await pgjobs.enqueue_async(conn, JOB, [3]) == 0  # already pending
        result = pgjobs.run_once(JOB, database=db)
        # the probe sees the entry; the claim (SKIP LOCKED) gets none of it,
        # and a tick that claimed nothing ends idle
        assert (result.outcome, result.items) == (pgjobs.Outcome.IDLE, 0), result
        assert stats(db) == {}
        assert queued(db) == [(JOB.name, "[3]")]
        await conn.commit()
    assert pgjobs.run_once(JOB, database=db).outcome is pgjobs.Outcome.RAN
    assert stats(db) == {3: 1}
    assert queued(db) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_enqueue_triggers_installed_and_dropped_from_async_code(db: Any, kind: str):
    async with KINDS[kind](db) as conn:
        await pgjobs.install_enqueue_trigger_async(
            conn, table="post", job=JOB, columns=["author_id"]
        )
        await conn.commit()
        await insert_post(conn, 4, "by trigger")
        await conn.commit()
    assert queued(db) == [(JOB.name, "[4]")]
    assert pgjobs.run_once(JOB, database=db).outcome is pgjobs.Outcome.RAN
    assert stats(db) == {4: 1}

    async with KINDS[kind](db) as conn:
        await pgjobs.drop_enqueue_trigger_async(conn, table="post", job=JOB)
        await insert_post(conn, 5, "no trigger")
        await conn.commit()
    assert queued(db) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_async_errors_say_what_is_wrong(db: Any, kind: str):
    async with KINDS[kind](db) as conn:
        with pytest.raises(pgjobs.ConfigError, match="columns: 'post' has no column"):
            await pgjobs.install_enqueue_trigger_async(conn, table="post", job="x", columns=["z"])
        await conn.rollback()
        with pytest.raises(pgjobs.PgJobsError, match="'elsewhere' is not installed"):
            await pgjobs.enqueue_async(conn, JOB, [1], schema="elsewhere")
        await conn.rollback()
        with pytest.raises(pgjobs.PgJobsError, match="'elsewhere' is not installed"):
            await pgjobs.queue_stats_async(conn, schema="elsewhere")
        await conn.rollback()
        # the sync function refuses an async connection, naming the one to await
        with pytest.raises(TypeError, match="enqueue_async"):
            pgjobs.enqueue(conn, JOB, [1])
    with db.connect() as sync, pytest.raises(TypeError, match=r"pgjobs\.enqueue\b"):
        await pgjobs.enqueue_async(sync, JOB, [1])
