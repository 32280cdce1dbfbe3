"""Turning what users pass as ``database=`` into a SQLAlchemy engine, and
the one setting for a transaction pooler between pgjobs and PostgreSQL.

A URL may name several hosts, as libpq's does and as pg_auto_failover and
Patroni hand out (``postgresql://u@h1:5432,h2:5432/app?target_session_attrs=
read-write``): :func:`normalize_url` turns it into SQLAlchemy's form
(``?host=h1:5432&host=h2:5432``), and libpq tries the hosts in turn, keeping
the first that matches ``target_session_attrs``.

Engines pgjobs creates from a URL connect with TCP keepalives, a
``tcp_user_timeout`` and a ``connect_timeout`` (:data:`CONNECT_DEFAULTS`),
each unless the URL sets it, so that a peer that vanished (a failover, a
network cut) is noticed by the kernel; and every engine pgjobs uses, the
user's too, has a deadline on each round trip (:mod:`pgjobs.deadline`).

Sessions of engines pgjobs creates carry an ``application_name`` naming
the process (:func:`application_name`: ``pgjobs (4242@host)``), unless the
URL or ``$PGAPPNAME`` gives one; a job's tick names the job it serves
(``pgjobs: exam-scores (4242@host)``, set in the tick's first round trip
when the session named another, and kept: the job it last served), on
any session whose name is pgjobs' or empty, so that an operator can tell
pgjobs' sessions apart in ``pg_stat_activity``. A name the user gave is
left alone.

``$PGJOBS_TRANSACTION_POOLING=1`` says that consecutive transactions of one
connection may run on different server sessions (PgBouncer with
``pool_mode = transaction``, and the like). pgjobs then keeps nothing in a
session from one transaction to the next:

* engines it creates from a URL never prepare statements (psycopg's
  ``prepare_threshold=None``; give an Engine of your own the same
  ``connect_args``);
* chunked writes (``RecomputeJob(chunk_parents=N)``), which hold the group
  lock at session level and their temp tables across commits, write in one
  transaction instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

import psycopg
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError

from .deadline import CONNECT_TIMEOUT, DEFAULT_CALL_TIMEOUT, bound_engine
from .errors import ConfigError

ENV_URL = "PGJOBS_DATABASE_URL"
ENV_TRANSACTION_POOLING = "PGJOBS_TRANSACTION_POOLING"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def transaction_pooling(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$PGJOBS_TRANSACTION_POOLING`` says a transaction pooler is in
    between (``1``/``true``/``yes``/``on``; unset, empty or ``0``/``false``/
    ``no``/``off``: not); anything else is a :class:`ConfigError`."""
    value = (os.environ if env is None else env).get(ENV_TRANSACTION_POOLING, "")
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ConfigError(
        f"${ENV_TRANSACTION_POOLING}: expected 1, true, yes, on or 0, false, no, off, got {value!r}"
    )


#: libpq settings of the connections of engines pgjobs creates from a URL,
#: each unless the URL gives it: keepalives after 10 s of silence, every 5 s,
#: 3 unanswered drop the connection (a vanished peer noticed in about 25 s);
#: data unacknowledged for 20 s drops it too; a host that does not answer
#: a connect within 5 s is given up (the next host of a multi-host URL tried)
CONNECT_DEFAULTS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,
    "connect_timeout": CONNECT_TIMEOUT,
}

#: what every session name of pgjobs' starts with (:func:`application_name`)
APPLICATION_PREFIX = "pgjobs"


def application_name(job: str | None = None) -> str:
    """The ``application_name`` of this process's sessions: ``pgjobs
    (<pid>@<host>)``, with ``: <job>`` during a tick of that job (the job
    first: PostgreSQL keeps 63 bytes)."""
    where = f"({os.getpid()}@{socket.gethostname()})"
    if job is None:
        return f"{APPLICATION_PREFIX} {where}"
    return f"{APPLICATION_PREFIX}: {job} {where}"


def names_itself(dbapi_conn: Any) -> bool:
    """Whether the session's ``application_name`` is pgjobs' own or empty
    (then a tick may name its job there); a user's name is left alone."""
    if not isinstance(dbapi_conn, psycopg.Connection):
        return False
    name = dbapi_conn.info.parameter_status("application_name") or ""
    return not name or name.startswith(APPLICATION_PREFIX)


_MULTI_HOST = re.compile(
    r"^(?P<scheme>[^:/]+://)(?P<user>[^@/?#]*@)?(?P<hosts>[^/?#]*)(?P<rest>.*)$"
)


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here; a libpq
    multi-host URL (``h1:p1,h2:p2``) becomes SQLAlchemy's ``?host=h1:p1&host=h2:p2``."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    return _multi_host(url)


def _multi_host(url: str) -> str:
    match = _MULTI_HOST.match(url)
    if match is None or "," not in match["hosts"]:
        return url
    hosts = match["hosts"].split(",")
    if not all(hosts):
        raise ConfigError(f"database: an empty host in the URL's host list: {match['hosts']!r}")
    rest = match["rest"]
    path, _, query = rest.partition("?")
    params = "&".join(f"host={quote(host, safe=':[]')}" for host in hosts)
    return f"{match['scheme']}{match['user'] or ''}{path or '/'}?{params}" + (
        f"&{query}" if query else ""
    )


def resolve_engine(
    database: str | Engine | None,
    *,
    field: str = "database",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    pooled: bool | None = None,
) -> tuple[Engine, bool]:
    """Return ``(engine, owned)``; an owned engine is disposed of by the caller.

    ``database`` is a URL (``postgresql://`` or ``postgresql+psycopg://``, one
    host or several), an :class:`~sqlalchemy.engine.Engine`, or ``None`` for
    ``$PGJOBS_DATABASE_URL``. Either way each round trip of the engine's
    connections has a deadline of ``call_timeout`` seconds unless a tick
    sets its own (:mod:`pgjobs.deadline`). ``pooled``: a transaction pooler
    is in between (``None``: as ``$PGJOBS_TRANSACTION_POOLING`` says).
    """
    if isinstance(database, Engine):
        bound_engine(database, call_timeout, own=False)
        return database, False
    url = database if database is not None else os.environ.get(ENV_URL)
    if not url:
        raise ConfigError(f"{field}: no database given; pass a URL or set ${ENV_URL}")
    if not isinstance(url, str):
        raise ConfigError(f"{field}: expected a URL or an Engine, got {database!r}")
    try:
        url = normalize_url(url)
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"{field}: not a database URL: {url!r}") from exc
    if parsed.drivername != "postgresql+psycopg":
        raise ConfigError(
            f"{field}: pgjobs needs PostgreSQL through psycopg 3 (postgresql://...), got {parsed.drivername!r}"
        )
    connect_args: dict[str, Any] = {
        name: value for name, value in CONNECT_DEFAULTS.items() if name not in parsed.query
    }
    if "application_name" not in parsed.query and not os.environ.get("PGAPPNAME"):
        connect_args["application_name"] = application_name()
    if pooled is None:
        pooled = transaction_pooling()
    if pooled:
        # A statement prepared on one server session is unknown on the next.
        connect_args["prepare_threshold"] = None
    # the pool's pre-ping is a round trip like any other: bounded (call_timeout)
    engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
    bound_engine(engine, call_timeout)
    if not pooled:
        event.listen(engine, "connect", _local_commit)
    return engine, True


@contextlib.contextmanager
def engine_for(
    database: str | Engine | None,
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    pooled: bool | None = None,
) -> Iterator[Engine]:
    """:func:`resolve_engine` for the length of a block: an engine pgjobs
    made from a URL is disposed of after it (what a CLI command or a
    one-off call uses)."""
    engine, owned = resolve_engine(database, call_timeout=call_timeout, pooled=pooled)
    try:
        yield engine
    finally:
        if owned:
            engine.dispose()


def _local_commit(dbapi_conn: Any, record: Any) -> None:
    """The session's commits wait for this server's disk, never for a
    synchronous standby: also the one a backend makes as it exits, dropping
    the session's temp tables (the queue worker's). On a primary told to
    shut down that commit waited for a standby the switchover had taken
    away: the backend stood as ``idle waiting for <LSN>``, and the primary's
    fast shutdown for 60 s and more. (Not behind a transaction pooler: a
    session setting would reach other clients' transactions there.)"""
    if isinstance(dbapi_conn, psycopg.Connection):
        idle = dbapi_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        dbapi_conn.execute("set synchronous_commit = local")
        if idle and not dbapi_conn.autocommit:
            dbapi_conn.commit()


__all__ = [
    "APPLICATION_PREFIX",
    "CONNECT_DEFAULTS",
    "ENV_TRANSACTION_POOLING",
    "ENV_URL",
    "application_name",
    "engine_for",
    "names_itself",
    "normalize_url",
    "resolve_engine",
    "transaction_pooling",
]
