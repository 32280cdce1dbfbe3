"""What a design is: the interface every design of the demo implements.

A design decides how a user's change is enqueued, how the two jobs (the
queue worker and the periodic recompute) run, how the queue is drained once
the users stop, and which interleavings it plays step by step beforehand.
The designs are ``naive.py`` and ``pgjobs_design.py``; the table that lists
them, and picks which run, is ``DESIGNS`` in ``__init__.py``. A new design
is a module with a subclass of :class:`Design` and a line in that table.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy.engine import Connection, Engine

from .lag import LagTally
from .report import JobTally, Scripted
from .scenario import RECOMPUTE, WORKER, DemoOptions


@dataclass(frozen=True, kw_only=True, slots=True)
class Place:
    """Where a design runs: its schema (the scenario's tables, built before
    the design is made) and, for designs that use pgjobs, the schema of
    pgjobs' own tables and the namespace of its advisory locks."""

    schema: str
    store_schema: str
    namespace: str


class Design:
    """One way of running the scenario's two jobs."""

    #: the design's name in the report's columns
    name: ClassVar[str] = ""
    #: its data schema is ``<run's prefix>_<schema_suffix>``
    schema_suffix: ClassVar[str] = ""
    #: pgjobs' own tables, for a design that installs them, go to ``<run's
    #: prefix>_<store_suffix>`` (dropped at the end in any case)
    store_suffix: ClassVar[str] = "jobs"

    @staticmethod
    def wanted(opts: DemoOptions) -> bool:
        """Whether a run with ``opts`` includes this design."""
        return True

    def __init__(self, engine: Engine, opts: DemoOptions, place: Place) -> None:
        self.engine = engine
        self.opts = opts
        self.place = place
        self.fresh_tallies()

    def fresh_tallies(self) -> None:
        """Count from zero: a timed run's figures are its own."""
        self.worker = JobTally(WORKER)
        self.recompute = JobTally(RECOMPUTE)
        self.lag = LagTally()

    def enqueue(self, conn: Connection, exam: int) -> None:
        """Queue ``exam`` for the worker, in the caller's transaction."""
        raise NotImplementedError

    def start_jobs(self, stop: threading.Event) -> None:
        """Start the jobs; they run until ``stop`` is set and :meth:`stop_jobs`."""
        raise NotImplementedError

    def stop_jobs(self) -> None:
        """Wait for the running job transactions to end, and stop."""
        raise NotImplementedError

    def drain(self) -> None:
        """Once users and timers have stopped, run the worker until its queue
        is empty (its ticks count in its figures), so that the scores can be
        compared with a from-scratch computation."""
        raise NotImplementedError

    def scripted(self) -> list[Scripted]:
        """Play the design's scripted interleavings, step by step."""
        raise NotImplementedError


__all__ = [
    "Design",
    "Place",
]
