"""Failures, whatever kills them: recorded, backed off, never run twice;
and a connection killed under a job, which is no failure of the job.

Real connections throughout: a backend terminated from another connection,
six runners racing on one failing job, a deferred constraint failing at
commit. Races are scripted with events, never with sleeps.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

import pgjobs

WAIT = 30.0
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    """A clock shared by several runners, moved by hand."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def job_state(engine, job: str):
    with engine.connect() as conn:
        return conn.execute(
            text(
                "select failures, next_attempt_at, last_sqlstate from pgjobs.job_state"
                " where job = :job"
            ),
            {"job": job},
        ).one_or_none()


def logged(engine, job: str) -> list[tuple[str, str | None]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text("select outcome, sqlstate from pgjobs.run where job = :job order by id"),
                {"job": job},
            )
        ]


def test_a_job_whose_backend_is_terminated_mid_write_is_interrupted_not_failed(engine) -> None:
    """A backend terminated under the job (57P01, what a switchover does) is
    not the job's failure: the run is rolled back and logged ``interrupted``
    with its SQLSTATE, the job's state keeps no failure and no backoff, and
    the next tick runs it on a fresh connection."""
    with engine.begin() as conn:
        conn.execute(text("create table written (n int)"))
    pid: list[int] = []
    writing = threading.Event()

    def body(conn):
        conn.execute(text("insert into written values (1)"))
        if not pid:
            pid.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
            writing.set()
            conn.execute(text("select pg_sleep(60)"))  # terminated in here

    def terminate() -> None:
        assert writing.wait(WAIT)
        with engine.connect() as admin:
            assert admin.execute(text("select pg_terminate_backend(:p)"), {"p": pid[0]}).scalar()

    job = pgjobs.TaskJob(name="killed", run=body, backoff="1h")
    killer = threading.Thread(target=terminate)
    killer.start()
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job)
        killer.join(WAIT)
        assert (result.outcome, result.sqlstate) == ("interrupted", "57P01")
        assert result.run_id is not None
        assert result.retry_after is not None and result.retry_after <= timedelta(seconds=1)
        assert job_state(engine, "killed") is None  # no failure, no backoff
        # the next tick runs at once, on a fresh connection
        assert runner.tick(job).outcome == "ran"
    failures, _, sqlstate = job_state(engine, "killed")
    assert (failures, sqlstate) == (0, None)
    assert logged(engine, "killed") == [("interrupted", "57P01"), ("ran", None)]
    with engine.connect() as conn:
        assert conn.execute(text("select count(*) from written")).scalar_one() == 1


def test_a_failing_job_runs_once_per_backoff_window_with_six_runners_racing(engine) -> None:
    """Six runners, in threads, tick one failing job together and retry at
    once whenever they find the group busy. Before the failure was written
    inside the job's transaction, a runner whose due check came before the
    failure's record could take the lock between the rollback and the
    record, and run the failing body a second time."""
    clock = Clock()
    runs: list[int] = []
    count_lock = threading.Lock()

    def failing(conn):
        with count_lock:
            runs[-1] += 1
        conn.execute(text("select pg_sleep(0.05)"))
        raise RuntimeError("always fails")

    job = pgjobs.TaskJob(name="failing", run=failing, every="1s", backoff="1h", busy_retry=None)
    rounds, racers = 20, 6
    start = threading.Barrier(racers + 1)
    done = threading.Barrier(racers + 1)
    outcomes: list[list[str]] = [[] for _ in range(racers)]
    runners = [pgjobs.Runner(engine, clock=clock, worker=f"r{i}") for i in range(racers)]

    def racer(i: int) -> None:
        for _ in range(rounds):
            start.wait(WAIT)
            while True:
                outcome = runners[i].tick(job).outcome
                if outcome != "busy":
                    break
            outcomes[i].append(str(outcome))
            done.wait(WAIT)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(rounds):
            runs.append(0)
            start.wait(WAIT)
            done.wait(WAIT)
            clock.now += timedelta(hours=2)  # past the backoff: due again
    finally:
        for thread in threads:
            thread.join(WAIT)
        for runner in runners:
            runner.close()
    assert runs == [1] * rounds
    for n in range(rounds):
        assert sorted(o[n] for o in outcomes) == ["backing_off"] * (racers - 1) + ["failed"]
    assert [o for o, _ in logged(engine, "failing")] == ["failed"] * rounds


def test_a_deferred_constraint_failing_at_commit_is_recorded_with_the_lock_held(engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "create table parent (id int primary key);"
                " create table child (parent_id int references parent"
                " deferrable initially deferred)"
            )
        )
    seen: dict[str, object] = {}

    def body(conn):
        conn.execute(text("insert into child values (42)"))  # no such parent: fails at commit

    job = pgjobs.TaskJob(name="deferred", run=body, group="g", backoff="1h")
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job)
        assert (result.outcome, result.sqlstate) == ("failed", "23503")
        # the same group's other job, right after: the failure's state was
        # written before the lock went, in the same transaction
        seen["other"] = runner.tick(job).outcome
    assert seen["other"] == "backing_off"
    assert job_state(engine, "deferred")[0] == 1
    assert logged(engine, "deferred") == [("failed", "23503")]
    with engine.connect() as conn:
        assert conn.execute(text("select count(*) from child")).scalar_one() == 0


# -- smaller items ------------------------------------------------------------------------------
def test_a_failed_items_last_error_is_the_databases_message_with_its_sqlstate(engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "create table parent (id int primary key);"
                " create table derived (parent_id int primary key references parent,"
                " v int not null); insert into parent values (1), (2)"
            )
        )
    job = pgjobs.QueueJob(
        name="w",
        target="derived",
        scope="parent_id",
        # item 2 divides by zero
        compute="select id as parent_id, 10 / (2 - id) as v from parent where id = any(:keys)",
    )
    pgjobs.install(engine)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, job, [1, 2])
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True)
    assert (result.items, result.failed_items) == (1, 1)
    with engine.connect() as conn:
        error = conn.execute(text("select last_error from pgjobs.queue")).scalar_one()
    assert error == "DivisionByZero: division by zero (SQLSTATE 22012)"


def test_a_key_too_long_for_the_queue_is_refused_naming_its_size(engine) -> None:
    pgjobs.install(engine)
    job = pgjobs.QueueJob(name="w", target="t", scope="k", compute="select 1")
    with engine.begin() as conn:
        try:
            pgjobs.enqueue(conn, job, ["x" * 1_000_000])
        except pgjobs.ConfigError as exc:
            message = str(exc)
        else:
            raise AssertionError("a 1 MB key was taken")
    assert "a key is at most 2,000 bytes" in message and "got 1,000,004 bytes" in message


def test_once_says_how_many_items_failed_when_none_succeeded() -> None:
    from pgjobs.cli import _summary

    result = pgjobs.RunResult(
        job="w", outcome=pgjobs.Outcome.RAN, started_at=T0, finished_at=T0, items=0, failed_items=1
    )
    assert "items 0 (1 failed)" in _summary(result)


def test_a_statement_failing_in_a_long_round_trip_raises_its_error_without_a_psycopg_warning(
    engine, caplog
) -> None:
    # psycopg reads results while a long pipeline is still being queued and
    # raises there; its exit then failed too and psycopg logged "error ignored
    # terminating <psycopg.Pipeline ...>: pipeline aborted" beside the error.
    import psycopg

    from pgjobs._pg import send

    caplog.set_level(logging.WARNING, logger="psycopg")
    with engine.connect() as conn:
        conn.begin()
        with pytest.raises(psycopg.errors.DivisionByZero):
            send(conn, ("select 1 / 0", {}), *[("select %(a)s::int", {"a": 1})] * 200)
        conn.rollback()
    assert [r.getMessage() for r in caplog.records if r.name == "psycopg"] == []
