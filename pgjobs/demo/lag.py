"""Queue lag: from an item's enqueue commit to the commit that processed it.

Users record each enqueue once its commit has returned, with the enqueuing
transaction's id (:func:`current_xid`). A design records the items its
worker processed, with a snapshot taken in the worker's transaction after
its claim (:func:`current_snapshot`) and the time the commit returned. An
enqueue counts as processed by the first such transaction whose snapshot saw
it committed: exact whichever thread the client schedules first, where the
two client-side clocks alone can be a few milliseconds out of order. A
processing's lag runs from the earliest enqueue it covers, so an item
enqueued several times before it is processed counts from its first enqueue.
Where each design records: ``users.py``, ``naive.py``, ``pgjobs_design.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection


def current_xid(conn: Connection) -> int:
    """The id of ``conn``'s transaction (assigned: it has written)."""
    return int(conn.execute(text("select pg_current_xact_id()::text")).scalar_one())


@dataclass(frozen=True, slots=True)
class XactSnapshot:
    """Which transactions a statement saw committed (``pg_current_snapshot()``)."""

    xmin: int
    xmax: int
    in_progress: frozenset[int]

    @classmethod
    def parse(cls, value: str) -> XactSnapshot:
        """``xmin:xmax:xip,...`` as PostgreSQL prints a ``pg_snapshot``."""
        xmin, xmax, xip = value.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def sees(self, xid: int) -> bool:
        """Whether ``xid``, a transaction that committed, had committed for it."""
        return xid < self.xmin or (xid < self.xmax and xid not in self.in_progress)


def current_snapshot(conn: Connection) -> XactSnapshot:
    """The snapshot of a statement in ``conn``'s transaction: what it saw committed."""
    return XactSnapshot.parse(
        str(conn.execute(text("select pg_current_snapshot()::text")).scalar())
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LagFigures:
    #: seconds, one per processing that covered at least one enqueue
    lags: list[float]
    #: enqueues of exams still alive that no worker transaction processed
    unprocessed: int


class LagTally:
    """Enqueues and processings of one timed run, matched by :meth:`figures`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._enqueued: dict[int, list[tuple[int, float]]] = {}
        self._processed: dict[int, list[tuple[float, XactSnapshot]]] = {}

    def enqueued(self, key: int, xid: int, at: float) -> None:
        """``key``'s enqueue by transaction ``xid`` committed; its commit returned ``at``."""
        with self._lock:
            self._enqueued.setdefault(key, []).append((xid, at))

    def processed(self, keys: Iterable[int], snapshot: XactSnapshot, at: float) -> None:
        """A worker transaction that saw ``snapshot`` processed ``keys``; its
        commit returned ``at``."""
        with self._lock:
            for key in keys:
                self._processed.setdefault(key, []).append((at, snapshot))

    def figures(self, live: set[int]) -> LagFigures:
        with self._lock:
            enqueued = {k: list(v) for k, v in self._enqueued.items()}
            processed = {k: sorted(v, key=lambda p: p[0]) for k, v in self._processed.items()}
        lags: list[float] = []
        unprocessed = 0
        for key, pending in enqueued.items():
            for at, snapshot in processed.get(key, []):
                covered = [t for xid, t in pending if snapshot.sees(xid)]
                pending = [(xid, t) for xid, t in pending if not snapshot.sees(xid)]
                if covered:
                    # A covered enqueue committed before the worker's snapshot;
                    # a thread scheduled late may still have stamped it after
                    # the worker's commit. Its true lag is not below zero.
                    lags.append(max(0.0, at - min(covered)))
            if key in live:
                unprocessed += len(pending)
        return LagFigures(lags=lags, unprocessed=unprocessed)


__all__ = [
    "LagFigures",
    "LagTally",
    "XactSnapshot",
    "current_snapshot",
    "current_xid",
]
