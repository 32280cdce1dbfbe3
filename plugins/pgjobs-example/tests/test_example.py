from __future__ import annotations

import threading

import pgjobs_example
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.registry import Registry
from pgjobs.testing import run_tick


def _seed(engine: Engine, expired: int, live: int) -> None:
    with engine.begin() as conn:
        pgjobs_example.install(conn)
        conn.execute(
            text(
                "insert into example_session (user_name, expires_at)"
                " select 'u' || g, now() - interval '1 hour' from generate_series(1, :n) g"
            ),
            {"n": expired},
        )
        conn.execute(
            text(
                "insert into example_session (user_name, expires_at)"
                " select 'v' || g, now() + interval '1 hour' from generate_series(1, :n) g"
            ),
            {"n": live},
        )


def _remaining(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "select count(*) filter (where expires_at < now()),"
                " count(*) filter (where expires_at >= now()) from example_session"
            )
        ).one()
    return row[0], row[1]


def test_the_hook_registers_the_job_under_the_plugins_name() -> None:
    registry = Registry.load(plugins=[pgjobs_example], entry_points=False)
    job = registry.get("example-expire-sessions")
    assert job is pgjobs_example.JOB
    assert registry.owner("example-expire-sessions") == "pgjobs_example"
    assert job.kind == "task" and job.group == "example-session"


def test_expired_sessions_are_deleted_and_live_ones_kept(engine: Engine) -> None:
    _seed(engine, expired=25, live=7)
    result = run_tick(pgjobs_example.JOB, engine)
    assert result.outcome == "ran", result.error
    assert result.stats.deleted == 25
    assert _remaining(engine) == (0, 7)


def test_nothing_expired_is_idle_without_taking_the_group_lock(engine: Engine) -> None:
    _seed(engine, expired=0, live=3)
    # Another transaction holds the job's group lock: a job that took the lock
    # before checking for work would come back "busy".
    with engine.connect() as holder, holder.begin():
        holder.execute(
            text("select pg_advisory_xact_lock(hashtextextended(:key, 0))"),
            {"key": "pgjobs:example-session"},
        )
        result = run_tick(pgjobs_example.JOB, engine)
    assert result.outcome == "idle"
    assert _remaining(engine) == (0, 3)


def test_a_locked_session_is_skipped_not_waited_on(engine: Engine) -> None:
    _seed(engine, expired=5, live=0)
    locked = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def hold_one_row() -> None:
        try:
            with engine.connect() as conn, conn.begin():
                conn.execute(
                    text("select id from example_session order by id limit 1 for update")
                ).one()
                locked.set()
                release.wait(timeout=60)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            locked.set()

    holder = threading.Thread(target=hold_one_row)
    holder.start()
    try:
        assert locked.wait(timeout=30)
        # While the row is locked: the run neither waits for it nor fails on
        # lock_timeout; it deletes the other four.
        first = run_tick(pgjobs_example.JOB, engine)
    finally:
        release.set()
        holder.join()
    assert not errors
    assert first.outcome == "ran", first.error
    assert first.stats.deleted == 4
    assert _remaining(engine) == (1, 0)

    second = run_tick(pgjobs_example.JOB, engine, force=True)
    assert second.outcome == "ran", second.error
    assert second.stats.deleted == 1
    assert _remaining(engine) == (0, 0)


def test_the_job_is_a_public_pgjobs_job() -> None:
    assert isinstance(pgjobs_example.JOB, pgjobs.TaskJob)
