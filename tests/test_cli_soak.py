"""Two ``pgjobs run`` processes against one database for two minutes, with
jobs every 1 s and every 5 s (one group): no job overlaps itself or its
group, each runs at most once per interval overall, and both processes stop
cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

SECONDS = 120
INTERVALS = {"every-1s": timedelta(seconds=1), "every-5s": timedelta(seconds=5)}


def slack(interval: timedelta) -> timedelta:
    """The runner's documented tolerance for timer jitter: 10 %, at most 1 s."""
    return min(interval / 10, timedelta(seconds=1))


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


JOBS = """
import os
import random

from sqlalchemy import text

import pgjobs


def body(name):
    def run(conn):
        started = conn.execute(text("select clock_timestamp()")).scalar()
        conn.execute(text("select pg_sleep(:s)"), {"s": random.uniform(0.05, 0.3)})
        conn.execute(
            text(
                "insert into soak_log (job, pid, started_at, finished_at)"
                " values (:job, :pid, :started, clock_timestamp())"
            ),
            {"job": name, "pid": os.getpid(), "started": started},
        )

    return run


@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.TaskJob(name="every-1s", group="soak", every="1s", busy_retry="200ms", run=body("every-1s")))
    register(pgjobs.TaskJob(name="every-5s", group="soak", every="5s", busy_retry="1s", run=body("every-5s")))
"""


@pytest.mark.slow
def test_two_schedulers_for_two_minutes(engine: Engine, db_url: str, tmp_path: Path) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "create table soak_log (id serial primary key, job text not null, pid int not null,"
                " started_at timestamptz not null, finished_at timestamptz not null)"
            )
        )
    module = f"soakjobs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(JOBS))
    config = tmp_path / "pgjobs.toml"
    config.write_text(f'plugins = ["{module}"]\nkeep_runs = "1h"\n')
    env = {**os.environ, "PGJOBS_DATABASE_URL": db_url, "PGJOBS_LOAD_PLUGINS": ""}

    procs = []
    logs = []
    for n in range(2):
        err = open(tmp_path / f"worker{n}.err", "w+")  # noqa: SIM115 - closed below
        logs.append(err)
        procs.append(
            subprocess.Popen(
                [*pgjobs_command(), "run", "-c", str(config)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        )
    try:
        time.sleep(SECONDS)  # the scenario's length, not an ordering claim
        assert [p.poll() for p in procs] == [None, None], "a scheduler died early"
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    stderr = []
    for err in logs:
        err.seek(0)
        stderr.append(err.read())
        err.close()
    assert codes == [0, 0], stderr
    for output in stderr:
        assert "pgjobs: running 2 job(s): every-1s, every-5s" in output, output
        assert "pgjobs: stopped" in output and "Traceback" not in output, output

    with engine.connect() as conn:
        log = conn.execute(
            text("select job, pid, started_at, finished_at from soak_log order by started_at")
        ).all()
        ran = conn.execute(
            text(
                "select job, started_at, worker from pgjobs.run where outcome = 'ran' order by started_at"
            )
        ).all()
        outcomes = dict(
            conn.execute(text("select outcome, count(*) from pgjobs.run group by outcome")).all()
        )

    # One group: no two runs, of the same job or not, ever overlap.
    for before, after in pairwise(log):
        assert after.started_at >= before.finished_at, (before, after)

    figures = {}
    for job, interval in INTERVALS.items():
        starts = [r.started_at for r in ran if r.job == job]
        assert len(starts) == sum(1 for r in log if r.job == job)  # every committed run logged once
        gaps = [b - a for a, b in pairwise(starts)]
        assert min(gaps) >= interval - slack(interval), (job, min(gaps))
        # It did run all along (at least half the possible runs).
        assert len(starts) >= SECONDS / interval.total_seconds() / 2, (job, len(starts))
        figures[job] = {
            "runs": len(starts),
            "min_gap_s": round(min(gaps).total_seconds(), 3),
            "by_process": sorted(
                sum(1 for r in log if r.job == job and r.pid == p.pid) for p in procs
            ),
        }
    assert outcomes.get("failed", 0) == 0, outcomes
    print(f"\nsoak: {figures}; outcomes {outcomes}")
