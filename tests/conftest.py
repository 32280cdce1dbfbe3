"""Every integration test gets a real PostgreSQL database of its own.

The server comes from ``--pgjobs-dsn`` / ``$PGJOBS_TEST_DSN``, else
testcontainers (when Docker answers), else an embedded PostgreSQL; with none
the session fails with instructions. Nothing is ever skipped for want of one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from pgjobs.testing import ENV_DSN, find_server_url, fresh_database


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pgjobs-dsn", default=None, help=f"PostgreSQL server for tests (default: ${ENV_DSN})"
    )


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests never auto-load whatever plugins happen to be installed.
    monkeypatch.setenv("PGJOBS_LOAD_PLUGINS", "")
    monkeypatch.delenv("PGJOBS_DATABASE_URL", raising=False)


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a server on which tests may create databases."""
    with find_server_url(request.config.getoption("--pgjobs-dsn")) as url:
        yield url


@pytest.fixture
def db_url(pg_server: str) -> Iterator[str]:
    """URL of a fresh, empty database, dropped after the test."""
    with fresh_database(pg_server) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def env_db(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fresh database also as $PGJOBS_DATABASE_URL, for CLI tests."""
    monkeypatch.setenv("PGJOBS_DATABASE_URL", db_url)
    return db_url
