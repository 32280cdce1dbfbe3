"""A fresh database per test on the server pgjobs' tests use
(``$PGJOBS_TEST_DSN``, else Docker or an embedded PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from pgjobs.testing import find_server_url, fresh_database


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGJOBS_LOAD_PLUGINS", "")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    with find_server_url() as url:
        yield url


@pytest.fixture
def engine(pg_server: str) -> Iterator[Engine]:
    with fresh_database(pg_server, prefix="pgjobs_example") as url:
        eng = create_engine(url)
        try:
            yield eng
        finally:
            eng.dispose()
