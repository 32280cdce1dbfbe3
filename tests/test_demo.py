"""``pgjobs demo`` against a real PostgreSQL, short runs.

The scripted interleavings are deterministic (threads ordered with events
and pg_stat_activity, not sleeps), so their outcomes are asserted for both
designs. The timed run's naive figures depend on timing and are only
checked to be reported; the pgjobs figures must show no deadlock, no FK
violation and exact scores.
"""

from __future__ import annotations

import io

import pytest
from sqlalchemy import create_engine, text

from pgjobs.demo import DEADLOCK, FK_VIOLATION, DemoOptions, format_report, main, run_demo
from pgjobs.demo.lag import LagTally, XactSnapshot
from pgjobs.demo.report import fmt_s

SMALL = {"exams": 2000, "students": 5, "compute_seconds": 0.5, "recompute_every": 1.5}


def _demo_schemas(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("select nspname from pg_namespace where nspname like 'pgjobs_demo_%'")
            ).all()
        return [r[0] for r in rows]
    finally:
        engine.dispose()


def test_naive_and_pgjobs_side_by_side(db_url: str) -> None:
    err = io.StringIO()
    report = run_demo(
        db_url, DemoOptions(seconds=3, naive=True, progress_every=1, **SMALL), err=err
    )

    # Scripted: the naive recompute holds every score while it computes; a
    # user's cascading delete waits for it, and its reinsert's FK check waits
    # for the user: PostgreSQL kills one of the two.
    naive_recompute, naive_worker, pgjobs_recompute = report.scripted
    assert (naive_recompute.design, naive_recompute.job) == ("naive", "recompute")
    assert DEADLOCK in (naive_recompute.job_sqlstate, naive_recompute.user_sqlstate)
    # Scripted: the naive worker computed an exam's rows, the exam was deleted
    # meanwhile (nothing blocked the user), the worker's insert fails.
    assert (naive_worker.design, naive_worker.job) == ("naive", "worker")
    assert naive_worker.user_sqlstate is None and naive_worker.user_done_during_job
    assert naive_worker.job_sqlstate == FK_VIOLATION
    # Scripted, pgjobs: the same delete during the recompute's compute commits
    # while the recompute is still open; the recompute then skips that exam's
    # rows instead of failing.
    assert (pgjobs_recompute.design, pgjobs_recompute.job) == ("pgjobs", "recompute")
    assert pgjobs_recompute.user_sqlstate is None
    assert pgjobs_recompute.user_done_during_job
    assert pgjobs_recompute.job_sqlstate is None
    assert pgjobs_recompute.skipped_missing_parent == SMALL["students"]

    naive, pgjobs = report.phase("naive"), report.phase("pgjobs")
    # The pgjobs run: both jobs ran, users worked, nothing failed, and the
    # scores equal a from-scratch computation once the queue drained.
    assert pgjobs.jobs["recompute"].outcomes.get("ran", 0) >= 1
    assert pgjobs.jobs["worker"].outcomes.get("ran", 0) >= 1
    assert pgjobs.jobs["worker"].items > 0
    assert pgjobs.deletes + pgjobs.merges > 0 and pgjobs.changes > 0
    assert pgjobs.deadlocks == 0
    assert pgjobs.fk_violations == 0
    assert pgjobs.user_errors == {}
    assert all(job.errors == {} for job in pgjobs.jobs.values())
    assert pgjobs.drift == 0
    assert len(pgjobs.delete_latencies) == pgjobs.deletes + pgjobs.merges
    # The naive run happened on its own copy of the same data, and its counts
    # are reported (how many failures it has depends on timing).
    assert naive.jobs["recompute"].runs >= 1
    assert naive.deletes + naive.merges > 0

    summary = format_report(report)
    assert any(line.split() == ["naive", "no-flow", "pgjobs"] for line in summary.splitlines())
    deadlock_line = next(
        line for line in summary.splitlines() if line.startswith("deadlocks (40P01)")
    )
    assert deadlock_line.split()[-3:] == [str(naive.deadlocks), "0", "0"]
    fk_line = next(
        line for line in summary.splitlines() if line.startswith("FK violations (23503)")
    )
    assert fk_line.split()[-3:] == [str(naive.fk_violations), "0", "0"]
    assert "failed with 40P01" in summary and "failed with 23503" in summary
    # Progress: a line per second or so on stderr, for each design.
    progress = err.getvalue().splitlines()
    assert any(line.startswith("[naive") for line in progress)
    assert any(line.startswith("[pgjobs") for line in progress)
    assert len(progress) < 30
    # Its schemas (data of both designs, pgjobs' own tables) are gone.
    assert _demo_schemas(db_url) == []


def test_the_report_shows_each_designs_queue_lag(db_url: str) -> None:
    opts = DemoOptions(
        seconds=2,
        naive=True,
        progress_every=0,
        exams=500,
        students=5,
        compute_seconds=0.2,
        recompute_every=1.5,
    )
    report = run_demo(db_url, opts)

    summary = format_report(report).splitlines()
    lag_line = next(line for line in summary if line.startswith("queue lag p50 / p95 / max"))
    shown = []
    for design in ("naive", "no-flow", "pgjobs"):
        phase = report.phase(design)
        # Users changed and merged exams (each change enqueues one), and the
        # worker processed some of them: each processing is one lag.
        assert phase.changes > 0
        assert phase.queue_lags, design
        p50, p95, top = (phase.queue_lag(q) for q in (0.5, 0.95, 1.0))
        assert p50 is not None and p95 is not None and top is not None
        assert 0 < p50 <= p95 <= top, (design, p50, p95, top)
        # Nobody waits longer than the run and its drain took.
        assert top < phase.seconds + 30
        shown.append(f"{fmt_s(p50)} / {fmt_s(p95)} / {fmt_s(top)}")
    # One column per design, in the report's order.
    assert lag_line.removeprefix("queue lag p50 / p95 / max").split() == " ".join(shown).split()
    measured = next(line for line in summary if line.startswith("queue lag: items measured"))
    assert measured.split()[-3:] == [
        f"{len(report.phase(d).queue_lags):,}" for d in ("naive", "no-flow", "pgjobs")
    ]
    # pgjobs loses no enqueued change: each was processed by the end of the drain.
    assert report.phase("pgjobs").unprocessed == 0
    assert any(
        line.startswith("Queue lag: from an item's first enqueue commit") for line in summary
    )


def test_main_prints_the_summary_and_cleans_up(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(db_url, seconds=2, exams=500, compute_seconds=0.2, recompute_every=1.5)
    out, err = capsys.readouterr()
    assert code == 0
    assert "pgjobs: no deadlock, no FK violation, no failed transaction;" in out
    assert "the scores are exact after the queue drained." in out
    assert "users: delete latency p50 / p99 / max" in out
    assert "pgjobs demo: building 500 exams" in err
    assert _demo_schemas(db_url) == []


def test_queue_lag_counts_from_the_first_enqueue_a_processing_saw() -> None:
    # Transactions 100..102 committed before the worker's snapshot; 103 was
    # still open then (in progress), 105 began after it (>= xmax).
    snapshot = XactSnapshot.parse("103:105:103")
    assert [snapshot.sees(x) for x in (100, 102, 103, 104, 105)] == [True, True, False, True, False]
    tally = LagTally()
    tally.enqueued(7, 100, at=1.0)  # enqueued twice before it was processed
    tally.enqueued(7, 102, at=2.0)
    tally.enqueued(7, 105, at=3.5)  # committed after the worker's snapshot
    tally.enqueued(8, 103, at=2.5)  # open at the snapshot, committed later
    tally.enqueued(9, 101, at=1.5)  # its exam was deleted before processing
    tally.processed([7, 8], snapshot, at=4.0)
    tally.processed([7], XactSnapshot.parse("106:106:"), at=6.0)
    figures = tally.figures(live={7, 8})
    # 7: 4.0 - 1.0 from its first enqueue, then 6.0 - 3.5 for the later one.
    assert sorted(figures.lags) == [2.5, 3.0]
    # 8's enqueue was never seen by a worker; 9 is gone and not counted.
    assert figures.unprocessed == 1


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main("postgresql://nowhere.invalid/x", seconds=0) == 2
    assert "seconds: expected a positive number, got 0" in capsys.readouterr().err


def test_without_a_database_it_runs_on_an_embedded_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # conftest leaves $PGJOBS_DATABASE_URL unset: "no database configured".
    code = main(None, seconds=2, exams=300, compute_seconds=0.2, recompute_every=1.5)
    out, _ = capsys.readouterr()
    assert code == 0
    assert "on an embedded PostgreSQL in a temporary directory (removed afterwards)" in out
    assert "pgjobs: no deadlock, no FK violation, no failed transaction;" in out


def test_an_unreachable_database_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main("postgresql://postgres@127.0.0.1:1/nothing", seconds=1) == 2
    assert "pgjobs demo: cannot connect to postgresql+psycopg://postgres@127.0.0.1:1/nothing" in (
        capsys.readouterr().err
    )
