"""What pgjobs' log lines say: a run, a failure, a backoff starting and
ending, as text and as JSON lines with the same fields; the logger's name
shown once; what -v and -vv turn on."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.cli import _logging
from pgjobs.logs import JsonFormatter, TextFormatter, run_line
from pgjobs.results import DiffStats, Outcome, RunResult
from pgjobs.testing import run_sql

T0 = datetime(2025, 5, 1, 12, 0, 0, tzinfo=UTC)

SCHEMA = """
create table parent (id int primary key);
create table src (parent_id int not null, k int not null, v int not null);
create table derived (
    parent_id int not null references parent on delete cascade,
    k int not null, v int not null, primary key (parent_id, k));
insert into parent values (1), (2);
insert into src values (1, 1, 10), (1, 2, 20), (2, 1, 30), (3, 1, 99);  -- parent 3 is gone
"""


class Capture:
    """pgjobs' records, formatted as text and as JSON lines."""

    def __init__(self) -> None:
        self.text, self.json = io.StringIO(), io.StringIO()
        self.handlers = []
        for stream, formatter in ((self.text, TextFormatter()), (self.json, JsonFormatter())):
            handler = logging.StreamHandler(stream)
            handler.setFormatter(formatter)
            self.handlers.append(handler)

    def lines(self) -> list[str]:
        return self.text.getvalue().splitlines()

    def objects(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.json.getvalue().splitlines()]

    def clear(self) -> None:
        for stream in (self.text, self.json):
            stream.seek(0)
            stream.truncate()


@pytest.fixture
def capture() -> Iterator[Capture]:
    logger = logging.getLogger("pgjobs")
    saved = logger.level
    cap = Capture()
    for handler in cap.handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield cap
    finally:
        for handler in cap.handlers:
            logger.removeHandler(handler)
        logger.setLevel(saved)


def _message(line: str) -> str:
    """The text after ``<date> <time> LEVEL logger: ``."""
    match = re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (\w+) ([\w.]+): (.*)", line)
    assert match, line
    return f"{match.group(1)} {match.group(2)}: {match.group(3)}"


def test_a_run_a_failure_a_backoff_and_its_end_as_text_and_json(
    engine: Engine, capture: Capture
) -> None:
    run_sql(engine, SCHEMA)
    failing = {"on": False}

    def compute(conn: object) -> str:
        if failing["on"]:
            raise RuntimeError("boom <b>not markup</b>")
        return "select parent_id, k, v from src"

    job = pgjobs.RecomputeJob(
        name="scores", target="derived", compute=compute, every="1h", backoff="1h"
    )
    with pgjobs.Runner(engine) as runner:
        runner.install()
        capture.clear()
        first = runner.tick(job)
        assert first.outcome is Outcome.RAN
        (line,) = [_message(x) for x in capture.lines()]
        assert re.fullmatch(
            r"INFO pgjobs\.runner: scores ran in \d+\.\d\d s: \+3 ~0 -0, 1 skipped \(parent gone\),"
            r" row locks \d+(\.\d)? ms",
            line,
        ), line
        (ran,) = capture.objects()
        assert ran["event"] == "ran" and ran["job"] == "scores" and ran["logger"] == "pgjobs.runner"
        assert (ran["inserted"], ran["updated"], ran["deleted"], ran["skipped_parent_gone"]) == (
            3,
            0,
            0,
            1,
        )
        assert ran["run_id"] == first.run_id and ran["message"] == line.split(": ", 1)[1]

        capture.clear()
        run_sql(
            engine,
            "update src set v = 11 where parent_id = 1 and k = 1;"
            " delete from src where parent_id = 1 and k = 2; insert into src values (2, 2, 40)",
        )
        runner.tick(job, force=True)
        (line,) = [_message(x) for x in capture.lines()]
        assert re.search(r": scores ran in .* s: \+1 ~1 -1, 1 skipped \(parent gone\)", line), line

        # a failure starts the backoff: two lines, ERROR then WARNING
        capture.clear()
        failing["on"] = True
        failed = runner.tick(job, force=True)
        assert failed.outcome is Outcome.FAILED and failed.next_attempt_at is not None
        error, backoff = (_message(x) for x in capture.lines())
        assert re.fullmatch(
            r"ERROR pgjobs\.runner: scores failed after \d+\.\d\d s:"
            r" RuntimeError: boom <b>not markup</b>",
            error,
        ), error
        stamp = failed.next_attempt_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        assert backoff == (
            f"WARNING pgjobs.runner: scores backing off for 1h: next attempt at {stamp}"
        ), backoff
        fail, start = capture.objects()
        assert fail["event"] == "failed" and fail["failures"] == 1
        assert fail["error"] == "RuntimeError: boom <b>not markup</b>"
        assert "exception" not in fail  # the traceback is for -v (DEBUG)
        assert start["event"] == "backoff_start" and start["failures"] == 1
        assert start["next_attempt_at"] == failed.next_attempt_at.isoformat()

        # a second failure: "again", and the backoff goes on
        capture.clear()
        runner.tick(job, force=True)
        error, backoff = (_message(x) for x in capture.lines())
        assert "scores failed again (2 in a row) after" in error
        assert backoff.startswith("WARNING pgjobs.runner: scores still backing off for 1h")
        assert [o["event"] for o in capture.objects()] == ["failed", "backoff_extended"]

        # the next run that commits ends the backoff, then says what it did
        capture.clear()
        failing["on"] = False
        assert runner.tick(job, force=True).outcome is Outcome.RAN
        end, line = (_message(x) for x in capture.lines())
        assert end == "INFO pgjobs.runner: scores no longer backing off: ran after 2 failures"
        assert re.search(r"scores ran in .* s: \+0 ~0 -0, 1 skipped \(parent gone\)", line)
        assert [o["event"] for o in capture.objects()] == ["backoff_end", "ran"]
        assert capture.objects()[0]["failures"] == 2

        # a tick that changes nothing says nothing at INFO ...
        capture.clear()
        assert runner.tick(job).outcome is Outcome.NOT_DUE
        assert capture.lines() == []
        # ... and one line at DEBUG (pgjobs run -v)
        logging.getLogger("pgjobs").setLevel(logging.DEBUG)
        runner.tick(job)
        (line,) = [_message(x) for x in capture.lines()]
        assert re.fullmatch(r"DEBUG pgjobs\.runner: scores: not due until .* UTC", line), line


def test_a_failure_shows_its_traceback_at_debug_only(engine: Engine, capture: Capture) -> None:
    def boom(conn: object) -> None:
        raise ValueError("bad value")

    job = pgjobs.TaskJob(name="t", run=boom, every="1h")
    logging.getLogger("pgjobs").setLevel(logging.DEBUG)
    with pgjobs.Runner(engine) as runner:
        runner.tick(job)
    text = capture.text.getvalue()
    assert "Traceback (most recent call last)" in text and 'raise ValueError("bad value")' in text
    failed = next(o for o in capture.objects() if o.get("event") == "failed")
    assert "ValueError: bad value" in str(failed["exception"])


def _result(**fields: object) -> RunResult:
    base: dict[str, object] = {
        "job": "exam-scores",
        "outcome": Outcome.RAN,
        "started_at": T0,
        "finished_at": T0 + timedelta(seconds=0.42),
    }
    base.update(fields)
    return RunResult(**base)  # type: ignore[arg-type]


def test_the_issue_s_example_line() -> None:
    result = _result(
        stats=DiffStats(inserted=12, updated=340, deleted=3, skipped_missing_parent=5),
        lock_seconds=0.018,
    )
    assert run_line(result) == (
        "exam-scores ran in 0.42 s: +12 ~340 -3, 5 skipped (parent gone), row locks 18 ms"
    )


def test_a_queue_run_says_its_items_and_what_it_left() -> None:
    result = _result(
        job="exam-worker",
        stats=DiffStats(updated=1_204),
        items=240,
        failed_items=1,
        lock_seconds=0.0031,
        detail={"claimed": 245, "parent_gone": 2, "rows_deferred": 7, "deferred": 2},
    )
    assert run_line(result) == (
        "exam-worker ran in 0.42 s: 240 items, +0 ~1,204 -0, 7 deferred (parent busy),"
        " 2 items dropped (parent gone), 1 item failed, row locks 3.1 ms"
    )


def test_the_logger_name_is_shown_once() -> None:
    record = logging.LogRecord(
        "pgjobs.scheduler", logging.INFO, __file__, 1, "pgjobs: scheduler started", None, None
    )
    assert TextFormatter().format(record).endswith(" INFO pgjobs.scheduler: scheduler started")
    assert json.loads(JsonFormatter().format(record))["message"] == "scheduler started"
    # another library's message is left as it is
    other = logging.LogRecord("app", logging.INFO, __file__, 1, "pgjobs: x", None, None)
    assert TextFormatter().format(other).endswith(" INFO app: pgjobs: x")


def test_a_percent_sign_in_a_job_name_or_an_error_is_not_a_format(capture: Capture) -> None:
    from pgjobs import logs

    result = _result(
        job="100%-done", outcome=Outcome.FAILED, error="ValueError: 50%s off", sqlstate=None
    )
    logs.failed(logging.getLogger("pgjobs.runner"), result, failures=1)
    assert "100%-done failed after 0.42 s: ValueError: 50%s off" in capture.text.getvalue()


@pytest.mark.parametrize(
    ("verbose", "own", "other", "sql"),
    [
        (0, logging.INFO, logging.WARNING, logging.WARNING),
        (1, logging.DEBUG, logging.WARNING, logging.WARNING),
        (2, logging.DEBUG, logging.DEBUG, logging.INFO),
    ],
)
def test_verbosity_means_what_it_says(verbose: int, own: int, other: int, sql: int) -> None:
    """run: pgjobs at INFO; -v: pgjobs' DEBUG (every tick, tracebacks);
    -vv: every library's DEBUG, SQLAlchemy's statements. Put back afterwards."""
    names = ("pgjobs", "", "sqlalchemy.engine")
    before = [logging.getLogger(n).level for n in names]
    with _logging(verbose, logging.INFO):
        assert logging.getLogger("pgjobs.runner").getEffectiveLevel() == own
        assert logging.getLogger("apscheduler.scheduler").getEffectiveLevel() == other
        assert logging.getLogger("sqlalchemy.engine.Engine").getEffectiveLevel() == sql
    assert [logging.getLogger(n).level for n in names] == before


# -- queue ticks at production rates (issue 39) -------------------------------------------
QUEUE_SCHEMA = """
create table parent (id int primary key);
create table src (parent_id int not null, k int not null, v int not null);
create table derived (
    parent_id int not null references parent on delete cascade,
    k int not null, v int not null, primary key (parent_id, k));
insert into parent select generate_series(1, 30);
insert into src select id, 1, id from parent;
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_queue_ticks_are_debug_and_each_queue_job_says_its_minute_in_one_line(
    engine: Engine, capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgjobs import logs

    run_sql(engine, QUEUE_SCHEMA)
    pgjobs.install(engine)
    clock = Clock()
    summary = logs.QueueSummary(clock=clock)
    monkeypatch.setattr(logs, "SUMMARY", summary)
    job = pgjobs.QueueJob(
        name="exam-worker",
        target="derived",
        compute="select parent_id, k, v from src where parent_id = any(:keys)",
        scope=("parent_id",),
        batch_size=10,
        every="1h",
    )
    recompute = pgjobs.RecomputeJob(
        name="exam-all", target="derived", compute="select parent_id, k, v from src", every="1h"
    )
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "exam-worker", [[i] for i in range(1, 31)])
    for _ in range(3):  # 3 ticks of 10 items, within the minute
        assert pgjobs.run_once(job, database=engine).items == 10
    pgjobs.run_once(recompute, database=engine, force=True)
    # no line per queue tick at INFO; the recompute keeps its own
    lines = capture.lines()
    assert not any("exam-worker" in line for line in lines), lines
    assert any("exam-all ran in" in line for line in lines), lines

    # a minute after the window's first tick, the next tick writes its line
    clock.now += 60
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "exam-worker", [[1], [2]])
    pgjobs.run_once(job, database=engine)
    (line,) = [m for m in map(_message, capture.lines()) if "exam-worker" in m]
    assert re.fullmatch(
        r"INFO pgjobs\.runner: exam-worker: 32 items in 4 ticks in the last 60 s,"
        r" lag p50 [\d.]+ m?s p95 [\d.]+ m?s, \+30 ~0 -0, 0 items failed",
        line,
    ), line
    (data,) = [o for o in capture.objects() if o.get("event") == "queue_summary"]
    assert data["job"] == "exam-worker" and data["level"] == "INFO"
    assert (data["ticks"], data["items"], data["failed_items"], data["inserted"]) == (4, 32, 0, 30)
    p50, p95 = data["lag_p50_seconds"], data["lag_p95_seconds"]
    assert isinstance(p50, float) and isinstance(p95, float) and 0 < p50 <= p95
    assert "horizon" not in data

    # a window that ends quiet is written by flush (the heartbeat's), naming
    # the horizon while one is held
    capture.clear()
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "exam-worker", [[3]])
    pgjobs.run_once(job, database=engine)
    summary.set_horizon("pid 4242 (report, active) for 6m0s", {"pid": 4242})
    summary.flush()  # not a minute yet: nothing
    assert capture.lines() == []
    clock.now += 61
    summary.flush()
    (line,) = capture.lines()
    assert "exam-worker: 1 item in 1 tick in the last 61 s" in line
    assert line.endswith("xmin horizon held by pid 4242 (report, active) for 6m0s")
    (data,) = capture.objects()
    assert data["horizon"] == {"pid": 4242}


def test_queue_ticks_show_at_debug() -> None:
    from pgjobs import logs

    logger = logging.getLogger("pgjobs.test-debug")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    saved = logs.SUMMARY
    logs.SUMMARY = logs.QueueSummary(clock=Clock())
    try:
        result = _result(job="w", items=1, detail={"claimed": 1})
        logs.ran(logger, result)
    finally:
        logs.SUMMARY = saved
        logger.removeHandler(handler)
    (record,) = records
    assert record.levelno == logging.DEBUG and record.getMessage().startswith("w ran in")
