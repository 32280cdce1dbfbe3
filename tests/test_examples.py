"""The examples under ``examples/`` work as their READMEs say, on a real PostgreSQL.

* ``fastapi_app``: the app's lifespan starts pgjobs' scheduler, a request
  enqueues an item, the worker job runs, ``GET /jobs/status`` shows it; after
  shutdown no thread and no database connection is left, and pgjobs touched
  neither the signal handlers nor the logging configuration.
* ``exams``: the plugin module registers its two jobs from ``pgjobs.toml``
  and they run: the recompute fills the scores, a change enqueued by the
  application code is processed by the worker, which upserts the status row.
* ``config_only``: a recompute job declared in TOML + SQL runs with
  ``pgjobs once`` and writes exactly the difference.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import pgjobs
from pgjobs.checks import check_jobs
from pgjobs.cli import cli
from pgjobs.database import normalize_url

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

with warnings.catch_warnings():
    # Starlette >= 1.x asks for httpx2 behind its test client and warns (once,
    # at import) when it finds only httpx; the client works with either.
    warnings.filterwarnings("ignore", message=r"Using `httpx` with `starlette\.testclient`")
    from fastapi.testclient import TestClient


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _apply(url: str, sql_file: Path) -> None:
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute(sql_file.read_text(encoding="utf-8"))  # type: ignore[call-overload]


def _query(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(_libpq(url)) as conn:
        return conn.execute(query, params).fetchall()  # type: ignore[call-overload, no-any-return]


def _load_module(path: Path) -> ModuleType:
    name = f"example_{path.parent.name}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy (waiting for a state,
    not asserting a duration)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def fastapi_module() -> Iterator[ModuleType]:
    module = _load_module(EXAMPLES / "fastapi_app" / "app.py")
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


def test_fastapi_app_runs_jobs_in_its_lifespan_and_leaves_nothing_behind(
    db_url: str, fastapi_module: ModuleType
) -> None:
    _apply(db_url, EXAMPLES / "fastapi_app" / "schema.sql")
    dbname = db_url.rsplit("/", 1)[1].split("?")[0]
    threads_before = set(threading.enumerate())
    handlers_before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    logging_before = (list(root.handlers), root.level, logging.getLogger("pgjobs").handlers[:])

    app = fastapi_module.create_app(db_url)
    with TestClient(app) as client:
        # pgjobs runs, and has installed no signal handler, no logging setup.
        assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before
        assert (list(root.handlers), root.level, logging.getLogger("pgjobs").handlers[:]) == (
            logging_before
        )

        # The recompute fires at start-up: one stats row per author.
        def recompute_ran() -> bool:
            jobs = {j["job"]: j for j in client.get("/jobs/status").json()["jobs"]}
            return jobs["author-stats"]["last_ran_at"] is not None

        _until("the start-up recompute", recompute_ran)
        assert client.post("/authors/7/posts", json={"title": "hello"}).status_code == 201
        assert client.post("/authors/7/posts", json={"title": "again"}).status_code == 201
        assert client.post("/authors/999/posts", json={"title": "nobody"}).status_code == 404

        # The worker job (every 1 s) processes author 7; its row shows both posts.
        def worker_ran() -> dict[str, Any] | None:
            status = client.get("/jobs/status").json()
            jobs = {j["job"]: j for j in status["jobs"]}
            worker = jobs["author-stats-worker"]
            if worker["last_ran_at"] is None or worker["queue"] is not None:
                return None
            return status

        status = _until("the worker job to run", worker_ran)
        assert client.get("/authors/7/stats").json()["posts"] == 2

    # The status endpoint's JSON, as the worker left it.
    assert status["running"] is True
    jobs = {j["job"]: j for j in status["jobs"]}
    assert set(jobs) == {"author-stats", "author-stats-worker"}
    recompute, worker = jobs["author-stats"], jobs["author-stats-worker"]
    assert (recompute["kind"], worker["kind"]) == ("recompute", "queue")
    assert recompute["group"] == worker["group"] == "author_stats"
    assert (recompute["schedule"], worker["schedule"]) == ("every 10m", "every 1s")
    # The recompute ran at start-up: one stats row per author (50).
    assert recompute["last_outcome"] == "ran"
    assert recompute["rows_changed"] == {"inserted": 50, "updated": 0, "deleted": 0}
    # The worker's run that wrote changed author 7's row only (once or, if the
    # two posts landed in two ticks, it updated it each time: never inserted).
    assert worker["rows_changed"]["inserted"] == 0
    assert worker["rows_changed"]["updated"] == 1
    assert worker["queue"] is None  # drained: no entry left for the job
    assert _query(db_url, "select posts from author_stats where author_id = 7") == [(2,)]

    # Shut down: no thread and no connection left behind.
    def threads_gone() -> bool:
        return set(threading.enumerate()) <= threads_before

    leftover = set(threading.enumerate()) - threads_before
    assert threads_gone(), f"threads left behind: {sorted(t.name for t in leftover)}"
    others = _query(
        db_url,
        "select pid, application_name, state, query from pg_stat_activity"
        " where datname = %s and pid <> pg_backend_pid()",
        (dbname,),
    )
    assert others == []


def test_exams_plugin_registers_and_runs_its_jobs(db_url: str) -> None:
    folder = EXAMPLES / "exams"
    _apply(db_url, folder / "schema.sql")
    config = pgjobs.load_config(folder / "pgjobs.toml")
    registry = pgjobs.Registry.load(config, entry_points=False)
    assert sorted(registry.owner(name) for name in ("exam-scores", "exam-worker")) == [
        "exams_jobs",
        "exams_jobs",
    ]
    scores, worker = registry.get("exam-scores"), registry.get("exam-worker")
    assert isinstance(scores, pgjobs.RecomputeJob) and isinstance(worker, pgjobs.QueueJob)
    assert scores.group == worker.group == "exams"
    assert scores.schedule == "every 15m"  # pgjobs.toml's override of the plugin's setting
    plugin = sys.modules["exams_jobs"]

    with pgjobs.Runner(db_url, namespace=config.namespace, schema=config.schema) as runner:
        check_jobs(runner.engine, registry.entries())
        first = runner.tick(scores, force=True)
        assert first.outcome is pgjobs.Outcome.RAN, first.error
        assert first.stats.inserted == 5000  # 1,000 exams x 5 students
        assert runner.tick(worker).outcome is pgjobs.Outcome.IDLE

        # Application code: change exam 42's weight and enqueue it, atomically.
        with runner.engine.begin() as conn:
            plugin.change_weight(conn, 42, 9)
        result = runner.tick(worker, force=True)
        assert result.outcome is pgjobs.Outcome.RAN, result.error
        assert (result.items, result.stats.updated, result.stats.inserted) == (1, 5, 0)
        # The queue is empty again (force: ignore the 1 s interval, not the queue).
        assert runner.tick(worker, force=True).outcome is pgjobs.Outcome.IDLE

    assert _query(db_url, "select students from exam_status where exam_id = 42") == [(5,)]
    drift = _query(
        db_url,
        "select count(*) from ((table exam_score except all " + plugin.SCORES + ")"
        " union all (" + plugin.SCORES + " except all table exam_score)) d",
    )
    assert drift == [(0,)]


def test_config_only_recompute_runs_from_toml_and_sql(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = EXAMPLES / "config_only"
    _apply(db_url, folder / "schema.sql")
    monkeypatch.chdir(folder)  # ./pgjobs.toml is the default config, as the README runs it
    runner = CliRunner()

    listed = runner.invoke(cli, ["list", "--database", db_url])
    assert listed.exit_code == 0, listed.output
    assert "customer-totals" in listed.output

    first = runner.invoke(cli, ["once", "customer-totals", "--database", db_url, "--json"])
    assert first.exit_code == 0, first.output
    expected = _query(db_url, (folder / "customer_totals.sql").read_text() + " order by 1")
    assert _query(db_url, "select * from customer_total order by 1") == expected
    assert len(expected) == 100

    # Two customers' orders change: the next run writes exactly their rows.
    with psycopg.connect(_libpq(normalize_url(db_url))) as conn:
        conn.execute("update orders set amount = amount + 1 where customer_id in (3, 4)")
    with pgjobs.Runner(db_url, namespace="shop") as r:
        job = pgjobs.Registry.load(pgjobs.load_config("pgjobs.toml"), entry_points=False).get(
            "customer-totals"
        )
        second = r.tick(job, force=True)
    assert second.outcome is pgjobs.Outcome.RAN, second.error
    assert (second.stats.updated, second.stats.inserted, second.stats.deleted) == (2, 0, 0)
    assert _query(db_url, "select * from customer_total order by 1") == _query(
        db_url, (folder / "customer_totals.sql").read_text() + " order by 1"
    )


def test_exams_declared_once_from_toml_alone(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/exams/declared.toml, as its README runs it: migrate, the
    first fill, then a plain SQL update that enqueues through the trigger."""
    folder = EXAMPLES / "exams"
    _apply(db_url, folder / "schema.sql")
    monkeypatch.chdir(folder)
    runner = CliRunner()
    args = ["--config", "declared.toml", "--database", db_url]
    migrated = runner.invoke(cli, [*args, "migrate"])
    assert migrated.exit_code == 0, migrated.output
    assert "trigger on public.exam installed" in migrated.output
    first = runner.invoke(cli, [*args, "once", "exam_score"])
    assert first.exit_code == 0, first.output
    assert "inserted 5,000" in first.output
    with psycopg.connect(_libpq(normalize_url(db_url)), autocommit=True) as conn:
        conn.execute("update exam set weight = 9 where id = 42")  # no enqueue: the trigger's
    registry = pgjobs.Registry.load(pgjobs.load_config("declared.toml"), entry_points=False)
    with pgjobs.Runner(db_url, namespace="exams-example") as r:
        result = r.tick(registry.get("exam_score:queue"), force=True)
    assert result.outcome is pgjobs.Outcome.RAN, result.error
    assert (result.items, result.stats.updated, result.stats.inserted) == (1, 5, 0)
    scores = (folder / "declared.toml").read_text().split('sql = """')[1].split('"""')[0]
    drift = _query(
        db_url,
        "select count(*) from ((table exam_score except all " + scores + ")"
        " union all (" + scores + " except all table exam_score)) d",
    )
    assert drift == [(0,)]
