"""``manage.py pgjobs VERB ...``: the ``pgjobs`` command's own verbs and
options (its code, :mod:`pgjobs.cli`), on the ``PGJOBS`` setting and the
database of ``DATABASES`` instead of ``pgjobs.toml`` and a URL.

``manage.py pgjobs run`` is ``pgjobs run``: the scheduler in the
foreground until SIGTERM or SIGINT, ``--shutdown-timeout`` (or
``PGJOBS["shutdown_timeout"]``) the longest it waits for running jobs.
Jobs' Python bodies run between closing Django's stale connections and
closing their thread's ones. ``manage.py migrate`` applies pgjobs' schema;
``manage.py pgjobs migrate`` is ``pgjobs migrate``: the schema too, then the
triggers of ``PGJOBS["derived"]`` (``--check``, ``--sql``), which
``manage.py pgjobs run`` otherwise installs at start (``auto_migrate``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

#: the verbs of ``pgjobs`` that ``manage.py pgjobs`` offers
VERBS = (
    "run",
    "once",
    "status",
    "check",
    "pause",
    "resume",
    "enqueue",
    "revive",
    "list",
    "migrate",
)
#: what manage.py read itself before handing the command its arguments
_DJANGO_OPTIONS = ("--settings", "--pythonpath")


def _own(argv: Sequence[str]) -> list[str]:
    """``argv`` without Django's own options."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _DJANGO_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _DJANGO_OPTIONS)):
            out.append(arg)
    return out


def run(argv: Sequence[str], *, prog_name: str = "manage.py pgjobs") -> int:
    """Run one verb of the ``pgjobs`` command on Django's settings; its exit code."""
    import click

    from pgjobs.cli import main
    from pgjobs.cli.base import EXIT_USAGE, preset
    from pgjobs.database import ENV_TRANSACTION_POOLING
    from pgjobs.errors import PgJobsError

    from ...conf import load
    from ...host import preset as host_preset

    args = list(argv)
    verb = next((a for a in args if not a.startswith("-")), None)
    if verb is None or verb not in VERBS:
        if (verb is None and any(a in ("-h", "--help") for a in args)) or not args:
            click.echo(f"usage: {prog_name} {{{','.join(VERBS)}}} [OPTIONS] [ARGS]...")
            click.echo("Each verb as the pgjobs command's: `" + prog_name + " VERB --help`.")
            return 0 if args else EXIT_USAGE
        click.echo(
            f"{prog_name}: error: no verb {verb!r} here (one of: {', '.join(VERBS)};"
            " `manage.py migrate` applies pgjobs' migrations)",
            err=True,
        )
        return EXIT_USAGE
    try:
        settings = load()
        given = host_preset(settings)
    except PgJobsError as exc:
        click.echo(f"pgjobs: error: {exc}", err=True)
        return EXIT_USAGE
    if settings.transaction_pooling:
        # read by pgjobs when it makes its engines (pgjobs.database)
        os.environ[ENV_TRANSACTION_POOLING] = "1"
    try:
        with preset(given):
            main(args, prog_name=prog_name)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


class Command(BaseCommand):
    help = f"pgjobs' command on this project's settings: {', '.join(VERBS)} (VERB --help)."
    requires_system_checks: Any = []  # `pgjobs run` checks the jobs against the database itself

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, help="VERB [OPTIONS] [ARGS]...")

    def run_from_argv(self, argv: list[str]) -> None:
        # The pgjobs command parses its own options (-v is its verbosity, not Django's).
        prog = f"{os.path.basename(argv[0])} {argv[1]}"
        sys.exit(run(_own(argv[2:]), prog_name=prog))

    def handle(self, *args: str, **options: Any) -> None:
        code = run(args)
        if code:
            raise CommandError(f"pgjobs {' '.join(args)}: exit code {code}", returncode=code)


__all__ = ["VERBS", "Command", "run"]
