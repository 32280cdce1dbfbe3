"""Queue jobs under the Scheduler: drain a backlog, wake on enqueue, several
workers. Every queue job here polls once an hour (``every = "1h"``): what
runs it sooner is the drain or a wake-up, never its interval."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter

import psycopg
import pytest
import statements
from sqlalchemy import text
from sqlalchemy.engine import Engine
from test_queue import COMPUTE as COMPUTE_SQL
from test_queue import SCHEMA, add_parents, derived, from_scratch, make_job

import pgjobs
from pgjobs.database import ENV_TRANSACTION_POOLING
from pgjobs.queue import channel, enqueue, install_enqueue_trigger
from pgjobs.results import Outcome, RunResult

WAIT = 30.0  # upper bound on any wait; never reached when things work


def wait_until(condition: object, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.005)


@pytest.fixture
def db(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.Runner(engine).install()
    return engine


class Results:
    """What the scheduler reports, by outcome, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all: list[RunResult] = []

    def __call__(self, result: RunResult) -> None:
        with self.lock:
            self.all.append(result)

    def count(self, outcome: Outcome) -> int:
        with self.lock:
            return sum(1 for r in self.all if r.outcome is outcome)

    def ran(self) -> list[RunResult]:
        with self.lock:
            return [r for r in self.all if r.outcome is Outcome.RAN]


def queue_depth(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("select count(*) from pgjobs.queue")).scalar_one())


def psycopg_url(engine: Engine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def enqueue_committed(engine: Engine, keys: list[int], job: str = "worker") -> None:
    with engine.begin() as conn:
        enqueue(conn, job, keys)


# -- the notification ------------------------------------------------------------------
def test_an_enqueue_notifies_its_channel_at_commit_only_when_it_adds_an_entry(db: Engine) -> None:
    add_parents(db, [1, 2])
    name = channel("pgjobs", "worker")
    assert name.startswith("pgjobs_") and len(name) <= 63
    with db.connect() as conn:
        assert conn.execute(text("select pgjobs.channel('worker')")).scalar_one() == name
    with psycopg.connect(psycopg_url(db), autocommit=True) as listener:
        listener.execute(f'listen "{name}"')
        listener.execute("listen marker")

        def next_channel() -> str:
            for notify in listener.notifies(timeout=WAIT, stop_after=1):
                return notify.channel
            raise AssertionError("no notification")

        with db.connect() as conn:
            with conn.begin():
                enqueue(conn, "worker", [1])
                # uncommitted: a round trip of the listener's gets nothing
                listener.execute("select 1")
                assert list(listener.notifies(timeout=0)) == []
            assert next_channel() == name  # delivered at commit
            with conn.begin():
                enqueue(conn, "worker", [2])
                conn.rollback()
            with conn.begin():
                enqueue(conn, "worker", [1])  # pending already: no entry added
            # notifications arrive in commit order: had the rollback or the
            # enqueue of a pending key notified, the marker would not be first
            with conn.begin():
                conn.execute(text("notify marker"))
            assert next_channel() == "marker"


# -- wake-ups ------------------------------------------------------------------------------
def test_an_enqueue_is_processed_at_once_not_at_the_next_poll(db: Engine) -> None:
    add_parents(db, [1, 2, 3])
    results = Results()
    job = make_job(every="1h")
    with pgjobs.Scheduler([job], db, on_result=results) as scheduler:
        assert scheduler.listener is not None
        wait_until(scheduler.listener.listening.is_set, what="listening")
        wait_until(lambda: results.count(Outcome.IDLE) == 1, what="the first tick")
        enqueue_committed(db, [1, 2])
        wait_until(lambda: queue_depth(db) == 0, what="the items processed")
        # the trigger helper wakes the job too
        with db.begin() as conn:
            install_enqueue_trigger(conn, table="parent", job="worker", columns=["id"])
        with db.begin() as conn:
            conn.execute(text("update parent set factor = 3 where id = 3"))
        wait_until(lambda: len(derived(db, 3)) == 5 and derived(db, 3) == from_scratch(db, 3))
    assert derived(db) == from_scratch(db)
    assert [r.items for r in results.ran()] == [2, 1]


def test_a_burst_of_wake_ups_during_a_tick_makes_one_more_tick(db: Engine) -> None:
    add_parents(db, range(1, 22))
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def compute(conn, keys):
        calls.append(len(keys))
        if len(calls) == 1:
            entered.set()
            assert release.wait(WAIT)
        return COMPUTE_SQL

    results = Results()
    scheduler = pgjobs.Scheduler([make_job(every="1h", compute=compute)], db, on_result=results)
    wakes = Counter[str]()
    wake = scheduler.wake

    def counting_wake(name: str) -> None:
        wakes[name] += 1
        wake(name)

    scheduler.wake = counting_wake  # type: ignore[method-assign]
    with scheduler:
        assert scheduler.listener is not None
        wait_until(scheduler.listener.listening.is_set, what="listening")
        wait_until(lambda: results.count(Outcome.IDLE) == 1, what="the first tick")
        enqueue_committed(db, [1])
        assert entered.wait(WAIT)
        for key in range(2, 22):  # twenty transactions, twenty notifications
            enqueue_committed(db, [key])
        wait_until(lambda: wakes["worker"] == 21, what="21 wake-ups")
        release.set()
        wait_until(lambda: queue_depth(db) == 0, what="the items processed")
    assert calls == [1, 20]  # one tick for the burst, with all of it
    assert [r.items for r in results.ran()] == [1, 20]
    assert derived(db) == from_scratch(db)


def test_a_backlog_drains_batch_after_batch_not_one_batch_an_interval(db: Engine) -> None:
    add_parents(db, range(1, 501))
    enqueue_committed(db, list(range(1, 501)))
    results = Results()
    # listening off: only the drain can take more than the first batch
    with pgjobs.Scheduler(
        [make_job(every="1h", batch_size=50)], db, on_result=results, listen=False
    ):
        wait_until(lambda: queue_depth(db) == 0, what="the queue drained")
        wait_until(lambda: results.count(Outcome.IDLE) == 1, what="the tick that finds it empty")
    ran = results.ran()
    assert [r.items for r in ran] == [50] * 10
    assert all(r.detail["claimed"] == 50 for r in ran)
    assert derived(db) == from_scratch(db)
    with db.connect() as conn:
        logged = conn.execute(text("select outcome, count(*) from pgjobs.run group by 1")).all()
    assert dict(logged) == {"ran": 10}  # the empty tick is counted, not logged


def test_the_listener_reconnects_by_itself_and_catches_up(
    db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    add_parents(db, [1, 2])
    caplog.set_level(logging.INFO, logger="pgjobs")
    with pgjobs.Scheduler([make_job(every="1h")], db) as scheduler:
        listener = scheduler.listener
        assert listener is not None
        wait_until(listener.listening.is_set, what="listening")
        pid = listener.backend_pid
        with db.connect() as conn:
            assert conn.execute(text("select pg_terminate_backend(:p)"), {"p": pid}).scalar()
        wait_until(lambda: not listener.listening.is_set(), what="the loss noticed")
        # enqueued while nobody listens: the catch-up after reconnecting takes it
        enqueue_committed(db, [1])
        wait_until(lambda: queue_depth(db) == 0, what="the item processed")
        assert listener.listening.is_set() and listener.backend_pid != pid
        enqueue_committed(db, [2])  # and the new connection listens
        wait_until(lambda: queue_depth(db) == 0, what="the second item processed")
    lines = [r.getMessage() for r in caplog.records if r.name == "pgjobs.scheduler"]
    assert sum("not listening for enqueues" in line for line in lines) == 1, lines
    assert sum("listening for enqueues again" in line for line in lines) == 1, lines
    assert derived(db) == from_scratch(db)


def test_behind_a_transaction_pooler_the_scheduler_polls_and_does_not_listen(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_parents(db, [1])
    monkeypatch.setenv(ENV_TRANSACTION_POOLING, "1")
    with pgjobs.Scheduler([make_job(every="0.2s")], db) as scheduler:
        assert scheduler.listen is False and scheduler.listener is None
        enqueue_committed(db, [1])
        wait_until(lambda: queue_depth(db) == 0, what="the item processed by polling")
        with db.connect() as conn:
            listening = conn.execute(
                text(
                    "select count(*) from pg_stat_activity"
                    " where datname = current_database() and query ilike 'listen %'"
                )
            ).scalar_one()
    assert listening == 0


def test_wake_ups_reach_every_replica_and_one_takes_each_batch(db: Engine) -> None:
    add_parents(db, range(1, 41))
    replicas = [Results() for _ in range(3)]
    schedulers = [pgjobs.Scheduler([make_job(every="1h")], db, on_result=r) for r in replicas]
    for scheduler in schedulers:
        scheduler.start()
    try:
        for scheduler, results in zip(schedulers, replicas, strict=True):
            assert scheduler.listener is not None
            wait_until(scheduler.listener.listening.is_set, what="listening")
            wait_until(lambda r=results: len(r.all) >= 1, what="each first tick")
        for key in range(1, 41):
            enqueue_committed(db, [key])
        wait_until(lambda: queue_depth(db) == 0, what="the items processed")
    finally:
        for scheduler in schedulers:
            scheduler.shutdown()
    processed = sum(r.items for results in replicas for r in results.ran())
    assert processed == 40  # each item once, whichever replica took it
    assert derived(db) == from_scratch(db)
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from status where runs > 1")).scalar() == 0


# -- several workers ---------------------------------------------------------------------
def test_a_job_with_two_workers_runs_two_batches_at_once(db: Engine) -> None:
    add_parents(db, range(1, 81))
    enqueue_committed(db, list(range(1, 81)))
    # The first worker calls the second in as soon as it has claimed a full
    # batch (its entries locked, so the second one's claim passes over them):
    # the first two batches meet at this barrier, which a single worker could
    # never pass (it would break after WAIT and fail them).
    both = threading.Barrier(2, timeout=WAIT)
    calls = itertools.count()

    def compute(conn, keys):
        if next(calls) in (0, 1):
            both.wait()
        return COMPUTE_SQL

    results = Results()
    job = make_job(every="1h", batch_size=10, workers=2, compute=compute)
    with pgjobs.Scheduler([job], db, on_result=results, listen=False):
        wait_until(lambda: queue_depth(db) == 0, what="the queue drained")
    assert not both.broken
    assert results.count(Outcome.FAILED) == 0, [r.error for r in results.all]
    # each item once (two workers may read the same due items; one gets each)
    assert sum(r.items for r in results.ran()) == 80
    assert derived(db) == from_scratch(db)
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from status where runs > 1")).scalar() == 0


def test_several_workers_need_flow_and_a_bounded_number_of_item_locks() -> None:
    with pytest.raises(pgjobs.ConfigError, match="workers"):
        make_job(workers=2, flow=False)
    # each worker holds an advisory lock per item it claims
    assert make_job(workers=4, batch_size=500).workers == 4
    with pytest.raises(pgjobs.ConfigError, match="2,001 item locks"):
        make_job(workers=3, batch_size=667)
    with pytest.raises(pgjobs.ConfigError, match="workers"):
        make_job(workers=0)


def test_workers_are_a_setting_of_pgjobs_toml(tmp_path) -> None:
    from pgjobs.config import load_config

    path = tmp_path / "pgjobs.toml"
    declared = (
        '[jobs.w]\nkind = "queue"\ntarget = "derived"\nscope = ["parent_id"]\nsql = "select 1"\n'
    )
    path.write_text(declared + "workers = 3\n")
    (job,) = load_config(path).jobs
    assert isinstance(job, pgjobs.QueueJob) and job.workers == 3
    for bad in ("0", "65", '"two"'):
        path.write_text(declared + f"workers = {bad}\n")
        with pytest.raises(pgjobs.ConfigError, match=r"pgjobs.toml: jobs\.w\.workers"):
            load_config(path)
    path.write_text(declared + "workers = 2\nflow = false\n")
    with pytest.raises(pgjobs.ConfigError, match="needs flow"):
        load_config(path)


def test_2000_items_enqueued_at_once_are_processed_within_seconds(db: Engine) -> None:
    add_parents(db, range(1, 2001))
    results = Results()
    with pgjobs.Scheduler([make_job(every="60s")], db, on_result=results) as scheduler:
        assert scheduler.listener is not None
        wait_until(scheduler.listener.listening.is_set, what="listening")
        wait_until(lambda: results.count(Outcome.IDLE) == 1, what="the first tick")
        started = time.monotonic()
        enqueue_committed(db, list(range(1, 2001)))
        # at one batch (100) per interval, 60 s x 20 batches: 20 minutes
        wait_until(lambda: queue_depth(db) == 0, timeout=30, what="2,000 items processed")
        took = time.monotonic() - started
    assert sum(r.items for r in results.ran()) == 2000 and took < 30
    assert derived(db) == from_scratch(db)


def test_an_enqueue_in_an_open_transaction_is_processed_only_after_its_commit(db: Engine) -> None:
    add_parents(db, [1])
    results = Results()
    with pgjobs.Scheduler([make_job(every="1h")], db, on_result=results) as scheduler:
        assert scheduler.listener is not None
        wait_until(scheduler.listener.listening.is_set, what="listening")
        wait_until(lambda: results.count(Outcome.IDLE) == 1, what="the first tick")
        with db.connect() as user, user.begin():
            enqueue(user, "worker", [1])
            # a tick now (as a poll would) does not see the uncommitted entry
            tick = scheduler.run_job("worker")
            assert tick is not None and tick.outcome is Outcome.IDLE
            assert derived(db) == [] and results.ran() == []
        # committed: the notification runs it, within the hour's poll
        wait_until(lambda: queue_depth(db) == 0, what="the item processed after the commit")
    assert [r.items for r in results.ran()] == [1]
    assert derived(db) == from_scratch(db)


def test_two_processes_take_each_item_once_and_log_a_run_per_batch_not_per_wake_up(
    db: Engine, db_url: str, tmp_path
) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    add_parents(db, range(1, 1001))
    config = tmp_path / "pgjobs.toml"
    config.write_text(
        '[jobs.worker]\nkind = "queue"\ntarget = "derived"\nscope = ["parent_id"]\n'
        f'every = "1h"\nsql = """{COMPUTE_SQL}"""\n'
    )
    env = {**os.environ, "PGJOBS_DATABASE_URL": db_url, "PGJOBS_LOAD_PLUGINS": ""}
    command = [str(Path(sys.executable).with_name("pgjobs")), "-c", str(config), "run"]
    errors = [open(tmp_path / f"run{n}.err", "w+") for n in range(2)]  # noqa: SIM115
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err) for err in errors
    ]
    try:

        def listeners() -> int:
            with db.connect() as conn:  # pg_stat_activity is a snapshot per transaction
                return int(
                    conn.execute(
                        text(
                            "select count(*) from pg_stat_activity"
                            " where datname = current_database() and query like 'listen %'"
                        )
                    ).scalar_one()
                )

        wait_until(lambda: listeners() == 2, what="both processes listening")
        with db.connect() as conn:
            for key in range(1, 1001):  # a thousand transactions, a thousand wake-ups each
                with conn.begin():
                    enqueue(conn, "worker", [key])
        wait_until(lambda: queue_depth(db) == 0, what="the items processed")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(WAIT) for proc in procs]
        for err in errors:
            err.close()
    assert codes == [0, 0]
    assert derived(db) == from_scratch(db)
    with db.connect() as conn:
        runs = conn.execute(
            text("select outcome, count(*), sum(items) from pgjobs.run group by 1")
        ).all()
        quiet = conn.execute(
            text("select sum(idle_ticks + busy_ticks) from pgjobs.job_state")
        ).scalar_one()
    by_outcome = {outcome: (count, items) for outcome, count, items in runs}
    assert set(by_outcome) == {"ran"}, by_outcome  # no row for a tick that found nothing
    count, items = by_outcome["ran"]
    assert items == 1000 and count <= 1000  # each item once; a row per batch at most
    assert quiet is not None and quiet > 0  # the other replica's wake-ups: counted


def test_a_flow_worker_waits_for_a_recompute_s_chunk_and_runs_right_after_it(db: Engine) -> None:
    """A recompute holds the group's write lock exclusively for one chunk at a
    time and asks for it again at once: a worker that only tried would find
    the next request queued and be busy for the whole write phase (lag of
    seconds at 100k rows). It waits, briefly, and gets in between."""
    from concurrent.futures import ThreadPoolExecutor

    from pgjobs.locking import lock_name

    add_parents(db, [1])
    enqueue_committed(db, [1])
    job = make_job(group="g")
    with db.connect() as holder, pgjobs.Runner(db) as runner:
        holder.begin()
        holder.execute(
            text("select pg_advisory_xact_lock(hashtextextended(:k, 0))"),
            {"k": lock_name("pgjobs", "g")},
        )  # as a recompute writing a chunk

        def waiting() -> bool:
            with db.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "select exists (select from pg_locks where locktype = 'advisory'"
                            " and not granted and mode = 'ShareLock')"
                        )
                    ).scalar()
                )

        with ThreadPoolExecutor(1) as pool:
            tick = pool.submit(runner.tick, job, force=True)
            wait_until(waiting, what="the worker waiting for the write lock")
            assert not tick.done()
            holder.commit()  # the chunk is written
            result = tick.result(WAIT)
    assert result.outcome is Outcome.RAN and result.items == 1
    assert derived(db) == from_scratch(db)


# -- a woken tick ---------------------------------------------------------------------------
def test_a_woken_tick_leaves_out_the_work_check_and_its_state_read_under_the_lock_decides(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Runner.tick(woken=True)`` (what the scheduler passes after a
    notification, or after a tick that took items) sends no work check
    before the lock; a woken tick with nothing to claim ends ``idle``, and
    one of a paused job ``paused``, by the state it reads under the lock."""
    sent = statements.texts(monkeypatch)
    job = make_job(every="1h")
    runner = pgjobs.Runner(db)
    pending = "and attempts = 0 and seq > %s order by seq limit 1)"
    try:
        assert runner.tick(job).outcome is Outcome.IDLE
        assert sum(pending in s for s in sent) == 1  # not woken: checked, no lock taken
        assert not any("pg_advisory_xact_lock" in s for s in sent)
        sent.clear()
        assert runner.tick(job, woken=True).outcome is Outcome.IDLE
        assert not any(pending in s for s in sent)
        assert any("pg_advisory_xact_lock" in s for s in sent)  # the lock, then an empty claim
        add_parents(db, [1])
        enqueue_committed(db, [1])
        sent.clear()
        result = runner.tick(job, woken=True)
        assert result.outcome is Outcome.RAN and result.items == 1
        assert not any(pending in s for s in sent)
        enqueue_committed(db, [1])
        with db.begin() as conn:
            conn.execute(
                text("update pgjobs.job_state set paused_at = now() where job = :j"),
                {"j": job.name},
            )
        assert runner.tick(job, woken=True).outcome is Outcome.PAUSED
        assert queue_depth(db) == 1
    finally:
        runner.close()
