"""The ``pgjobs`` command.

::

    pgjobs run              start the scheduler in the foreground (SIGTERM/SIGINT stop it)
    pgjobs once JOB         run one tick of JOB now, showing its phases and progress
    pgjobs list             jobs, owner plugins, kinds, groups and schedules
    pgjobs status           last outcome, next attempt, failures, rows changed, queue depth
    pgjobs pause JOB        pause JOB on every scheduler (``resume JOB`` resumes it)
    pgjobs enqueue JOB KEY  add items to JOB's queue (``revive JOB`` brings dead ones back)
    pgjobs migrate          apply pgjobs' pending migrations (--check: are any? --sql: print them)
    pgjobs demo             the demonstration (see ``pgjobs demo --help``)

Every command takes ``--config/-c`` (default ``$PGJOBS_CONFIG``, else
``./pgjobs.toml`` when present) and ``--database`` (default
``$PGJOBS_DATABASE_URL``, else the config file's ``database``), before the
command (``pgjobs --config f list``) or after it (``pgjobs list --config f``).

Exit codes: 0 ok; 1 a job failed (``once``: the tick failed or found its
group busy; ``status``: a job is failing; ``migrate --check``: migrations
are pending); 2 a usage, config or plugin error, or a schema that does not
fit the code (newer than it, or not migrated with ``auto_migrate = false``);
3 the database is unreachable (or refused pgjobs' own statements, outside
any job: the connection, the checks, the status query). A tick that fails
on the database inside the job is a failed job: 1.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Sequence

# the commands register themselves on ``cli`` when their modules are imported
from . import operating, reading, running, ticking, tools
from .base import (
    _STOPPED,
    DISTRIBUTION,
    EXIT_DATABASE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    _jsonable,
    _logging,
    cli,
)
from .ticking import _summary


def main(argv: Sequence[str] | None = None, *, prog_name: str = "pgjobs") -> None:
    """The ``pgjobs`` console script.

    Once ``pgjobs run`` has stopped, the process runs its exit handlers
    (logging, trace exporters) and ends, without the interpreter's teardown
    of its modules: that took 0.6 to 1 s on a loaded machine, a third of a
    ``--shutdown-timeout 2s`` budget, to free memory the system frees anyway.
    ``prog_name``: what usage lines call the command (``manage.py pgjobs``)."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name=prog_name)
    except SystemExit as exc:
        if not _STOPPED.is_set():
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


__all__ = [
    "DISTRIBUTION",
    "EXIT_DATABASE",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "cli",
    "main",
    "operating",
    "reading",
    "running",
    "ticking",
    "tools",
]
__all__ += ["_jsonable", "_logging", "_summary"]  # used by the tests
