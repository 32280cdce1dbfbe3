"""Wake on enqueue: one connection that LISTENs on the queue jobs' channels.

An enqueue notifies its job's channel in the caller's transaction
(:func:`pgjobs.queue.channel`, migration 008); PostgreSQL delivers the
notification at commit. :class:`Listener` holds one connection of its own
(autocommit, out of the engine's pool), listens on the channels of the jobs
it is given and calls ``wake(job)`` for each notification, from its thread.
A burst is the caller's to coalesce (the scheduler runs one more tick,
however many wake-ups arrived during the current one).

When the connection is lost, the listener says so through ``on_lost`` and
reconnects by itself, every ``retry`` at most; once it listens again it
calls ``on_back`` (with the server it reached: after a failover, the new
primary, which a multi-host URL's ``target_session_attrs=read-write``
picks) and wakes every job, since what was enqueued meanwhile notified
nobody. Until then the jobs' polling interval is what runs them.

Every wait is bounded: connecting by the URL's ``connect_timeout``, each
round trip by its engine's deadline (:mod:`pgjobs.deadline`). A connection
that went half-open (no traffic, no close: a proxy or a NAT that dropped
it, a server host that vanished) delivers no notification and no error;
so every ``check_every`` seconds without a notification the listener makes
a cheap round trip (``select 1``) under ``check_timeout``, and one that
does not come back in time counts as a lost connection: noticed within
``check_every + check_timeout``.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Engine

from .deadline import DEFAULT_CALL_TIMEOUT, bound
from .queue import channel

log = logging.getLogger(__name__)

#: how long one wait for notifications lasts: the longest :meth:`Listener.stop` waits
_POLL_SECONDS = 0.2
#: seconds without a notification before the listener checks its connection
CHECK_EVERY = 5.0


class Listener:
    """LISTEN on the channels of ``jobs`` (names) in ``schema``; call
    ``wake(job)`` for each notification, in the listener's thread."""

    def __init__(
        self,
        engine: Engine,
        jobs: Iterable[str],
        *,
        schema: str,
        wake: Callable[[str], None],
        on_lost: Callable[[BaseException], None] | None = None,
        on_back: Callable[[str], None] | None = None,
        retry: tuple[float, float] = (0.2, 5.0),
        check_every: float = CHECK_EVERY,
        check_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.channels = {channel(schema, job): job for job in jobs}
        self.wake = wake
        self.on_lost = on_lost
        self.on_back = on_back
        self.retry = retry
        self.check_every = check_every
        self.check_timeout = check_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        #: set once the first LISTEN went through (tests and the scheduler wait on it)
        self.listening = threading.Event()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._main, name="pgjobs-listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and close the connection (within about 0.2 s; a
        thread still connecting is left to end on its own, at most its
        ``check_timeout`` later: it is a daemon, and what it opens it closes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.check_timeout)
            self._thread = None

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening connection (``None`` while it has none)."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    # -- the thread -----------------------------------------------------------------
    def _main(self) -> None:
        delay = self.retry[0]
        lost = False
        while not self._stop.is_set():
            try:
                self._conn = self._connect()
                self.listening.set()
                if lost:
                    lost = False
                    delay = self.retry[0]
                    if self.on_back is not None:
                        self.on_back(_server(self._conn))
                    for job in self.channels.values():
                        self._wake(job)
                self._receive(self._conn)
            except Exception as exc:  # the connection, or the server, is gone (wakes: _wake)
                self.listening.clear()
                if not self._stop.is_set() and not lost:
                    lost = True
                    log.debug("pgjobs: the listener lost its connection", exc_info=True)
                    if self.on_lost is not None:
                        self.on_lost(exc)
                self._stop.wait(delay)
                delay = min(delay * 2, self.retry[1])
            finally:
                self._close()

    def _connect(self) -> psycopg.Connection[Any]:
        # A connection of the engine's kind (URL, connect_args, creator), taken
        # out of its pool for good: it stays in LISTEN for the process's life.
        fairy = self.engine.raw_connection()
        conn = fairy.driver_connection
        fairy.detach()
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"listening needs a psycopg 3 connection, got {type(conn).__name__}")
        self._conn = conn
        bound(conn, self.check_timeout)  # before its first round trip
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        conn.autocommit = True
        for name in self.channels:
            conn.execute(sql.SQL("listen {}").format(sql.Identifier(name)))
        return conn

    def _receive(self, conn: psycopg.Connection[Any]) -> None:
        with selectors.DefaultSelector() as socket:  # (epoll where there is: no fd limit)
            socket.register(conn.pgconn.socket, selectors.EVENT_READ)
            self._receive_on(conn, socket)

    def _receive_on(self, conn: psycopg.Connection[Any], socket: selectors.BaseSelector) -> None:
        heard = time.monotonic()
        while not self._stop.is_set():
            names = _arrived(conn, socket, _POLL_SECONDS)
            if names:
                heard = time.monotonic()
            elif time.monotonic() - heard >= self.check_every:
                # a half-open connection says nothing: ask it something (a
                # notification that arrives meanwhile waits in psycopg's backlog:
                # taken at once); no answer in check_timeout raises
                conn.execute("select 1")
                heard = time.monotonic()
                names = [notify.channel for notify in conn.notifies(timeout=0)]
            for name in names:
                job = self.channels.get(name)
                if job is not None:
                    self._wake(job)

    def _wake(self, job: str) -> None:
        """``wake(job)``; what it raises is its bug, not a lost connection:
        logged, and the listener listens on (the job polls meanwhile)."""
        try:
            self.wake(job)
        except Exception:
            log.exception("pgjobs: waking %s on its enqueue failed; listening on", job)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("pgjobs: closing the listener's connection failed", exc_info=True)


def _arrived(
    conn: psycopg.Connection[Any], socket: selectors.BaseSelector, timeout: float
) -> list[str]:
    """The channels of the notifications that arrive on ``conn`` within
    ``timeout`` seconds (none: an empty list). A wait on its ``socket``, then
    libpq reads what came: psycopg's ``notifies(timeout=)`` cost the idle
    listener about 0.7 ms of CPU a call (4 ms a second of an idle
    scheduler, polling every 0.2 s), this about 0.1. A connection lost
    raises (libpq's read fails)."""
    pgconn = conn.pgconn
    if not socket.select(timeout):
        return []
    pgconn.consume_input()
    if pgconn.status == psycopg.pq.ConnStatus.BAD:
        raise psycopg.OperationalError("pgjobs: the listener's connection was lost")
    encoding = conn.info.encoding
    names = []
    while (notify := pgconn.notifies()) is not None:
        names.append(notify.relname.decode(encoding))
    return names


def _server(conn: psycopg.Connection[Any] | None) -> str:
    """``host:port`` of the server ``conn`` reached."""
    if conn is None or conn.closed:
        return "?"
    return f"{conn.info.host}:{conn.info.port}"


__all__ = ["Listener"]
