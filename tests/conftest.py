"""Every integration test gets a real PostgreSQL database of its own.

The server comes from ``--pgjobs-dsn`` / ``$PGJOBS_TEST_DSN``, else
testcontainers (when Docker answers), else an embedded PostgreSQL; with none
the session fails with instructions. Nothing is ever skipped for want of one.

Tests that need a program beyond Python and PostgreSQL are marked
``@pytest.mark.needs("pgbouncer")`` (see ``extras.py``): skipped where it is
missing, with the install hint, and named in the summary at the end;
failed instead where ``$PGJOBS_TEST_REQUIRE_EXTRAS=1`` (CI).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from extras import EXTRAS, binary, required
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

import pgjobs.worker.vacuum
from pgjobs.testing import ENV_DSN, find_server_url, fresh_database


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pgjobs-dsn", default=None, help=f"PostgreSQL server for tests (default: ${ENV_DSN})"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        for name in mark.args:
            if name not in EXTRAS:
                raise pytest.UsageError(
                    f"{item.nodeid}: needs({name!r}): not one of {', '.join(EXTRAS)}"
                )
            binary(name)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per program that was missing: how many tests it left out,
    and how to install it."""
    left_out: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        for name in EXTRAS:
            if reason.startswith(f"Skipped: needs {name},") or reason.startswith(f"needs {name},"):
                left_out[name] = left_out.get(name, 0) + 1
    if not left_out:
        return
    terminalreporter.section("left out for want of a program", sep="-")
    for name, count in left_out.items():
        terminalreporter.write_line(
            f"{count} test(s) need {name}, not installed here: {EXTRAS[name].hint}"
        )
    if not required():
        terminalreporter.write_line(
            "(skipped on this machine; CI installs them and sets $PGJOBS_TEST_REQUIRE_EXTRAS=1)"
        )


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests never auto-load whatever plugins happen to be installed.
    monkeypatch.setenv("PGJOBS_LOAD_PLUGINS", "")
    monkeypatch.delenv("PGJOBS_DATABASE_URL", raising=False)


@pytest.fixture(autouse=True)
def _fresh_vacuum_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's own VACUUM counts entries per schema in the process
    # (pgjobs/worker/vacuum.py): every test's database starts from none,
    # not from what a test before it (a held horizon: far apart) left.
    monkeypatch.setattr(pgjobs.worker.vacuum, "_deleted", {})
    monkeypatch.setattr(pgjobs.worker.vacuum, "_every", {})


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
