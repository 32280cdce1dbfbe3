"""The APScheduler adapter against a real database: entries, busy retries,
cron next-due, pruning, graceful shutdown, and the FastAPI lifespan."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

import pgjobs
from pgjobs.results import RunResult

WAIT = 30.0  # upper bound on any wait for an event; never reached when things work


def wait_until(condition: object, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_one_entry_per_enabled_job_with_max_instances_1_and_coalesce(engine: Engine) -> None:
    jobs = [
        pgjobs.TaskJob(name="every", run=lambda conn: None, every="1h"),
        pgjobs.TaskJob(name="cron", run=lambda conn: None, every=None, cron="0 3 * * *"),
        pgjobs.TaskJob(name="off", run=lambda conn: None, enabled=False),
    ]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with pgjobs.Scheduler(jobs, engine) as scheduler:
        aps = scheduler._aps
        assert aps is not None
        entries = {job.id: job for job in aps.get_jobs()}
        assert set(entries) == {"pgjobs:every", "pgjobs:cron", "pgjobs:prune"}
        for entry in entries.values():
            assert entry.max_instances == 1 and entry.coalesce is True
        assert "cron[" in str(entries["pgjobs:cron"].trigger)
        assert "interval[1:00:00]" in str(entries["pgjobs:every"].trigger)
        # The library leaves signals to its host.
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert not scheduler.running


def test_jobs_run_on_their_interval_and_results_are_reported(engine: Engine) -> None:
    results: list[RunResult] = []
    three = threading.Event()

    def on_result(result: RunResult) -> None:
        results.append(result)
        if sum(r.outcome == "ran" for r in results) >= 3:
            three.set()

    job = pgjobs.TaskJob(name="fast", run=lambda conn: None, every="100ms")
    with pgjobs.Scheduler([job], engine, on_result=on_result):
        assert three.wait(WAIT)
    assert {r.job for r in results} == {"fast"}
    with engine.connect() as conn:
        ran = conn.execute(text("select count(*) from pgjobs.run where outcome = 'ran'")).scalar()
    assert ran is not None and ran >= 3


def test_a_busy_periodic_job_is_retried_after_retry_after_not_a_whole_interval(
    engine: Engine,
) -> None:
    outcomes: list[str] = []
    busy_seen = threading.Event()
    ran = threading.Event()

    def on_result(result: RunResult) -> None:
        outcomes.append(str(result.outcome))
        if result.outcome == "busy":
            busy_seen.set()
        if result.outcome == "ran":
            ran.set()

    # Interval of an hour: only the one-off retry can run it again in this test.
    job = pgjobs.TaskJob(
        name="hourly", group="g", run=lambda conn: None, every="1h", busy_retry="200ms"
    )
    with engine.connect() as holder:
        trans = holder.begin()
        holder.execute(text("select pg_advisory_xact_lock(hashtextextended('pgjobs:g', 0))"))
        with pgjobs.Scheduler([job], engine, on_result=on_result):
            assert busy_seen.wait(WAIT)
            trans.rollback()  # frees the group
            assert ran.wait(WAIT)
    assert outcomes[0] == "busy" and outcomes[-1] == "ran"
    assert set(outcomes) == {"busy", "ran"}


def test_a_job_found_not_due_by_a_hair_runs_when_it_becomes_due(engine: Engine) -> None:
    """Another replica ran the job a little late, so its next due time falls
    just after this process's tick: the job runs then, not an interval later."""
    outcomes: list[str] = []
    ran = threading.Event()

    def on_result(result: RunResult) -> None:
        outcomes.append(str(result.outcome))
        if result.outcome == "ran":
            ran.set()

    pgjobs.install(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                "insert into pgjobs.job_state (job, next_attempt_at, failures)"
                " values ('hourly', now() + interval '1.5 s', 0)"
            )
        )
    # Interval of an hour: only a retry at the due time can run it in this test.
    job = pgjobs.TaskJob(name="hourly", run=lambda conn: None, every="1h")
    with pgjobs.Scheduler([job], engine, on_result=on_result):
        assert ran.wait(WAIT)
    assert outcomes == ["not_due", "ran"]


def test_a_cron_job_records_the_next_fire_time_as_next_due(engine: Engine) -> None:
    job = pgjobs.TaskJob(name="c", run=lambda conn: None, every=None, cron="*/5 * * * *")
    scheduler = pgjobs.Scheduler([job], engine)
    before = datetime.now(UTC)
    result = scheduler.run_job("c")
    after = datetime.now(UTC)

    def next_five(t: datetime) -> datetime:
        base = t.replace(second=0, microsecond=0)
        return base + timedelta(minutes=5 - base.minute % 5)

    assert result is not None and result.outcome == "ran", result
    assert result.next_attempt_at in {next_five(before), next_five(after)}
    with engine.connect() as conn:
        stored = conn.execute(
            text("select next_attempt_at from pgjobs.job_state where job = 'c'")
        ).scalar()
    assert stored == result.next_attempt_at
    scheduler.runner.close()


def test_the_same_job_never_runs_twice_at_once_in_one_process(engine: Engine) -> None:
    inside, proceed = threading.Event(), threading.Event()

    def body(conn: Connection) -> None:
        inside.set()
        assert proceed.wait(WAIT)

    scheduler = pgjobs.Scheduler([pgjobs.TaskJob(name="slow", run=body, every="1h")], engine)
    first: list[RunResult | None] = []
    thread = threading.Thread(target=lambda: first.append(scheduler.run_job("slow")))
    thread.start()
    try:
        assert inside.wait(WAIT)
        assert scheduler.run_job("slow") is None  # the busy-retry entry would do this
    finally:
        proceed.set()
        thread.join()
    assert first[0] is not None and first[0].outcome == "ran"
    scheduler.runner.close()


def test_shutdown_waits_for_the_running_transaction(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("create table written (n int)"))
    inside, proceed = threading.Event(), threading.Event()
    order: list[str] = []

    def body(conn: Connection) -> None:
        conn.execute(text("insert into written values (1)"))
        inside.set()
        assert proceed.wait(WAIT)
        conn.execute(text("insert into written values (2)"))

    scheduler = pgjobs.Scheduler(
        [pgjobs.TaskJob(name="writer", run=body, every="1h")],
        engine,
        on_result=lambda result: order.append(f"committed:{result.outcome}"),
    )
    scheduler.start()
    assert inside.wait(WAIT)

    def stop() -> None:
        scheduler.shutdown(wait=True)
        order.append("shutdown returned")

    stopper = threading.Thread(target=stop)
    stopper.start()
    wait_until(lambda: not scheduler.running)  # shutdown has begun while the job is mid-write
    proceed.set()
    stopper.join(WAIT)
    assert order == ["committed:ran", "shutdown returned"]
    with engine.connect() as conn:
        assert conn.execute(text("select array_agg(n order by n) from written")).scalar() == [1, 2]


def test_old_runs_are_pruned_periodically(engine: Engine) -> None:
    job = pgjobs.TaskJob(name="t", run=lambda conn: None)
    for _ in range(3):
        assert pgjobs.run_once(job, engine, force=True).outcome == "ran"

    def count() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("select count(*) from pgjobs.run")).scalar() or 0)

    assert count() == 3
    with pgjobs.Scheduler([], engine, keep_runs="0s", prune_every="100ms"):
        wait_until(lambda: count() == 0)


def test_bad_settings_are_config_errors(engine: Engine) -> None:
    job = pgjobs.TaskJob(name="t", run=lambda conn: None)
    with pytest.raises(pgjobs.ConfigError, match="timezone"):
        pgjobs.Scheduler([job], engine, timezone="Nowhere/Else")
    with pytest.raises(pgjobs.ConfigError, match="prune_every: must be positive"):
        pgjobs.Scheduler([job], engine, prune_every=0)
    with pytest.raises(pgjobs.ConfigError, match="registered twice"):
        pgjobs.Scheduler([job, job], engine)
    with pytest.raises(pgjobs.ConfigError, match="cron"):
        pgjobs.Scheduler([job.replace(every=None, cron="61 * * * *")], engine)


def test_a_strict_start_checks_the_jobs_before_writing_anything(engine: Engine) -> None:
    job = pgjobs.RecomputeJob(name="r", target="missing_table", compute="select 1")
    scheduler = pgjobs.Scheduler([job], engine, strict=True)
    with pytest.raises(pgjobs.ConfigError, match="table 'missing_table' does not exist"):
        scheduler.start()
    assert not scheduler.running
    with engine.connect() as conn:
        assert not conn.execute(
            text("select exists (select from pg_namespace where nspname = 'pgjobs')")
        ).scalar()


def test_from_config_uses_the_files_settings(db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        f'database = "{db_url}"\nnamespace = "shop"\nschema = "jobs"\n'
        "keep_runs = '2d'\n\n[jobs.cleanup]\nkind = 'task'\nsql = 'select 1'\nevery = '1h'\n"
    )
    scheduler = pgjobs.Scheduler.from_config(path)
    assert list(scheduler.jobs) == ["cleanup"]
    assert scheduler.runner.namespace == "shop" and scheduler.runner.store.schema == "jobs"
    assert scheduler.keep_runs == timedelta(days=2)
    result = scheduler.run_job("cleanup")
    assert result is not None and result.outcome == "ran", result
    scheduler.runner.close()


def test_lifespan_as_an_async_context_manager(engine: Engine) -> None:
    ran = threading.Event()
    job = pgjobs.TaskJob(name="t", run=lambda conn: ran.set(), every="1h")
    scheduler = pgjobs.Scheduler([job], engine)

    async def main() -> None:
        async with pgjobs.lifespan(scheduler) as state:
            assert state["pgjobs"] is scheduler and scheduler.running
            assert await asyncio.to_thread(ran.wait, WAIT)
        assert not scheduler.running

    asyncio.run(main())


# Starlette's TestClient warns about its own httpx dependency; nothing of pgjobs'.
@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient` is deprecated")
def test_lifespan_in_a_fastapi_app(db_url: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    path = tmp_path / "pgjobs.toml"
    path.write_text(f'database = "{db_url}"\n\n[jobs.hello]\nkind = "task"\nsql = "select 1"\n')
    app = FastAPI(lifespan=pgjobs.lifespan(path))

    @app.get("/jobs")
    def jobs(request: Request) -> dict[str, object]:
        scheduler = request.state.pgjobs
        return {"running": scheduler.running, "jobs": list(scheduler.jobs)}

    with TestClient(app) as client:
        assert client.get("/jobs").json() == {"running": True, "jobs": ["hello"]}
