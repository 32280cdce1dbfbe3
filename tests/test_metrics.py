"""Prometheus metrics scraped from a running scheduler: the families and
values its runs must produce (equal to pgjobs.run's rows and job_state's
counts), the queues as the database has them, parsed with
prometheus_client's own parser; nothing in the global registry; a
database that does not answer; the ASGI app a FastAPI application mounts."""

from __future__ import annotations

import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import prometheus_client
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.metrics import Metrics
from pgjobs.results import RunResult
from pgjobs.serve import Source, serve
from pgjobs.testing import run_sql

with warnings.catch_warnings():
    # Starlette >= 1.x asks for httpx2 behind its test client and warns (once,
    # at import) when it finds only httpx; the client works with either.
    warnings.filterwarnings("ignore", message=r"Using `httpx` with `starlette\.testclient`")
    from fastapi.testclient import TestClient

WAIT = 60.0  # an upper bound on a wait for an event; never reached when things work

SCHEMA = """
create table parent (id int primary key);
create table src (parent_id int not null references parent, k int not null, v int not null);
create table derived (parent_id int not null references parent on delete cascade,
    k int not null, v int not null, primary key (parent_id, k));
create table derived2 (parent_id int not null references parent on delete cascade,
    k int not null, v int not null, primary key (parent_id, k));
insert into parent select g from generate_series(1, 5) g;
insert into src select p, k, p * 10 + k from generate_series(1, 5) p, generate_series(1, 3) k;
"""

FOR_KEYS = "select parent_id, k, v from src where parent_id = any(:keys)"


def jobs() -> list[pgjobs.Job]:
    return [
        pgjobs.RecomputeJob(
            name="scores", target="derived", compute="select parent_id, k, v from src", every="1h"
        ),
        pgjobs.QueueJob(
            name="worker",
            target="derived",
            scope=("parent_id",),
            compute=FOR_KEYS,
            every="100ms",
            max_attempts=1,
        ),
        # fires once at start, then not for 30 s (the schedulers here do not listen,
        # so no enqueue wakes it): what is enqueued stays queued
        pgjobs.QueueJob(name="later", target="derived2", scope=("parent_id",), compute=FOR_KEYS),
    ]


class Results:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.results: list[RunResult] = []

    def __call__(self, result: RunResult) -> None:
        with self.cond:
            self.results.append(result)
            self.cond.notify_all()

    def wait_for(self, condition: Any) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: condition(self.results), WAIT)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(body: str) -> tuple[dict[str, Any], Samples]:
    """Families by name and samples by (name, labels), with prometheus_client's parser."""
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def db_runs(engine: Engine) -> dict[tuple[str, str], dict[str, float]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "select job, outcome, count(*) as n, sum(inserted) as inserted,"
                " sum(updated) as updated, sum(deleted) as deleted,"
                " sum(skipped_missing_parent) as skipped, sum(items) as items,"
                " sum(failed_items) as failed_items, sum(compute_ms) as compute_ms,"
                " sum(write_ms) as write_ms, sum(lock_ms) as lock_ms"
                " from pgjobs.run group by job, outcome"
            )
        ).mappings()
        return {
            (r["job"], r["outcome"]): {
                k: float(v or 0) for k, v in r.items() if k not in ("job", "outcome")
            }
            for r in rows
        }


@pytest.fixture
def schema(engine: Engine) -> Engine:
    run_sql(engine, SCHEMA)
    return engine


def test_metrics_scraped_from_a_running_scheduler_match_the_database(schema: Engine) -> None:
    engine = schema
    results = Results()
    metrics = Metrics()
    scheduler = pgjobs.Scheduler(jobs(), engine, on_result=results, listen=False)
    metrics.bind(scheduler)
    started = time.monotonic()
    with scheduler, serve(("127.0.0.1", 0), {"/metrics": metrics.wsgi_app(scheduler)}) as server:
        url = f"{server.url}/metrics"
        results.wait_for(
            lambda rs: (
                {"scores", "later"} <= {r.job for r in rs}
                and any(r.job == "scores" and r.outcome == "ran" for r in rs)
            )
        )
        with engine.begin() as conn:
            pgjobs.enqueue(conn, "worker", [1, 2])
            pgjobs.enqueue(conn, "worker", ["not-a-number"])  # fails, parked (max_attempts=1)
            pgjobs.enqueue(conn, "later", [1, 2, 3])
        results.wait_for(lambda rs: sum(r.items for r in rs if r.job == "worker") >= 2)
        results.wait_for(lambda rs: sum(r.failed_items for r in rs if r.job == "worker") >= 1)
        content_type, body = scrape(url)
        elapsed = time.monotonic() - started

        assert content_type == prometheus_client.CONTENT_TYPE_LATEST
        families, samples = parse(body)
        for name, kind in {
            "pgjobs_runs": "counter",
            "pgjobs_run_duration_seconds": "histogram",
            "pgjobs_run_phase_seconds": "histogram",
            "pgjobs_rows": "counter",
            "pgjobs_queue_items": "counter",
            "pgjobs_queue_lag_seconds": "histogram",
            "pgjobs_queue_depth": "gauge",
            "pgjobs_queue_due": "gauge",
            "pgjobs_queue_retrying": "gauge",
            "pgjobs_queue_dead": "gauge",
            "pgjobs_queue_oldest_due_age_seconds": "gauge",
            "pgjobs_job_failures": "gauge",
            "pgjobs_job_backing_off": "gauge",
            "pgjobs_job_last_success_timestamp_seconds": "gauge",
            "pgjobs_database_up": "gauge",
        }.items():
            assert families[name].type == kind, name
        assert value(samples, "pgjobs_database_up") == 1

        # every run that ran or failed is a row of pgjobs.run: the counts and sums agree
        runs = db_runs(engine)
        for job in ("scores", "worker"):
            ran = runs[(job, "ran")]
            assert value(samples, "pgjobs_runs_total", job=job, outcome="ran") == ran["n"]
            assert (
                value(samples, "pgjobs_runs_total", job=job, outcome="failed")
                == runs.get((job, "failed"), {"n": 0})["n"]
            )
            for change, column in (
                ("inserted", "inserted"),
                ("updated", "updated"),
                ("deleted", "deleted"),
                ("skipped", "skipped"),
            ):
                assert value(samples, "pgjobs_rows_total", job=job, change=change) == ran[column]
            for phase, column in (
                ("compute", "compute_ms"),
                ("write", "write_ms"),
                ("row_locks", "lock_ms"),
            ):
                assert (
                    value(samples, "pgjobs_run_phase_seconds_count", job=job, phase=phase)
                    == ran["n"]
                )
                assert value(
                    samples, "pgjobs_run_phase_seconds_sum", job=job, phase=phase
                ) == pytest.approx(ran[column] / 1000, abs=1e-6)
            assert value(samples, "pgjobs_run_duration_seconds_count", job=job) == ran["n"]
        assert runs[("scores", "ran")]["inserted"] == 15  # 5 parents x 3 rows, the first recompute
        worker = runs[("worker", "ran")]
        assert (
            value(samples, "pgjobs_queue_items_total", job="worker", result="processed")
            == worker["items"]
            == 2
        )
        assert (
            value(samples, "pgjobs_queue_items_total", job="worker", result="failed")
            == worker["failed_items"]
            == 1
        )

        # queue lag: one observation per processed item, each within the test's own span
        assert value(samples, "pgjobs_queue_lag_seconds_count", job="worker") == 2
        lag_sum = value(samples, "pgjobs_queue_lag_seconds_sum", job="worker")
        assert 0 < lag_sum < 2 * elapsed

        # the queues as the database has them
        with engine.connect() as conn:
            table = {
                r.job: r
                for r in conn.execute(
                    text(
                        "select job, count(*) filter (where dead_at is null) as depth,"
                        " count(*) filter (where dead_at is not null) as dead"
                        " from pgjobs.queue group by job"
                    )
                )
            }
        assert value(samples, "pgjobs_queue_depth", job="later") == table["later"].depth == 3
        assert value(samples, "pgjobs_queue_due", job="later") == 3
        assert value(samples, "pgjobs_queue_oldest_due_age_seconds", job="later") > 0
        assert value(samples, "pgjobs_queue_depth", job="worker") == table["worker"].depth == 0
        assert value(samples, "pgjobs_queue_dead", job="worker") == table["worker"].dead == 1
        assert ("pgjobs_queue_depth", (("job", "scores"),)) not in samples  # not a queue job
        for job in ("scores", "worker", "later"):
            assert value(samples, "pgjobs_job_failures", job=job) == 0
            assert value(samples, "pgjobs_job_backing_off", job=job) == 0
        assert value(samples, "pgjobs_job_last_success_timestamp_seconds", job="scores") > 0

        # labels: the job's name and fixed words, nothing else
        names = {"scores", "worker", "later"}
        for _, labels in samples:
            found = dict(labels)
            assert set(found) <= {"job", "outcome", "phase", "change", "result", "le", "state"}
            assert found.get("job", "scores") in names

    # stopped: the ticks that changed nothing are written to job_state (on
    # close); the counters of this process say the same
    _, samples = parse(metrics.exposition().decode())
    with engine.connect() as conn:
        states = {
            r.job: r
            for r in conn.execute(
                text(
                    "select job, idle_ticks, busy_ticks, not_due_ticks, backing_off_ticks from pgjobs.job_state"
                )
            )
        }
    for job in ("scores", "worker", "later"):
        for outcome in ("idle", "busy", "not_due", "backing_off"):
            assert value(samples, "pgjobs_runs_total", job=job, outcome=outcome) == getattr(
                states[job], f"{outcome}_ticks"
            ), (job, outcome)
    assert value(samples, "pgjobs_runs_total", job="later", outcome="idle") >= 1


def test_the_database_read_is_cached_and_one_replica_sees_another_s_queue(schema: Engine) -> None:
    """The gauges are the database's, read at most once per cache period: a
    process that runs no job reports the queue another one filled."""
    pgjobs.install(schema)
    source = Source(engine=schema, jobs={j.name: j for j in jobs()})
    cached, fresh = Metrics(cache_seconds=3600).bind(source), Metrics(cache_seconds=0).bind(source)
    for m in (cached, fresh):
        assert value(parse(m.exposition().decode())[1], "pgjobs_queue_depth", job="later") == 0
    with schema.begin() as conn:
        pgjobs.enqueue(conn, "later", [1, 2])
    assert value(parse(cached.exposition().decode())[1], "pgjobs_queue_depth", job="later") == 0
    assert value(parse(fresh.exposition().decode())[1], "pgjobs_queue_depth", job="later") == 2


def test_the_library_registers_nothing_globally_unless_given_a_registry() -> None:
    def ours() -> set[str]:
        return {m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("pgjobs")}

    before = ours()
    Metrics()
    assert ours() == before == set()
    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry)
    assert metrics.registry is registry
    assert "pgjobs_runs" in {m.name for m in registry.collect()}


def test_a_database_that_does_not_answer_is_reported_not_raised() -> None:
    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")
    try:
        metrics = Metrics().bind(Source(engine=engine, jobs={j.name: j for j in jobs()}))
        _, samples = parse(metrics.exposition().decode())
    finally:
        engine.dispose()
    assert value(samples, "pgjobs_database_up") == 0
    assert not any(name.startswith("pgjobs_queue_depth") for name, _ in samples)
    assert value(samples, "pgjobs_runs_total", job="worker", outcome="ran") == 0


@pytest.fixture
def app_client(schema: Engine) -> Iterator[tuple[TestClient, Metrics]]:
    metrics = Metrics()
    app = FastAPI(lifespan=pgjobs.lifespan(pgjobs.Scheduler(jobs(), schema, listen=False)))
    app.mount("/metrics", metrics.asgi_app())
    with TestClient(app) as client:
        yield client, metrics


def test_a_fastapi_app_mounts_the_metrics_and_they_find_the_lifespan_s_scheduler(
    app_client: tuple[TestClient, Metrics], schema: Engine
) -> None:
    client, _ = app_client
    with schema.begin() as conn:
        pgjobs.enqueue(conn, "later", [4])
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    _, samples = parse(response.text)
    assert value(samples, "pgjobs_database_up") == 1
    assert value(samples, "pgjobs_queue_depth", job="later") == 1
    # bound on that scrape: the scheduler's ticks are counted from then on
    # (its worker job ticks every 100 ms)
    deadline = time.monotonic() + WAIT
    while True:
        _, samples = parse(client.get("/metrics").text)
        ticks = sum(
            v
            for (name, labels), v in samples.items()
            if name == "pgjobs_runs_total" and ("job", "worker") in labels
        )
        if ticks > 0:
            break
        assert time.monotonic() < deadline, "the worker's ticks were never counted"
        time.sleep(0.01)
    assert client.post("/metrics").status_code == 405
