"""The reviewer's points of issue 37, each with a test that failed before
its fix: the run log pruned in batches; scheduled verifications taken in
turns by the replicas of a group; a wake callback's bug is not a lost
connection; a heartbeat that fails says so at WARNING, once;
``install_enqueue_trigger``'s DDL waits a bounded time for the table's
lock, and is retried."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine

import pgjobs
import pgjobs.queue
from pgjobs.heartbeat import Heartbeat
from pgjobs.listener import Listener
from pgjobs.queue import channel, install_enqueue_trigger
from pgjobs.store import Store

WAIT = 30.0


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "create table item (id int primary key, v int not null default 0);"
            " create table item_total (id int primary key references item, v int not null);"
            " insert into item select generate_series(1, 5)"
        )
    pgjobs.Runner(engine).install()
    yield engine
    engine.dispose()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT} s"
        time.sleep(0.01)


# -- pruning ----------------------------------------------------------------------------
def test_prune_deletes_old_runs_in_batches_each_its_own_transaction(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,500 runs older than a week, pruned 1,000 at a time: three
    transactions, each under the call's deadline; the recent run stays."""
    with db.begin() as conn:
        conn.execute(
            text(
                "insert into pgjobs.run (job, outcome, started_at, finished_at)"
                " select 'j', 'ran', now() - interval '8 days', now() - interval '8 days'"
                " from generate_series(1, 2500)"
            )
        )
        conn.execute(
            text(
                "insert into pgjobs.run (job, outcome, started_at, finished_at)"
                " values ('j', 'ran', now(), now())"
            )
        )
    batches: list[int] = []
    prune = Store.prune

    def counted(self: Store, conn: Connection, **kwargs: Any) -> int:
        done = prune(self, conn, **kwargs)
        batches.append(done)
        return done

    monkeypatch.setattr(Store, "prune", counted)
    with pgjobs.Runner(db) as runner:
        assert runner.prune(timedelta(days=7), batch=1000) == 2500
    assert batches == [1000, 1000, 500]
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from pgjobs.run")).scalar() == 1


# -- verifications -------------------------------------------------------------------------
def test_scheduled_verifications_of_a_group_take_turns_across_replicas(db: Engine) -> None:
    """Two replicas' ``verify_every`` fire together: the one that checks
    holds the group's verification lock; the other, finding it taken, does
    not run the full check at the same time, and after it finds the check
    recorded. One check, not two."""
    computing, go, calls = threading.Event(), threading.Event(), []

    def compute(conn: Connection) -> str:
        calls.append(1)
        if len(calls) == 1:
            computing.set()
            assert go.wait(WAIT)
        return "select id, v from item"

    job = pgjobs.RecomputeJob(
        name="totals", target="item_total", compute=compute, every="1h", verify_every="1h"
    )
    one = pgjobs.Scheduler([job], db, check=False)
    two = pgjobs.Scheduler([job], db, check=False)
    try:
        first = threading.Thread(target=one._verify, args=("totals",))
        first.start()
        assert computing.wait(WAIT)
        two._verify("totals")  # the first holds the group's turn: nothing here
        assert len(calls) == 1
        go.set()
        first.join(WAIT)
        two._verify("totals")  # the first's check is recorded: not due
    finally:
        one.shutdown()
        two.shutdown()
    with db.connect() as conn:
        checked = conn.execute(
            text("select count(*) from pgjobs.run where outcome = 'checked'")
        ).scalar()
    assert (checked, len(calls)) == (1, 1)


# -- the listener ----------------------------------------------------------------------------
def test_a_wake_callback_that_raises_is_logged_not_taken_for_a_lost_connection(
    db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    woken: list[str] = []
    lost: list[BaseException] = []

    def wake(job: str) -> None:
        woken.append(job)
        if len(woken) == 1:
            raise RuntimeError("a bug in the callback")

    listener = Listener(db, ["j"], schema="pgjobs", wake=wake, on_lost=lost.append)
    listener.start()
    try:
        assert listener.listening.wait(WAIT)
        pid = listener.backend_pid
        for n in (1, 2):
            with db.begin() as conn:
                conn.execute(text("select pg_notify(:c, '')"), {"c": channel("pgjobs", "j")})
            wait_until(lambda n=n: len(woken) == n, f"wake-up {n}")
        assert lost == []
        assert listener.backend_pid == pid and listener.listening.is_set()
    finally:
        listener.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "pgjobs: waking j on its enqueue failed; listening on"
    ]


# -- heartbeats --------------------------------------------------------------------------------
def test_a_failing_heartbeat_says_so_at_warning_once_and_when_it_beats_again(
    db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    failing = [True, True]

    @contextmanager
    def connect() -> Iterator[Connection]:
        if failing:
            failing.pop()
            raise RuntimeError("permission denied for table scheduler")
        with db.connect() as conn:
            yield conn

    caplog.set_level(logging.DEBUG, logger="pgjobs")
    beat = Heartbeat(connect, "pgjobs", ["j"], "1h")
    for _ in range(3):
        beat._try_beat()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "pgjobs: heartbeat not recorded (permission denied for table scheduler); other"
        " schedulers and `pgjobs status` will see this one as gone quiet until it is",
        "pgjobs: heartbeat recorded again",
    ]
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from pgjobs.scheduler")).scalar() == 1


# -- the enqueue trigger's DDL -------------------------------------------------------------
def test_the_trigger_ddl_waits_briefly_for_the_table_and_writers_do_not_queue_behind_it(
    db: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A long transaction has written ``item``; ``install_enqueue_trigger``
    needs its SHARE ROW EXCLUSIVE lock (CREATE TRIGGER's; replacing one,
    DROP TRIGGER takes ACCESS EXCLUSIVE). Each attempt waits at most
    ``TRIGGER_LOCK_WAIT`` (0.2 s here), so a user's insert arriving
    meanwhile is not stuck behind the queued DDL (PostgreSQL grants locks in
    order); the attempts go on until the long transaction ends, then the
    triggers are in, and the caller's own ``lock_timeout`` is what it was."""
    monkeypatch.setattr(pgjobs.queue, "TRIGGER_LOCK_WAIT", 0.2, raising=False)
    writing, done = threading.Event(), threading.Event()

    def long_writer() -> None:
        with db.connect() as conn, conn.begin():
            conn.execute(text("update item set v = 1 where id = 1"))
            writing.set()
            assert done.wait(WAIT)

    holder = threading.Thread(target=long_writer)
    holder.start()
    assert writing.wait(WAIT)
    installed: list[str] = []

    def install() -> None:
        with db.connect() as conn, conn.begin():
            conn.execute(text("set local lock_timeout = '7s'"))
            install_enqueue_trigger(conn, table="item", job="j", columns=["id"])
            installed.append(conn.execute(text("show lock_timeout")).scalar())

    installer = threading.Thread(target=install)
    installer.start()
    try:
        wait_until(lambda: "trying again" in caplog.text, "a retry of the trigger's DDL")
        with db.connect() as conn, conn.begin():  # a user's insert, meanwhile
            conn.execute(text("set local statement_timeout = '5s'"))
            conn.execute(text("insert into item (id) values (6)"))
        assert installed == []  # still retrying: the long transaction holds on
    finally:
        done.set()
        holder.join(WAIT)
        installer.join(WAIT)
    assert installed == ["7s"]
    with db.connect() as conn:
        triggers = conn.execute(
            text(
                "select count(*) from pg_trigger where tgrelid = 'item'::regclass and not tgisinternal"
            )
        ).scalar()
    assert triggers == 3


def test_the_trigger_ddl_gives_up_after_retry_for_changing_nothing(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pgjobs.queue, "TRIGGER_LOCK_WAIT", 0.05, raising=False)
    monkeypatch.setattr(pgjobs.queue, "TRIGGER_RETRY_FOR", 0.5, raising=False)
    with db.connect() as holder, holder.begin():
        holder.execute(text("update item set v = 1 where id = 1"))
        with db.connect() as conn, conn.begin():
            conn.execute(text("set local lock_timeout = '5s'"))  # (the caller's: not waited)
            with pytest.raises(pgjobs.PgJobsError, match="item stayed locked"):
                install_enqueue_trigger(conn, table="item", job="j", columns=["id"])
            assert conn.execute(text("select 1")).scalar() == 1  # the transaction lives on
    with db.connect() as conn:
        assert (
            conn.execute(
                text(
                    "select count(*) from pg_trigger where tgrelid = 'item'::regclass and not tgisinternal"
                )
            ).scalar()
            == 0
        )
