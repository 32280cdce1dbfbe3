"""The database's xmin horizon, shown (issue 39): ``pgjobs status``, the page
and the metrics name a snapshot held past ``horizon_warning``; a scheduler's
heartbeat logs one line when that starts and one when it ends; pgjobs'
sessions name their process and job in ``application_name``.

A held snapshot is another session's REPEATABLE READ transaction, left idle
in a thread of the test between two events. The threshold is a microsecond:
the holder's transaction began before the read that sees it, in order, so
it is always past it (nothing is timed).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.cli import cli
from pgjobs.config import load_config
from pgjobs.database import application_name, resolve_engine
from pgjobs.errors import ConfigError
from pgjobs.heartbeat import Heartbeat
from pgjobs.horizon import HorizonWatch
from pgjobs.metrics import Metrics
from pgjobs.serve import Request, Source
from pgjobs.web import StatusPage

TINY = timedelta(microseconds=1)


class Holder:
    """A session that holds a REPEATABLE READ snapshot from :meth:`hold`
    until :meth:`release`, in a thread of its own (scripted with events)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pid = 0
        self._held = threading.Event()
        self._release = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, application_name="nightly-report") as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            row = conn.execute("select pg_backend_pid()").fetchone()
            assert row is not None
            self.pid = row[0]  # the snapshot is taken: the transaction stays open
            self._held.set()
            self._release.wait(timeout=60)
            conn.commit()
        self._done.set()

    def hold(self) -> None:
        self._thread.start()
        assert self._held.wait(timeout=30)

    def release(self) -> None:
        self._release.set()
        assert self._done.wait(timeout=30)
        self._thread.join(timeout=30)


@pytest.fixture
def holder(db_url: str) -> Iterator[Holder]:
    found = Holder(db_url.replace("postgresql+psycopg://", "postgresql://"))
    yield found
    found._release.set()


def _status(db_url: str, config: Path) -> dict[str, Any]:
    result = CliRunner().invoke(
        cli, ["status", "--json", "-c", str(config), "--database", db_url], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_status_and_the_page_warn_of_a_held_snapshot_and_clear_after_it(
    engine: Engine, db_url: str, holder: Holder, tmp_path: Path
) -> None:
    job = pgjobs.TaskJob(name="export", run=lambda conn: None, every="1h")
    pgjobs.run_once(job, database=engine)  # installs pgjobs' tables
    config = tmp_path / "pgjobs.toml"
    config.write_text('horizon_warning = "0.000001"\n')
    assert load_config(config).horizon_warning == TINY
    page, source = StatusPage(), Source(engine=engine, jobs={"export": job}, horizon_warning=TINY)

    holder.hold()
    held = _status(db_url, config)
    assert held["horizon_held"] is True
    horizon = held["horizon"]
    assert horizon["pid"] == holder.pid
    assert horizon["application_name"] == "nightly-report"
    assert horizon["state"] == "idle in transaction"
    assert horizon["query"] == "select pg_backend_pid()"
    assert horizon["held_seconds"] >= 0
    text_out = CliRunner().invoke(cli, ["status", "-c", str(config), "--database", db_url]).stdout
    assert f"the xmin horizon is held back by pid {holder.pid} (nightly-report" in text_out
    body = page(source, Request("/")).body.decode()
    assert 'id="horizon"' in body and f"pid {holder.pid} (nightly-report" in body
    gauges = {
        s.name: s.value
        for f in text_string_to_metric_families(
            Metrics(cache_seconds=0).bind(source).exposition().decode()
        )
        for s in f.samples
        if s.name.startswith("pgjobs_horizon")
    }
    assert gauges["pgjobs_horizon_age_seconds"] > 0 and gauges["pgjobs_horizon_xid_age"] >= 0
    # a threshold not reached: shown in the JSON, not warned of
    calm = Source(engine=engine, jobs={"export": job}, horizon_warning=timedelta(hours=1))
    assert 'id="horizon"' not in page(calm, Request("/")).body.decode()

    holder.release()
    released = Metrics(cache_seconds=0).bind(source).exposition().decode()
    assert "pgjobs_horizon_age_seconds 0.0" in released
    after = _status(db_url, config)
    assert after["horizon"] is None and after["horizon_held"] is False
    assert 'id="horizon"' not in page(source, Request("/")).body.decode()
    assert "xmin horizon" not in (
        CliRunner().invoke(cli, ["status", "-c", str(config), "--database", db_url]).stdout
    )


def test_the_heartbeat_logs_one_line_when_it_is_held_and_one_when_it_ends(
    engine: Engine, holder: Holder, caplog: pytest.LogCaptureFixture
) -> None:
    pgjobs.install(engine)
    beat = Heartbeat(engine.connect, "pgjobs", ["export"], "5s", watch=HorizonWatch(TINY))
    caplog.set_level(logging.INFO, logger="pgjobs.horizon")

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "pgjobs.horizon"]

    beat.beat()
    assert lines() == []  # nothing held
    holder.hold()
    beat.beat()
    beat.beat()
    beat.beat()
    (started,) = lines()  # one line, not one a beat
    assert started.levelno == logging.WARNING
    message = started.getMessage()
    assert f"held back by pid {holder.pid} (nightly-report, idle in transaction" in message
    assert started.pgjobs["horizon"]["pid"] == holder.pid  # type: ignore[attr-defined]
    holder.release()
    beat.beat()
    beat.beat()
    assert [r.levelno for r in lines()] == [logging.WARNING, logging.INFO]
    assert f"no longer held back (pid {holder.pid} held it" in lines()[1].getMessage()


def test_pgjobs_sessions_name_their_process_and_job(engine: Engine, db_url: str) -> None:
    seen: list[str] = []

    def look(conn: Any) -> None:
        seen.append(conn.execute(text("select current_setting('application_name')")).scalar())

    job = pgjobs.TaskJob(name="export", run=look, every="1h")
    other = pgjobs.TaskJob(name="import", run=look, every="1h")
    owned, _ = resolve_engine(db_url)
    try:
        with owned.connect() as conn:  # before any tick: the process's name
            seen.append(conn.execute(text("select current_setting('application_name')")).scalar())
        pgjobs.run_once(job, database=owned, force=True)
        pgjobs.run_once(other, database=owned, force=True)  # the same session, another job
        pgjobs.run_once(job, database=owned, force=True)
        with owned.connect() as conn:  # after: the job it last served
            seen.append(conn.execute(text("select current_setting('application_name')")).scalar())
    finally:
        owned.dispose()
    assert seen == [
        application_name(),
        application_name("export"),
        application_name("import"),
        application_name("export"),
        application_name("export"),
    ]
    assert seen[0].startswith("pgjobs (") and seen[1].startswith("pgjobs: export (")
    # a name the user gave is left alone, in the tick too
    # (the embedded server's URL has a query already: its socket directory)
    mine, _ = resolve_engine(db_url + ("&" if "?" in db_url else "?") + "application_name=billing")
    try:
        pgjobs.run_once(job, database=mine, force=True)
    finally:
        mine.dispose()
    assert seen[-1] == "billing"


def test_a_bad_horizon_warning_is_named(tmp_path: Path) -> None:
    config = tmp_path / "pgjobs.toml"
    config.write_text('horizon_warning = "soon"\n')
    with pytest.raises(ConfigError, match=r"pgjobs.toml.*horizon_warning.*'soon'"):
        load_config(config)
    config.write_text('horizon_warning = "0s"\n')
    with pytest.raises(ConfigError, match="horizon_warning: must be positive"):
        load_config(config)
    with pytest.raises(ConfigError, match="horizon_warning"):
        pgjobs.Scheduler([], "postgresql://localhost/x", horizon_warning="0s")
