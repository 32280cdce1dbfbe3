"""One failover as users live it, measured: shared by tests/test_failover.py
and benchmarks/failover_bench.py.

In a fresh database of a pg_auto_failover formation (tests/ha.py): ``pgjobs
run`` (a real subprocess, one queue job, woken by NOTIFY: its ``every`` is an
hour, so that a polling fallback shows as latency) and a users' thread
changing items at about 20 a second, each change with its enqueue in the
same transaction, reconnecting through the writable node when a server goes
away. Then a planned switchover or a crash of the primary, users going on
throughout; then the queue is drained and everything measured:

* ``writable_s``: from the failure's start to the first write a new primary
  committed (:meth:`Formation.wait_writable`, polled every 20 ms);
* ``first_item_s``: from then to the end of pgjobs' first run that wrote
  derived rows (pgjobs.run, written on the new primary);
* latency after recovery: each change's ``changed_at`` (the user's
  transaction) to the compute that derived it (``processed_at``), for the
  changes made from 2 s after the first item on;
* lost: items whose derived rows differ from a from-scratch derivation after
  the drain (``wrong``), and changes users saw commit that the new primary
  does not have (``acked_lost``);
* ``pgjobs run``: alive, a traceback or not, its lines about failures and
  backoffs, its stacks (faulthandler, SIGUSR1) if the drain did not finish,
  and how long SIGTERM took to stop it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from ha import Formation, Node, client_ports
from psycopg import sql

import pgjobs

SCHEMA = """
create table item (id int primary key, v int not null, changed_at timestamptz not null);
create table derived (item_id int primary key, v int not null, changed_at timestamptz not null,
                      processed_at timestamptz not null);
"""
DERIVE = "select id as item_id, v * 10 as v, changed_at from item"
CONFIG = """
keep_runs = "1h"

[jobs.worker]
kind = "queue"
target = "derived"
scope = ["item_id"]
sql = "select id as item_id, v * 10 as v, changed_at, clock_timestamp() as processed_at from item where id = any(:keys)"
every = "1h"
"""
WRONG = f"""
select count(distinct item_id) from (
  (select item_id, v, changed_at from derived except ({DERIVE}))
  union all (({DERIVE}) except select item_id, v, changed_at from derived)
) as x
"""
#: `pgjobs run` with a stack dump of every thread on SIGUSR1
BOOT = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True);"
    " from pgjobs.cli import main; sys.argv[0] = 'pgjobs'; main()"
)
#: the words of pgjobs run's lines worth reporting
NOTABLE = ("fail", "backing off", "listening", "unreachable", "answers", "interrupt", "Error")
#: how long SIGTERM may take to stop `pgjobs run` (it waits for the running tick)
SHUTDOWN_BOUND = 10.0
#: client-side bounds of the users' connections
USER_OPTIONS = (
    " options='-c statement_timeout=2s' keepalives_idle=2 keepalives_interval=1"
    " keepalives_count=2 tcp_user_timeout=5000"
)


class PgjobsRun:
    """``pgjobs run`` in a subprocess; its stderr kept line by line."""

    def __init__(self, url: str, config: Path) -> None:
        env = {**os.environ, "PGJOBS_DATABASE_URL": url, "PGJOBS_LOAD_PLUGINS": ""}
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT, "-c", str(config), "run"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
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

    def output(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.output()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not seen; stderr: {self.output()}")
            time.sleep(0.02)

    def stacks(self) -> list[str]:
        """Every thread's stack (faulthandler), where it stands now."""
        before = len(self.output())
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # faulthandler writes at once; a second for the reader thread
        return self.output()[before:]

    def stop(self) -> tuple[float, int | None]:
        """SIGTERM; the seconds until it exited and its exit code (None: it
        had not exited after twice the bound, and was killed)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.process.wait(2 * SHUTDOWN_BOUND)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            code = None
        took = time.monotonic() - started
        self._reader.join(10)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return took, code


class Users:
    """One thread changing items at ``rate`` a second, each change and its
    enqueue in one transaction; reconnects (bounded) after any error."""

    def __init__(self, conninfo: str, rate: float = 20.0) -> None:
        self.conninfo = conninfo + USER_OPTIONS
        self.pause = 1.0 / rate
        self.stop_event = threading.Event()
        self.acked: dict[int, int] = {}  # item -> the v users saw commit
        self.errors: dict[str, int] = {}
        self.commits = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(30)
        if self._thread.is_alive():
            raise AssertionError("the users' thread did not stop within 30 s")

    def _change(self, conn: psycopg.Connection[Any], rng: random.Random) -> tuple[int, int]:
        if self.acked and rng.random() < 0.25:
            item = rng.choice(list(self.acked))
        else:
            item = len(self.acked) + 1
        row = conn.execute(
            "insert into item values (%s, 1, clock_timestamp()) on conflict (id) do update"
            " set v = item.v + 1, changed_at = clock_timestamp() returning v",
            (item,),
        ).fetchone()
        assert row is not None
        conn.execute("select pgjobs.enqueue('worker', %s::jsonb)", (json.dumps([item]),))
        conn.commit()
        return item, int(row[0])

    def _loop(self) -> None:
        rng = random.Random(21)
        conn: psycopg.Connection[Any] | None = None
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.conninfo)
                item, v = self._change(conn, rng)
                self.acked[item] = max(v, self.acked.get(item, 0))
                self.commits += 1
            except psycopg.Error as exc:
                key = exc.sqlstate or type(exc).__name__
                self.errors[key] = self.errors.get(key, 0) + 1
                if conn is not None:
                    conn.close()
                conn = None
                self.stop_event.wait(0.05)  # a failed connect comes back at once: not a spin
            next_at += self.pause
            self.stop_event.wait(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - 1.0)  # no burst after an outage
        if conn is not None:
            conn.close()


@dataclass
class Failover:
    kind: str
    started: float  # time.time()
    writable_at: float
    old: int  # ports
    new: int
    done_s: float = float("nan")  # switchover: the command's own length
    command_error: str | None = None  # switchover: what pg_autoctl said if it failed
    #: switchover: the old primary's backends seen waiting for a synchronous standby
    waiting: list[str] = field(default_factory=list)
    #: switchover: the states each node reached, seconds after the start (the monitor's events)
    phases: list[tuple[float, int, str]] = field(default_factory=list)
    #: switchover: the monitor's event log meanwhile (why it assigned what it did)
    events: list[str] = field(default_factory=list)

    def phase_text(self) -> str:
        """ "old: draining 0.4, demoted 3.1, ... | new: ...", from :attr:`phases`."""
        parts = []
        for label, port in (("old", self.old), ("new", self.new)):
            reached = [f"{state} {at:.1f}" for at, p, state in self.phases if p == port]
            parts.append(f"{label}: " + ", ".join(reached))
        return " | ".join(parts)


def _watch_waiting(node: Node, pgjobs_pid: int | None, until: threading.Event) -> list[str]:
    """Until ``until``: every distinct backend of ``node`` seen waiting for a
    synchronous standby, each marked [pgjobs run] when its client port is one
    of that process's connections (sampled every 100 ms)."""
    seen: dict[str, None] = {}
    while not until.wait(0.1):
        titles = node.waiting_backends()
        ports = client_ports(pgjobs_pid) if titles and pgjobs_pid else set()
        for title in titles:
            port = re.search(r"\((\d+)\)", title)
            whose = "[pgjobs run]" if port and int(port.group(1)) in ports else "[other]"
            seen[re.sub(r"waiting for \S+", "waiting for <lsn>", title) + " " + whose] = None
    return list(seen)


def fail(f: Formation, kind: str, pgjobs_pid: int | None = None) -> Failover:
    """A planned switchover or a crash of the primary, timed (see the module)."""
    old = f.wait_healthy()
    started = time.time()
    if kind == "crash":
        f.crash_primary()
        at, new = f.wait_writable(after=started)
        return Failover(kind, started, at, old.port, new.port)
    result: dict[str, Any] = {}
    done = threading.Event()

    def switch() -> None:
        result["error"] = f.switchover()
        result["done"] = time.time()
        done.set()

    def watch() -> None:
        result["waiting"] = _watch_waiting(old, pgjobs_pid, done)

    threads = [threading.Thread(target=t, daemon=True) for t in (switch, watch)]
    for thread in threads:
        thread.start()
    at, new = f.wait_writable(after=started, not_on=old)
    for thread in threads:
        thread.join(120)  # bounded by the command's own timeout (switchover())
    out = Failover(kind, started, at, old.port, new.port)
    out.done_s = result.get("done", float("nan")) - started
    out.command_error = result.get("error", "still running after 120 s")
    out.waiting = result.get("waiting", [])
    out.phases = [(at - started, port, state) for at, port, state in f.reached(started)]
    out.events = f.events(started)
    return out


@dataclass
class Outcome:
    failover: Failover
    with_pgjobs: bool
    first_item_s: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    samples: int = 0
    wrong: int = 0
    acked_lost: int = 0
    drained: bool = True
    alive: bool = True
    traceback: bool = False
    stop_s: float | None = None
    exit_code: int | None = 0
    commits: int = 0
    user_errors: dict[str, int] = field(default_factory=dict)
    notable: list[str] = field(default_factory=list)  # pgjobs' lines on failures, backoffs
    stacks: list[str] = field(default_factory=list)


def _fresh_database(f: Formation) -> str:
    name = f"failover_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f.conninfo(), autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    with psycopg.connect(f.conninfo(name)) as conn:
        conn.execute(SCHEMA)
    pgjobs.install(f.sqlalchemy_url(name))
    return name


def _measure(conninfo: str, out: Outcome, users: Users) -> None:
    with psycopg.connect(conninfo + USER_OPTIONS) as conn:
        out.wrong = int(conn.execute(WRONG).fetchone()[0])  # type: ignore[index]
        have: dict[int, int] = dict(conn.execute("select id, v from item").fetchall())
        out.acked_lost = sum(have.get(item, 0) < v for item, v in users.acked.items())
        if not out.with_pgjobs:
            return
        at = out.failover.writable_at
        first = conn.execute(
            "select extract(epoch from min(finished_at)) from pgjobs.run where job = 'worker'"
            " and outcome = 'ran' and inserted + updated + deleted > 0"
            " and finished_at > to_timestamp(%s)",
            (at,),
        ).fetchone()
        if first and first[0] is not None:
            out.first_item_s = float(first[0]) - at
            lat = conn.execute(
                "select percentile_cont(array[0.5, 0.95]) within group (order by"
                " extract(epoch from processed_at - changed_at)), count(*) from derived"
                " where changed_at > to_timestamp(%s)",
                (float(first[0]) + 2.0,),
            ).fetchone()
            if lat and lat[0] is not None:
                out.p50_ms, out.p95_ms = (1000 * x for x in lat[0])
                out.samples = int(lat[1])


def _drain(conninfo: str, timeout: float) -> bool:
    """Until the queue is empty and every item derived (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(conninfo + USER_OPTIONS) as conn:
                queued = conn.execute("select count(*) from pgjobs.queue where dead_at is null")
                if queued.fetchone()[0] == 0 and conn.execute(WRONG).fetchone()[0] == 0:  # type: ignore[index]
                    return True
        except psycopg.Error:
            pass
        time.sleep(0.2)
    return False


def scenario(
    f: Formation,
    kind: str,
    workdir: Path,
    *,
    with_pgjobs: bool = True,
    before: float = 3.0,
    after: float = 10.0,
    url_form: str = "libpq",
) -> Outcome:
    """One failover (``kind``: "switchover" or "crash") with users throughout,
    and ``pgjobs run`` unless not ``with_pgjobs``; measured (see the module)."""
    name = _fresh_database(f)
    conninfo = f.conninfo(name)
    url = f.libpq_url(name) if url_form == "libpq" else f.sqlalchemy_url(name)
    config = workdir / f"{name}.toml"
    config.write_text(textwrap.dedent(CONFIG))
    run = PgjobsRun(url, config) if with_pgjobs else None
    try:
        out = _live(f, kind, conninfo, run, before=before, after=after)
    finally:
        if run is not None and run.process.poll() is None:
            run.process.kill()  # only where the scenario broke before its SIGTERM
            run.process.wait(10)
    f.wait_healthy()  # the next scenario starts from a formation like this one's
    return out


def _live(
    f: Formation, kind: str, conninfo: str, run: PgjobsRun | None, *, before: float, after: float
) -> Outcome:
    if run is not None:
        run.wait_for("pgjobs: running 1 job(s)")
    users = Users(conninfo)
    users.start()
    try:
        time.sleep(before)  # the scenario's length before the failure, not an ordering
        failover = fail(f, kind, run.process.pid if run else None)
        time.sleep(max(0.0, failover.writable_at + after - time.time()))  # users go on
    finally:
        users.stop()
    out = Outcome(failover, run is not None, commits=users.commits, user_errors=dict(users.errors))
    if run is not None:
        out.drained = _drain(conninfo, timeout=30.0)
        if not out.drained:
            out.stacks = run.stacks()
        out.alive = run.process.poll() is None
        out.stop_s, out.exit_code = run.stop()
        lines = run.output()
        out.traceback = any("Traceback" in line for line in lines)
        out.notable = [line for line in lines if any(w in line for w in NOTABLE)]
    _measure(conninfo, out, users)
    return out


def describe(out: Outcome) -> str:
    """One line of figures."""
    fo = out.failover

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    line = (
        f"{fo.kind:10} writable {fo.writable_at - fo.started:5.2f} s"
        + (f" (command {fo.done_s:5.2f} s)" if fo.kind == "switchover" else "")
        + (f" [switchover failed: {fo.command_error}]" if fo.command_error else "")
        + (
            f"  old primary's backends waiting for a standby: {len(fo.waiting)}"
            if fo.waiting
            else ""
        )
        + f"  commits {out.commits}  user errors {out.user_errors or 0}"
        + f"  acked lost {out.acked_lost}"
    )
    if out.with_pgjobs:
        first = "never" if out.first_item_s is None else f"{out.first_item_s:.2f} s"
        line += (
            f"  wrong {out.wrong}  first item {first}  latency p50 {ms(out.p50_ms)} ms p95 {ms(out.p95_ms)} ms"
            f" ({out.samples})  drained {out.drained}  alive {out.alive}"
            f"  traceback {'yes' if out.traceback else 'no'}"
            f"  SIGTERM stop {out.stop_s:.2f} s (exit {out.exit_code})"
        )
    return line
