"""The queue worker's incremental path and the recompute agree
(:func:`pgjobs.testing.assert_no_drift`), after a scenario of inserts,
moves between users and deletes; and a deliberately broken incremental
path (the application enqueues only the new owner of a moved session,
instead of the trigger's old and new) is caught, naming the stale row."""

from __future__ import annotations

import pgjobs_example
import pytest
from pgjobs_example import COUNT_WORKER, RECOUNT
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.testing import assert_no_drift, run_tick


def _setup(engine: Engine, *, trigger: bool) -> None:
    pgjobs.install(engine)
    with engine.begin() as conn:
        pgjobs_example.install(conn)
        if trigger:
            pgjobs_example.install_counts(conn)
        else:
            for statement in pgjobs_example.COUNTS_DDL:
                conn.execute(text(statement))


def _scenario(engine: Engine, *, enqueue_new_owner_only: bool = False) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "insert into example_session (user_name, expires_at)"
                " select 'u' || (g % 7), now() + g * interval '1 minute'"
                " from generate_series(1, 60) g"
            )
        )
        if enqueue_new_owner_only:
            pgjobs.enqueue(conn, COUNT_WORKER, [f"u{i}" for i in range(7)])
    assert run_tick(COUNT_WORKER, engine).stats.inserted == 7
    with engine.begin() as conn:
        # sessions move from u1 to u2, and all of u3's end
        conn.execute(text("update example_session set user_name = 'u2' where user_name = 'u1'"))
        conn.execute(text("delete from example_session where user_name = 'u3'"))
        if enqueue_new_owner_only:
            # the bug: the new owner is enqueued, the old one (u1) forgotten
            pgjobs.enqueue(conn, COUNT_WORKER, ["u2", "u3"])


def test_the_worker_and_the_recompute_agree_after_the_scenario(engine: Engine) -> None:
    _setup(engine, trigger=True)
    _scenario(engine)
    result = assert_no_drift(RECOUNT, engine, workers=[COUNT_WORKER])
    assert result.unchanged == 5  # u0, u2, u4, u5, u6: every row checked, none differs
    with engine.connect() as conn:
        users = conn.execute(text("select user_name from example_user_sessions order by 1"))
        assert [r[0] for r in users] == ["u0", "u2", "u4", "u5", "u6"]
        # the worker's after() saw every user it processed, u1 and u3 (rows gone) too
        refreshed = conn.execute(text("select user_name from example_user_refresh order by 1"))
        assert [r[0] for r in refreshed] == [f"u{i}" for i in range(7)]


def test_a_broken_incremental_path_is_caught(engine: Engine) -> None:
    _setup(engine, trigger=False)
    _scenario(engine, enqueue_new_owner_only=True)
    with pytest.raises(AssertionError) as caught:
        assert_no_drift(RECOUNT, engine, workers=[COUNT_WORKER])
    message = str(caught.value)
    assert "a recompute would insert 0, update 0, delete 1" in message
    assert 'deleted: {"user_name": "u1"}' in message  # u1's row outlived its sessions


def test_items_left_in_the_queue_are_not_agreement(engine: Engine) -> None:
    _setup(engine, trigger=True)
    _scenario(engine)
    with pytest.raises(AssertionError, match="on their way"):
        assert_no_drift(RECOUNT, engine, workers=[COUNT_WORKER], drain=False)
