"""Drift (``pgjobs check``, :func:`pgjobs.check`): what a recompute would
write, seen on a real PostgreSQL without writing.

Drift is injected into a derived table (rows missing, wrong and extra) and a
user deletes a parent while the check computes: the check reports exactly
those rows, the table is unchanged afterwards, the user's delete does not
wait for the check, ``pgjobs once`` repairs exactly what was reported and
the check finds nothing after it. Rows of queued items are reported apart.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

import pgjobs
from pgjobs.cli import cli
from pgjobs.testing import run_sql

SCHEMA = """
create table exam (id int primary key);
create table answer (
    exam_id int not null references exam (id) on delete cascade,
    student int not null,
    points int not null);
create table exam_score (
    exam_id int not null references exam (id) on delete cascade,
    student int not null,
    score int not null,
    primary key (exam_id, student));
insert into exam select g from generate_series(1, 10) g;
insert into answer select e, s, q from generate_series(1, 10) e, generate_series(1, 5) s,
    generate_series(1, 3) q;
"""

SCORES = (
    "select a.exam_id, a.student, sum(a.points)::int as score from answer a"
    " group by a.exam_id, a.student"
)
SCORES_FOR_ITEMS = (
    "select a.exam_id, a.student, sum(a.points)::int as score from answer a"
    " where a.exam_id = any(:keys) group by a.exam_id, a.student"
)


def recompute(**fields: Any) -> pgjobs.RecomputeJob:
    fields.setdefault("compute", SCORES)
    return pgjobs.RecomputeJob(name="scores", group="exams", target="exam_score", **fields)


def worker() -> pgjobs.QueueJob:
    return pgjobs.QueueJob(
        name="scores-worker",
        group="exams",
        target="exam_score",
        scope=("exam_id",),
        compute=SCORES_FOR_ITEMS,
    )


def table(engine: Engine) -> list[tuple[int, int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("select * from exam_score order by 1, 2")).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


INJECT = """
delete from exam_score where (exam_id, student) in ((2, 1), (3, 4));
update exam_score set score = score + 100 where (exam_id, student) in ((4, 2), (5, 5), (6, 1));
insert into exam_score values (1, 99, 7);
"""


@pytest.fixture
def exams(engine: Engine) -> Engine:
    """Ten exams of five students, scores derived exactly, then drift injected."""
    run_sql(engine, SCHEMA)
    assert pgjobs.run_once(recompute(), engine, force=True).outcome is pgjobs.Outcome.RAN
    run_sql(engine, INJECT)
    return engine


def keys(result: pgjobs.CheckResult, kind: str) -> list[tuple[Any, ...]]:
    return [tuple(s.key.values()) for s in result.samples.get(kind, ())]


def test_injected_drift_is_reported_exactly_with_samples(exams: Engine) -> None:
    before = table(exams)
    result = pgjobs.check(recompute(), exams)
    assert result.drift
    assert (result.inserted, result.updated, result.deleted) == (2, 3, 1)
    assert result.skipped_missing_parent == 0
    assert result.unchanged == 50 - 2 - 3
    assert keys(result, "inserted") == [(2, 1), (3, 4)]
    assert keys(result, "updated") == [(4, 2), (5, 5), (6, 1)]
    assert keys(result, "deleted") == [(1, 99)]
    first = result.samples["updated"][0]
    assert first.old == {"exam_id": 4, "student": 2, "score": 106}
    assert first.new == {"exam_id": 4, "student": 2, "score": 6}
    assert first.changed == ("score",)
    assert result.samples["inserted"][0].old is None
    assert result.samples["deleted"][0].new is None
    assert result.samples["deleted"][0].old == {"exam_id": 1, "student": 99, "score": 7}
    assert table(exams) == before  # nothing written


def test_the_sample_is_the_first_n_keys(exams: Engine) -> None:
    result = pgjobs.check(recompute(), exams, sample=1)
    assert keys(result, "updated") == [(4, 2)]
    assert result.updated == 3
    assert pgjobs.check(recompute(), exams, sample=0).samples == {}


def test_no_drift_after_a_recompute(exams: Engine) -> None:
    pgjobs.run_once(recompute(), exams, force=True)
    result = pgjobs.check(recompute(), exams)
    assert not result.drift
    assert result.stats == pgjobs.DiffStats(unchanged=50)
    assert result.samples == {}


def test_the_check_takes_no_row_lock_and_a_writing_compute_fails_it(exams: Engine) -> None:
    def writing(conn: Any) -> str:
        conn.execute(text("update exam set id = id where id = 1"))
        return SCORES

    with pytest.raises(pgjobs.JobError, match="RowExclusiveLock on exam"):
        pgjobs.check(recompute(compute=writing), exams)

    def locking(conn: Any) -> str:
        conn.execute(text("select from exam where id = 1 for key share"))
        return SCORES

    with pytest.raises(pgjobs.JobError, match="RowShareLock on exam"):
        pgjobs.check(recompute(compute=locking), exams)
    assert table(exams)[-1] == (10, 5, 6)


def test_rows_of_queued_items_are_on_their_way_not_drift(exams: Engine) -> None:
    pgjobs.install(exams)
    with exams.begin() as conn:
        pgjobs.enqueue(conn, worker(), [4, 1])  # the updated (4, 2) and the extra (1, 99)
    result = pgjobs.check(recompute(), exams, workers=[worker()])
    assert (result.inserted, result.updated, result.deleted) == (2, 2, 0)
    assert (result.on_the_way.updated, result.on_the_way.deleted) == (1, 1)
    assert keys(result, "on_the_way") == [(1, 99), (4, 2)]
    # a parked (dead) item is not on its way: its rows are drift
    run_sql(exams, "update pgjobs.queue set dead_at = now() where key = '[1]'")
    result = pgjobs.check(recompute(), exams, workers=[worker()])
    assert (result.deleted, result.on_the_way.deleted) == (1, 0)


def test_a_queue_job_is_checked_for_its_items(exams: Engine) -> None:
    pgjobs.install(exams)
    result = pgjobs.check(worker(), exams, keys=[4, 1, 7])
    assert result.keys == ((1,), (4,), (7,))
    assert (result.inserted, result.updated, result.deleted) == (0, 1, 1)
    assert result.unchanged == 14
    assert keys(result, "updated") == [(4, 2)]
    with exams.begin() as conn:
        pgjobs.enqueue(conn, worker(), [4])
    result = pgjobs.check(worker(), exams, keys=[4])
    assert (result.updated, result.on_the_way.updated) == (0, 1)
    with pytest.raises(pgjobs.ConfigError, match="give keys"):
        pgjobs.check(worker(), exams)


# -- a parent deleted while the check computes, through the command line ---------------
PLUGIN = """
import threading

import pgjobs
from sqlalchemy import text

computed = threading.Event()
deleted = threading.Event()

SCORES = {scores!r}


def compute(conn):
    rows = [tuple(r) for r in conn.execute(text(SCORES))]
    computed.set()
    assert deleted.wait(10), "the user's delete did not come"
    return rows


@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.RecomputeJob(name="scores", group="exams", target="exam_score",
                                 compute=compute))
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Path]]:
    name = f"driftplug_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN.format(scores=SCORES)))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "pgjobs.toml"
    config.write_text(f'plugins = ["{name}"]\n')
    module = __import__(name)
    try:
        yield module, config
    finally:
        sys.modules.pop(name, None)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_a_parent_deleted_during_the_compute_is_skipped_and_the_user_does_not_wait(
    exams: Engine, db_url: str, plugin: tuple[Any, Path]
) -> None:
    module, config = plugin
    waited: list[float] = []
    errors: list[BaseException] = []

    def user() -> None:
        try:
            assert module.computed.wait(20), "the check never computed"
            # a bounded wait: should the delete wait for the check, it fails
            # after 2 s (lock_timeout) instead of hanging
            with psycopg.connect(db_url.replace("+psycopg", ""), connect_timeout=5) as conn:
                conn.execute("set lock_timeout = '2s'")
                started = time.perf_counter()
                conn.execute("delete from exam where id = 10")
                conn.commit()
                waited.append(time.perf_counter() - started)
        except BaseException as exc:
            errors.append(exc)
        finally:
            module.deleted.set()

    before = [row for row in table(exams) if row[0] != 10]
    thread = threading.Thread(target=user)
    thread.start()
    result = invoke("check", "scores", "--config", str(config), "--database", db_url, "--json")
    thread.join(30)
    assert not errors, errors
    assert waited and waited[0] < 1.0, waited
    assert result.exit_code == 1, result.output
    figures = json.loads(result.output)
    assert figures["job"] == "scores" and figures["drift"] is True
    assert {k: figures[k] for k in ("inserted", "updated", "deleted")} == {
        "inserted": 2,
        "updated": 3,
        "deleted": 1,
    }
    # the five rows of exam 10: computed before its delete, parent gone since
    assert figures["skipped_missing_parent"] == 5
    assert figures["unchanged"] == 40
    samples = figures["samples"]
    assert [s["key"] for s in samples["skipped_missing_parent"]] == [
        {"exam_id": 10, "student": s} for s in range(1, 6)
    ]
    assert [s["key"] for s in samples["inserted"]] == [
        {"exam_id": 2, "student": 1},
        {"exam_id": 3, "student": 4},
    ]
    assert samples["updated"][0]["old"]["score"] == 106
    assert samples["updated"][0]["new"]["score"] == 6
    assert table(exams) == before  # only the user's cascade changed it


CONFIG_JOB = f'''
[jobs.scores]
kind = "recompute"
target = "exam_score"
group = "exams"
sql = "{SCORES}"
'''


def test_once_repairs_exactly_what_check_reported_and_check_exits_0_after(
    exams: Engine, db_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "pgjobs.toml"
    config.write_text(CONFIG_JOB)
    checked = invoke("check", "scores", "-c", str(config), "--database", db_url, "--json")
    assert checked.exit_code == 1, checked.output
    reported = json.loads(checked.output)
    text_out = invoke("check", "scores", "-c", str(config), "--database", db_url)
    assert text_out.exit_code == 1
    assert "scores: drift: a recompute would insert 2, update 3, delete 1" in text_out.output
    assert 'updated: {"exam_id": 4, "student": 2} {"score": 106} -> {"score": 6}' in (
        text_out.output
    )
    ran = invoke("once", "scores", "-c", str(config), "--database", db_url, "--json")
    assert ran.exit_code == 0, ran.output
    stats = json.loads(ran.stdout)["stats"]
    for kind in ("inserted", "updated", "deleted", "skipped_missing_parent", "unchanged"):
        assert stats[kind] == reported[kind], kind
    after = invoke("check", "scores", "-c", str(config), "--database", db_url, "--json")
    assert after.exit_code == 0, after.output
    assert json.loads(after.output)["drift"] is False


def test_check_of_a_queue_job_by_keys_on_the_command_line(
    exams: Engine, db_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "pgjobs.toml"
    config.write_text(
        CONFIG_JOB
        + textwrap.dedent(
            f'''
            [jobs.worker]
            kind = "queue"
            target = "exam_score"
            group = "exams"
            scope = "exam_id"
            sql = "{SCORES_FOR_ITEMS}"
            '''
        )
    )
    pgjobs.install(exams)
    out = invoke("check", "worker", "-c", str(config), "--database", db_url, "--keys", "7", "8")
    assert out.exit_code == 0, out.output
    assert "worker (2 item(s)): no drift: a run of these items would insert 0" in out.output
    assert "recompute" not in out.output  # a queue job's items, not a recompute
    out = invoke(
        "check", "worker", "-c", str(config), "--database", db_url, "--keys", "4", "--json"
    )
    assert out.exit_code == 1
    assert json.loads(out.output)["keys"] == [[4]]
    bad = invoke("check", "worker", "-c", str(config), "--database", db_url)
    assert bad.exit_code == 2 and "give keys" in bad.output


# -- scheduled verification ------------------------------------------------------------
def job_state(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("select * from pgjobs.job_state"))]


def test_verify_every_checks_on_its_own_schedule_and_records_the_figures(exams: Engine) -> None:
    before, state_before = table(exams), job_state(exams)
    got: list[pgjobs.RunResult] = []
    checked = threading.Event()

    def on_result(result: pgjobs.RunResult) -> None:
        got.append(result)
        if result.outcome is pgjobs.Outcome.CHECKED:
            checked.set()

    # the recompute itself fires once a year: only the verification runs here
    job = recompute(every=None, cron="0 0 1 1 *", verify_every="1s")
    with pgjobs.Scheduler([job], exams, on_result=on_result):
        assert checked.wait(15), got
    result = next(r for r in got if r.outcome is pgjobs.Outcome.CHECKED)
    assert (result.stats.inserted, result.stats.updated, result.stats.deleted) == (2, 3, 1)
    assert not [r for r in got if r.outcome is pgjobs.Outcome.RAN]
    with exams.connect() as conn:
        row = conn.execute(
            text(
                "select outcome, inserted, updated, deleted, unchanged, detail from pgjobs.run"
                " where id = :id"
            ),
            {"id": result.run_id},
        ).one()
    assert tuple(row[:5]) == ("checked", 2, 3, 1, 45)
    assert [s["key"] for s in row[5]["check"]["samples"]["deleted"]] == [
        {"exam_id": 1, "student": 99}
    ]
    assert job_state(exams) == state_before  # a check changes no state: no backoff, no schedule
    assert table(exams) == before


def test_a_replica_skips_a_check_another_made_within_the_interval(exams: Engine) -> None:
    from pgjobs.drift import verify
    from pgjobs.store import Store

    pgjobs.install(exams)
    job = recompute(verify_every="1h")
    first = verify(exams, Store(), job)
    assert first is not None and first.outcome is pgjobs.Outcome.CHECKED
    assert verify(exams, Store(), job) is None


def test_each_scheduled_check_writes_one_log_line(
    exams: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Drift is a warning; a check that finds none is still one INFO line,
    so an operator sees the checks happen."""
    from pgjobs.drift import verify
    from pgjobs.store import Store

    pgjobs.install(exams)
    job = recompute(verify_every="1s")
    with caplog.at_level(logging.INFO, logger="pgjobs.drift"):
        assert verify(exams, Store(), job) is not None
        assert pgjobs.run_once(job, exams, force=True).outcome is pgjobs.Outcome.RAN
        with exams.begin() as conn:  # the last check, long enough ago for the next
            conn.execute(text("update pgjobs.run set started_at = started_at - interval '1h'"))
        assert verify(exams, Store(), job) is not None
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pgjobs.drift"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO], lines
    assert "scores: drift: a recompute would insert 2, update 3, delete 1" in lines[0][1]
    assert "scores: no drift: a recompute would insert 0, update 0, delete 0" in lines[1][1]


def test_a_failing_check_is_recorded_as_checked_with_its_error(exams: Engine) -> None:
    from pgjobs.drift import verify
    from pgjobs.store import Store

    pgjobs.install(exams)
    job = recompute(compute="select exam_id, student from exam_score", verify_every="1h")
    result = verify(exams, Store(), job)
    assert result is not None and result.outcome is pgjobs.Outcome.CHECKED
    assert result.error is not None and "score" in result.error


def test_verify_every_in_pgjobs_toml(tmp_path: Path) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text(CONFIG_JOB + 'verify_every = "1h"\n')
    (job,) = pgjobs.load_config(path).jobs
    assert isinstance(job, pgjobs.RecomputeJob) and job.verify_interval is not None
    assert job.verify_interval.total_seconds() == 3600
    path.write_text(CONFIG_JOB + 'verify_every = "soon"\n')
    with pytest.raises(pgjobs.ConfigError, match=r"pgjobs.toml.*jobs.scores.verify_every.*soon"):
        pgjobs.load_config(path)
    path.write_text(CONFIG_JOB.replace("recompute", "queue") + 'verify_every = "1h"\n')
    with pytest.raises(pgjobs.ConfigError, match="verify_every"):
        pgjobs.load_config(path)
    assert recompute(verify_every=0).verify_interval is None


# -- metrics and the status page -------------------------------------------------------
def samples_of(exposition: bytes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_last_check_and_the_repairs_in_the_metrics_and_on_the_page(exams: Engine) -> None:
    from pgjobs.drift import verify
    from pgjobs.metrics import Metrics
    from pgjobs.serve import Request, Source
    from pgjobs.store import Store
    from pgjobs.web import StatusPage

    pgjobs.install(exams)
    job = recompute(verify_every="1h")
    with exams.begin() as conn:
        pgjobs.enqueue(conn, worker(), [1])  # the extra row (1, 99) is on its way
    assert verify(exams, Store(), job, workers=[worker()]) is not None
    source = Source(engine=exams, jobs={job.name: job, "scores-worker": worker()})
    metrics = Metrics(cache_seconds=0).bind(source)
    drift = samples_of(metrics.exposition(), "pgjobs_drift_rows")
    assert {dict(k)["change"]: v for k, v in drift.items() if dict(k)["job"] == "scores"} == {
        "inserted": 2,
        "updated": 3,
        "deleted": 0,
        "skipped": 0,
    }
    way = samples_of(metrics.exposition(), "pgjobs_drift_on_the_way_rows")
    assert way[(("change", "deleted"), ("job", "scores"))] == 1
    assert samples_of(metrics.exposition(), "pgjobs_check_failed") == {(("job", "scores"),): 0}
    # the recompute's repair on a target that workers maintain: what the queue missed
    with pgjobs.Runner(exams) as runner:
        ran = runner.tick(job, force=True)
    metrics.observe(ran)
    repaired = samples_of(metrics.exposition(), "pgjobs_repaired_rows_total")
    assert {dict(k)["change"]: v for k, v in repaired.items()} == {
        "inserted": 2,
        "updated": 3,
        "deleted": 1,
    }
    page = StatusPage(refresh=0)
    body = page(source, Request("/job/scores")).body.decode()
    assert "Last check" in body and "Last repair" in body
    assert "{&quot;exam_id&quot;: 4, &quot;student&quot;: 2}" in body  # an updated key, both
    assert (
        body.count("{&quot;exam_id&quot;: 1, &quot;student&quot;: 99}") == 2
    )  # on its way; repaired
    overview = page(source, Request("/")).body.decode()
    assert "Drift (last check)" in overview and "+2 ~3 -0" in overview


def test_a_composite_scope_is_checked_by_json_keys(
    exams: Engine, db_url: str, tmp_path: Path
) -> None:
    from pgjobs.drift_text import parse_keys

    assert parse_keys(["[4, 2]", "7", '["a", "b"]']) == [(4, 2), "7", ("a", "b")]
    with pytest.raises(pgjobs.ConfigError, match="not a JSON array"):
        parse_keys(["[4,"])
    pgjobs.install(exams)
    pairs = pgjobs.QueueJob(
        name="pairs",
        group="exams",
        target="exam_score",
        scope=("exam_id", "student"),
        compute="select a.exam_id, a.student, sum(a.points)::int as score from answer a"
        " join pgjobs_keys k using (exam_id, student) group by a.exam_id, a.student",
    )
    result = pgjobs.check(pairs, exams, keys=[(4, 2), (5, 5), (7, 1)])
    assert (result.updated, result.unchanged) == (2, 1)
    assert keys(result, "updated") == [(4, 2), (5, 5)]


SLOW = "select exam_id, student, score from exam_score where pg_sleep(0.05) is not null"


def test_the_check_runs_under_the_job_s_statement_timeout(
    exams: Engine, db_url: str, tmp_path: Path
) -> None:
    slow = recompute(compute=SLOW, statement_timeout="200ms")
    started = time.perf_counter()
    with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
        pgjobs.check(slow, exams)
    assert time.perf_counter() - started < 2  # 50 rows x 50 ms, cut at 200 ms
    config = tmp_path / "pgjobs.toml"
    config.write_text(CONFIG_JOB.replace(SCORES, SLOW) + 'statement_timeout = "200ms"\n')
    out = invoke("check", "scores", "-c", str(config), "--database", db_url)
    assert out.exit_code == 3, out.output
    assert "pgjobs: the check failed: canceling statement due to statement timeout" in out.output


#: a compute of about a second, longer than the bookkeeping bound below
SLOW_COMPUTE = SCORES.replace("from answer a", "from answer a, (select pg_sleep(1)) as pause")


def test_the_check_has_the_job_s_deadline_not_the_bookkeeping_one(db_url: str) -> None:
    # A compute longer than call_timeout (the bound of pgjobs' bookkeeping
    # round trips) but within the job's statement_timeout completes: the
    # check's round trips have the job's deadline, as its ticks do
    # (lock_timeout + statement_timeout + call_timeout), on pgjobs.check
    # and on a scheduled verification alike; the bookkeeping bound after.
    from pgjobs.database import resolve_engine
    from pgjobs.drift import check_on, verify
    from pgjobs.store import Store

    engine, _ = resolve_engine(db_url, call_timeout=0.5)
    try:
        run_sql(engine, SCHEMA)
        pgjobs.install(engine)
        job = recompute(compute=SLOW_COMPUTE, statement_timeout="5s", verify_every="1h")
        started = time.perf_counter()
        result = pgjobs.check(job, engine, call_timeout=0.5)
        assert time.perf_counter() - started >= 1
        assert result.inserted == 50  # exam_score is empty: every row is missing
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert check_on(conn, job, call_timeout=0.5).inserted == 50
            assert raw.pgjobs_bound == 0.5  # the bookkeeping bound again
        recorded = verify(engine, Store(), job, call_timeout=0.5)
        assert recorded is not None and recorded.error is None, recorded
        assert recorded.stats.inserted == 50
        # the bookkeeping bound is what it was: without the job's deadline the
        # same compute is abandoned after 0.5 s
        with engine.connect() as conn, pytest.raises(OperationalError, match=r"within 0\.5 s"):
            conn.execute(text("select pg_sleep(1)"))
    finally:
        engine.dispose()


def test_rows_of_an_item_a_worker_holds_are_in_flight_and_the_check_does_not_wait(
    exams: Engine,
) -> None:
    pgjobs.install(exams)
    claimed, release = threading.Event(), threading.Event()

    def slow_compute(conn: Any, keys: Any) -> Any:
        claimed.set()
        assert release.wait(20), "the check never finished"
        return text(SCORES_FOR_ITEMS)

    slow = worker().replace(compute=slow_compute)
    assert isinstance(slow, pgjobs.QueueJob)
    with exams.begin() as conn:
        pgjobs.enqueue(conn, slow, [5])
    ticks: list[pgjobs.RunResult] = []
    thread = threading.Thread(target=lambda: ticks.append(pgjobs.run_once(slow, exams)))
    thread.start()
    try:
        assert claimed.wait(20)
        started = time.perf_counter()
        result = pgjobs.check(recompute(lock_timeout="1s"), exams, workers=[slow])
        assert time.perf_counter() - started < 1.0  # nothing it needs is held against it
    finally:
        release.set()
        thread.join(30)
    assert (result.updated, result.on_the_way.updated) == (2, 1)
    assert keys(result, "on_the_way") == [(5, 5)]
    assert ticks and ticks[0].outcome is pgjobs.Outcome.RAN and ticks[0].stats.updated == 1


def test_an_item_a_worker_rewrote_while_the_check_computed_is_not_drift(exams: Engine) -> None:
    """A user changes exam 7's answers and enqueues it, and a worker rewrites
    its rows, all after the check computed and before it takes the
    difference: the check's new rows are older than the target's. The
    worker's flow mark (its xid, not visible in the check's start snapshot)
    puts those rows on their way, not in the drift."""
    pgjobs.install(exams)
    computed, rewritten = threading.Event(), threading.Event()

    def compute(conn: Any) -> list[tuple[Any, ...]]:
        rows = [tuple(r) for r in conn.execute(text(SCORES))]
        computed.set()
        assert rewritten.wait(20), "the worker never came"
        return rows

    errors: list[BaseException] = []

    def user_and_worker() -> None:
        try:
            assert computed.wait(20)
            with exams.begin() as conn:
                conn.execute(text("update answer set points = points + 1 where exam_id = 7"))
                pgjobs.enqueue(conn, worker(), [7])
            ran = pgjobs.run_once(worker(), exams)
            assert ran.outcome is pgjobs.Outcome.RAN and ran.stats.updated == 5, ran
        except BaseException as exc:
            errors.append(exc)
        finally:
            rewritten.set()

    thread = threading.Thread(target=user_and_worker)
    thread.start()
    result = pgjobs.check(recompute(compute=compute), exams, workers=[worker()])
    thread.join(30)
    assert not errors, errors
    assert (result.inserted, result.updated, result.deleted) == (2, 3, 1)
    assert result.on_the_way.updated == 5
    assert keys(result, "on_the_way") == [(7, s) for s in range(1, 6)]


def test_status_shows_the_last_check_the_page_and_metrics_read(
    exams: Engine, db_url: str, tmp_path: Path
) -> None:
    """``pgjobs status`` reads the last recorded check through the read model
    the page and the metrics read: the same figures on all three."""
    from pgjobs.drift import verify
    from pgjobs.metrics import Metrics
    from pgjobs.serve import Request, Source
    from pgjobs.store import Store
    from pgjobs.web import StatusPage

    pgjobs.install(exams)
    job = recompute(verify_every="1h")
    recorded = verify(exams, Store(), job)
    assert recorded is not None and recorded.outcome == "checked"
    figures = {"inserted": 2, "updated": 3, "deleted": 1}
    assert {k: getattr(recorded.stats, k) for k in figures} == figures
    config = tmp_path / "pgjobs.toml"
    config.write_text(CONFIG_JOB)
    out = invoke("status", "-c", str(config), "--database", db_url, "--json")
    assert out.exit_code == 0, out.output
    [row] = [r for r in json.loads(out.output)["jobs"] if r["job"] == "scores"]
    assert row["last_check"]["drift"] == figures
    assert row["last_check"]["error"] is None and row["last_check"]["at"] is not None
    text_out = invoke("status", "-c", str(config), "--database", db_url)
    line = r"scores: last checked \d+[smh]\S* ago: 6 rows drift \(\+2 ~3 -1\)"
    assert re.search(line, text_out.output), text_out.output
    source = Source(engine=exams, jobs={job.name: job})
    drift = samples_of(Metrics(cache_seconds=0).bind(source).exposition(), "pgjobs_drift_rows")
    assert {dict(k)["change"]: v for k, v in drift.items()} == {**figures, "skipped": 0}
    overview = StatusPage(refresh=0)(source, Request("/")).body.decode()
    assert "+2 ~3 -1" in overview
