"""A database outage under ``pgjobs run``, on a private PostgreSQL cluster
(tests/cluster.py) that the test stops and starts: the shared server is
never touched. ``pgjobs run`` waits for a database that is down at start,
says once that it is gone and once that it is back, and goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cluster import Cluster, private_cluster

WAIT = 60.0  # upper bound on any wait; never reached when things work

SCHEMA = """
create table parent (id int primary key);
create table derived (parent_id int primary key references parent (id) on delete cascade,
                      n int not null);
insert into parent select generate_series(1, 20);
"""

CONFIG = """
[jobs.tick]
kind = "task"
sql = "select 1"
every = "0.2s"

[jobs.worker]
kind = "queue"
target = "derived"
scope = ["parent_id"]
sql = "select id as parent_id, id * 2 as n from parent where id = any(:keys)"
every = "1h"
"""


class Run:
    """``pgjobs run`` in a subprocess; its stderr read line by line."""

    def __init__(self, url: str, config: Path) -> None:
        env = {**os.environ, "PGJOBS_DATABASE_URL": url, "PGJOBS_LOAD_PLUGINS": ""}
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "pgjobs"), "-c", str(config), "run"],
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def seen(self, text: str) -> int:
        with self._lock:
            return sum(text in line for line in self.lines)

    def wait_for(self, text: str, count: int = 1) -> None:
        deadline = time.monotonic() + WAIT
        while self.seen(text) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} x{count} not seen; stderr: {self.lines}")
            time.sleep(0.02)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(WAIT)
        self._reader.join(WAIT)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return code


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with private_cluster() as c:
        with psycopg.connect(c.url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        yield c


def enqueue(url: str, keys: list[int]) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("select pgjobs.enqueue('worker', %s::jsonb)", (str(keys),))


def derived_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("select count(*) from derived").fetchone()
    return int(row[0]) if row else 0


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached")
        time.sleep(0.02)


def test_run_waits_for_the_database_says_so_once_and_once_when_it_is_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = tmp_path / "pgjobs.toml"
    config.write_text(textwrap.dedent(CONFIG))
    cluster.stop()
    run = Run(cluster.url, config)
    try:
        # down at start: one line, then it waits (it used to exit 1 at once)
        run.wait_for("the database is unreachable")
        assert run.process.poll() is None
        cluster.start()
        run.wait_for("the database answers")
        run.wait_for("pgjobs: running 2 job(s)")
        enqueue(cluster.url, [1, 2])  # woken by the notification, not by its hourly poll
        wait_until(lambda: derived_count(cluster.url) == 2, "the first items processed")

        # an outage while it runs: the task ticks five times a second meanwhile
        before = len(run.lines)
        cluster.stop("fast")
        run.wait_for("the database is unreachable", count=2)
        run.wait_for("not listening for enqueues")
        time.sleep(2.0)  # ten ticks of the task job into a database that is gone
        cluster.start()
        run.wait_for("the database answers again")
        run.wait_for("listening for enqueues again")
        enqueue(cluster.url, [3])
        wait_until(lambda: derived_count(cluster.url) == 3, "the item after the outage")
        # what was said, less the task job's line per run (five a second)
        during = [line for line in run.lines[before:] if "tick ran in" not in line]
    finally:
        code = run.stop()
    assert code == 0, run.lines
    assert sum("the database is unreachable" in line for line in during) == 1, during
    assert sum("the database answers again" in line for line in during) == 1, during
    assert not any("Traceback" in line for line in run.lines), run.lines
    assert not any("error ignored terminating" in line for line in run.lines), run.lines
    # one line for the outage, one for its end, the listener's two; a job that
    # was in the middle of a tick when the server went may say it failed
    assert len(during) <= 8, during
