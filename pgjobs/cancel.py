"""Cancelling, from another thread, the statement a connection is running.

A shutdown deadline (:meth:`pgjobs.Scheduler.shutdown` with ``timeout``)
ends the ticks still running when it passes by cancelling their statements
on the server: the driver's cancel request, which libpq sends over a
connection of its own (the one the statement runs on is busy), bounded by a
timeout. The server then fails the statement with SQLSTATE 57014, and the
tick rolls back. A connection that runs nothing at that moment is left as
it is: the server ignores a cancel request that finds no statement running.

Kept in one function, apart from the runner, so that a client-side deadline
on database calls can use the same mechanism.
"""

from __future__ import annotations

import logging

import psycopg
from sqlalchemy.engine import Connection

log = logging.getLogger(__name__)

#: the longest a cancel request may take (connect, send, the server's answer)
CANCEL_TIMEOUT = 2.0


def cancel_statement(conn: Connection, *, timeout: float = CANCEL_TIMEOUT) -> bool:
    """Ask the server to cancel the statement ``conn`` is running now (``conn``
    is in use by another thread). True when the request was delivered; never
    raises."""
    try:
        if conn.invalidated or conn.closed:
            return False
        raw = conn.connection.driver_connection
        if not isinstance(raw, psycopg.Connection) or raw.closed:
            return False
        raw.cancel_safe(timeout=timeout)
    except Exception:
        log.debug("pgjobs: a cancel request failed", exc_info=True)
        return False
    return True


__all__ = ["CANCEL_TIMEOUT", "cancel_statement"]
