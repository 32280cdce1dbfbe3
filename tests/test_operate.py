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
