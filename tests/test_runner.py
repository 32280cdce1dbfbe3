"""The run protocol on a real PostgreSQL, proven with several real connections."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from psycopg import sql
from sqlalchemy import text

import pgjobs
from pgjobs.locking import lock_name

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class FakeClock:
    """A clock the test moves by hand, shared by every runner of a test."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kwargs: float) -> None:
        self.now += timedelta(**kwargs)


def advisory_locks(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "select count(*) from pg_locks where locktype = 'advisory'"
                " and database = (select oid from pg_database where datname = current_database())"
            )
        ).scalar_one()


def runs(engine, job: str) -> list[tuple[str, int]]:
    """The job's rows in the run log: runs that did something, and failures."""
    with engine.connect() as conn:
        return [
            (r.outcome, r.inserted)
            for r in conn.execute(
                text("select outcome, inserted from pgjobs.run where job = :job order by id"),
                {"job": job},
            )
        ]


def quiet(engine, job: str) -> dict[str, int]:
    """The job's ticks that changed nothing, as counted in its state (written
    with its next run record, or when the runner flushes or closes)."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "select idle_ticks, busy_ticks, not_due_ticks, backing_off_ticks"
                " from pgjobs.job_state where job = :job"
            ),
            {"job": job},
        ).one_or_none()
    if row is None:
        return {}
    counts = dict(zip(("idle", "busy", "not_due", "backing_off"), row, strict=True))
    return {outcome: n for outcome, n in counts.items() if n}


@pytest.fixture
def items(engine):
    with engine.begin() as conn:
        conn.execute(text("create table item (id int primary key, note text)"))
    return engine


def insert_items(n: int):
    def run(conn):
        conn.execute(text("insert into item select g, 'x' from generate_series(1, :n) g"), {"n": n})
        return pgjobs.DiffStats(inserted=n)

    return run


def test_busy_while_another_transaction_holds_the_group_lock(items):
    job = pgjobs.TaskJob(name="writer", group="g1", run=insert_items(3))
    with items.connect() as holder, pgjobs.Runner(items) as runner:
        holder.begin()
        holder.execute(
            text("select pg_advisory_xact_lock(hashtextextended(:k, 0))"),
            {"k": lock_name("pgjobs", "g1")},
        )
        result = runner.tick(job)  # the holder's transaction is still open here
        assert result.outcome == "busy"
        assert timedelta(seconds=2.5) <= result.retry_after <= timedelta(seconds=5)
        assert holder.execute(text("select count(*) from item")).scalar_one() == 0
        holder.rollback()
        assert runner.tick(job).outcome == "ran"
    with items.connect() as conn:
        assert conn.execute(text("select count(*) from item")).scalar_one() == 3
    assert runs(items, "writer") == [("ran", 3)]
    assert quiet(items, "writer") == {"busy": 1}


def test_the_lock_key_uses_namespace_and_group(items):
    """A job of another namespace does not contend for the lock."""
    job = pgjobs.TaskJob(name="writer", group="g1", run=insert_items(1))
    with items.connect() as holder:
        holder.begin()
        holder.execute(text("select pg_advisory_xact_lock(hashtextextended('pgjobs:g1', 0))"))
        with pgjobs.Runner(items, namespace="other") as runner:
            assert runner.tick(job).outcome == "ran"
        holder.rollback()


def test_idle_pass_takes_no_advisory_lock(items):
    seen: list[int] = []

    def has_work(conn):
        # While has_work runs, another connection looks at pg_locks.
        seen.append(advisory_locks(items))
        return False

    job = pgjobs.TaskJob(name="idle", run=insert_items(1), has_work=has_work)
    with pgjobs.Runner(items) as runner:
        result = runner.tick(job)
    assert result.outcome == "idle"
    assert seen == [0]
    assert runs(items, "idle") == []
    assert quiet(items, "idle") == {"idle": 1}


def test_has_work_runs_read_only(items):
    def has_work(conn):
        conn.execute(text("insert into item values (1, 'sneaky')"))
        return True

    job = pgjobs.TaskJob(name="ro", run=insert_items(1), has_work=has_work, backoff="1m")
    with pgjobs.Runner(items) as runner:
        result = runner.tick(job)
    assert result.outcome == "failed" and result.sqlstate == "25006"  # read_only_sql_transaction


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueryChecked(pgjobs.TaskJob):
    """A job whose work check is one statement (as a built-in queue's is)."""

    work_sql: str = "select true"

    def work_query(self, ctx):
        return sql.SQL(self.work_sql), ()


def test_a_one_statement_work_check_decides_idle_or_ran_with_the_state_read(items):
    clock = FakeClock()
    with pgjobs.Runner(items, clock=clock) as runner:
        idle = runner.tick(
            QueryChecked(name="q", run=insert_items(1), work_sql="select count(*) > 0 from item")
        )
        ran = runner.tick(QueryChecked(name="q", run=insert_items(2), work_sql="select true"))
        # the state still decides first: ran a moment ago, every 60 s
        clock.advance(seconds=10)
        not_due = runner.tick(QueryChecked(name="q", run=insert_items(3), every="60s"))
    assert (idle.outcome, ran.outcome, not_due.outcome) == ("idle", "ran", "not_due")
    assert runs(items, "q") == [("ran", 2)]
    assert quiet(items, "q") == {"idle": 1, "not_due": 1}


def test_a_work_statement_that_fails_falls_back_to_check_work_read_only(items):
    def has_work(conn):
        return conn.execute(text("select count(*) > 0 from item")).scalar_one()

    # The statement writes: refused in the read-only check, so the runner
    # asks check_work (has_work), which finds nothing to do.
    sneaky = QueryChecked(
        name="s",
        run=insert_items(1),
        has_work=has_work,
        work_sql="insert into item values (1, 'sneaky') returning true",
    )
    broken = QueryChecked(name="b", run=insert_items(1), work_sql="select no_such_column")
    with pgjobs.Runner(items) as runner:
        assert runner.tick(sneaky).outcome == "idle"
        assert runner.tick(broken).outcome == "ran"  # TaskJob.check_work: no has_work, so True
    with items.connect() as conn:
        assert conn.execute(text("select id, note from item")).all() == [(1, "x")]


def test_job_settings_apply_to_the_job_transaction_only(items):
    """lock_timeout, statement_timeout and synchronous_commit are SET LOCAL in
    the job's transaction: recompute and queue jobs commit asynchronously by
    default, tasks synchronously, each as configured; the session keeps its
    own values afterwards."""
    seen: dict[str, tuple[str, ...]] = {}

    def settings(conn):
        return tuple(
            conn.execute(
                text(
                    "select current_setting('synchronous_commit'),"
                    " current_setting('lock_timeout'), current_setting('statement_timeout')"
                )
            ).one()
        )

    def task(name: str):
        def run(conn):
            seen[name] = settings(conn)

        return run

    def compute(conn):
        seen["recompute"] = settings(conn)
        return "select id, note from item"

    jobs = [
        pgjobs.TaskJob(name="task", run=task("task"), lock_timeout="1500ms"),
        pgjobs.TaskJob(name="task-async", run=task("task-async"), synchronous_commit=False),
        pgjobs.RecomputeJob(name="recompute", target="item", compute=compute),
    ]
    with pgjobs.Runner(items) as runner:
        for job in jobs:
            assert runner.tick(job, force=True).outcome == "ran"
        with runner.engine.connect() as conn:
            after = settings(conn)
    # synchronous_commit = true waits for this server's disk, never for a
    # synchronous standby (docs/failover.md): "local"
    assert seen["task"] == ("local", "1500ms", "30min")
    assert seen["task-async"] == ("off", "5s", "30min")
    assert seen["recompute"] == ("off", "5s", "30min")
    assert after[0] == "on"
    assert (
        pgjobs.QueueJob(name="q", target="item", scope="id", compute="x").synchronous_commit
        is False
    )
    assert pgjobs.RecomputeJob(
        name="r", target="item", compute="x", synchronous_commit=True
    ).synchronous_commit
    with pytest.raises(pgjobs.ConfigError, match="synchronous_commit: expected true or false"):
        pgjobs.TaskJob(name="t", run=task("t"), synchronous_commit="off")


def test_field_report_race_periodic_job_runs_every_time_it_is_due(items):
    """A 30 s queue job with an empty queue and a 60 s recompute fire in the same
    tick for 20 simulated minutes: the recompute never loses the lock race."""
    with items.begin() as conn:
        conn.execute(text("create table work_queue (id int primary key)"))
    clock = FakeClock()

    def queue_has_work(conn):
        # A realistically slow check: were the lock taken first, it would be
        # held for these 50 ms, exactly when the periodic job wants it.
        conn.execute(text("select pg_sleep(0.05)"))
        return conn.execute(text("select exists (select 1 from work_queue)")).scalar_one()

    worker = pgjobs.TaskJob(
        name="worker", group="exams", every="30s", has_work=queue_has_work, run=lambda c: None
    )
    periodic = pgjobs.TaskJob(name="recompute", group="exams", every="60s", run=lambda c: None)
    outcomes: dict[str, list[str]] = {"worker": [], "recompute": []}
    with pgjobs.Runner(items, clock=clock) as r1, pgjobs.Runner(items, clock=clock) as r2:
        r1.install()
        barrier = threading.Barrier(2)

        def fire(runner, job):
            barrier.wait()
            outcomes[job.name].append(runner.tick(job).outcome)

        for _tick in range(40):  # 40 ticks of 30 s = 20 minutes
            threads = [
                threading.Thread(target=fire, args=(r1, worker)),
                threading.Thread(target=fire, args=(r2, periodic)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            clock.advance(seconds=30)
    assert outcomes["worker"] == ["idle"] * 40
    assert outcomes["recompute"] == ["ran", "not_due"] * 20


def test_failing_job_backs_off_everywhere_until_next_attempt(items, db_url):
    clock = FakeClock()
    fail = {"on": True}

    def flaky(conn):
        conn.execute(text("insert into item values (1, 'partial')"))
        if fail["on"]:
            raise RuntimeError("plugin bug")
        return None

    job = pgjobs.TaskJob(name="flaky", run=flaky, every="1m", backoff="1h")
    with pgjobs.Runner(items, clock=clock) as runner:
        first = runner.tick(job)
        assert first.outcome == "failed" and "plugin bug" in first.error
        assert first.next_attempt_at == T0 + timedelta(hours=1)
        clock.advance(minutes=10)
        assert runner.tick(job).outcome == "backing_off"
    with pgjobs.Runner(items, clock=clock) as fresh:  # a restart, or another replica
        assert fresh.tick(job).outcome == "backing_off"
    # A second process, with the same simulated time.
    code = textwrap.dedent(
        """
        import sys
        from datetime import datetime
        import pgjobs
        job = pgjobs.TaskJob(name="flaky", run=lambda c: None, every="1m", backoff="1h")
        now = datetime.fromisoformat(sys.argv[2])
        with pgjobs.Runner(sys.argv[1], clock=lambda: now) as runner:
            print(runner.tick(job).outcome)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, db_url, (T0 + timedelta(minutes=59)).isoformat()],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "backing_off"
    with items.connect() as conn:
        assert conn.execute(text("select count(*) from item")).scalar_one() == 0  # rolled back
    fail["on"] = False
    clock.advance(minutes=51)  # 61 minutes after the failure
    with pgjobs.Runner(items, clock=clock) as runner:
        assert runner.tick(job).outcome == "ran"
        with items.connect() as conn:
            row = conn.execute(text("select failures, next_attempt_at from pgjobs.job_state")).one()
        assert row.failures == 0 and row.next_attempt_at == clock.now + timedelta(minutes=1)
    assert [o for o, _ in runs(items, "flaky")] == ["failed", "ran"]
    assert quiet(items, "flaky") == {"backing_off": 3}


def test_consecutive_failures_grow_the_backoff(items):
    clock = FakeClock()
    job = pgjobs.TaskJob(
        name="bad", run=lambda c: 1 / 0, backoff=pgjobs.Backoff(initial="1m", factor=2)
    )
    with pgjobs.Runner(items, clock=clock) as runner:
        delays = []
        for _ in range(3):
            result = runner.tick(job)
            assert result.outcome == "failed"
            delays.append(result.next_attempt_at - clock.now)
            clock.now = result.next_attempt_at
    assert delays == [timedelta(minutes=1), timedelta(minutes=2), timedelta(minutes=4)]


WORKER = textwrap.dedent(
    """
    import sys, time
    from sqlalchemy import text
    import pgjobs

    def body(conn):
        conn.execute(text("insert into log (worker, started) values (:w, clock_timestamp())"), {"w": sys.argv[2]})
        time.sleep(0.15)
        conn.execute(text("update log set finished = clock_timestamp() where id = (select max(id) from log)"))

    job = pgjobs.TaskJob(name="shared", run=body, every="1s")
    deadline = time.monotonic() + float(sys.argv[3])
    with pgjobs.Runner(sys.argv[1], worker=sys.argv[2]) as runner:
        while time.monotonic() < deadline:
            runner.tick(job)
            time.sleep(0.03)
    """
)


def test_two_processes_never_overlap_and_run_once_per_interval(items, db_url):
    with items.begin() as conn:
        conn.execute(
            text(
                "create table log (id serial primary key, worker text, started timestamptz, finished timestamptz)"
            )
        )
    pgjobs.Runner(items).install()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, db_url, f"w{i}", "6"]) for i in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    with items.connect() as conn:
        log = conn.execute(text("select worker, started, finished from log order by started")).all()
        ran = (
            conn.execute(
                text(
                    "select started_at from pgjobs.run where job = 'shared' and outcome = 'ran' order by started_at"
                )
            )
            .scalars()
            .all()
        )
        outcomes = set(conn.execute(text("select distinct outcome from pgjobs.run")).scalars())
        not_due = conn.execute(
            text("select not_due_ticks from pgjobs.job_state where job = 'shared'")
        ).scalar_one()
    assert len(log) >= 4 and len(log) == len(ran)
    for before, after in itertools.pairwise(log):
        assert before.finished is not None and before.finished <= after.started, "runs overlapped"
    for before, after in itertools.pairwise(ran):
        assert after - before >= timedelta(seconds=0.9), "ran twice within one interval"
    assert outcomes == {"ran"}  # ticks that changed nothing are counted, not logged
    assert not_due > 0


KILLED = textwrap.dedent(
    """
    import sys, time
    from sqlalchemy import text
    import pgjobs

    def body(conn):
        conn.execute(text("insert into item select g, 'half' from generate_series(1, 100) g"))
        print("writing", flush=True)
        time.sleep(120)

    with pgjobs.Runner(sys.argv[1]) as runner:
        runner.tick(pgjobs.TaskJob(name="victim", group="g", run=body))
    """
)


def test_sigkill_mid_run_leaves_no_lock_and_no_partial_write(items, db_url):
    pgjobs.Runner(items).install()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, db_url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert advisory_locks(items) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    # The server notices the dead client and ends its transaction; wait for that.
    with items.connect() as conn:
        conn.execute(
            text(
                "do $$ begin for i in 1..300 loop"
                " exit when not exists (select 1 from pg_locks where locktype = 'advisory'"
                " and database = (select oid from pg_database where datname = current_database()));"
                " perform pg_sleep(0.05); end loop; end $$"
            )
        )
    assert advisory_locks(items) == 0
    with items.connect() as conn:
        assert conn.execute(text("select count(*) from item")).scalar_one() == 0
    with pgjobs.Runner(items) as runner:
        result = runner.tick(pgjobs.TaskJob(name="victim", group="g", run=insert_items(2)))
    assert result.outcome == "ran"


def test_database_errors_are_recorded_with_their_sqlstate(items):
    """The job's own failures (its SQL, its data, its statement timeout) fail
    and back it off; a lock timeout and a deadlock with a user's
    transaction are transient (issue 37): recorded in the run log with
    their SQLSTATE, the job's state untouched, retried within seconds."""
    with items.begin() as conn:
        conn.execute(
            text("create table child (id int primary key, item_id int not null references item)")
        )
        conn.execute(text("insert into item values (1, 'a'), (2, 'b')"))
    with pgjobs.Runner(items) as runner:
        fk = runner.tick(
            pgjobs.TaskJob(
                name="fk", run=lambda c: c.execute(text("insert into child values (1, 99)"))
            )
        )
        assert (fk.outcome, fk.sqlstate) == ("failed", "23503")
        # What PostgreSQL said, without SQLAlchemy's wrapping around it.
        assert fk.error.startswith("ForeignKeyViolation: insert or update on table")
        assert "sqlalche.me" not in fk.error

        with items.connect() as holder:
            holder.begin()
            holder.execute(text("select * from item where id = 1 for update"))
            blocked = runner.tick(
                pgjobs.TaskJob(
                    name="lock",
                    lock_timeout="200ms",
                    run=lambda c: c.execute(text("update item set note = 'x' where id = 1")),
                )
            )
            holder.rollback()
        assert (blocked.outcome, blocked.sqlstate) == ("transient", "55P03")
        assert blocked.retry_after is not None and blocked.retry_after.total_seconds() <= 1

        slow = runner.tick(
            pgjobs.TaskJob(
                name="slow",
                statement_timeout="100ms",
                run=lambda c: c.execute(text("select pg_sleep(5)")),
            )
        )
        assert (slow.outcome, slow.sqlstate) == ("failed", "57014")

        # A deadlock with a user transaction: the job locks 1 then 2, the user 2 then 1.
        user_has_2 = threading.Event()
        job_waits = threading.Event()

        def user():
            with items.connect() as conn:
                conn.begin()
                conn.execute(text("set local deadlock_timeout = '10s'"))  # the job detects it
                conn.execute(text("update item set note = 'u' where id = 2"))
                user_has_2.set()
                job_waits.wait(10)
                conn.execute(text("select pg_sleep(0.2)"))  # let the job block on row 2 first
                conn.execute(text("update item set note = 'u' where id = 1"))
                conn.commit()

        def deadlocking(conn):
            # Checked once, 1 s after the job starts waiting: by then the user waits too.
            conn.execute(text("set local deadlock_timeout = '1s'"))
            conn.execute(text("update item set note = 'j' where id = 1"))
            user_has_2.wait(10)
            job_waits.set()
            conn.execute(text("update item set note = 'j' where id = 2"))

        thread = threading.Thread(target=user)
        thread.start()
        deadlock = runner.tick(pgjobs.TaskJob(name="dl", lock_timeout="20s", run=deadlocking))
        thread.join(30)
        assert (deadlock.outcome, deadlock.sqlstate) == ("transient", "40P01")
        assert runner.tick(pgjobs.TaskJob(name="dl", run=deadlocking)).outcome == "ran"
    with items.connect() as conn:
        stored = dict(conn.execute(text("select job, last_sqlstate from pgjobs.job_state")).all())
        logged = [tuple(r) for r in conn.execute(text("select job, sqlstate from pgjobs.run"))]
    assert stored == {"fk": "23503", "slow": "57014", "dl": None}
    assert logged == [
        ("fk", "23503"),
        ("lock", "55P03"),
        ("slow", "57014"),
        ("dl", "40P01"),
        ("dl", None),
    ]


def test_runs_and_failures_land_in_the_run_log_and_quiet_ticks_are_counted(items):
    clock = FakeClock()
    ok = pgjobs.TaskJob(name="ok", run=insert_items(4), every="1m")
    with pgjobs.Runner(items, clock=clock) as runner:
        ran = runner.tick(ok)
        not_due = runner.tick(ok)
        idle = runner.tick(
            pgjobs.TaskJob(name="idle", run=insert_items(1), has_work=lambda c: False)
        )
        failed = runner.tick(pgjobs.TaskJob(name="bad", run=lambda c: 1 / 0))
        backing_off = runner.tick(pgjobs.TaskJob(name="bad", run=lambda c: 1 / 0))
        with items.connect() as holder:
            holder.begin()
            holder.execute(text("select pg_advisory_xact_lock(hashtextextended('pgjobs:busy', 0))"))
            busy = runner.tick(pgjobs.TaskJob(name="busy", run=insert_items(1)))
            holder.rollback()
    results = [ran, not_due, idle, failed, backing_off, busy]
    assert [r.outcome for r in results] == [
        "ran",
        "not_due",
        "idle",
        "failed",
        "backing_off",
        "busy",
    ]
    with items.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                text(
                    "select id, job, outcome, inserted, error, started_at, finished_at, worker from pgjobs.run"
                )
            )
        }
    assert len(rows) == 2
    for result in (ran, failed):
        row = rows[result.run_id]
        assert (row.job, row.outcome) == (result.job, result.outcome)
        assert row.started_at == result.started_at and row.finished_at >= row.started_at
        assert row.worker
    assert rows[ran.run_id].inserted == 4
    assert "ZeroDivisionError" in rows[failed.run_id].error
    for result in (not_due, idle, backing_off, busy):
        assert result.run_id is None
    assert quiet(items, "ok") == {"not_due": 1}
    assert quiet(items, "idle") == {"idle": 1}
    assert quiet(items, "bad") == {"backing_off": 1}
    assert quiet(items, "busy") == {"busy": 1}


def test_prune_deletes_old_runs_only(items):
    clock = FakeClock()
    job = pgjobs.TaskJob(name="p", run=lambda c: None, every="1s")
    with pgjobs.Runner(items, clock=clock) as runner:
        runner.tick(job)
        clock.advance(days=8)
        runner.tick(job)
        assert runner.prune(timedelta(days=7)) == 1
    assert runs(items, "p") == [("ran", 0)]


def test_store_installs_once_when_processes_start_together(db_url):
    code = "import sys, pgjobs; pgjobs.install(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url]) for _ in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    with pgjobs.Runner(db_url) as runner:
        runner.install()
        with runner.engine.connect() as conn:
            versions = conn.execute(text("select count(*) from pgjobs.schema_version")).scalar_one()
    assert versions == len(list((Path(pgjobs.__file__).parent / "sql").glob("*.sql")))


def test_run_once_accepts_urls_and_engines(items, db_url):
    plain = db_url.replace("postgresql+psycopg://", "postgresql://")
    assert (
        pgjobs.run_once(pgjobs.TaskJob(name="a", run=insert_items(1)), database=plain).outcome
        == "ran"
    )
    result = pgjobs.run_once(pgjobs.TaskJob(name="b", run=lambda c: None), database=items)
    assert result.outcome == "ran"
    with pytest.raises(pgjobs.ConfigError, match="database"):
        pgjobs.run_once(pgjobs.TaskJob(name="c", run=lambda c: None), database="mysql://x/y")


def test_a_recompute_run_record_keeps_the_writers_detail(items):
    with items.begin() as conn:
        conn.execute(text("create table derived (id int primary key references item, note text)"))
        conn.execute(text("insert into item values (1, 'a'), (2, 'b')"))
    job = pgjobs.RecomputeJob(name="copy", target="derived", compute="select id, note from item")
    with pgjobs.Runner(items) as runner:
        result = runner.tick(job)
    assert result.outcome == "ran" and result.stats.inserted == 2
    with items.connect() as conn:
        detail = conn.execute(
            text("select detail from pgjobs.run where id = :id"), {"id": result.run_id}
        ).scalar_one()
    assert detail["staged_rows"] == 2 and detail["deferred"] == 0


def test_a_commit_that_fails_is_a_failed_run_with_nothing_written(items):
    """A deferred foreign key is checked at COMMIT (sent with the run record):
    the run fails with the SQLSTATE, nothing it wrote stays, and the failure
    is recorded and backed off."""
    with items.begin() as conn:
        conn.execute(
            text(
                "create table owner (id int primary key);"
                " create table owned (id int primary key, owner_id int references owner"
                " deferrable initially deferred)"
            )
        )

    def orphan(conn):
        conn.execute(text("insert into owned values (1, 42)"))  # no owner 42

    job = pgjobs.TaskJob(name="orphan", run=orphan, backoff="10m")
    with pgjobs.Runner(items) as runner:
        result = runner.tick(job)
    assert result.outcome == "failed" and result.sqlstate == "23503", result
    with items.connect() as conn:
        assert conn.execute(text("select count(*) from owned")).scalar_one() == 0
    assert runs(items, "orphan") == [("failed", 0)]
    assert result.next_attempt_at is not None


def _held_advisory_locks(conn) -> list[str]:
    """The advisory locks this connection's session holds (their modes)."""
    rows = conn.execute(
        text(
            "select mode from pg_locks where locktype = 'advisory' and pid = pg_backend_pid()"
            " and granted"
        )
    )
    return [r.mode for r in rows]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _OwnKind(pgjobs.Job):
    """A job kind of a user's own that decides in its body: which locks, chunks,
    when next due. ``seen`` collects what its body saw, run by run."""

    kind = "own"
    taken: pgjobs.Locks = pgjobs.Locks.WRITE
    chunks: bool = False
    due_in: timedelta | None = None
    seen: list = dataclasses.field(default_factory=list)

    def locks(self, ctx):
        return self.taken

    def chunked(self, ctx):
        return self.chunks

    def next_due(self, started, scheduled):
        if self.due_in is None:
            return pgjobs.Job.next_due(self, started, scheduled)
        return started + self.due_in

    def execute(self, conn, ctx):
        self.seen.append((len(_held_advisory_locks(conn)), ctx.checkpoint is not None))
        return pgjobs.results.Execution()


def test_a_kind_of_its_own_gets_todays_behaviour_by_default(items):
    """The defaults of the hooks: the write lock alone, no chunks, due one
    interval after the run started."""
    clock = FakeClock()
    job = _OwnKind(name="own", every="10m")
    with pgjobs.Runner(items, clock=clock) as runner:
        assert runner.tick(job).outcome is pgjobs.Outcome.RAN
        assert job.seen == [(1, False)]
        clock.advance(minutes=9)
        assert runner.tick(job).outcome is pgjobs.Outcome.NOT_DUE
        clock.advance(minutes=1)
        assert runner.tick(job).outcome is pgjobs.Outcome.RAN


def test_a_kind_of_its_own_decides_its_locks_chunks_and_next_due(items):
    """The runner asks the body: two locks (recompute and write), a
    checkpoint to commit part-way, next due in an hour for a 1 s job."""
    clock = FakeClock()
    job = _OwnKind(
        name="mine",
        every="1s",
        taken=pgjobs.Locks.RECOMPUTE_AND_WRITE,
        chunks=True,
        due_in=timedelta(hours=1),
    )
    with pgjobs.Runner(items, clock=clock) as runner:
        result = runner.tick(job)
        assert result.outcome is pgjobs.Outcome.RAN
        assert job.seen == [(2, True)]
        assert result.next_attempt_at == T0 + timedelta(hours=1)
        clock.advance(minutes=59)
        assert runner.tick(job).outcome is pgjobs.Outcome.NOT_DUE
        # and the recompute lock alone is the group's recompute lock: a
        # holder of the write lock does not keep the tick out
        alone = dataclasses.replace(job, name="alone", taken=pgjobs.Locks.RECOMPUTE, seen=[])
        with items.connect() as holder:
            holder.execute(
                text("select pg_advisory_lock(hashtextextended(:n, 0))"),
                {"n": lock_name("pgjobs", "alone")},
            )
            try:
                assert runner.tick(alone).outcome is pgjobs.Outcome.RAN
            finally:
                holder.execute(text("select pg_advisory_unlock_all()"))
        assert alone.seen == [(1, True)]


def test_one_error_text_for_the_run_log_the_items_and_the_checks(items):
    """`_pg.error_text` renders what the driver said, under SQLAlchemy's
    wrapper (which repeats the SQL and adds a link): whole for the run log,
    with the SQLSTATE for a queue item, one line with it for a check."""
    from pgjobs._pg import error_text, first_line

    with items.connect() as conn, pytest.raises(Exception) as caught:
        conn.execute(text("select * from no_such_table"))
    exc = caught.value
    whole = error_text(exc)
    assert whole.startswith('UndefinedTable: relation "no_such_table" does not exist')
    assert "sqlalche.me" not in whole and "[SQL:" not in whole
    assert error_text(exc, sqlstate=True).endswith(" (SQLSTATE 42P01)")
    line = error_text(exc, first=True, sqlstate=True)
    assert line == 'relation "no_such_table" does not exist (SQLSTATE 42P01)'
    assert first_line(exc) == 'relation "no_such_table" does not exist'
    assert len(error_text(exc, limit=20)) == 20 and error_text(exc, limit=20).endswith("...")
    # a failed tick stores the same text
    job = pgjobs.TaskJob(name="bad", run=lambda c: c.execute(text("select * from no_such_table")))
    with pgjobs.Runner(items) as runner:
        result = runner.tick(job)
    assert result.outcome is pgjobs.Outcome.FAILED
    assert result.error == whole
