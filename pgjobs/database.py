"""Turning what users pass as ``database=`` into a SQLAlchemy engine, and
the one setting for a transaction pooler between pgjobs and PostgreSQL.

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

import os
from collections.abc import Mapping
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError

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


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def resolve_engine(
    database: str | Engine | None, *, field: str = "database"
) -> tuple[Engine, bool]:
    """Return ``(engine, owned)``; an owned engine is disposed of by the caller.

    ``database`` is a URL (``postgresql://`` or ``postgresql+psycopg://``), an
    :class:`~sqlalchemy.engine.Engine`, or ``None`` for ``$PGJOBS_DATABASE_URL``.
    """
    if isinstance(database, Engine):
        return database, False
    url = database if database is not None else os.environ.get(ENV_URL)
    if not url:
        raise ConfigError(f"{field}: no database given; pass a URL or set ${ENV_URL}")
    if not isinstance(url, str):
        raise ConfigError(f"{field}: expected a URL or an Engine, got {database!r}")
    url = normalize_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"{field}: not a database URL: {url!r}") from exc
    if parsed.drivername != "postgresql+psycopg":
        raise ConfigError(
            f"{field}: pgjobs needs PostgreSQL through psycopg 3 (postgresql://...), got {parsed.drivername!r}"
        )
    connect_args: dict[str, Any] = {}
    if transaction_pooling():
        # A statement prepared on one server session is unknown on the next.
        connect_args["prepare_threshold"] = None
    return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args), True
