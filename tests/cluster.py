"""A private PostgreSQL cluster for tests that stop and restart a server.

The shared server at 127.0.0.1:5432 is never stopped by a test: a test that
needs an outage starts one of these (``initdb`` and ``pg_ctl`` of the
machine's PostgreSQL, a directory and a port of its own) and stops it as
it likes. As root, the server runs as the ``postgres`` system user (initdb
refuses root), in a directory of its own under the system's temporary
directory that it owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bin_dir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        # a symlink on PATH (/usr/local/bin/pg_ctl): the tools beside it are
        # where it points (pg_basebackup, initdb of the same version)
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not versions:
        raise RuntimeError(
            "a private PostgreSQL cluster needs initdb and pg_ctl (Debian: apt-get install"
            " postgresql); none found on PATH or under /usr/lib/postgresql"
        )
    return versions[-1].parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """``initdb`` in a directory of its own; :meth:`start`, :meth:`stop`.
    ``settings``: server settings (``-c name=value``) for every start.
    :meth:`standby` makes a streaming replica of it (``pg_basebackup -R``),
    :meth:`promote` makes a standby the primary."""

    def __init__(self, *, settings: dict[str, str] | None = None, init: bool = True) -> None:
        self.bin = _bin_dir()
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="pgjobs-cluster-"))
        self.data = self.root / "data"
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.settings = dict(settings or {})
        if init:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def standby(self) -> Cluster:
        """A new cluster, a streaming replica of this one (which must run),
        not started."""
        replica = Cluster(settings=self.settings, init=False)
        replica._run(
            "pg_basebackup",
            "-D",
            str(replica.data),
            "-R",
            "-X",
            "stream",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "--no-sync",
        )
        return replica

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stdout}{done.stderr}")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        for name, value in self.settings.items():
            options += f" -c {name}={value}"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "log"),
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def private_cluster() -> Iterator[Cluster]:
    """A started private cluster, stopped and removed afterwards."""
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()
