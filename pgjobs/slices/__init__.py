"""Sliced recomputes: a :class:`~pgjobs.RecomputeJob` with a ``scope`` runs
as a sequence of slices of the scope's key space, each its own short
transaction, resumed after a crash and shared by several processes.

* :mod:`.body` — the body the runner runs such a job through (:data:`SLICED`);
* :mod:`.compute` — what a slice computes (restricted SQL, keyed SQL, Python);
* :mod:`.cut` — how the key space is cut into pieces;
* :mod:`.progress` — the run's progress in the database (migration 014).

The user's page is ``docs/slices.md``; the reasons are in
``docs/DESIGN.md``, "Slices".
"""

from __future__ import annotations

from .body import SLICED, SlicedBody, run_sliced
from .progress import in_progress

__all__ = ["SLICED", "SlicedBody", "in_progress", "run_sliced"]
