"""Turning what users pass as ``database=`` into a SQLAlchemy engine."""

from __future__ import annotations

import os

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError

from .errors import ConfigError

ENV_URL = "PGJOBS_DATABASE_URL"


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
    return create_engine(parsed, pool_pre_ping=True), True
