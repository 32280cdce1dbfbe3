"""Flow in any process layout (docs/flow.md): a recompute learns its queue
workers' scope from their records in ``pgjobs.flow_worker`` (migration
010), not from a registry it shares with them.

The scripted interleavings of tests/test_flow.py (R1, R2, R7) run again
with a recompute that knows nothing of its workers; then the edge cases
(no record, a conflict, a stale record, two versions at once, a worker
that records itself during the run); last the must-show: ``pgjobs run``
in a subprocess with only the queue job, the recompute in this process
with no registry at all, items enqueued during a 4 s compute processed
within 1 s, and the strict check exact with no extra recompute.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from test_flow import DERIVE, SCHEMA, WAIT, Case, X, r1, r2, r7, ran

import pgjobs
import pgjobs.flow
import pgjobs.recompute

FLOW_LOG = "pgjobs.flow"


@pytest.fixture(autouse=True)
def _fresh_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # what this process has said already (once per process and job)
    monkeypatch.setattr(pgjobs.flow, "_told", {})


@pytest.fixture
def apart(engine: Engine) -> Iterator[Case]:
    """test_flow's case, with a recompute that knows nothing of its workers
    (no worker_scope: no registry put it there), the worker recorded as its
    scheduler records it when it starts, in another Runner."""
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    c = Case(engine)
    c.recompute = c.recompute.replace(worker_scope=None)
    record(engine, c.worker)
    with pgjobs.Runner(engine) as runner:
        first = runner.tick(c.recompute, force=True)
    assert first.outcome == "ran" and first.detail["flow"] == "on"
    assert c.wrong() == []
    yield c
    c.pool.shutdown(wait=True)


def record(engine: Engine, *jobs: pgjobs.QueueJob, namespace: str = "pgjobs") -> None:
    """What a scheduler does for its queue jobs when it starts."""
    with engine.connect() as conn:
        pgjobs.flow.renew(conn, jobs, namespace, "pgjobs")


def records(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(text("select * from pgjobs.flow_worker order by job, scope"))
        return [dict(r._mapping) for r in rows]


def age(engine: Engine, minutes: float, **where: Any) -> None:
    """Make records look ``minutes`` old (their worker stopped renewing
    them), and this process's notes of the records its ticks sent as old
    (time passed for them too: see pgjobs.flow.record_for_tick)."""
    for key in pgjobs.flow._recorded:
        pgjobs.flow._recorded[key] -= minutes * 60
    cond = " and ".join(f"{k} = :{k}" for k in where) or "true"
    with engine.begin() as conn:
        conn.execute(
            text(
                "update pgjobs.flow_worker set seen_at = clock_timestamp()"
                f" - make_interval(secs => :s) where {cond}"
            ),
            {"s": minutes * 60, **where},
        )


def flow_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == FLOW_LOG and r.levelno == level]


# -- R1, R2, R7 with the recompute apart ---------------------------------------------------------
def test_r1_apart(apart: Case) -> None:
    result = r1(apart)
    assert result.detail["flow"] == "on" and result.detail["excluded"] == 2
    assert apart.wrong() == []


def test_r2_apart(apart: Case) -> None:
    result = r2(apart)
    assert result.detail["flow"] == "on" and result.detail["excluded"] == 2
    assert apart.wrong() == []


def test_r7_apart(apart: Case) -> None:
    result = r7(apart)
    assert result.detail["flow"] == "on" and result.detail["excluded"] == 2
    assert apart.wrong() == []


# -- what the workers record ---------------------------------------------------------------------
def test_a_tick_records_its_job_once_per_fresh_period(
    apart: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_once of a bare queue job (no scheduler) records it; a tick while
    that record is fresh writes nothing, and within FRESH / 2 of the
    committed tick that sent it this process sends no statement at all."""
    sent: list[str] = []
    record_query = pgjobs.flow.record_query

    def spy(job: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(job.name)
        return record_query(job, *args, **kwargs)

    monkeypatch.setattr(pgjobs.flow, "record_query", spy)
    with apart.engine.begin() as conn:
        conn.execute(text("delete from pgjobs.flow_worker"))
    pgjobs.flow._recorded.clear()  # a new process: it sent none
    apart.change(X)
    ran(apart.start_worker())
    assert sent == ["w"]
    (first,) = records(apart.engine)
    assert (first["job"], first["grp"], first["scope"], first["flow"]) == (
        "w",
        "g",
        ["item_id"],
        True,
    )
    assert first["target"] == "public.derived" and first["worker"] == pgjobs.flow.WORKER
    apart.change(X)
    ran(apart.start_worker())
    assert records(apart.engine) == [first]  # same xid, same seen_at
    assert sent == ["w"]  # the committed first tick was seconds ago: not asked again
    age(apart.engine, 0.75)  # past FRESH / 2 here, still fresh there: asked, writes nothing
    apart.change(X)
    ran(apart.start_worker())
    assert sent == ["w", "w"] and records(apart.engine)[0]["xid"] == first["xid"]
    age(apart.engine, 2)  # older than FRESH: the next tick renews it
    apart.change(X)
    ran(apart.start_worker())
    (renewed,) = records(apart.engine)
    assert renewed["xid"] != first["xid"]


def test_a_tick_never_waits_for_the_recompute_that_prunes_its_record(apart: Case) -> None:
    """The worker's only record is 2 h old, written by the very server
    session its next tick runs on: a recompute (flow by its registry's
    worker_scope) deletes it, but in its commit's round trip, under the
    write lock; a tick during the compute renews the row at once, without
    waiting, and the recompute then keeps it (no longer old)."""
    one = create_engine(apart.engine.url, pool_size=1, max_overflow=0)
    try:
        with one.connect() as conn:
            backend = conn.execute(text("select pg_backend_pid()")).scalar_one()
        with apart.engine.begin() as conn:
            conn.execute(
                text(
                    "update pgjobs.flow_worker set backend = :b,"
                    " seen_at = clock_timestamp() - interval '2 hours'"
                ),
                {"b": backend},
            )
        believes = apart.recompute.replace(worker_scope=("item_id",))
        apart.points.stop_at("R:computed")

        def run() -> pgjobs.RunResult:
            with pgjobs.Runner(apart.engine) as runner:
                return runner.tick(believes, force=True, progress=apart.progress)

        r = apart.pool.submit(run)
        apart.points.wait("R:computed")
        apart.change(X)
        with pgjobs.Runner(one) as runner:  # lock_timeout 200 ms: a wait would fail it
            assert runner.tick(apart.worker.replace(lock_timeout="200ms"), force=True).ok
        apart.points.release("R:computed")
        assert ran(r).detail["flow"] == "on"
    finally:
        one.dispose()
    (renewed,) = records(apart.engine)
    assert renewed["backend"] == backend
    assert apart.wrong() == []


# -- when the recompute cannot know ---------------------------------------------------------------
def blocked_worker_tick(c: Case, recompute: pgjobs.RecomputeJob) -> tuple[str, pgjobs.RunResult]:
    """A worker tick while ``recompute`` computes: its outcome, and the
    recompute's result."""
    c.points.stop_at("R:computed")

    def run() -> pgjobs.RunResult:
        with pgjobs.Runner(c.engine) as runner:
            return runner.tick(recompute, force=True, progress=c.progress)

    r = c.pool.submit(run)
    c.points.wait("R:computed")
    c.change(X)
    quick = c.worker.replace(lock_timeout="200ms")  # waits for the write lock that long
    with pgjobs.Runner(c.engine) as runner:
        tried = runner.tick(quick, force=True)
    c.points.release("R:computed")
    return str(tried.outcome), ran(r)


def test_no_record_says_so_once_and_runs_without_flow(
    apart: Case, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's record is 10 min old (its scheduler stopped, say): the
    recompute cannot know, says so once (a warning naming the record and
    what to do), and holds the write lock: a worker tick is busy."""
    age(apart.engine, 10)
    caplog.set_level(logging.INFO, logger=FLOW_LOG)
    outcome, result = blocked_worker_tick(apart, apart.recompute)
    assert result.detail["flow"] == "unknown" and outcome == "busy"
    with pgjobs.Runner(apart.engine) as runner:
        assert runner.tick(apart.recompute, force=True).detail["flow"] == "unknown"
    (line,) = flow_lines(caplog, logging.WARNING)
    assert "r: runs WITHOUT flow" in line and "group 'g'" in line
    assert "w (scope (item_id), group 'g') on " in line and "10 min ago" in line
    assert "docs/flow.md" in line
    apart.drain()
    assert apart.wrong() == []


def test_a_recompute_alone_says_nothing(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """No record and no mark of any worker: most likely there is none (the
    usual recompute), and without one flow changes nothing: a debug line."""
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    caplog.set_level(logging.DEBUG, logger=FLOW_LOG)
    job = pgjobs.RecomputeJob(name="lone", target="derived", compute=DERIVE)
    for _ in range(2):
        assert pgjobs.run_once(job, engine, force=True).detail["flow"] == "no workers"
    assert flow_lines(caplog, logging.WARNING) == flow_lines(caplog, logging.INFO) == []
    (line,) = flow_lines(caplog, logging.DEBUG)
    assert "lone: runs without flow: no queue worker of its target is known" in line


def test_a_worker_with_another_scope_than_the_registry_believes(
    apart: Case, caplog: pytest.LogCaptureFixture
) -> None:
    """The recompute's process registers the queue job with scope (item_id);
    the worker that runs records (item_id, n): a conflict, said once, and the
    run holds the write lock (exact, no flow)."""
    with apart.engine.begin() as conn:
        conn.execute(text("delete from pgjobs.flow_worker"))
    record(apart.engine, apart.worker.replace(scope=("item_id", "n")))
    believes = apart.recompute.replace(worker_scope=("item_id",))
    caplog.set_level(logging.WARNING, logger=FLOW_LOG)
    outcome, result = blocked_worker_tick(apart, believes)
    assert result.detail["flow"] == "conflict" and outcome == "busy"
    (line,) = flow_lines(caplog, logging.WARNING)
    assert "disagree on the scope" in line and "w (scope (item_id, n)" in line
    assert "this process registers its queue jobs with scope (item_id)" in line


def test_a_worker_of_another_group_or_without_flow_is_a_conflict(apart: Case) -> None:
    for other, says in (
        (apart.worker.replace(name="w2", group="h"), "another write lock than"),
        (apart.worker.replace(name="w3", flow=False), "has flow = false"),
    ):
        record(apart.engine, other)
        plan = read(apart)
        assert plan.state == "conflict" and says in plan.reason, plan
        with apart.engine.begin() as conn:
            conn.execute(text("delete from pgjobs.flow_worker where job = :j"), {"j": other.name})
    assert read(apart).state == "on"


def read(c: Case) -> pgjobs.flow.FlowPlan:
    with c.engine.connect() as conn, conn.begin():
        return pgjobs.flow.read_plan(conn, c.recompute, "pgjobs", "pgjobs")


def test_two_versions_during_a_deploy_then_the_old_record_ages_out(apart: Case) -> None:
    """v1 of the plugin (scope item_id) and v2 (scope item_id, n) both run:
    no flow. Once v1's last record is older than STALE, v2's scope is the
    plan; a record older than PRUNE_AFTER is deleted by the next recompute."""
    v2 = apart.worker.replace(scope=("item_id", "n"))
    record(apart.engine, v2)
    assert read(apart).state == "conflict"
    age(apart.engine, 6, scope=["item_id"])  # v1 stopped 6 min ago
    plan = read(apart)
    assert plan.state == "on" and plan.scope == ("item_id", "n")
    age(apart.engine, 2 * 60, scope=["item_id"])  # 2 h: past PRUNE_AFTER
    with pgjobs.Runner(apart.engine) as runner:
        assert runner.tick(apart.recompute, force=True).outcome == "ran"
    assert [r["scope"] for r in records(apart.engine)] == [["item_id", "n"]]


def test_a_worker_that_records_itself_during_the_run_makes_it_give_up(
    apart: Case, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan had flow (scope item_id). During the compute a worker with
    flow off (another process's version of the job) rewrites X without a
    mark, and records itself: the recompute sees the record after its write
    lock and gives up (busy) instead of overwriting X with its older rows.
    The next run has no flow; after draining, with no extra recompute, every
    item is exact."""
    apart.change(X, enqueue=False)  # drift of X: in R's difference
    apart.points.stop_at("R:computed")
    r = apart.start_recompute()
    apart.points.wait("R:computed")
    apart.change(X)
    unmarked = apart.worker.replace(flow=False)
    with pgjobs.Runner(apart.engine) as runner:
        assert runner.tick(unmarked, force=True).outcome == "ran"
    apart.points.release("R:computed")
    gave_up = r.result(WAIT)
    assert gave_up.outcome == "busy" and gave_up.retry_after is not None
    assert apart.wrong() == []  # X as the worker wrote it
    with pgjobs.Runner(apart.engine) as runner:
        assert runner.tick(apart.recompute, force=True).detail["flow"] == "conflict"
    apart.drain()
    assert apart.wrong() == []
    (line,) = flow_lines(caplog, logging.WARNING)  # once, for the next run
    assert "has flow = false" in line
    gave = [r.getMessage() for r in caplog.records if "gives up this run" in r.getMessage()]
    assert len(gave) == 1 and "w (scope (item_id), group 'g', flow = false)" in gave[0]


def test_records_that_change_between_the_work_check_and_s0_give_the_run_up(
    apart: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work check planned flow; a worker of another scope records itself
    before S0: the S0 statement sees it, and the run gives up before it
    computes. The next run plans again: a conflict, without flow."""
    original = pgjobs.recompute.read_plan

    def then_a_worker_records(conn: Any, job: Any, namespace: str, schema: str) -> Any:
        plan = original(conn, job, namespace, schema)
        record(apart.engine, apart.worker.replace(name="w9", scope=("item_id", "n")))
        return plan

    monkeypatch.setattr(pgjobs.recompute, "read_plan", then_a_worker_records)
    with pgjobs.Runner(apart.engine) as runner:
        gave_up = runner.tick(apart.recompute, force=True)
        assert gave_up.outcome == "busy"
        monkeypatch.setattr(pgjobs.recompute, "read_plan", original)
        again = runner.tick(apart.recompute, force=True)
    assert again.outcome == "ran" and again.detail["flow"] == "conflict"


# -- the must-show: a scheduler with only the queue job, the recompute in another process ---------
PLUGIN = """
import json

from sqlalchemy import create_engine, text

import pgjobs

DERIVE = {derive!r}


def after(conn, keys, stats):
    conn.execute(text("select pg_notify('apart', :k)"), {{"k": json.dumps([k[0] for k in keys])}})


@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(
        pgjobs.QueueJob(
            name="w", group="g", target="derived", scope="item_id", every="1s",
            compute=DERIVE + " where item_id = any(:keys)", after=after,
        )
    )
"""

ITEMS = 200
COMPUTE_SECONDS = 4.0


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def test_a_scheduler_with_only_the_queue_job_and_a_recompute_elsewhere(
    engine: Engine, db_url: str, tmp_path: Path
) -> None:
    """``pgjobs run`` (a subprocess) has only the queue job; this process
    runs the recompute with ``pgjobs.run_once`` on a bare job (no registry,
    no worker_scope). Items changed and enqueued during its 4 s compute
    are processed within 1 s each; the recompute runs with flow, leaves
    them out, and repairs the drift; after draining, with no extra
    recompute, the target equals a from-scratch derivation."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "create table item (id int primary key);"
            "create table source (item_id int not null references item on delete cascade,"
            " n int not null, v int not null, primary key (item_id, n));"
            "create table derived (item_id int not null references item on delete cascade,"
            " n int not null, v int not null, primary key (item_id, n));"
            f"insert into item select generate_series(1, {ITEMS});"
            f"insert into source select i, n, 1 from generate_series(1, {ITEMS}) i,"
            " generate_series(1, 2) n;"
            f"insert into derived {DERIVE};"
            "update source set v = 7 where item_id <= 10;"  # drift: only a recompute repairs it
        )
    pgjobs.install(engine)
    module = f"apart_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PLUGIN.format(derive=DERIVE)))
    config = tmp_path / "pgjobs.toml"
    config.write_text(f'plugins = ["{module}"]\n')
    env = {**os.environ, "PGJOBS_DATABASE_URL": db_url, "PGJOBS_LOAD_PLUGINS": ""}
    err = (tmp_path / "run.err").open("w+")
    proc = subprocess.Popen(
        [*pgjobs_command(), "run", "-c", str(config)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        lags, result = _scenario(engine, db_url, proc)
        assert proc.poll() is None, "pgjobs run died"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        err.seek(0)
        stderr = err.read()
        err.close()
    assert code == 0 and "Traceback" not in stderr, stderr
    ordered = sorted(lags)
    print(
        f"\napart: {len(lags)} items during the compute, lag p50"
        f" {ordered[len(ordered) // 2] * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms"
    )
    assert len(lags) >= 10
    assert max(lags) < 1.0, lags
    assert result.outcome == "ran" and result.detail["flow"] == "on", result
    assert result.compute_seconds >= COMPUTE_SECONDS
    assert result.detail["excluded"] > 0  # the items the worker rewrote meanwhile
    assert result.stats.updated >= 20  # the drift (10 items x 2 rows), repaired
    with engine.connect() as conn:
        pending = conn.execute(text("select count(*) from pgjobs.queue")).scalar_one()
        recomputes = conn.execute(
            text("select count(*) from pgjobs.run where job = 'r' and outcome = 'ran'")
        ).scalar_one()
        wrong = conn.execute(
            text(
                f"select count(*) from ((select * from derived except ({DERIVE}))"
                f" union all (({DERIVE}) except select * from derived)) d"
            )
        ).scalar_one()
    assert (pending, recomputes, wrong) == (0, 1, 0)


def _scenario(
    engine: Engine, db_url: str, proc: subprocess.Popen[bytes]
) -> tuple[list[float], pgjobs.RunResult]:
    """The recompute computes (blocked) while items are changed and
    enqueued one after another, each waited for by its notification."""
    computing, release = threading.Event(), threading.Event()

    def compute(conn: Any) -> list[tuple[Any, ...]]:
        rows = [tuple(r) for r in conn.execute(text(DERIVE))]
        computing.set()
        assert release.wait(WAIT)
        return rows

    recompute = pgjobs.RecomputeJob(name="r", group="g", target="derived", compute=compute)
    plain = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as listen:
        listen.execute("listen apart")
        _wait_for_the_workers_record(engine, proc)
        box: list[pgjobs.RunResult] = []
        thread = threading.Thread(
            target=lambda: box.append(pgjobs.run_once(recompute, engine, force=True))
        )
        thread.start()
        try:
            assert computing.wait(WAIT)
            started = time.monotonic()
            lags = []
            item = 10
            while time.monotonic() - started < COMPUTE_SECONDS:
                item += 1
                with engine.begin() as conn:
                    conn.execute(
                        text("update source set v = v + 1 where item_id = :i"), {"i": item}
                    )
                    pgjobs.enqueue(conn, "w", [item])
                committed = time.monotonic()
                lags.append(_processed(listen, item) - committed)
                threading.Event().wait(0.1)  # the users' pace, not an ordering claim
        finally:
            release.set()
            thread.join(WAIT)
    return lags, box[0]


def _processed(listen: psycopg.Connection[Any], item: int) -> float:
    """When the worker's commit that processed ``item`` was notified (at most 2 s)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        for note in listen.notifies(timeout=deadline - time.monotonic(), stop_after=1):
            if item in json.loads(note.payload):
                return time.monotonic()
    raise AssertionError(f"item {item} not processed within 2 s")


def _wait_for_the_workers_record(engine: Engine, proc: subprocess.Popen[bytes]) -> None:
    """Until ``pgjobs run`` started and recorded its queue job (bounded):
    the scheduler's own record, at its start (its ticks so far found no
    item, and a tick with nothing to do takes no lock and records nothing)."""
    with engine.connect() as conn:
        for _ in range(600):
            assert proc.poll() is None, "pgjobs run exited"
            found = conn.execute(text("select job, scope, worker from pgjobs.flow_worker")).all()
            conn.rollback()
            if found:
                assert [tuple(r) for r in found] == [
                    ("w", ["item_id"], f"{socket.gethostname()}:{proc.pid}")
                ]
                return
            threading.Event().wait(0.05)
    raise AssertionError("pgjobs run never recorded its queue job")
