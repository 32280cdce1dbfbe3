"""A pg_auto_failover formation for failover tests: a monitor and two nodes.

Started on free private ports in a private directory, as the ``postgres``
system user (pg_autoctl refuses root; the tests run as root on CI), and
stopped by process id, whatever happens to the test: every process the
formation started, and every process those started (the PostgreSQL servers
and their backends, found from ``/proc`` while their parents still live),
gets SIGTERM, then SIGKILL. Nothing is stopped by name.

Used by tests/test_failover.py and benchmarks/failover_bench.py:

    with formation() as f:
        f.wait_healthy()                 # a primary and a secondary
        f.switchover()                   # pg_autoctl perform switchover
        f.crash_primary()                # SIGKILL of the primary's postmaster
        at = f.wait_writable(after=t)    # when a primary took a write

pg_autoctl keeps its state under ``$XDG_CONFIG_HOME`` and ``$XDG_DATA_HOME``
and its pid files under ``$XDG_RUNTIME_DIR``: all three point inside the
formation's directory, so that formations never see each other.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from extras import EXTRAS, missing_reason

PG_BIN = Path("/usr/lib/postgresql/15/bin")
USER = "postgres"
DBNAME = "app"
WAIT = 120.0  # upper bound on any wait of the formation's; never reached when it works


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (parent id: field 4 of stat)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _descendants(roots: list[int]) -> set[int]:
    tree, found, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(tree.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours is gone for our purpose
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def client_ports(pid: int) -> set[int]:
    """The local TCP ports of process ``pid``'s sockets (its connections'
    client ports, as a backend's ps title shows them): its socket fds'
    inodes, looked up in /proc/net/tcp and tcp6."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass(frozen=True)
class Node:
    name: str
    port: int
    data: Path

    def postmaster_pid(self) -> int | None:
        """The first line of postmaster.pid: the running server's process id."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def waiting_backends(self) -> list[str]:
        """The ps titles of this server's backends that wait: "waiting for
        <LSN>" is a commit waiting for a synchronous standby (these keep a
        fast shutdown, and so a switchover, from finishing)."""
        pid = self.postmaster_pid()
        titles = []
        for child in _children().get(pid or -1, []):
            with contextlib.suppress(OSError):
                title = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"waiting for" in title:
                    titles.append(title.decode(errors="replace").strip())
        return titles


class Formation:
    """A pg_auto_failover monitor and two PostgreSQL nodes; see the module."""

    def __init__(self) -> None:
        program = EXTRAS["pg_auto_failover"].find()
        if program is None:
            raise RuntimeError(missing_reason("pg_auto_failover"))
        #: the pg_autoctl that tests/extras.py finds (on $PATH or in /usr/sbin)
        self.program = program
        self.root = Path(tempfile.mkdtemp(prefix="pgjobs-ha-"))
        entry = pwd.getpwnam(USER) if os.geteuid() == 0 else None
        if entry is not None:
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._user = entry
        monitor_port, *node_ports = _free_ports(3)
        self.monitor = Node("monitor", monitor_port, self.root / "monitor")
        self.nodes = [
            Node(f"node{n}", port, self.root / f"node{n}") for n, port in enumerate(node_ports, 1)
        ]
        self._processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []

    # -- URLs ------------------------------------------------------------------------
    @property
    def monitor_url(self) -> str:
        return f"postgresql://autoctl_node@127.0.0.1:{self.monitor.port}/pg_auto_failover"

    def node_url(self, node: Node) -> str:
        return f"postgresql://postgres@127.0.0.1:{node.port}/{DBNAME}"

    def libpq_url(self, database: str = DBNAME) -> str:
        """The multi-host URL pg_auto_failover hands out (libpq's form)."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def sqlalchemy_url(self, database: str = DBNAME) -> str:
        """The same servers in SQLAlchemy's form (``?host=h1:p1&host=h2:p2``)."""
        hosts = "&".join(f"host=127.0.0.1:{n.port}" for n in self.nodes)
        return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def conninfo(self, database: str = DBNAME) -> str:
        """For plain psycopg: both nodes, the writable one, bounded connects."""
        ports = ",".join(str(n.port) for n in self.nodes)
        return (
            f"host=127.0.0.1,127.0.0.1 port={ports} dbname={database} user=postgres"
            " target_session_attrs=read-write connect_timeout=2"
        )

    # -- running pg_autoctl ------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {
            "PATH": f"{PG_BIN}:/usr/bin:/bin",
            "HOME": str(self.root),
            "XDG_CONFIG_HOME": str(self.root / "config"),
            "XDG_DATA_HOME": str(self.root / "share"),
            "XDG_RUNTIME_DIR": str(self.root / "run"),
            "LANG": "C.UTF-8",
        }

    def _as_user(self) -> dict[str, Any]:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def autoctl(self, *args: str, timeout: float = WAIT) -> str:
        """``pg_autoctl ARGS`` to its end (bounded); its output, or an error with it."""
        done = subprocess.run(
            [self.program, *args],
            env=self._env(),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            **self._as_user(),
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg_autoctl {' '.join(args)}: {done.stdout}{done.stderr}")
        return str(done.stdout) + str(done.stderr)

    def _run(self, node: Node) -> None:
        """``pg_autoctl run`` for ``node``, in a session of its own, logging to a file."""
        log = open(self.root / f"{node.name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        self._processes.append(
            subprocess.Popen(
                [self.program, "run", "--pgdata", str(node.data)],
                env=self._env(),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as_user(),
            )
        )

    def start(self) -> None:
        common = ["--auth", "trust", "--no-ssl", "--hostname", "127.0.0.1"]
        common += ["--pgctl", str(PG_BIN / "pg_ctl")]
        m = self.monitor
        self.autoctl("create", "monitor", "--pgdata", str(m.data), "--pgport", str(m.port), *common)
        self._run(m)
        self._wait(lambda: self._monitor_query("select 1") is not None, "the monitor answers")
        for n, node in enumerate(self.nodes):
            self.autoctl(
                "create", "postgres", "--pgdata", str(node.data), "--pgport", str(node.port),
                "--dbname", DBNAME, "--monitor", self.monitor_url, *common,
            )  # fmt: skip
            self._run(node)
            if n == 0:
                self._wait(lambda: "single" in self.states().values(), "the first node single")
        self.wait_healthy()

    # -- observing ----------------------------------------------------------------------
    def _monitor_query(
        self, sql: str, params: tuple[Any, ...] = ()
    ) -> list[tuple[Any, ...]] | None:
        try:
            with psycopg.connect(self.monitor_url, connect_timeout=2, autocommit=True) as conn:
                conn.execute("set statement_timeout = '5s'")
                return conn.execute(sql, params).fetchall()
        except psycopg.Error:
            return None

    def states(self) -> dict[int, str]:
        """Each node's port and its reported state, where it matches its goal
        (a node between states shows as ``state->goal``)."""
        rows = self._monitor_query(
            "select nodeport, reportedstate, goalstate from pgautofailover.node"
        )
        return {
            int(port): str(reported) if reported == goal else f"{reported}->{goal}"
            for port, reported, goal in rows or []
        }

    def reached(self, since: float) -> list[tuple[float, int, str]]:
        """The states nodes reached after ``since`` (time.time()), from the
        monitor's event log: (when, the node's port, the state), in order."""
        rows = self._monitor_query(
            "select extract(epoch from eventtime)::float8, nodeport, reportedstate::text"
            " from pgautofailover.event where reportedstate = goalstate"
            " and eventtime > to_timestamp(%s) order by eventid",
            (since,),
        )
        return [(float(at), int(port), str(state)) for at, port, state in rows or []]

    def events(self, since: float) -> list[str]:
        """The monitor's event log after ``since``, one line each: seconds
        after it, the node's port, its reported and goal state, the reason."""
        rows = self._monitor_query(
            "select extract(epoch from eventtime)::float8, nodeport, reportedstate::text,"
            " goalstate::text, description from pgautofailover.event"
            " where eventtime > to_timestamp(%s) order by eventid",
            (since,),
        )
        return [
            f"{float(at) - since:6.2f} s {port} {reported} -> {goal}: {description}"
            for at, port, reported, goal, description in rows or []
        ]

    def primary(self) -> Node:
        """The node the monitor has as primary (waits for one)."""
        found: list[Node] = []

        def one() -> bool:
            states = self.states()
            found[:] = [n for n in self.nodes if states.get(n.port) in ("primary", "wait_primary")]
            return len(found) == 1

        self._wait(one, "a primary")
        return found[0]

    def wait_healthy(self, timeout: float = WAIT) -> Node:
        """Until one node is primary and the other secondary; the primary."""
        self._wait(
            lambda: sorted(self.states().values()) == ["primary", "secondary"],
            "a primary and a secondary",
            timeout,
        )
        return self.primary()

    def writable(self, node: Node) -> bool:
        """Does ``node`` take (and commit) a write right now? Bounded."""
        try:
            with psycopg.connect(self.node_url(node), connect_timeout=1, autocommit=True) as conn:
                conn.execute("set statement_timeout = '1s'")
                conn.execute("create table if not exists ha_probe (at timestamptz)")
                conn.execute("insert into ha_probe values (clock_timestamp())")
                return True
        except psycopg.Error:
            return False

    def wait_writable(self, *, after: float, not_on: Node | None = None) -> tuple[float, Node]:
        """The wall-clock time (time.time()) when a node first committed a write
        after ``after``, polling every 20 ms, and that node; not ``not_on``."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node != not_on and self.writable(node):
                    at = time.time()
                    if at > after:
                        return at, node
            time.sleep(0.02)
        raise AssertionError(f"no primary took a write within {WAIT:.0f} s: {self.states()}")

    # -- failures -----------------------------------------------------------------------
    def switchover(self, timeout: float = 60.0) -> str | None:
        """``pg_autoctl perform switchover``, waiting ``timeout`` s for its
        end; None when it succeeded, else what it said (its last lines)."""
        try:
            self.autoctl(
                "perform", "switchover", "--pgdata", str(self.monitor.data),
                "--wait", str(int(timeout)), timeout=timeout + 30,
            )  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            said = exc.stderr if isinstance(exc, subprocess.TimeoutExpired) else str(exc)
            text = said.decode(errors="replace") if isinstance(said, bytes) else str(said)
            return f"{type(exc).__name__}: " + " | ".join(text.strip().splitlines()[-3:])
        return None

    def crash_primary(self) -> Node:
        """SIGKILL of the primary's postmaster (no shutdown at all); that node."""
        node = self.primary()
        pid = node.postmaster_pid()
        if pid is None:
            raise AssertionError(f"{node.name} has no postmaster.pid")
        os.kill(pid, signal.SIGKILL)
        return node

    # -- stopping -----------------------------------------------------------------------
    def stop(self) -> None:
        """Every process started here and their descendants: SIGTERM, then
        SIGKILL after a bounded wait; by process id, never by name."""
        pids = _descendants([p.pid for p in self._processes])
        pids |= {pid for node in [self.monitor, *self.nodes] if (pid := node.postmaster_pid())}
        pids |= _descendants(list(pids))
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            for p in self._processes:
                p.poll()
            time.sleep(0.1)
        pids |= _descendants(list(pids))  # a server restarted meanwhile
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for p in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for log in self._logs:
            log.close()

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of every pg_autoctl log, for a failure's message."""
        out = []
        for node in [self.monitor, *self.nodes]:
            path = self.root / f"{node.name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {node.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def _wait(self, condition: Any, what: str, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what}: not reached in {timeout:.0f} s; states {self.states()}\n"
                    + self.log_tail()
                )
            time.sleep(0.1)


@contextlib.contextmanager
def formation() -> Iterator[Formation]:
    """A started, healthy formation, stopped and removed afterwards."""
    f = Formation()
    try:
        f.start()
        yield f
    finally:
        f.remove()
