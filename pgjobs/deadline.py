"""Client-side deadlines on every round trip pgjobs makes, and the one way
to abandon a connection.

psycopg waits for the server's answer as long as it takes: a statement
stuck on a server that stopped answering (a failover, a half-open TCP
connection behind a proxy or a NAT, a commit waiting for a synchronous
standby that is gone) blocks its thread forever. In the field that was
SQLAlchemy's pool pre-ping (``select 1``) on pooled connections to an old
primary: the tick's slot stayed taken, and the process never ran another
tick.

:func:`bound_engine` puts every connection of an engine under
:class:`BoundedConnection` (a class swap at connect, for engines of the
user's too): each of its waits for the server (a round trip: a statement,
a pipeline's sync, a COMMIT, the pool's ping) has a deadline, the
connection's :func:`bound`: ``call_timeout`` for the pool's ping, and
while pgjobs uses it (a tick sets its own, see :func:`bounded`). On an
engine pgjobs created, always; on a user's, the user's own statements
keep no deadline (a checkout sets none; pgjobs sets one for its use). psycopg's own wait loop enforces it (it wakes every
0.1 s anyway): the cost is one Python call per round trip, about 0.2 µs,
and no thread. Past the deadline the connection is abandoned
(:func:`abandon_connection`: its socket shut down and the libpq connection
closed, *broken*), and :class:`DeadlineExceeded` is raised: an
``OperationalError`` on a broken connection, which SQLAlchemy counts as a
disconnect, so that its pool hands out a fresh connection next.

Connecting is bounded by libpq's ``connect_timeout`` (psycopg applies it
client-side): engines pgjobs creates set it (:mod:`pgjobs.database`), and
:func:`bound_engine` gives a user's engine :data:`CONNECT_TIMEOUT` unless it
sets one itself (its URL or ``connect_args``, a ``conninfo`` string,
``$PGCONNECT_TIMEOUT``): without one, a connect to a host that accepts and
never answers (a failover's old primary behind a proxy) waited some two
minutes, for the kernel to give up; a shutdown's last heartbeat with it.

:func:`abandon_connection` may be called from another thread too (a
shutdown deadline cancelling what runs: shut the socket down, and the
owner's blocked wait returns with an error); :func:`cancel_statement` asks
the server to cancel the running statement first, within a bound.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)


#: seconds: the default bound of a bookkeeping round trip (pgjobs' own
#: statements, the pool's ping, the listener's check)
DEFAULT_CALL_TIMEOUT = 10.0
#: seconds: the longest a connect waits for a host (libpq's
#: ``connect_timeout``), on a user's engine that sets none
CONNECT_TIMEOUT = 5
#: seconds: the least bound of one round trip of an installation (a
#: migration may rewrite a table, or wait for another process installing);
#: :func:`pgjobs.migrations.migrate` allows more where its settings let the
#: server take longer
INSTALL_TIMEOUT = 300.0

try:  # psycopg's wait loop wakes this often to let a Ctrl-C through
    from psycopg.connection import _WAIT_INTERVAL
except ImportError:  # pragma: no cover - psycopg moved it
    _WAIT_INTERVAL = 0.1

_WaitTimeout: type[BaseException] = getattr(errors, "_WaitTimeout", errors.OperationalError)

if "timeout" not in inspect.signature(psycopg.Connection.wait).parameters:
    # psycopg before 3.3.6: its wait loop has no deadline to enforce, and
    # every round trip would fail on the argument (pyproject.toml says so too)
    raise ImportError(
        f"pgjobs needs psycopg >= 3.3.6, whose Connection.wait() takes a timeout"
        f" (the deadline of each round trip); psycopg {psycopg.__version__} is installed"
    )


class DeadlineExceeded(psycopg.OperationalError):
    """No answer from the server within the deadline; the connection was
    abandoned (its socket shut down) and will not be used again."""


#: psycopg's own wait, which the bounded one calls (looked up once: it runs
#: for every statement, about 7 times per round trip in a pipeline)
_plain_wait = psycopg.Connection.wait


class BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait for the server has a deadline:
    :attr:`pgjobs_bound` seconds (0: none)."""

    #: the deadline of one wait, in seconds (0: none); set per connection
    pgjobs_bound: float = 0.0

    def wait(
        self,
        gen: Any,
        interval: float = _WAIT_INTERVAL,
        timeout: float | None = None,
    ) -> Any:
        bound = self.pgjobs_bound
        if timeout is not None or not bound:
            # a wait with a timeout of its own (notifies(timeout=...)): the caller's
            return _plain_wait(self, gen, interval, timeout)
        try:
            return _plain_wait(self, gen, interval, bound)
        except _WaitTimeout:
            abandon_connection(self, owner=True)
            raise DeadlineExceeded(
                f"pgjobs: no answer from the server within {bound:g} s;"
                " the connection was abandoned"
            ) from None

    #: how many times psycopg sent DEALLOCATE ALL on this connection (after
    #: a ROLLBACK, DROP or ALTER it saw while it had statements prepared):
    #: pgjobs' own prepared statements went with its (:mod:`pgjobs._wire`)
    pgjobs_deallocations: int = 0

    def _deallocate(self, name: bytes | None) -> Any:
        if name is None:
            self.pgjobs_deallocations += 1
        return super()._deallocate(name)


def bound(raw: psycopg.Connection[Any], seconds: float) -> float:
    """Set the deadline of each of ``raw``'s round trips to ``seconds`` (0:
    none); returns the previous one. A connection not yet bounded becomes
    a :class:`BoundedConnection`."""
    _adopt(raw)
    previous = raw.pgjobs_bound  # type: ignore[attr-defined]
    raw.pgjobs_bound = seconds  # type: ignore[attr-defined]
    return float(previous)


def bound_of(conn: Connection) -> float:
    """The deadline of each of ``conn``'s round trips now, in seconds (0:
    none, or a connection that is not psycopg's or is gone)."""
    raw = _raw_of(conn)
    return float(getattr(raw, "pgjobs_bound", 0.0)) if raw is not None else 0.0


@contextlib.contextmanager
def bounded(conn: Connection, seconds: float) -> Iterator[None]:
    """Within the block, each round trip of ``conn`` (a SQLAlchemy connection)
    has a deadline of ``seconds``; the previous bound afterwards. The
    block's connection may be replaced meanwhile (a lost one, reconnected):
    the new one has its engine's default."""
    raw = _raw_of(conn)
    if raw is None:
        yield
        return
    previous = bound(raw, seconds)
    try:
        yield
    finally:
        if not raw.closed:
            raw.pgjobs_bound = previous  # type: ignore[attr-defined]


def bound_for_use(conn: Connection, seconds: float) -> None:
    """Bound each round trip of ``conn`` (a SQLAlchemy connection) to
    ``seconds`` until it goes back to its pool, its reset (a rollback)
    included: the pool's checkin and checkout events set the bound again
    (:func:`bound_engine`)."""
    raw = _raw_of(conn)
    if raw is not None:
        bound(raw, seconds)


def _raw_of(conn: Connection) -> psycopg.Connection[Any] | None:
    if conn.invalidated or conn.closed:
        return None
    raw = conn.connection.driver_connection
    return raw if isinstance(raw, psycopg.Connection) else None


def _adopt(raw: psycopg.Connection[Any]) -> None:
    if type(raw) is psycopg.Connection:
        raw.__class__ = BoundedConnection
    elif not isinstance(raw, BoundedConnection):
        raise TypeError(
            f"pgjobs bounds psycopg.Connection, not a subclass of it: {type(raw).__name__}"
        )


#: engines already bounded, and their call timeout
_BOUND_ENGINES = "pgjobs_call_timeout"


def bound_engine(engine: Engine, call_timeout: float, *, own: bool = True) -> None:
    """Bound the connections of ``engine``: the pool's ping (at connect and
    checkin the bound is ``call_timeout``, which the ping at the next
    checkout finds) and, when the engine is pgjobs' ``own``, every round
    trip unless a tick sets its own (:func:`bounded`). A user's engine gets
    no bound at checkout: pgjobs bounds its own use of it (:func:`bounded`).
    Idempotent; a second call changes the timeout."""
    already = _BOUND_ENGINES in engine.__dict__
    engine.__dict__[_BOUND_ENGINES] = call_timeout
    if already:
        return

    def for_ping(dbapi_conn: Any, *_: Any) -> None:
        if isinstance(dbapi_conn, psycopg.Connection):
            bound(dbapi_conn, float(engine.__dict__[_BOUND_ENGINES]))

    def for_use(dbapi_conn: Any, *_: Any) -> None:
        # also resets a bound a tick left behind (it restores it, unless its
        # connection failed in between)
        if isinstance(dbapi_conn, psycopg.Connection):
            bound(dbapi_conn, float(engine.__dict__[_BOUND_ENGINES]) if own else 0.0)

    event.listen(engine, "do_connect", _connect_bounded)
    event.listen(engine, "connect", for_ping)
    event.listen(engine, "checkin", for_ping)
    event.listen(engine, "checkout", for_use)


def _connect_bounded(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    """A connect of an engine that sets no ``connect_timeout`` gets one."""
    given = (
        "connect_timeout" in cparams
        or bool(os.environ.get("PGCONNECT_TIMEOUT"))
        or any("connect_timeout" in str(v) for v in (*cargs, cparams.get("conninfo", "")))
    )
    if not given:
        cparams["connect_timeout"] = CONNECT_TIMEOUT


def abandon_connection(raw: psycopg.Connection[Any], *, owner: bool = False) -> None:
    """Give ``raw`` up: shut its socket down, so that a wait blocked on it
    (in any thread) returns with an error at once, and the server sees the
    session end. ``owner``: the caller is the thread using ``raw`` (not in
    a call on it): the libpq connection is closed too, marked broken (so
    that SQLAlchemy's pool drops it). From another thread only the socket
    is shut down: the owner's next read fails and psycopg closes it there.
    Never raises."""
    if raw.closed:
        return
    with contextlib.suppress(Exception):
        fd = raw.pgconn.socket
        dup = socket.socket(fileno=os.dup(fd))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()
    if owner:
        with contextlib.suppress(Exception):
            raw.pgconn.finish()  # not raw.close(): broken, not closed cleanly


def cancel_statement(raw: psycopg.Connection[Any], *, timeout: float = 5.0) -> bool:
    """Ask the server to cancel the statement ``raw`` runs (from any thread),
    waiting at most ``timeout`` seconds for the request to be delivered;
    whether it was. The statement's wait then ends with ``QueryCanceled``;
    when the server cannot be reached, :func:`abandon_connection` is what
    is left."""
    if raw.closed:
        return False
    try:
        raw.cancel_safe(timeout=timeout)
    except Exception:
        log.debug("pgjobs: cancelling the statement failed", exc_info=True)
        return False
    return True


def exceeded(exc: BaseException | None) -> bool:
    """Did ``exc`` (or what it wraps) come from a deadline that passed?"""
    return passed(exc) is not None


def passed(exc: BaseException | None) -> DeadlineExceeded | None:
    """The deadline that passed behind ``exc``, if one did: what to report
    rather than what it caused afterwards ("the connection is closed", from
    a rollback on the connection it abandoned)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for found in (exc, getattr(exc, "orig", None)):
            if isinstance(found, DeadlineExceeded):
                return found
        exc = exc.__cause__ or exc.__context__
    return None


__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_CALL_TIMEOUT",
    "INSTALL_TIMEOUT",
    "BoundedConnection",
    "DeadlineExceeded",
    "abandon_connection",
    "bound",
    "bound_engine",
    "bound_for_use",
    "bound_of",
    "bounded",
    "cancel_statement",
    "exceeded",
    "passed",
]
