"""pgjobs through a real PgBouncer in transaction mode.

Each test gets a fresh database and a PgBouncer of its own in front of it
(``pool_mode = transaction``, two server connections, handed out round
robin), so that one client's consecutive transactions really run in
different server sessions: what a session keeps (a prepared statement, a
temp table, a session advisory lock) is not there in the next transaction.
``$PGJOBS_TRANSACTION_POOLING=1`` is set, as the README asks behind a
transaction pooler, except where a test shows what happens without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from extras import binary, first_address, retarget
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

import pgjobs
import pgjobs.worker.vacuum
from pgjobs.cli import cli
from pgjobs.database import ENV_TRANSACTION_POOLING, transaction_pooling
from pgjobs.testing import fresh_database, run_sql, run_tick

#: server connections in the pool: two, so that consecutive transactions alternate
POOL_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quoted(value: str) -> str:
    """A value of PgBouncer's auth_file, in double quotes (doubled inside)."""
    return '"' + value.replace('"', '""') + '"'


@dataclass(frozen=True)
class Bouncer:
    #: the database through PgBouncer (``postgresql+psycopg://``)
    url: str
    #: the same database, straight to PostgreSQL
    direct_url: str
    log: Path
    #: the server sessions (backend pids) of the pool, both open
    backends: frozenset[int]


@contextlib.contextmanager
def pgbouncer(direct_url: str, directory: Path) -> Iterator[Bouncer]:
    """A PgBouncer in transaction mode in front of ``direct_url``'s database,
    listening on a free port of 127.0.0.1, stopped when the block ends."""
    program = binary("pgbouncer")
    server = make_url(direct_url)
    host, server_port = first_address(direct_url)
    user = server.username or "postgres"
    port = free_port()
    target = f"host={host} port={server_port} dbname={server.database}"
    # auth_type trust still needs the user in auth_file; the password there
    # (if the test server wants one) is what PgBouncer logs in with.
    (directory / "users.txt").write_text(f"{quoted(user)} {quoted(server.password or '')}\n")
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        "\n".join(
            [
                "[databases]",
                f"{server.database} = {target}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {directory / 'users.txt'}",
                "pool_mode = transaction",
                f"default_pool_size = {POOL_SIZE}",
                "max_client_conn = 100",
                # idle server connections are handed out in turn, not the
                # last one used first: one client's consecutive
                # transactions alternate between the two
                "server_round_robin = 1",
                "",
            ]
        )
    )
    command = [program]
    if os.geteuid() == 0:
        # PgBouncer refuses to run as root; -u drops to that user once it
        # has read its files (which may then stay private to root): the
        # owner of the server's socket directory where it dials one (the
        # embedded server's, private to its user), else nobody.
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "nobody"
        command += ["-u", owner]
    command.append(str(ini))
    log = directory / "pgbouncer.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = retarget(direct_url, host="127.0.0.1", port=port)
        _wait_listening(process, port, log)
        backends = _open_the_pool(url)
        yield Bouncer(url=url, direct_url=direct_url, log=log, backends=backends)
    finally:
        process.terminate()  # SIGTERM: immediate shutdown, server connections closed
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            pytest.fail(f"pgbouncer exited with {process.returncode}:\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"pgbouncer did not listen on {port} within 15 s:\n{log.read_text()}")
            time.sleep(0.02)


def _psycopg_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _open_the_pool(url: str) -> frozenset[int]:
    """Open both server connections (two clients inside a transaction at
    once), and give them back idle: committed, not closed mid-transaction,
    which would make PgBouncer close them."""
    clients = [psycopg.connect(_psycopg_url(url), prepare_threshold=None) for _ in range(POOL_SIZE)]
    try:
        pids = frozenset(
            row[0]
            for c in clients
            if (row := c.execute("select pg_backend_pid()").fetchone()) is not None
        )
        for c in clients:
            c.commit()
    finally:
        for c in clients:
            c.close()
    assert len(pids) == POOL_SIZE, pids
    return pids


@pytest.fixture
def bouncer(pg_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bouncer]:
    """A fresh database, a PgBouncer in transaction mode in front of it, and
    ``$PGJOBS_TRANSACTION_POOLING=1``."""
    monkeypatch.setenv(ENV_TRANSACTION_POOLING, "1")
    with fresh_database(pg_server) as url, pgbouncer(url, tmp_path) as b:
        yield b


@pytest.fixture
def direct(bouncer: Bouncer) -> Iterator[Engine]:
    """The test database, not through PgBouncer: the schema and the checks."""
    eng = create_engine(bouncer.direct_url)
    try:
        run_sql(eng, SCHEMA)
        pgjobs.install(eng)
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def pooled(bouncer: Bouncer) -> Iterator[Engine]:
    """An Engine of the user's own through PgBouncer, set up as the README says."""
    eng = create_engine(bouncer.url, connect_args={"prepare_threshold": None})
    try:
        yield eng
    finally:
        eng.dispose()


SCHEMA = """
create table parent (id int primary key);
create table source (
    id bigserial primary key,
    parent_id int not null references parent on delete cascade,
    val int not null
);
create table derived (
    parent_id int not null references parent on delete cascade,
    bucket int not null,
    total bigint not null,
    n int not null,
    primary key (parent_id, bucket)
);
create table status (
    parent_id int primary key references parent on delete cascade,
    runs int not null default 1
);
insert into parent select generate_series(1, 40);
insert into source (parent_id, val)
select p, v from generate_series(1, 40) p, generate_series(1, 10) v;
"""

FROM_SCRATCH = """
select parent_id, val % 5 as bucket, sum(val) as total, count(*) as n
from source group by parent_id, val % 5
"""

#: a queue job's compute: the rows of the batch's parents
FOR_KEYS = FROM_SCRATCH.replace("from source", "from source where parent_id = any(:keys)")


def expected(engine: Engine) -> list[tuple[int, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(FROM_SCRATCH + " order by 1, 2"))]


def derived(engine: Engine) -> list[tuple[int, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("select * from derived order by 1, 2"))]


def advisory_locks(engine: Engine) -> list[tuple[int, bool]]:
    """The advisory locks held or awaited in the test database: (pid, granted)."""
    with engine.connect() as conn:
        return [
            (r[0], r[1])
            for r in conn.execute(
                text(
                    "select pid, granted from pg_locks where locktype = 'advisory'"
                    " and database = (select oid from pg_database where datname = current_database())"
                )
            )
        ]


def assert_no_prepared_statements(bouncer: Bouncer) -> None:
    """No server session of the pool has a prepared statement (two clients
    inside a transaction at once hold both). They need not be the sessions
    the pool began with: now and then (a few times in a hundred runner
    lifetimes here) a client's disconnect makes PgBouncer close a server
    connection ("client disconnect while server was not ready"). The trace
    of one such client ends with the extra Sync psycopg sends when a
    pipeline whose last statement was COMMIT ends, after the server went
    back to the pool, then Terminate."""
    clients = [
        psycopg.connect(_psycopg_url(bouncer.url), prepare_threshold=None) for _ in range(POOL_SIZE)
    ]
    try:
        found: dict[int, list[str]] = {}
        for c in clients:
            row = c.execute(
                "select pg_backend_pid(), coalesce(array_agg(name order by name), '{}')"
                " from pg_prepared_statements"
            ).fetchone()
            assert row is not None
            found[row[0]] = row[1]
        for c in clients:
            c.commit()
    finally:
        for c in clients:
            c.close()
    assert len(found) == POOL_SIZE, found
    assert found == {pid: [] for pid in found}, found


def vacuum_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("select pg_stat_get_vacuum_count('pgjobs.queue'::regclass)")
            ).scalar_one()
        )


def count_status_runs(conn, keys, stats):
    """The queue job's ``after``: one more run for each processed parent."""
    conn.execute(
        text(
            "insert into status (parent_id) select unnest(cast(:keys as int[]))"
            " on conflict (parent_id) do update set runs = status.runs + 1"
        ),
        {"keys": [k[0] for k in keys]},
    )


def queue_job(**changes):
    fields = dict(
        name="worker",
        group="derived",
        target="derived",
        scope=("parent_id",),
        compute=FOR_KEYS,
        after=count_status_runs,
        every="1h",
        batch_size=10,
    )
    fields.update(changes)
    return pgjobs.QueueJob(**fields)


RECOMPUTE = pgjobs.RecomputeJob(
    name="recompute", group="derived", target="derived", compute=FROM_SCRATCH, every="1h"
)


# -- the pooler is real ----------------------------------------------------------------------
@pytest.mark.needs("pgbouncer")
def test_one_clients_consecutive_transactions_run_in_different_server_sessions(
    bouncer: Bouncer,
) -> None:
    with psycopg.connect(_psycopg_url(bouncer.url), prepare_threshold=None) as conn:
        seen = []
        for n in range(4):
            row = conn.execute(
                "select pg_backend_pid(), current_setting('pgjobs.mark', true)"
            ).fetchone()
            assert row is not None
            seen.append(tuple(row))
            # a session setting: it stays with the server session, not the client
            conn.execute("select set_config('pgjobs.mark', %s, false)", (str(n),))
            conn.commit()
    pids = [pid for pid, _ in seen]
    assert set(pids) == bouncer.backends
    assert pids[0] == pids[2] != pids[1] == pids[3]
    # what the 1st transaction set, the 2nd doesn't see; the 3rd does (its session)
    assert [mark for _, mark in seen] == [None, None, "0", "1"]


# -- recompute ---------------------------------------------------------------------------------
@pytest.mark.needs("pgbouncer")
def test_a_recompute_through_pgbouncer_writes_the_target_then_only_the_difference(
    bouncer: Bouncer, direct: Engine
) -> None:
    first = pgjobs.run_once(RECOMPUTE, database=bouncer.url)
    assert first.outcome == "ran", first.error
    assert first.stats.inserted == 200
    assert derived(direct) == expected(direct)

    with direct.begin() as conn:
        conn.execute(text("update source set val = val + 5 where parent_id = 3"))
        conn.execute(text("delete from parent where id = 4"))
    again = pgjobs.run_once(RECOMPUTE, database=bouncer.url, force=True)
    assert again.outcome == "ran", again.error
    # parent 3's buckets now hold other sums; parent 4's rows went with it
    assert (again.stats.updated, again.stats.inserted, again.stats.deleted) == (5, 0, 0)
    assert again.stats.unchanged == 190
    assert derived(direct) == expected(direct)
    assert advisory_locks(direct) == []


@pytest.mark.needs("pgbouncer")
def test_ticks_on_one_long_lived_runner_leave_no_prepared_statement_in_any_server_session(
    bouncer: Bouncer, direct: Engine
) -> None:
    # The scheduler's way: one engine, tick after tick on the same client
    # connection. psycopg prepares a statement at its 5th run (by default),
    # in whichever server session that transaction runs, and deallocates
    # after a rollback in whichever session that runs: without the setting,
    # 30 ticks here left 9 statements (_pg3_0, ...) in one server session,
    # where any other client preparing _pg3_0 fails with 42P05 (PgBouncer
    # < 1.21 does not track prepared statements in transaction mode).
    with pgjobs.Runner(bouncer.url) as runner:
        results = [runner.tick(RECOMPUTE, force=True) for _ in range(30)]
        with runner.engine.connect() as conn:
            threshold = conn.connection.driver_connection.prepare_threshold
    assert [(r.outcome, r.error) for r in results] == [("ran", None)] * 30
    assert_no_prepared_statements(bouncer)
    assert threshold is None
    assert derived(direct) == expected(direct)


@pytest.mark.needs("pgbouncer")
def test_the_group_lock_taken_through_pgbouncer_makes_a_tick_from_another_client_busy(
    bouncer: Bouncer, direct: Engine, pooled: Engine
) -> None:
    # A replica's job transaction holds the group's lock in one server
    # session; this client's tick runs in the other one.
    holder = pooled.connect()
    try:
        holder.begin()
        assert holder.execute(
            text("select pg_try_advisory_xact_lock(hashtextextended('pgjobs:derived', 0))")
        ).scalar_one()
        busy = run_tick(RECOMPUTE, pooled)
        assert busy.outcome == "busy"
        holder.commit()  # the lock goes with the transaction, not the session
    finally:
        holder.close()
    ran = run_tick(RECOMPUTE, pooled, force=True)
    assert ran.outcome == "ran", ran.error
    assert derived(direct) == expected(direct)
    assert advisory_locks(direct) == []


# -- the queue ----------------------------------------------------------------------------------
@pytest.mark.needs("pgbouncer")
def test_enqueue_through_pgbouncer_dedups_and_its_lock_keeps_the_worker_off_until_commit(
    bouncer: Bouncer, direct: Engine, pooled: Engine
) -> None:
    job = queue_job()
    with pooled.begin() as conn:
        assert pgjobs.enqueue(conn, job, [1, 2, 3]) == 3
    with pooled.begin() as conn:
        assert pgjobs.enqueue(conn, job, [2, 3, 4]) == 1
    with pooled.connect() as conn, conn.begin():
        assert [s.depth for s in pgjobs.queue_stats(conn) if s.job == "worker"] == [4]

    # A user's uncommitted change and enqueue hold one server session (and
    # the entry's row lock); the worker's tick runs in the other one.
    user = pooled.connect()
    try:
        user.begin()
        user.execute(text("insert into source (parent_id, val) values (5, 100)"))
        pgjobs.enqueue(user, job, [5])
        first = run_tick(job, pooled)
        assert first.outcome == "ran", first.error
        assert first.items == 4  # 1-4; 5's entry is the user's until commit
        user.commit()
    finally:
        user.close()
    second = run_tick(job, pooled, force=True)
    assert second.outcome == "ran", second.error
    assert second.items == 1
    with direct.connect() as conn:
        runs = dict(conn.execute(text("select parent_id, runs from status")).all())
    assert runs == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    want = [r for r in expected(direct) if r[0] in (1, 2, 3, 4, 5)]
    assert derived(direct) == want


@pytest.mark.needs("pgbouncer")
def test_several_clients_enqueue_and_tick_concurrently_through_pgbouncer(
    bouncer: Bouncer, direct: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the worker's own VACUUM (outside a transaction, after a commit) too
    monkeypatch.setattr(pgjobs.worker.vacuum, "VACUUM_EVERY", 10)
    vacuums_before = vacuum_count(direct)
    job = queue_job()
    clients = 4
    per_client = 10
    outcomes: Counter[str] = Counter()
    processed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(n: int) -> None:
        # Each client the way a replica runs: its own runner (engine) through
        # the pooler; it changes its parents' rows, enqueues them in the same
        # transaction, and ticks the worker after each change.
        keys = range(n * per_client + 1, (n + 1) * per_client + 1)
        try:
            with pgjobs.Runner(bouncer.url) as runner:
                start.wait(timeout=30)
                for key in keys:
                    with runner.engine.begin() as conn:
                        conn.execute(
                            text("insert into source (parent_id, val) values (:k, :k)"), {"k": key}
                        )
                        pgjobs.enqueue(conn, job, [key])
                    result = runner.tick(job, force=True)
                    with lock:
                        outcomes[result.outcome] += 1
                        processed.append(result.items)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert outcomes["failed"] == 0, outcomes
    assert outcomes["ran"] > 0

    # What a tick lost to a busy group lock is still queued: drain it.
    with pgjobs.Runner(bouncer.url) as runner:
        for _ in range(clients * per_client):
            result = runner.tick(job, force=True)
            assert result.outcome in ("ran", "idle"), result.error
            processed.append(result.items)
            if result.outcome == "idle":
                break
    total = clients * per_client
    assert sum(processed) == total
    with direct.connect() as conn:
        runs = dict(conn.execute(text("select parent_id, runs from status")).all())
        depth = conn.execute(text("select count(*) from pgjobs.queue")).scalar_one()
    assert runs == {k: 1 for k in range(1, total + 1)}  # every item processed once
    assert depth == 0
    assert vacuum_count(direct) > vacuums_before
    assert derived(direct) == [r for r in expected(direct) if r[0] <= total]
    assert_no_prepared_statements(bouncer)


# -- failures -----------------------------------------------------------------------------------
@pytest.mark.needs("pgbouncer")
def test_a_failing_job_through_pgbouncer_is_recorded_and_backs_off(
    bouncer: Bouncer, direct: Engine, pooled: Engine
) -> None:
    job = pgjobs.RecomputeJob(
        name="broken",
        target="derived",
        compute="select parent_id, 0 as bucket, 1 / 0 as total, 1 as n from source",
        every="1m",
        backoff="1h",
    )
    failed = run_tick(job, pooled)
    assert failed.outcome == "failed"
    assert failed.sqlstate == "22012"
    assert failed.next_attempt_at is not None
    later = run_tick(job, pooled)
    assert later.outcome == "backing_off"
    assert later.next_attempt_at == failed.next_attempt_at
    with direct.connect() as conn:
        state = conn.execute(
            text(
                "select failures, last_sqlstate, backing_off_ticks from pgjobs.job_state"
                " where job = 'broken'"
            )
        ).one()
        outcomes = conn.execute(
            text("select array_agg(outcome::text order by id) from pgjobs.run where job = 'broken'")
        ).scalar_one()
    assert tuple(state) == (1, "22012", 1)  # the backing_off tick: counted, not logged
    assert outcomes == ["failed"]
    assert derived(direct) == []


# -- chunked writes -------------------------------------------------------------------------------
CHUNKED = pgjobs.RecomputeJob(
    name="chunked", target="derived", compute=FROM_SCRATCH, chunk_parents=7, every="1h"
)


@pytest.mark.needs("pgbouncer")
def test_chunked_writes_behind_pgbouncer_write_in_one_transaction(
    bouncer: Bouncer, direct: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # a name of its own: the warning is logged once per job and process
    job = CHUNKED.replace(name=f"chunked-{uuid.uuid4().hex[:8]}")
    with caplog.at_level(logging.WARNING, logger="pgjobs.runner"):
        result = pgjobs.run_once(job, database=bouncer.url)
    assert result.outcome == "ran", result.error
    assert result.stats.inserted == 200
    assert result.detail["chunks"] == 1
    assert derived(direct) == expected(direct)
    # no session lock was taken, so none is left with a server session
    assert advisory_locks(direct) == []
    assert any(
        "behind a transaction pooler ($PGJOBS_TRANSACTION_POOLING) it writes in one transaction"
        in m
        for m in caplog.messages
    )

    with direct.begin() as conn:
        conn.execute(text("update source set val = val * 2 where parent_id > 30"))
    again = pgjobs.run_once(job, database=bouncer.url, force=True)
    assert again.outcome == "ran", again.error
    assert again.stats.updated == 50
    assert derived(direct) == expected(direct)


@pytest.mark.needs("pgbouncer")
def test_without_the_setting_a_chunked_run_behind_pgbouncer_fails_at_its_first_commit(
    bouncer: Bouncer, direct: Engine, pooled: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What happens when nobody says a transaction pooler is in between: the
    # first chunk commits, the next transaction runs in the other server
    # session, where neither the chunks' temp tables nor the group's session
    # lock are. The run stops there with an error that says so.
    monkeypatch.delenv(ENV_TRANSACTION_POOLING)
    result = run_tick(CHUNKED, pooled)
    assert result.outcome == "failed"
    assert result.error is not None
    assert "chunked writes need one server session across their commits" in result.error
    assert f"set ${ENV_TRANSACTION_POOLING}=1" in result.error
    written = derived(direct)
    assert 0 < len(written) < 200  # the first chunk (7 parents' rows) committed
    assert written == expected(direct)[: len(written)]
    # (Whether the group's session lock is left behind depends on which
    # server session the release lands in: with two, round robin, it lands
    # in the one that took it. The setting is what makes this safe.)


# -- the CLI --------------------------------------------------------------------------------------
@pytest.mark.needs("pgbouncer")
def test_status_json_through_pgbouncer(bouncer: Bouncer, direct: Engine, tmp_path: Path) -> None:
    config = tmp_path / "pgjobs.toml"
    config.write_text(
        "[jobs.totals]\n"
        'kind = "recompute"\n'
        'group = "derived"\n'
        'target = "derived"\n'
        f"sql = {json.dumps(FROM_SCRATCH)}\n"
        "[jobs.worker]\n"
        'kind = "queue"\n'
        'group = "derived"\n'
        'target = "derived"\n'
        'scope = "parent_id"\n'
        f"sql = {json.dumps(FOR_KEYS)}\n"
        "[jobs.broken]\n"
        'kind = "task"\n'
        'sql = "select 1 / 0"\n'
        'backoff = "10m"\n'
    )
    cli_runner = CliRunner()
    args = ["-c", str(config), "--database", bouncer.url]
    ran = cli_runner.invoke(cli, ["once", "totals", *args], catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    failed = cli_runner.invoke(cli, ["once", "broken", *args], catch_exceptions=False)
    assert failed.exit_code == 1, failed.output
    with direct.begin() as conn:
        pgjobs.enqueue(conn, "worker", [1, 2, 3])

    status = cli_runner.invoke(cli, ["status", "--json", *args], catch_exceptions=False)
    assert status.exit_code == 1, status.output  # a job is failing
    report = json.loads(status.stdout)
    jobs = {job["job"]: job for job in report["jobs"]}
    assert jobs["totals"]["last_outcome"] == "ran" and jobs["totals"]["failures"] == 0
    assert jobs["totals"]["rows_changed"] == {"inserted": 200, "updated": 0, "deleted": 0}
    assert jobs["broken"]["last_outcome"] == "failed" and jobs["broken"]["failures"] == 1
    assert jobs["broken"]["last_sqlstate"] == "22012"
    assert jobs["broken"]["next_attempt_at"] > report["now"]
    assert jobs["worker"]["last_outcome"] is None and jobs["worker"]["queue"]["depth"] == 3


# -- the setting ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("on", True),
        ("", False),
        ("0", False),
        ("false", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_the_setting_reads_yes_and_no(value: str, on: bool) -> None:
    assert transaction_pooling({ENV_TRANSACTION_POOLING: value}) is on
    assert transaction_pooling({}) is False


def test_a_bad_value_of_the_setting_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(pgjobs.ConfigError, match=r"PGJOBS_TRANSACTION_POOLING: .* got 'maybe'"):
        transaction_pooling({ENV_TRANSACTION_POOLING: "maybe"})
    monkeypatch.setenv(ENV_TRANSACTION_POOLING, "maybe")
    result = CliRunner().invoke(
        cli, ["status", "--database", "postgresql://nobody@127.0.0.1:1/none"]
    )
    assert result.exit_code == 2
    assert "$PGJOBS_TRANSACTION_POOLING: expected 1, true, yes, on" in result.stderr
    assert "got 'maybe'" in result.stderr
