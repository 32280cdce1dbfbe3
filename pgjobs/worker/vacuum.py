"""The worker vacuums its own queue: after every :data:`VACUUM_EVERY`
entries this process took off a schema's queue, right after the commit
(see :func:`pgjobs.queue.vacuum_queue` for why).
"""

from __future__ import annotations

import threading

from ..jobs import RunContext
from ..queue import vacuum_queue

#: the queue is vacuumed after this many entries were taken off it (see vacuum_queue)
VACUUM_EVERY = 1000
_deleted_lock = threading.Lock()
#: entries this process took off each schema's queue since it last vacuumed it
_deleted: dict[str, int] = {}


def count_deleted(ctx: RunContext, n: int) -> None:
    """Count ``n`` entries taken off the queue; at :data:`VACUUM_EVERY`, vacuum
    it once this tick has committed."""
    schema = ctx.schema
    with _deleted_lock:
        total = _deleted.get(schema, 0) + n
        due = total >= VACUUM_EVERY
        _deleted[schema] = 0 if due else total
    if due:
        ctx.after_commit.append(lambda conn: vacuum_queue(conn, schema=schema))


__all__ = [
    "VACUUM_EVERY",
    "count_deleted",
]
