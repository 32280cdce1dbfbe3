"""pgjobs against replicated PostgreSQL, on private clusters (tests/cluster.py):
multi-host libpq URLs (the first host down; only a standby, then promoted)
and a synchronous standby that is gone, which makes every commit with
``synchronous_commit = on`` wait forever: none of pgjobs' may."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cluster import Cluster, _free_port, private_cluster
from sqlalchemy import text

import pgjobs
from pgjobs.config import load_config
from pgjobs.database import resolve_engine
from pgjobs.queue import enqueue
from pgjobs.results import RunResult

WAIT = 30.0


def wait_until(condition: object, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def url_of(*clusters: Cluster | int, query: str = "") -> str:
    hosts = ",".join(f"127.0.0.1:{c.port if isinstance(c, Cluster) else c}" for c in clusters)
    return f"postgresql://postgres@{hosts}/postgres" + (f"?{query}" if query else "")


def psql(url: str, statement: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all: list[RunResult] = []

    def __call__(self, result: RunResult) -> None:
        with self.lock:
            self.all.append(result)

    def outcomes(self) -> list[str]:
        with self.lock:
            return [str(r.outcome) for r in self.all]


@pytest.fixture
def primary() -> Iterator[Cluster]:
    with private_cluster() as cluster:
        yield cluster


# -- multi-host URLs --------------------------------------------------------------------
def test_a_multi_host_url_whose_first_host_is_down_works_wherever_a_url_is(
    primary: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    down = _free_port()  # nothing listens there
    url = url_of(down, primary, query="target_session_attrs=read-write")
    psql(primary.url, "create table done (n int)")
    job = pgjobs.TaskJob(
        name="t", run=lambda conn: conn.execute(text("insert into done values (1)"))
    )
    # database=
    assert pgjobs.run_once(job, database=url).outcome == "ran"
    # $PGJOBS_DATABASE_URL
    monkeypatch.setenv("PGJOBS_DATABASE_URL", url)
    with pgjobs.Runner() as runner:
        assert runner.tick(job, force=True).outcome == "ran"
        with runner.engine.connect() as conn:
            port = conn.connection.driver_connection.info.port  # type: ignore[union-attr]
        assert port == primary.port
    monkeypatch.delenv("PGJOBS_DATABASE_URL")
    # pgjobs.toml's database (and so --database, which takes its place)
    config = tmp_path / "pgjobs.toml"
    config.write_text(f'database = "{url}"\n')
    loaded = load_config(config)
    engine, owned = resolve_engine(loaded.database_url())
    assert owned
    with engine.connect() as conn:
        assert conn.execute(text("select count(*) from done")).scalar_one() == 2
    engine.dispose()


def test_a_standby_only_url_says_so_once_keeps_trying_and_works_once_promoted(
    primary: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The URL reaches only a standby (the primary is gone, the standby not
    promoted yet: a failover half done). The ticks are interrupted, not
    failed, with one line that says "read-only server"; once the standby
    is promoted the job runs within seconds, with no backoff to sit out."""
    psql(primary.url, "create table done (n int)")
    with pgjobs.Runner(primary.url) as runner:
        runner.install()
    standby = primary.standby()
    try:
        standby.start()
        primary.stop("fast")
        job = pgjobs.TaskJob(
            name="t", every="1h", run=lambda conn: conn.execute(text("insert into done values (1)"))
        )
        results = Results()
        caplog.set_level(logging.INFO, logger="pgjobs")
        with pgjobs.Scheduler([job], standby.url, on_result=results):
            wait_until(lambda: len(results.all) >= 3, what="three interrupted ticks")
            standby.promote()  # pg_ctl -w: returns once the server accepts writes
            promoted = time.monotonic()
            wait_until(lambda: "ran" in results.outcomes(), what="ran once promoted")
            ran_after = time.monotonic() - promoted
        outcomes = results.outcomes()
        first_ran = outcomes.index("ran")
        assert set(outcomes[:first_ran]) == {"interrupted"}, outcomes
        assert {r.sqlstate for r in results.all[:first_ran]} == {"25006"}
        assert ran_after < 10.0  # the retry delay is at most 8 s
        lines = [r.getMessage() for r in caplog.records]
        assert sum("read-only server" in line for line in lines) == 1, lines
        assert not any("failed" in line or "backing off" in line for line in lines), lines
        rows = psql(standby.url, "select failures from pgjobs.job_state where job = 't'")
        assert rows == [(0,)]
        # the interrupted runs, kept while the server was read-only, written after
        logged = psql(
            standby.url,
            "select outcome, sqlstate, count(*) from pgjobs.run where job = 't'"
            " group by 1, 2 order by 1",
        )
        assert logged == [("interrupted", "25006", first_ran), ("ran", None, 1)]
        assert psql(standby.url, "select count(*) from done") == [(1,)]
    finally:
        standby.remove()


# -- a synchronous standby that is gone -------------------------------------------------
def test_no_commit_of_pgjobs_waits_for_a_synchronous_standby_that_is_gone() -> None:
    """``synchronous_standby_names`` names a standby that does not exist:
    a commit with ``synchronous_commit = on`` (the server's default) waits
    forever, as the old primary's did in a switchover. pgjobs' installation,
    ticks (a task that commits synchronously, a queue job, a failure) and
    bookkeeping (tick counts, prune) do not wait."""
    with private_cluster() as cluster:
        psql(cluster.url, "alter system set synchronous_standby_names = 'nobody'")
        psql(cluster.url, "select pg_reload_conf()")
        # the setup bites: a plain commit waits for the standby
        waiting = threading.Thread(target=psql, args=(cluster.url, "create table item (id int)"))
        waiting.start()
        wait_until(
            lambda: (
                psql(
                    cluster.url,
                    "select count(*) from pg_stat_activity where wait_event = 'SyncRep'",
                )
                == [(1,)]
            ),
            what="a commit waiting for the standby",
        )
        psql(
            cluster.url,
            "select pg_cancel_backend(pid) from pg_stat_activity where wait_event = 'SyncRep'",
        )
        waiting.join(WAIT)
        psql(
            cluster.url,
            "set synchronous_commit = local;"
            " create table derived (id int primary key, n int not null);"
            " insert into item select generate_series(1, 5)",
        )
        started = time.monotonic()
        with pgjobs.Runner(cluster.url, call_timeout="5s") as runner:
            runner.install()
            # short timeouts: a commit that waited would end at its deadline
            # (1 + 2 + 5 s), interrupted, instead of hanging the test
            short = {"lock_timeout": "1s", "statement_timeout": "2s"}
            task = pgjobs.TaskJob(
                name="task",
                synchronous_commit=True,
                **short,
                run=lambda conn: conn.execute(text("insert into item values (6)")),
            )
            failing = pgjobs.TaskJob(name="failing", run=lambda conn: 1 / 0, **short)
            worker = pgjobs.QueueJob(
                name="worker",
                target="derived",
                scope="id",
                compute="select id, id * 2 as n from item where id = any(:keys)",
                **short,
            )
            with psycopg.connect(cluster.url) as user:
                user.execute("set synchronous_commit = local")
                enqueue(user, "worker", [1, 2])
            assert runner.tick(task, force=True).outcome == "ran"
            failed = runner.tick(failing, force=True)
            assert failed.outcome == "failed" and failed.run_id is not None
            assert runner.tick(worker, force=True).outcome == "ran"
            assert runner.tick(worker).outcome == "idle"  # counted, written by flush
            runner.flush()
            assert runner.prune() == 0
        elapsed = time.monotonic() - started
        assert elapsed < 20.0, elapsed  # nothing waited for a deadline
        # nor does a backend of pgjobs' as it exits, dropping the queue worker's
        # temp tables in a commit of its own (the field's "idle waiting for <LSN>")
        assert psql(cluster.url, "select count(*) from derived") == [(2,)]
        assert (
            psql(
                cluster.url,
                "select query from pg_stat_activity where wait_event = 'SyncRep'",
            )
            == []
        )


# -- a failover under pgjobs run --------------------------------------------------------
def test_a_failover_is_not_slowed_by_pgjobs_and_the_listener_follows_the_new_primary(
    primary: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Streaming replication with a synchronous standby, and a scheduler on
    the multi-host URL (read-write) with a queue job woken by its listener.
    The standby goes (a switchover takes it over): pgjobs' ticks go on and
    none of its backends waits for it; the old primary's fast shutdown is
    quick; the standby is promoted; the listener listens again on it (one
    line naming it) and an enqueue there is processed at once."""
    psql(primary.url, "create table item (id int primary key)")
    psql(primary.url, "create table derived (id int primary key, n int not null)")
    with pgjobs.Runner(primary.url) as runner:
        runner.install()
    standby = primary.standby()
    try:
        standby.start()
        psql(primary.url, "alter system set synchronous_standby_names = '*'")
        psql(primary.url, "select pg_reload_conf()")
        wait_until(
            lambda: psql(primary.url, "select sync_state from pg_stat_replication") == [("sync",)],
            what="a synchronous standby",
        )
        job = pgjobs.QueueJob(
            name="w",
            target="derived",
            scope="id",
            every="1h",  # what runs it is the listener
            compute="select id, id * 2 as n from item where id = any(:keys)",
        )
        url = url_of(primary, standby, query="target_session_attrs=read-write")
        results = Results()
        caplog.set_level(logging.INFO, logger="pgjobs")

        def add(on: Cluster, n: int) -> None:
            with psycopg.connect(on.url) as user:
                user.execute("set synchronous_commit = local")
                user.execute("insert into item values (%s)", (n,))
                enqueue(user, "w", [n])

        def derived(on: Cluster) -> int:
            return psql(on.url, "select count(*) from derived")[0][0]  # type: ignore[return-value]

        with pgjobs.Scheduler([job], url, on_result=results) as scheduler:
            assert scheduler.listener is not None and scheduler.listener.listening.wait(WAIT)
            add(primary, 1)
            wait_until(lambda: derived(primary) == 1, what="item 1 on the primary")
            standby.stop("fast")  # the synchronous standby is gone
            add(primary, 2)
            wait_until(lambda: derived(primary) == 2, what="item 2 without the standby")
            waiting = psql(
                primary.url,
                "select count(*) from pg_stat_activity where wait_event = 'SyncRep'",
            )
            assert waiting == [(0,)]
            # the worker's session holds temp tables: what a backend drops,
            # in a commit of its own, as the fast shutdown ends it
            temp = psql(primary.url, "select count(*) from pg_class where relpersistence = 't'")
            assert temp[0][0] > 0, temp
            started = time.monotonic()
            primary.stop("fast")
            shutdown = time.monotonic() - started
            standby.start()
            standby.promote()
            wait_until(
                lambda: any(
                    "listening for enqueues again" in r.getMessage() for r in caplog.records
                ),
                what="the listener back",
            )
            add(standby, 3)
            enqueued = time.monotonic()
            wait_until(
                lambda: (
                    derived(standby) >= 1
                    and psql(standby.url, "select count(*) from derived where id = 3") == [(1,)]
                ),
                what="item 3 on the new primary",
            )
            latency = time.monotonic() - enqueued
        assert shutdown < 5.0, shutdown  # 60-90 s in the field
        assert latency < 2.0, latency  # woken, not polled (every = 1h)
        lines = [r.getMessage() for r in caplog.records]
        back = [line for line in lines if "listening for enqueues again" in line]
        assert back == [f"pgjobs: listening for enqueues again, on 127.0.0.1:{standby.port}"]
        assert "failed" not in results.outcomes(), results.outcomes()
        assert not any("backing off" in line for line in lines), lines
    finally:
        standby.remove()


def test_an_exiting_session_with_temp_tables_waits_for_a_gone_standby_unless_local(
    primary: Cluster,
) -> None:
    """The field's ``idle waiting for <LSN>``, shown: a session that made a
    temp table, with the server's default ``synchronous_commit = on``,
    does not end when its client goes while the synchronous standby is
    gone (a fast shutdown then waited 60 s and gave up, measured here);
    one of an engine pgjobs created (``synchronous_commit = local`` for the
    session) ends at once."""
    standby = primary.standby()
    try:
        standby.start()
        psql(primary.url, "alter system set synchronous_standby_names = '*'")
        psql(primary.url, "select pg_reload_conf()")
        wait_until(
            lambda: psql(primary.url, "select sync_state from pg_stat_replication") == [("sync",)],
            what="a synchronous standby",
        )
        plain = psycopg.connect(primary.url)
        plain.execute("set local synchronous_commit = local")  # its own commit goes through
        plain.execute("create temp table t (n int)")
        plain.commit()
        engine, _ = resolve_engine(primary.url)
        with engine.connect() as conn:
            conn.execute(text("create temp table t (n int)"))
            conn.commit()
            ours = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
        theirs = plain.info.backend_pid
        standby.stop("fast")
        engine.dispose()
        plain.close()

        def alive(pid: int) -> bool:
            return psql(
                primary.url, f"select count(*) from pg_stat_activity where pid = {pid}"
            ) == [(1,)]

        wait_until(lambda: not alive(ours), timeout=5.0, what="pgjobs' backend gone")

        def waits() -> bool:
            query = f"select wait_event from pg_stat_activity where pid = {theirs}"
            return psql(primary.url, query) == [("SyncRep",)]

        # the plain one stays, waiting for the standby, until the server is killed
        wait_until(waits, timeout=5.0, what="the plain backend waiting for the standby")
        assert alive(theirs)
    finally:
        standby.remove()
