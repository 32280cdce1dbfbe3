"""No database call without a deadline, and a lost connection is no failure.

Real PostgreSQL throughout: a statement stuck on the server with no
server-side timeout, a half-open TCP connection (a proxy in the test that
stops forwarding without closing, as pg-boss tests it) under the pool's
ping, under a tick and under the listener, a backend terminated mid-tick.
Each cut-off tick must end at its deadline as ``interrupted`` (not
``failed``: no backoff), free its slot, and the next one run on a fresh
connection. Ordered by events between statements; the only sleeps are the
waits that a deadline itself must end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from extras import first_address, retarget
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

import pgjobs
from pgjobs.deadline import DeadlineExceeded, bounded
from pgjobs.listener import Listener
from pgjobs.queue import channel, enqueue
from pgjobs.results import Outcome, RunResult

WAIT = 30.0  # upper bound on any wait; never reached when things work


def wait_until(condition: object, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


class Proxy:
    """A TCP proxy, on 127.0.0.1, to ``target`` (a server's host and port, or
    a Unix socket's path). :meth:`freeze` stops forwarding
    on every connection it carries, without closing any (a half-open
    connection, as a NAT or a failed-over host leaves it: the client's
    kernel still sees a live peer); connections made after it are
    forwarded as usual."""

    def __init__(self, target: tuple[str, int] | str) -> None:
        #: a TCP server's (host, port), or a Unix socket's path
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.closed = threading.Event()
        #: connections made from now on are frozen too (see freeze)
        self.freezing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                if isinstance(self.target, tuple):
                    upstream = socket.create_connection(self.target)
                else:
                    upstream = socket.socket(socket.AF_UNIX)
                    upstream.connect(self.target)
            except OSError:
                client.close()
                continue
            frozen = threading.Event()
            with self.lock:
                if self.closed.is_set():
                    # accepted while close() ran (a blocked accept() outlives
                    # the socket's close): close() has gone past the pairs
                    client.close()
                    upstream.close()
                    return
                if self.freezing:
                    frozen.set()
                self.pairs.append((client, upstream, frozen))
            threading.Thread(
                target=self._pipe, args=(client, upstream, frozen), daemon=True
            ).start()

    def _pipe(self, a: socket.socket, b: socket.socket, frozen: threading.Event) -> None:
        ends = {a: b, b: a}
        try:
            while not self.closed.is_set():
                if frozen.is_set():  # read nothing, write nothing, close nothing
                    self.closed.wait(0.05)
                    continue
                ready, _, _ = select.select(list(ends), [], [], 0.05)
                for end in ready:
                    data = end.recv(65536)
                    if not data:
                        return
                    ends[end].sendall(data)
        except OSError:
            return
        finally:
            if not frozen.is_set():
                a.close()
                b.close()

    def freeze(self, *, new: bool = False) -> int:
        """Freeze every connection so far; how many. ``new``: the connections
        made after it too (a host gone: a cancel request cannot reach it)."""
        with self.lock:
            self.freezing = new
            for _, _, frozen in self.pairs:
                frozen.set()
            return len(self.pairs)

    def close(self) -> None:
        with self.lock:
            self.closed.set()
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
        self.server.close()
        with self.lock:
            for a, b, _ in self.pairs:
                a.close()
                b.close()


@pytest.fixture
def proxy(db_url: str) -> Iterator[Proxy]:
    host, port = first_address(db_url)
    # a socket directory is the embedded server's
    p = Proxy(f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port))
    try:
        yield p
    finally:
        p.close()


def through(db_url: str, proxy: Proxy) -> str:
    return retarget(db_url, host="127.0.0.1", port=proxy.port)


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all: list[tuple[float, RunResult]] = []

    def __call__(self, result: RunResult) -> None:
        with self.lock:
            self.all.append((time.monotonic(), result))

    def outcomes(self) -> list[str]:
        with self.lock:
            return [str(r.outcome) for _, r in self.all]

    def first(self, outcome: Outcome) -> tuple[float, RunResult] | None:
        with self.lock:
            return next(((t, r) for t, r in self.all if r.outcome is outcome), None)


def job_state(engine: Engine, job: str) -> tuple[int, object] | None:
    with engine.connect() as conn:
        row = conn.execute(
            text("select failures, next_attempt_at from pgjobs.job_state where job = :j"),
            {"j": job},
        ).one_or_none()
    return None if row is None else (row[0], row[1])


# -- a statement stuck on the server ------------------------------------------------------
@pytest.mark.parametrize("stuck", ["pg_sleep", "row lock"])
def test_a_statement_stuck_without_a_server_timeout_frees_its_slot_at_the_deadline(
    engine: Engine, stuck: str
) -> None:
    """The job's body turns the server's timeouts off and then waits (a
    sleep, or a row lock another connection holds): nothing on the server
    ends it. The client's deadline (lock_timeout 0.5 s + statement_timeout
    1 s + call_timeout 1 s = 2.5 s) does: the tick is ``interrupted``, its
    slot is free, the scheduler retries it within a second on a fresh
    connection, and the job keeps no failure. The abandoned backend goes
    too (the server notices the closed socket)."""
    with engine.begin() as conn:
        conn.execute(text("create table item (id int primary key); insert into item values (1)"))
    pgjobs.Runner(engine).install()
    stuck_pid: list[int] = []
    stuck_at: list[float] = []
    holder = engine.connect()
    holder.begin()
    holder.execute(text("select * from item for update"))

    def body(conn):
        if stuck_pid:
            return None  # the retry: nothing stuck
        conn.execute(text("select set_config('statement_timeout', '0', true)"))
        conn.execute(text("select set_config('lock_timeout', '0', true)"))
        stuck_pid.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
        stuck_at.append(time.monotonic())
        if stuck == "pg_sleep":
            conn.execute(text("select pg_sleep(60)"))
        else:
            conn.execute(text("select * from item for update"))
        return None

    job = pgjobs.TaskJob(
        name="stuck", run=body, every="1h", lock_timeout="500ms", statement_timeout="1s"
    )
    results = Results()
    scheduler = pgjobs.Scheduler([job], engine, on_result=results, call_timeout="1s")
    try:
        scheduler.start()
        wait_until(lambda: results.first(Outcome.RAN), what="the retry ran")
    finally:
        scheduler.shutdown()
        holder.close()
    interrupted_at, interrupted = results.first(Outcome.INTERRUPTED) or (0.0, None)
    ran_at, _ = results.first(Outcome.RAN) or (0.0, None)
    assert interrupted is not None, results.outcomes()
    assert "no answer from the server within 2.5 s" in (interrupted.error or "")
    assert interrupted.sqlstate == "08006"
    # at the deadline of the stuck round trip, not later
    assert 2.5 <= interrupted_at - stuck_at[0] < 6.0, interrupted_at - stuck_at[0]
    assert ran_at - interrupted_at < 2.0  # retried within seconds (0.5 s)
    assert results.outcomes() == ["interrupted", "ran"]
    assert job_state(engine, "stuck")[0] == 0  # type: ignore[index]  # no failure, no backoff

    def gone() -> bool:
        with engine.connect() as conn:
            return not conn.execute(
                text("select count(*) from pg_stat_activity where pid = :p"), {"p": stuck_pid[0]}
            ).scalar_one()

    # client_connection_check_interval (1 s, the job's settings) ends it on
    # the server; a lock wait ends when the holder lets go
    wait_until(gone, timeout=10.0, what="the abandoned backend gone")


def test_a_bounded_round_trip_abandons_its_connection_and_the_pool_connects_afresh(
    engine: Engine,
) -> None:
    """pgjobs' use of an Engine of the user's is bounded (call_timeout);
    the user's own statements on it are not."""
    with pgjobs.Runner(engine, call_timeout="0.3s") as runner:
        with runner.connect() as conn:
            first = conn.execute(text("select pg_backend_pid()")).scalar_one()
            started = time.monotonic()
            with pytest.raises(Exception) as caught:
                conn.execute(text("select pg_sleep(30)"))
            assert time.monotonic() - started < 2.0
            assert isinstance(caught.value.orig, DeadlineExceeded)  # type: ignore[attr-defined]
            assert conn.invalidated
        with runner.connect() as conn:
            assert conn.execute(text("select pg_backend_pid()")).scalar_one() != first
            # a block of its own bound, and the runner's bound after it
            with bounded(conn, 5.0):
                conn.execute(text("select pg_sleep(0.5)"))
            with pytest.raises(Exception, match=r"no answer from the server within 0\.3 s"):
                conn.execute(text("select pg_sleep(0.6)"))
        with engine.connect() as conn:  # the user's own: no deadline
            conn.execute(text("select pg_sleep(0.6)"))


# -- half-open connections --------------------------------------------------------------
def test_ticks_through_a_half_open_connection_notice_at_their_deadline_and_reconnect(
    engine: Engine, db_url: str, proxy: Proxy
) -> None:
    """Through a proxy that stops forwarding: (1) the pool's pre-ping of the
    pooled connection (what blocked forever in the field) gives up at
    call_timeout and the tick runs on a fresh connection; (2) a tick whose
    connection freezes mid-body is interrupted at its deadline, and the
    next one runs."""
    with engine.begin() as conn:
        conn.execute(text("create table seen (n int)"))
    pgjobs.Runner(engine).install()
    in_body = threading.Event()
    frozen = threading.Event()
    calls: list[int] = []

    def body(conn):
        calls.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
        conn.execute(text("insert into seen values (:n)"), {"n": len(calls)})
        if len(calls) == 2:
            in_body.set()
            assert frozen.wait(WAIT)
            conn.execute(text("select 1"))  # never answered
        return None

    job = pgjobs.TaskJob(name="t", run=body, lock_timeout="500ms", statement_timeout="1s")
    url = through(db_url, proxy)
    with pgjobs.Runner(url, call_timeout="1s") as runner:
        assert runner.tick(job, force=True).outcome == "ran"
        assert proxy.freeze() == 1  # the pooled connection, half-open now
        started = time.monotonic()
        results: list[RunResult] = []
        worker = threading.Thread(target=lambda: results.append(runner.tick(job, force=True)))
        worker.start()
        # (1) its pre-ping: no answer within 1 s, then the body on a fresh connection
        assert in_body.wait(WAIT)
        ping_seconds = time.monotonic() - started
        # (2) which freezes under the body
        assert proxy.freeze() == 2
        frozen.set()
        worker.join(WAIT)
        assert not worker.is_alive()
        frozen_seconds = time.monotonic() - started - ping_seconds
        (cut,) = results
        assert cut.outcome == "interrupted", cut
        assert "no answer from the server within 2.5 s" in (cut.error or "")
        # The server's side of a half-open connection lives on (here the
        # proxy keeps it open; a NAT that forgot it leaves it so until the
        # server's own keepalives), with the group lock: the next tick, on a
        # fresh connection, finds the group busy, never blocks on it.
        assert runner.tick(job, force=True).outcome == "busy"
        with engine.connect() as admin:  # what the server's keepalives would do
            admin.execute(text("select pg_terminate_backend(:p)"), {"p": calls[1]})
        wait_until(lambda: runner.tick(job, force=True).outcome == "ran", what="ran again")
    assert 1.0 <= ping_seconds < 4.0, ping_seconds
    assert 2.5 <= frozen_seconds < 6.0, frozen_seconds
    with engine.connect() as conn:
        assert conn.execute(text("select array_agg(n order by n) from seen")).scalar_one() == [
            1,
            3,
        ]
        outcomes = conn.execute(
            text("select array_agg(outcome order by id) from pgjobs.run where job = 't'")
        ).scalar_one()
    assert outcomes == ["ran", "interrupted", "ran"]  # busy ticks are counted, not logged


def test_the_listener_notices_a_half_open_connection_and_listens_again(
    engine: Engine, db_url: str, proxy: Proxy
) -> None:
    pgjobs.Runner(engine).install()
    woken: list[str] = []
    lost = threading.Event()
    back: list[str] = []
    listener_engine = create_engine(through(db_url, proxy))
    pgjobs.Runner(listener_engine).close()  # bounds the engine (call_timeout 10 s)
    listener = Listener(
        listener_engine,
        ["w"],
        schema="pgjobs",
        wake=woken.append,
        on_lost=lambda exc: lost.set(),
        on_back=back.append,
        retry=(0.1, 0.5),
        check_every=0.5,
        check_timeout=1.0,
    )
    listener.start()
    try:
        assert listener.listening.wait(WAIT)
        with engine.begin() as conn:
            enqueue(conn, "w", [1])
        wait_until(lambda: woken == ["w"], what="woken through the proxy")
        started = time.monotonic()
        proxy.freeze()
        assert lost.wait(WAIT)
        noticed = time.monotonic() - started
        wait_until(lambda: back, what="listening again")
        woken.clear()
        with engine.begin() as conn:
            enqueue(conn, "w", [2])
        wait_until(lambda: "w" in woken, what="woken after the reconnect")
    finally:
        listener.stop()
        listener_engine.dispose()
    # silent for check_every (0.5 s), then a check unanswered for check_timeout (1 s)
    assert 1.0 <= noticed < 5.0, noticed
    assert back == [f"127.0.0.1:{proxy.port}"]
    assert channel("pgjobs", "w") in listener.channels


# -- a backend terminated mid-tick under the scheduler -----------------------------------
def test_a_backend_terminated_mid_tick_is_retried_within_seconds_without_backoff(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    pgjobs.Runner(engine).install()
    pid: list[int] = []
    sleeping = threading.Event()

    def body(conn):
        if not pid:
            pid.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
            sleeping.set()
            conn.execute(text("select pg_sleep(60)"))
        return None

    job = pgjobs.TaskJob(name="k", run=body, every="1h", backoff="1h")
    results = Results()
    caplog.set_level(logging.INFO, logger="pgjobs")
    with pgjobs.Scheduler([job], engine, on_result=results):
        assert sleeping.wait(WAIT)
        with engine.connect() as admin:
            assert admin.execute(text("select pg_terminate_backend(:p)"), {"p": pid[0]}).scalar()
        wait_until(lambda: results.first(Outcome.RAN), what="the retry ran")
    (at_cut, cut), (at_ran, _) = results.all[:2]
    assert (str(cut.outcome), cut.sqlstate) == ("interrupted", "57P01")
    assert cut.retry_after == timedelta(seconds=0.5)
    assert at_ran - at_cut < 2.0
    assert job_state(engine, "k")[0] == 0  # type: ignore[index]
    lines = [r.getMessage() for r in caplog.records]
    assert not any("backing off" in line for line in lines), lines
    assert sum("k: interrupted" in line for line in lines) == 1, lines
    assert sum("k: gets through again" in line for line in lines) == 1, lines


def test_status_and_metrics_show_interruptions_since_the_last_run(
    engine: Engine, db_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from pgjobs.cli import cli
    from pgjobs.metrics import Metrics

    pids: list[int] = []
    sleeping = threading.Event()
    cut = threading.Event()

    def body(conn):
        if len(pids) < 3:
            pids.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
            if len(pids) > 1:  # the first one runs
                sleeping.set()
                conn.execute(text("select pg_sleep(60)"))
        return None

    def terminate() -> None:
        for _ in range(2):
            assert sleeping.wait(WAIT)
            sleeping.clear()
            with engine.connect() as admin:
                admin.execute(text("select pg_terminate_backend(:p)"), {"p": pids[-1]})
        cut.set()

    job = pgjobs.TaskJob(name="flaky", run=body)
    metrics = Metrics()
    killer = threading.Thread(target=terminate)
    killer.start()
    with pgjobs.Runner(engine) as runner:
        outcomes = []
        for _ in range(3):
            result = runner.tick(job, force=True)
            metrics.observe(result)
            outcomes.append(str(result.outcome))
    killer.join(WAIT)
    assert outcomes == ["ran", "interrupted", "interrupted"]
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(cli, ["status", "--database", db_url, "--json"])
    assert shown.exit_code == 0, shown.output  # interrupted is not failing
    (row,) = json.loads(shown.output)["jobs"]
    assert (row["job"], row["last_outcome"], row["interrupted"], row["failures"]) == (
        "flaky",
        "interrupted",
        2,
        0,
    )
    table = CliRunner().invoke(cli, ["status", "--database", db_url])
    assert "interrupted (2 interrupted)" in table.output, table.output
    exposition = metrics.exposition().decode()
    assert 'pgjobs_runs_total{job="flaky",outcome="interrupted"} 2.0' in exposition


def test_engines_made_from_a_url_keep_alive_bound_their_connects_and_commit_locally(
    db_url: str,
) -> None:
    from pgjobs.database import resolve_engine

    url = make_url(db_url).update_query_dict({"keepalives_idle": "42"})
    engine, owned = resolve_engine(url.render_as_string(hide_password=False))
    assert owned
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            params = {o.keyword.decode(): o.val for o in raw.pgconn.info}  # type: ignore[union-attr]
            local = conn.exec_driver_sql("show synchronous_commit").scalar_one()
    finally:
        engine.dispose()
    assert params["keepalives_idle"] == b"42"  # the URL's own, kept
    assert (params["keepalives"], params["keepalives_interval"], params["keepalives_count"]) == (
        b"1",
        b"5",
        b"3",
    )
    assert (params["tcp_user_timeout"], params["connect_timeout"]) == (b"20000", b"5")
    assert local == "local"


@pytest.mark.parametrize("how", ["cancel", "abandon"])
def test_a_statement_running_in_another_thread_is_cancelled_or_abandoned(
    db_url: str, how: str
) -> None:
    """What a shutdown deadline uses: from another thread, cancel the
    running statement (the connection stays usable), or abandon the
    connection (its blocked wait returns at once, the connection broken)."""
    import psycopg

    from pgjobs.deadline import abandon_connection, cancel_statement

    raw = psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://"))
    running = threading.Event()
    caught: list[BaseException] = []

    def run() -> None:
        try:
            running.set()
            raw.execute("select pg_sleep(30)")
        except BaseException as exc:  # what the statement's thread sees
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert running.wait(WAIT)
    pid = raw.info.backend_pid
    with psycopg.connect(
        db_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    ) as watcher:
        # running on the server, not only sent: a cancel that arrives before
        # the statement starts finds nothing to cancel
        wait_until(
            lambda: (
                watcher.execute(
                    "select exists (select from pg_stat_activity where pid = %s"
                    " and state = 'active' and query like 'select pg_sleep%%')",
                    (pid,),
                ).fetchone()
                == (True,)
            ),
            what="the statement running on the server",
        )
    started = time.monotonic()
    if how == "cancel":
        assert cancel_statement(raw, timeout=5.0)
    else:
        abandon_connection(raw)
    thread.join(WAIT)
    assert time.monotonic() - started < 3.0
    (exc,) = caught
    try:
        if how == "cancel":
            assert isinstance(exc, psycopg.errors.QueryCanceled)
            raw.rollback()
            assert raw.execute("select 1").fetchone() == (1,)
        else:
            assert isinstance(exc, psycopg.OperationalError)
            assert raw.closed
    finally:
        raw.close()


def test_interruptions_retry_soon_and_say_so_once_then_once_more_if_they_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pgjobs import records

    now = [1000.0]
    monkeypatch.setattr(records.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="pgjobs")
    tracker = records.Interruptions()
    delays = [tracker.note("j", "57P01") for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]  # never the job's backoff
    now[0] += 61.0
    delays.append(tracker.note("j", "08006"))
    now[0] += 60.0
    delays.append(tracker.note("j", "08006"))
    assert delays[-2:] == [8.0, 8.0]
    assert tracker.streak("j") == (8, 121.0)
    tracker.clear("j")
    assert tracker.streak("j") is None
    assert tracker.note("j", "57P01") == 0.5  # a new streak
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "pgjobs: j: interrupted (57P01); not a failure of the job: retrying in 0.5 s on a"
        " fresh connection",
        "pgjobs: j: interrupted 7 times over 61 s (last: 08006); still retrying every 8 s at most",
        "pgjobs: j: gets through again, after 8 interruption(s) over 121.0 s",
        "pgjobs: j: interrupted (57P01); not a failure of the job: retrying in 0.5 s on a"
        " fresh connection",
    ]
    # a tick that could not start says nothing itself (the outage line does)
    quiet = records.Interruptions()
    caplog.clear()
    quiet.note("k", "down", quiet=True)
    quiet.clear("k")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_call_timeout_in_pgjobs_toml_reaches_the_runner_and_a_bad_one_names_the_key(
    tmp_path, db_url: str
) -> None:
    from pgjobs.config import load_config

    good = tmp_path / "pgjobs.toml"
    good.write_text('call_timeout = "2s"\n')
    config = load_config(good)
    assert config.call_timeout == timedelta(seconds=2)
    scheduler = pgjobs.Scheduler.from_config(config, database=db_url, check=False)
    try:
        assert scheduler.runner.call_timeout == 2.0
    finally:
        scheduler.shutdown()
    for value, why in (('"soon"', "call_timeout"), ('"0s"', "call_timeout: must be positive")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f"call_timeout = {value}\n")
        with pytest.raises(pgjobs.ConfigError, match=why) as caught:
            load_config(bad)
        assert str(bad) in str(caught.value)
    with pytest.raises(pgjobs.ConfigError, match="call_timeout: must be positive"):
        pgjobs.Runner(db_url, call_timeout=0)


def test_status_and_the_operators_commands_stop_at_the_configs_call_timeout(
    tmp_path, db_url: str
) -> None:
    # The status read and `pgjobs pause` wait for a lock another session
    # holds on job_state; the config's call_timeout (1 s here, not the
    # default 10 s) bounds them: status's statement stops on the server.
    from click.testing import CliRunner

    from pgjobs.cli import cli

    pgjobs.install(db_url)
    config = tmp_path / "pgjobs.toml"
    config.write_text(
        'call_timeout = "1s"\n[jobs.t]\nkind = "recompute"\ntarget = "t"\n'
        'sql = "select 1 as id"\nevery = "1h"\n'
    )
    engine = create_engine(db_url)
    try:
        with engine.connect() as holder, holder.begin():
            holder.exec_driver_sql("lock table pgjobs.job_state in access exclusive mode")
            for command in (["status", "--json"], ["pause", "t"]):
                started = time.monotonic()
                result = CliRunner().invoke(
                    cli, [*command, "-c", str(config), "--database", db_url]
                )
                took = time.monotonic() - started
                # the server's words (statement timeout) or the client's, never
                # what the abandoned connection said afterwards
                assert result.exit_code == 3, result.output
                assert "timeout" in result.output or "within 1 s" in result.output, result.output
                assert took < 5, (command, took, result.output)
            # nothing left waiting on the server once its statement_timeout
            # passed (the client's bound, the same second, may pass first)
            waiters = (
                "select count(*) from pg_locks l join pg_class c on c.oid = l.relation"
                " where c.relname = 'job_state' and not l.granted"
            )
            wait_until(
                lambda: holder.exec_driver_sql(waiters).scalar_one() == 0,
                timeout=3,
                what="the waiting statements stopped on the server",
            )
    finally:
        engine.dispose()


def test_a_shutdown_deadline_holds_when_the_cancel_cannot_reach_the_server(
    db_url: str, proxy: Proxy
) -> None:
    # Two ticks sleep in a statement through the proxy; then the host
    # "goes": its connections and any new one are frozen. The shutdown
    # returns within its deadline and the cancel grace: the cancel requests
    # go out side by side within the grace (each had waited 2 s for its
    # connection, tick after tick, attempt after attempt), and the
    # heartbeat's row is left to be pruned (deleting it had connected
    # afresh, for some two minutes on this engine of the user's, which sets
    # no connect_timeout: now pgjobs' 5 s, shown below).
    from pgjobs.deadline import CONNECT_TIMEOUT
    from pgjobs.firing import CANCEL_GRACE

    entered: list[int] = []

    def slow(conn: object) -> None:
        entered.append(1)
        conn.execute(text("select pg_sleep(60)"))  # type: ignore[attr-defined]

    engine = create_engine(through(db_url, proxy))
    jobs = [pgjobs.TaskJob(name=f"slow-{n}", every="1h", run=slow) for n in range(2)]
    scheduler = pgjobs.Scheduler(jobs, engine, check=False)
    try:
        scheduler.start()
        wait_until(lambda: len(entered) == 2, what="both ticks at their statement")
        proxy.freeze(new=True)
        began = time.monotonic()
        stopped = scheduler.shutdown(timeout="300ms")
        took = time.monotonic() - began
        assert not stopped  # the ticks are stuck on the frozen connections, left to their bound
        assert took < 0.3 + CANCEL_GRACE + 1, took
        # a connect of an engine of the user's that sets no connect_timeout,
        # given to pgjobs, to the gone host
        fresh = create_engine(through(db_url, proxy))
        pgjobs.Runner(fresh)
        began = time.monotonic()
        with pytest.raises(Exception, match="timeout"):
            fresh.connect().close()
        assert time.monotonic() - began < CONNECT_TIMEOUT + 2
        fresh.dispose()
    finally:
        proxy.close()  # the stuck ticks' connections fail now
        engine.dispose()
