"""The embedded PostgreSQL: real server, real signals, nothing left behind."""

from __future__ import annotations

import logging
import os
import select
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import pgjobs
from pgjobs import embedded
from pgjobs.embedded import embedded_server

# Generous bounds for a loaded CI machine; the tests poll and return as soon
# as the condition holds, they assert no duration.
START_DEADLINE = 120.0
CLEANUP_DEADLINE = 60.0

HOLDER = textwrap.dedent(
    """
    import sys
    from pgjobs.embedded import embedded_server

    with embedded_server() as url:
        print(url, flush=True)
        sys.stdin.read()  # hold the server until killed (or stdin closes)
    """
)


def alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_until(condition, deadline: float) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], deadline)
    assert ready, "the embedded server did not start in time"
    line = proc.stdout.readline().strip()
    assert line, (
        f"holder exited early: rc={proc.poll()} stderr={proc.stderr.read() if proc.stderr else ''}"
    )
    return line


def server_facts(url: str) -> tuple[Path, int]:
    """(data directory, postmaster pid) of the server at ``url``, asked over SQL
    and read from the postmaster's own pid file."""
    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            data_dir = Path(
                conn.execute(text("select current_setting('data_directory')")).scalar_one()
            )
    finally:
        eng.dispose()
    pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    return data_dir, pid


def libpq_kwargs(url: str) -> dict[str, str]:
    u = make_url(url)
    return {
        "host": str(u.query["host"]),
        "user": u.username or "postgres",
        "dbname": u.database or "postgres",
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_server_of_a_killed_process_does_not_survive(sig: signal.Signals) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = read_line(holder, START_DEADLINE)
        data_dir, postmaster = server_facts(url)
        assert url.startswith("postgresql+psycopg://")
        assert alive(postmaster) and data_dir.is_dir()

        # A client stays connected across the kill: it must not keep the server up.
        with psycopg.connect(**libpq_kwargs(url), autocommit=True) as client:
            assert client.execute("select 41 + 1").fetchone() == (42,)
            holder.send_signal(sig)
            assert holder.wait(timeout=CLEANUP_DEADLINE) == -sig  # died of it: no finally ran

            assert wait_until(lambda: not alive(postmaster), CLEANUP_DEADLINE), (
                "postmaster survived"
            )
            assert wait_until(lambda: not data_dir.exists(), CLEANUP_DEADLINE), (
                "data dir left behind"
            )
            with pytest.raises(psycopg.OperationalError):
                client.execute("select 1")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()


def test_runner_ticks_against_the_embedded_server_and_the_block_cleans_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def body(conn):
        conn.execute(text("create table if not exists done (n int)"))
        conn.execute(text("insert into done values (1), (2)"))
        return pgjobs.DiffStats(inserted=2)

    job = pgjobs.TaskJob(name="embedded-e2e", run=body)
    with caplog.at_level(logging.WARNING, logger="pgjobs.embedded"), embedded_server() as url:
        data_dir, postmaster = server_facts(url)
        with pgjobs.Runner(url) as runner:
            result = runner.tick(job)
        assert result.outcome == "ran"
        assert result.stats.inserted == 2
        eng = create_engine(url)
        try:
            with eng.connect() as conn:
                assert conn.execute(text("select count(*) from done")).scalar_one() == 2
                logged = conn.execute(
                    text("select outcome, inserted from pgjobs.run where job = 'embedded-e2e'")
                )
                assert [tuple(r) for r in logged] == [("ran", 2)]
        finally:
            eng.dispose()
    # The block has ended: server stopped and directory deleted before it returned.
    assert not alive(postmaster)
    assert not data_dir.exists()
    root_warnings = [r for r in caplog.records if "running as root" in r.getMessage()]
    if os.geteuid() == 0:
        assert len(root_warnings) == 1
        assert "$PGJOBS_TEST_DSN" in root_warnings[0].getMessage()
        assert "$PGJOBS_DATABASE_URL" in root_warnings[0].getMessage()
    else:
        assert root_warnings == []


def test_root_data_dir_goes_where_no_permission_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)  # mkdir's mode is filtered by the umask
    monkeypatch.setattr("tempfile.tempdir", str(private))

    # A user's own temp dir is fine for the user...
    assert embedded._default_parent(as_root=False) == private
    # ...but as root it would be chmodded for the server's system user, so a
    # directory everyone may already traverse is chosen instead.
    chosen = embedded._default_parent(as_root=True)
    assert chosen != private
    for p in (chosen.resolve(), *chosen.resolve().parents):
        mode = p.stat().st_mode
        assert mode & stat.S_IXOTH and mode & stat.S_IROTH, p
