"""OpenTelemetry spans of runs: one per run that ran or failed, its phases
as children in the order they happen, the run's figures as attributes."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.testing import run_sql
from pgjobs.tracing import Tracing


def test_a_span_per_run_with_its_phases(engine: Engine) -> None:
    run_sql(
        engine,
        "create table parent (id int primary key);"
        " create table derived (parent_id int references parent, k int, primary key (parent_id, k));"
        " insert into parent values (1), (2);",
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)

    def boom(conn: object) -> None:
        raise RuntimeError("boom")

    ok = pgjobs.RecomputeJob(
        name="scores",
        target="derived",
        compute="select p.id as parent_id, k from parent p, generate_series(1, 3) k",
    )
    with pgjobs.Runner(engine) as runner:
        ran = runner.tick(ok)
        failed = runner.tick(pgjobs.TaskJob(name="bad", run=boom))
        quiet = runner.tick(ok)  # not due: no span
    for result in (ran, failed, quiet):
        tracing.observe(result)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"pgjobs run scores", "compute", "write", "row_locks", "pgjobs run bad"}
    run = spans["pgjobs run scores"]
    assert run.attributes is not None
    assert run.attributes["pgjobs.outcome"] == "ran"
    assert run.attributes["pgjobs.rows.inserted"] == 6
    assert run.attributes["pgjobs.run_id"] == ran.run_id
    assert run.start_time == int(ran.started_at.timestamp() * 1e9)
    assert run.end_time == int(ran.finished_at.timestamp() * 1e9)
    compute, write, locks = spans["compute"], spans["write"], spans["row_locks"]
    for child in (compute, write, locks):
        assert child.parent is not None and child.parent.span_id == run.context.span_id
        assert run.start_time <= child.start_time <= child.end_time  # type: ignore[operator]
    assert compute.end_time == write.start_time and locks.end_time == write.end_time
    assert spans["pgjobs run bad"].status.status_code is StatusCode.ERROR
    assert "boom" in (spans["pgjobs run bad"].status.description or "")
