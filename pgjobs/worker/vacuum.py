"""The worker vacuums its own queue: after every :data:`VACUUM_EVERY`
entries this process took off a schema's queue, right after the commit
(see :func:`pgjobs.queue.vacuum_queue` for why).

While a snapshot holds the database's xmin horizon, a vacuum removes
nothing and still reads the whole table, which grows with every entry
processed meanwhile: at 800 items a second, a vacuum every 1.25 s on the
worker's connection cost the queue more each minute (`VACUUM` in 8 of 46
samples of the worker's session 390 s into a held horizon; lag p95 6.5x
its figure before the hold at 600 s). So when a vacuum leaves at least as
many dead entries as were taken off since the one before, the next comes
after twice as many entries (at most :data:`VACUUM_MOST`), and after
:data:`VACUUM_EVERY` again once one removes them.
"""

from __future__ import annotations

import threading

from sqlalchemy.engine import Connection

from ..jobs import RunContext
from ..queue import vacuum_queue

#: the queue is vacuumed after this many entries were taken off it (see vacuum_queue)
VACUUM_EVERY = 1000
#: the most entries taken off between two vacuums while they remove nothing
VACUUM_MOST = 256_000
_deleted_lock = threading.Lock()
#: entries this process took off each schema's queue since it last vacuumed it
_deleted: dict[str, int] = {}
#: after how many entries each schema's queue is vacuumed next, while vacuums
#: leave what they were meant to remove (else VACUUM_EVERY)
_every: dict[str, int] = {}


def count_deleted(ctx: RunContext, n: int) -> None:
    """Count ``n`` entries taken off the queue; when enough were, vacuum it
    once this tick has committed."""
    schema = ctx.schema
    with _deleted_lock:
        total = _deleted.get(schema, 0) + n
        due = total >= _every.get(schema, VACUUM_EVERY)
        _deleted[schema] = 0 if due else total
    if due:
        ctx.after_commit.append(lambda conn: _vacuum(conn, schema, total))


def _vacuum(conn: Connection, schema: str, taken: int) -> None:
    left = vacuum_queue(conn, schema=schema)
    with _deleted_lock:
        if left is not None and left >= taken:  # it removed nothing of it: held
            _every[schema] = min(2 * _every.get(schema, VACUUM_EVERY), VACUUM_MOST)
        else:
            _every.pop(schema, None)


__all__ = [
    "VACUUM_EVERY",
    "VACUUM_MOST",
    "count_deleted",
]
