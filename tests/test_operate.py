"""Operating a running pgjobs (docs/operate.md), each against a real
``pgjobs run`` in another process: pre-flight isolation, the shutdown
deadline, pause and resume, enqueue and revive from the CLI, heartbeats.

Every wait polls the database (or the process) with a bound; none is a
fixed sleep standing in for an ordering."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import Engine

from pgjobs.cli import cli
from pgjobs.serve import Request, Source
from pgjobs.web import StatusPage

WAIT = 30.0  # the bound of every wait; never reached when things work


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def scalar(engine: Engine, query: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(query), params).scalar()


class Run:
    """``pgjobs run -c CONFIG ARGS...`` in a process of its own."""

    def __init__(self, config: Path, db_url: str, *args: str) -> None:
        self.err_path = config.parent / f"run-{uuid.uuid4().hex[:6]}.err"
        self._err = open(self.err_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PGJOBS_DATABASE_URL": db_url, "PGJOBS_LOAD_PLUGINS": ""}
        self.proc = subprocess.Popen(
            [*pgjobs_command(), "run", "-c", str(config), *args],
            cwd=config.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
        )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def running(self) -> bool:
        assert self.proc.poll() is None, f"pgjobs run exited early:\n{self.stderr}"
        return "pgjobs: running" in self.stderr

    def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._err.close()


@pytest.fixture
def start(tmp_path: Path, db_url: str) -> Iterator[Callable[..., Run]]:
    """Start ``pgjobs run`` processes on the test's database; all are
    stopped at the end."""
    runs: list[Run] = []

    def starter(config: Path, *args: str) -> Run:
        run = Run(config, db_url, *args)
        runs.append(run)
        wait_until(run.running, "pgjobs run started")
        return run

    yield starter
    for run in runs:
        run.stop(signal.SIGKILL)


def invoke(db_url: str, *args: str) -> Any:
    """A ``pgjobs`` command in this process (the CLI's own code path)."""
    return CliRunner().invoke(cli, [*args, "--database", db_url], catch_exceptions=False)


def status(db_url: str, config: Path) -> dict[str, Any]:
    result = invoke(db_url, "status", "--json", "-c", str(config))
    assert result.exit_code in (0, 1), result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def job_row(data: dict[str, Any], name: str) -> dict[str, Any]:
    (row,) = [r for r in data["jobs"] if r["job"] == name]
    return row


# -- pre-flight isolation ---------------------------------------------------------------
PREFLIGHT = """
[jobs.good]
kind = "recompute"
target = "good_t"
sql = "select id, v from src"
every = "1s"

[jobs.broken]
kind = "recompute"
target = "broken_t"
sql = "select id, v from src"
every = "1s"
backoff = "1s"
"""


def test_a_job_whose_table_is_missing_is_set_aside_and_runs_once_it_exists(
    engine: Engine, db_url: str, tmp_path: Path, start: Callable[..., Run]
) -> None:
    with engine.begin() as conn:
        conn.execute(text("create table src (id int primary key, v int not null)"))
        conn.execute(text("insert into src select g, g * 10 from generate_series(1, 5) g"))
        conn.execute(text("create table good_t (id int primary key, v int not null)"))
    config = tmp_path / "pgjobs.toml"
    config.write_text(PREFLIGHT)
    run = start(config)
    # the other job runs
    wait_until(lambda: scalar(engine, "select count(*) from good_t") == 5, "good ran")
    # the broken one: one line, failing with its reason, backed off
    reason = "table 'broken_t' does not exist"
    lines = [line for line in run.stderr.splitlines() if "pre-flight" in line]
    assert lines and reason in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    data = status(db_url, config)
    broken = job_row(data, "broken")
    assert broken["failures"] >= 1 and reason in broken["last_error"], broken
    assert "pre-flight check" in broken["last_error"]
    assert job_row(data, "good")["failures"] == 0
    assert invoke(db_url, "status", "-c", str(config)).exit_code == 1  # a job is failing
    # ... on the status page and in the metrics
    source = Source(engine=engine)
    page = StatusPage()(source, Request(path="/")).body.decode()
    assert "broken" in page and "broken_t" in page and "does not exist" in page
    from pgjobs.metrics import Metrics

    metrics = Metrics(cache_seconds=0).bind(source).exposition().decode()
    assert 'pgjobs_job_failures{job="broken"}' in metrics
    failures = [
        line
        for line in metrics.splitlines()
        if line.startswith('pgjobs_job_failures{job="broken"}')
    ]
    assert float(failures[0].split()[-1]) >= 1, failures
    # ... checked again after its backoff: it runs once its table exists
    with engine.begin() as conn:
        conn.execute(text("create table broken_t (id int primary key, v int not null)"))
    wait_until(lambda: scalar(engine, "select count(*) from broken_t") == 5, "broken ran")
    assert job_row(status(db_url, config), "broken")["failures"] == 0
    assert "broken: passes its pre-flight check now" in run.stderr
    assert run.stop() == 0, run.stderr


# -- the shutdown deadline ---------------------------------------------------------------
SLOW_PLUGIN = """
from sqlalchemy import text

import pgjobs


def slow(conn):
    conn.execute(text("insert into written (id) values (1)"))
    conn.execute(text("select pg_sleep(30) /* pgjobs-test-slow */"))


@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.TaskJob(name="slow", every="1h", run=slow, backoff="1h"))
"""


def plugin(tmp_path: Path, source: str) -> Path:
    module = f"opjobs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    config = tmp_path / "pgjobs.toml"
    config.write_text(f'plugins = ["{module}"]\n')
    return config


SLOW_QUERY = (
    "select count(*) from pg_stat_activity where query like '%pgjobs-test-slow%'"
    " and pid <> pg_backend_pid()"
)


def test_a_shutdown_deadline_cancels_the_running_statement_and_rolls_back(
    engine: Engine, db_url: str, tmp_path: Path, start: Callable[..., Run]
) -> None:
    with engine.begin() as conn:
        conn.execute(text("create table written (id int primary key)"))
    config = plugin(tmp_path, SLOW_PLUGIN)
    run = start(config, "--shutdown-timeout", "2s")
    wait_until(
        lambda: scalar(
            engine, SLOW_QUERY.replace("count(*)", "count(*) filter (where state = 'active')")
        ),
        "the 30 s statement running",
    )
    began = time.monotonic()
    code = run.stop(signal.SIGTERM)
    took = time.monotonic() - began
    print(f"SIGTERM to exit, --shutdown-timeout 2s: {took:.2f} s")
    assert code == 0, run.stderr
    assert took < 3.0, (took, run.stderr)
    assert scalar(engine, SLOW_QUERY) == 0  # the statement is gone from the server
    assert scalar(engine, "select count(*) from written") == 0  # rolled back
    assert "slow: cancelled by the shutdown deadline" in run.stderr, run.stderr
    with engine.connect() as conn:
        outcomes = conn.execute(text("select outcome from pgjobs.run where job = 'slow'")).all()
        state = conn.execute(
            text(
                "select failures, next_attempt_at > now() from pgjobs.job_state where job = 'slow'"
            )
        ).first()
    assert [o for (o,) in outcomes] == ["cancelled"]
    assert state is None or state[0] == 0  # not a failure: no backoff


# -- enqueue, pause, resume, revive ----------------------------------------------------
QUEUE = """
heartbeat_every = "500ms"

[jobs.scores]
kind = "queue"
target = "item_score"
scope = ["item_id"]
sql = \"\"\"
select i.id as item_id, g.n, i.factor * g.n / (case when i.broken then 0 else 1 end) as v
from item i, generate_series(1, 3) as g(n) where i.id = any(:keys)
\"\"\"
every = "1s"
max_attempts = 2
item_backoff = "100ms"
"""

ITEMS = """
create table item (id int primary key, factor int not null, broken bool not null default false);
create table item_score (
    item_id int not null references item on delete cascade,
    n int not null,
    v int not null,
    primary key (item_id, n)
);
insert into item (id, factor) select g, g from generate_series(1, 9) g;
"""


@pytest.fixture
def queue_config(engine: Engine, tmp_path: Path) -> Path:
    with engine.begin() as conn:
        conn.exec_driver_sql(ITEMS)
    config = tmp_path / "pgjobs.toml"
    config.write_text(QUEUE)
    return config


def scores(engine: Engine, item: int) -> int:
    return int(scalar(engine, "select count(*) from item_score where item_id = :i", i=item))


def queued(engine: Engine) -> list[tuple[Any, bool]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("select key, dead_at is not null from pgjobs.queue order by key")
        ).all()
    return [(key, dead) for key, dead in rows]


def test_an_item_enqueued_from_the_cli_is_processed_by_the_running_scheduler(
    engine: Engine, db_url: str, queue_config: Path, start: Callable[..., Run]
) -> None:
    start(queue_config)
    result = invoke(db_url, "enqueue", "scores", "1", "2", "2", "-c", str(queue_config))
    assert result.exit_code == 0, result.output
    assert "2 item(s) enqueued (2 added, 0 revived); 0 pending already" in result.output
    wait_until(lambda: scores(engine, 1) == 3 and scores(engine, 2) == 3, "items processed")
    assert queued(engine) == []


def test_enqueue_takes_json_keys_and_names_bad_input(
    engine: Engine, db_url: str, queue_config: Path
) -> None:
    bad = invoke(db_url, "enqueue", "scores", "x", "-c", str(queue_config))
    assert bad.exit_code == 2 and "'x' is not a value of item_score.item_id" in bad.output
    bad = invoke(db_url, "enqueue", "scores", "--json", "[1, 2]", "-c", str(queue_config))
    assert bad.exit_code == 2 and "expected 1 scope value(s) per key" in bad.output
    good = invoke(
        db_url, "enqueue", "scores", "--json", "[3]", '{"item_id": 4}', "-c", str(queue_config)
    )
    assert good.exit_code == 0 and "2 item(s) enqueued (2 added" in good.output, good.output
    again = invoke(db_url, "enqueue", "scores", "3", "-c", str(queue_config))
    assert "0 item(s) enqueued (0 added, 0 revived); 1 pending already" in again.output
    # typed by the scope column: the application's int key and the CLI's text are one item
    import pgjobs

    with engine.begin() as conn:
        assert pgjobs.enqueue(conn, "scores", [8]) == 1
    same = invoke(db_url, "enqueue", "scores", "8", "-c", str(queue_config))
    assert "1 pending already" in same.output, same.output
    assert [key for key, _ in queued(engine)] == [[3], [4], [8]]


def test_pause_is_honoured_at_the_next_tick_and_resume_drains_the_queue(
    engine: Engine, db_url: str, queue_config: Path, start: Callable[..., Run]
) -> None:
    run = start(queue_config, "-v")
    wait_until(lambda: "scores: idle" in run.stderr, "a first tick")
    paused = invoke(db_url, "pause", "scores", "--reason", "backfill", "-c", str(queue_config))
    assert paused.exit_code == 0 and "paused scores (backfill)" in paused.output, paused.output
    ticks = run.stderr.count("scores: paused")
    assert (
        invoke(db_url, "enqueue", "scores", "1", "2", "3", "-c", str(queue_config)).exit_code == 0
    )
    # the tick that the enqueue woke (or the next poll) is paused: nothing processed
    wait_until(lambda: run.stderr.count("scores: paused") > ticks, "a paused tick")
    assert [key for key, _ in queued(engine)] == [[1], [2], [3]]
    assert scalar(engine, "select count(*) from item_score") == 0
    data = status(db_url, queue_config)
    pause = job_row(data, "scores")["paused"]
    assert pause["reason"] == "backfill" and pause["since"] and "@" in pause["by"], pause
    text_status = invoke(db_url, "status", "-c", str(queue_config))
    assert text_status.exit_code == 0  # paused is not failing
    assert "scores: paused since" in text_status.output and "backfill" in text_status.output
    page = StatusPage()(Source(engine=engine), Request(path="/")).body.decode()
    assert "backfill" in page and "paused" in page
    from pgjobs.metrics import Metrics

    metrics = Metrics(cache_seconds=0).bind(Source(engine=engine)).exposition().decode()
    assert 'pgjobs_job_paused{job="scores"} 1.0' in metrics
    assert 'pgjobs_job_paused_since_timestamp_seconds{job="scores"}' in metrics
    # once says so, and --force runs it anyway
    once = invoke(db_url, "once", "scores", "-c", str(queue_config))
    assert once.exit_code == 1 and "scores: paused since" in once.output, once.output
    assert "--force runs this tick anyway" in once.output
    assert scalar(engine, "select count(*) from item_score") == 0
    # resume: the running scheduler drains what waited
    resumed = invoke(db_url, "resume", "scores", "-c", str(queue_config))
    assert resumed.exit_code == 0 and "resumed scores" in resumed.output, resumed.output
    wait_until(lambda: queued(engine) == [], "the queue drained")
    assert [scores(engine, i) for i in (1, 2, 3)] == [3, 3, 3]
    assert job_row(status(db_url, queue_config), "scores")["paused"] is None
    assert "was not paused" in invoke(db_url, "resume", "scores", "-c", str(queue_config)).output
    forced_pause = invoke(db_url, "pause", "scores", "-c", str(queue_config))
    assert forced_pause.exit_code == 0
    invoke(db_url, "enqueue", "scores", "4", "-c", str(queue_config))
    forced = invoke(db_url, "once", "scores", "--force", "-c", str(queue_config))
    assert forced.exit_code == 0 and "scores: ran" in forced.output, forced.output
    assert scores(engine, 4) == 3


def test_a_dead_item_is_processed_again_after_its_fix_and_revive(
    engine: Engine, db_url: str, queue_config: Path, start: Callable[..., Run]
) -> None:
    with engine.begin() as conn:
        conn.execute(text("update item set broken = true where id = 7"))
    start(queue_config)
    invoke(db_url, "enqueue", "scores", "6", "7", "-c", str(queue_config))
    wait_until(lambda: queued(engine) == [([7], True)], "item 7 dead after max_attempts")
    assert scores(engine, 6) == 3 and scores(engine, 7) == 0
    assert scalar(engine, "select attempts from pgjobs.queue where key = '[7]'") == 2
    # revived before its fix, it dies again (attempts reset, then max_attempts again)
    dead_at = scalar(engine, "select dead_at from pgjobs.queue where key = '[7]'")
    assert (
        "revived 1 dead item(s)"
        in invoke(db_url, "revive", "scores", "7", "-c", str(queue_config)).output
    )
    wait_until(
        lambda: scalar(
            engine, "select dead_at > :d from pgjobs.queue where key = '[7]'", d=dead_at
        ),
        "item 7 dead again",
    )
    assert scores(engine, 7) == 0
    # fixed, then revived: processed
    with engine.begin() as conn:
        conn.execute(text("update item set broken = false where id = 7"))
    revived = invoke(db_url, "revive", "scores", "-c", str(queue_config))
    assert revived.exit_code == 0 and "revived 1 dead item(s)" in revived.output, revived.output
    wait_until(lambda: scores(engine, 7) == 3, "item 7 processed after its revival")
    assert queued(engine) == []
    none = invoke(db_url, "revive", "scores", "7", "8", "-c", str(queue_config))
    assert "revived 0 dead item(s); 2 of the keys given were not dead" in none.output, none.output


# -- heartbeats ----------------------------------------------------------------------------
def test_status_lists_live_schedulers_and_those_gone_quiet(
    engine: Engine, db_url: str, queue_config: Path, start: Callable[..., Run]
) -> None:
    first, second = start(queue_config), start(queue_config)

    def schedulers() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = status(db_url, queue_config)["schedulers"]
        return found

    wait_until(lambda: len(schedulers()) == 2, "both schedulers recorded")
    data = status(db_url, queue_config)
    now = datetime.fromisoformat(data["now"])
    for entry in data["schedulers"]:
        assert entry["live"] is True and entry["jobs"] == ["scores"], entry
        assert now - datetime.fromisoformat(entry["last_seen"]) < timedelta(seconds=2), entry
        assert entry["version"] and entry["host"]
    pids = {entry["pid"] for entry in data["schedulers"]}
    assert pids == {first.proc.pid, second.proc.pid}
    from pgjobs.metrics import Metrics

    def metric(state: str) -> float:
        text_ = Metrics(cache_seconds=0).bind(Source(engine=engine)).exposition().decode()
        (line,) = [
            li
            for li in text_.splitlines()
            if li.startswith(f'pgjobs_schedulers{{state="{state}"}}')
        ]
        return float(line.split()[-1])

    assert metric("live") == 2 and metric("quiet") == 0
    # SIGKILL: no goodbye; gone quiet after 3 heartbeats of 500 ms (1.5 s)
    first.stop(signal.SIGKILL)
    killed = time.monotonic()

    def quiet() -> dict[str, Any] | None:
        for entry in schedulers():
            if entry["pid"] == first.proc.pid and not entry["live"]:
                return entry
        return None

    entry = wait_until(quiet, "the killed scheduler shown gone quiet", timeout=10)
    assert time.monotonic() - killed < 1.5 + 2.0  # its last beat, plus 3 beats, plus slack
    assert entry["quiet_seconds"] >= 1.5
    (other,) = [e for e in schedulers() if e["pid"] == second.proc.pid]
    assert other["live"] is True
    assert metric("live") == 1 and metric("quiet") == 1
    text_status = invoke(db_url, "status", "-c", str(queue_config)).output
    assert "gone quiet" in text_status and "live" in text_status, text_status
    page = StatusPage()(Source(engine=engine), Request(path="/")).body.decode()
    assert f"{entry['host']}:{first.proc.pid}" in page and "gone quiet" in page
    # a clean stop deletes its own row
    assert second.stop() == 0
    assert [e["pid"] for e in schedulers()] == [first.proc.pid]


# -- in process: Scheduler(shutdown_timeout=), lifespan, strict, per-job timezone --------
def test_scheduler_shutdown_timeout_and_the_lifespan_cancel_a_long_statement(
    engine: Engine,
) -> None:
    import asyncio
    import threading

    import pgjobs

    with engine.begin() as conn:
        conn.execute(text("create table written (id int primary key)"))
    entered = threading.Event()

    def slow(conn: Any) -> None:
        conn.execute(text("insert into written (id) values (1)"))
        entered.set()
        conn.execute(text("select pg_sleep(30) /* pgjobs-test-slow */"))

    job = pgjobs.TaskJob(name="slow", every="1h", run=slow)
    scheduler = pgjobs.Scheduler([job], engine)
    scheduler.start()
    assert entered.wait(WAIT)
    began = time.monotonic()
    assert scheduler.shutdown(timeout="500ms") is True
    assert time.monotonic() - began < 1.5
    assert scalar(engine, SLOW_QUERY) == 0 and scalar(engine, "select count(*) from written") == 0

    # the lifespan's equivalent: shutdown_timeout, passed on to the scheduler
    entered.clear()

    async def app() -> float:
        async with pgjobs.lifespan(
            pgjobs.Scheduler([job], engine, shutdown_timeout="500ms")
        ) as state:
            assert state["pgjobs"].shutdown_timeout.total_seconds() == 0.5
            assert await asyncio.to_thread(entered.wait, WAIT)
            began = time.monotonic()
        return time.monotonic() - began

    assert asyncio.run(app()) < 1.5
    with engine.connect() as conn:
        outcomes = [o for (o,) in conn.execute(text("select outcome from pgjobs.run")).all()]
        failures = conn.execute(text("select failures from pgjobs.job_state")).scalars().all()
    assert outcomes == ["cancelled", "cancelled"] and set(failures) <= {0}


def test_a_scheduler_starts_beside_a_job_that_fails_its_check_unless_strict(
    engine: Engine,
) -> None:
    import pgjobs

    broken = pgjobs.RecomputeJob(name="broken", target="missing_table", compute="select 1")
    fine = pgjobs.TaskJob(name="fine", every="1h", run=lambda conn: None)
    with pgjobs.Scheduler([broken, fine], engine) as scheduler:
        assert scheduler.preflight.failing == ["broken"]
        wait_until(
            lambda: scalar(engine, "select count(*) from pgjobs.run where job = 'fine'"), "fine ran"
        )
    error = scalar(engine, "select last_error from pgjobs.job_state where job = 'broken'")
    assert error.startswith("pre-flight check: ") and "missing_table" in error
    strict = pgjobs.Scheduler([broken, fine], engine, strict=True)
    with pytest.raises(pgjobs.ConfigError, match="table 'missing_table' does not exist"):
        strict.start()


def test_a_cron_job_fires_in_its_own_time_zone(engine: Engine, tmp_path: Path) -> None:
    import pgjobs
    from pgjobs.config import load_config

    paris = pgjobs.TaskJob(
        name="paris", every=None, cron="0 3 * * *", timezone="Europe/Paris", run=lambda c: None
    )
    utc = pgjobs.TaskJob(name="utc", every=None, cron="0 3 * * *", run=lambda conn: None)
    assert paris.schedule == "cron 0 3 * * * (Europe/Paris)"
    scheduler = pgjobs.Scheduler([paris, utc], engine, timezone="UTC")
    winter = datetime.fromisoformat("2026-01-10T12:00:00+00:00")
    summer = datetime.fromisoformat("2026-07-10T12:00:00+00:00")
    fire = {n: scheduler._triggers[n].get_next_fire_time for n in ("paris", "utc")}
    assert fire["paris"](None, winter).astimezone(UTC).hour == 2  # CET = UTC+1
    assert fire["paris"](None, summer).astimezone(UTC).hour == 1  # CEST = UTC+2
    assert fire["utc"](None, winter).astimezone(UTC).hour == 3
    with pytest.raises(pgjobs.ConfigError, match="timezone: expected an IANA time zone"):
        pgjobs.TaskJob(name="x", every=None, cron="0 3 * * *", timezone="Mars/Olympus", run=print)
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        'timezone = "UTC"\n[jobs.t]\nkind = "task"\nsql = "select 1"\ncron = "0 3 * * *"\n'
        'timezone = "Asia/Tokyo"\n'
    )
    (declared,) = load_config(path).jobs
    assert declared.timezone == "Asia/Tokyo"
    path.write_text('[jobs.t]\nkind = "task"\nsql = "select 1"\ntimezone = "Nowhere"\n')
    with pytest.raises(pgjobs.ConfigError, match=r"jobs\.t\.timezone"):
        load_config(path)


def test_a_tick_busy_outside_any_statement_is_left_to_its_thread(engine: Engine) -> None:
    import threading

    import pgjobs

    entered, release = threading.Event(), threading.Event()

    def busy(conn: Any) -> None:
        entered.set()
        release.wait(WAIT)  # Python, not a statement: nothing to cancel

    scheduler = pgjobs.Scheduler([pgjobs.TaskJob(name="busy", every="1h", run=busy)], engine)
    scheduler.start()
    assert entered.wait(WAIT)
    began = time.monotonic()
    try:
        assert scheduler.shutdown(timeout="200ms") is False
        assert time.monotonic() - began < 0.2 + 0.8 + 0.5  # the deadline, the grace, slack
    finally:
        release.set()
    # the tick goes on in its thread, and ends: its connection goes back to the pool
    assert scheduler._flight.wait(WAIT)
    scheduler.runner.close()
    assert scalar(engine, "select outcome from pgjobs.run where job = 'busy'") == "ran"


def test_a_pause_committed_between_the_work_check_and_the_lock_stops_the_tick(
    engine: Engine,
) -> None:
    """Two connections: the tick's (blocked in its work check, step 2, by an
    event) and the operator's, whose pause commits meanwhile; the tick reads
    the state again under the lock (step 3) and ends ``paused``, writing nothing."""
    import threading

    import pgjobs
    from pgjobs.operate import pause, resume
    from pgjobs.results import Outcome
    from pgjobs.store import Store

    with engine.begin() as conn:
        conn.execute(text("create table written (id serial primary key)"))
    entered, release = threading.Event(), threading.Event()

    def has_work(conn: Any) -> bool:
        entered.set()
        assert release.wait(WAIT)
        return True

    def write(conn: Any) -> None:
        conn.execute(text("insert into written default values"))

    job = pgjobs.TaskJob(name="t", every="1h", has_work=has_work, run=write)
    with pgjobs.Runner(engine) as runner:
        runner.install()
        results: list[Any] = []
        tick = threading.Thread(target=lambda: results.append(runner.tick(job)))
        tick.start()
        assert entered.wait(WAIT)
        first, new = pause(engine, Store(), job, reason="now")  # another connection
        assert new
        release.set()
        tick.join(WAIT)
        (result,) = results
        assert result.outcome is Outcome.PAUSED and result.detail["reason"] == "now"
        assert result.detail["paused_at"] == first.since
        assert scalar(engine, "select count(*) from written") == 0
        # pausing a paused job keeps its since, takes the new reason
        again, new = pause(engine, Store(), job, reason="later")
        assert not new and again.since == first.since and again.reason == "later"
        # a forced tick does not pass a pause; run_paused does
        entered.clear()
        assert runner.tick(job, force=True).outcome is Outcome.PAUSED
        assert runner.tick(job, run_paused=True).outcome is Outcome.RAN
        resume(engine, Store(), job)
        assert runner.tick(job, force=True).outcome is Outcome.RAN
    # the paused ticks were counted in job_state, not logged in the run log
    assert scalar(engine, "select paused_ticks from pgjobs.job_state where job = 't'") == 2
    assert scalar(engine, "select count(*) from pgjobs.run where outcome = 'paused'") == 0


def test_the_configs_shutdown_timeout_and_heartbeat_every(
    engine: Engine, db_url: str, tmp_path: Path
) -> None:
    import pgjobs
    from pgjobs.config import load_config

    path = tmp_path / "pgjobs.toml"
    path.write_text(
        'shutdown_timeout = "3s"\nheartbeat_every = "2s"\n'
        '[jobs.t]\nkind = "task"\nsql = "select 1"\n'
    )
    scheduler = pgjobs.Scheduler.from_config(path, database=engine)
    assert scheduler.shutdown_timeout == timedelta(seconds=3)
    assert scheduler.heartbeat.every == timedelta(seconds=2)
    assert pgjobs.Scheduler.from_config(
        path, database=engine, shutdown_timeout="1s"
    ).shutdown_timeout == timedelta(seconds=1)
    bad = invoke(db_url, "run", "--shutdown-timeout", "soon", "-c", str(path))
    assert bad.exit_code == 2 and "--shutdown-timeout" in bad.output, bad.output
    path.write_text('heartbeat_every = "0s"\n')
    with pytest.raises(pgjobs.ConfigError, match="heartbeat_every: must be positive"):
        load_config(path)
