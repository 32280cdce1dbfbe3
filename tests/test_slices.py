"""Sliced recomputes (``pgjobs/slices/``, ``docs/slices.md``): a recompute
with a scope runs slice by slice, each its own transaction; resumed after
a failure; shared by several processes. Real PostgreSQL, real connections;
races scripted with events at the points between slices (the progress
callback, called after each slice's commit), never sleeps."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
import pgjobs.logs
import pgjobs.slices.body
import pgjobs.slices.progress
import pgjobs.steps
from pgjobs import ConfigError, RecomputeJob, Runner
from pgjobs.config import load_config

WAIT = 30.0
PARENTS = 3000  # 3 pieces of 1,000 keys

SCHEMA = f"""
create table parent (id int primary key, v int not null);
create table derived (
    parent_id int not null references parent on delete cascade,
    n int not null,
    h text not null,
    primary key (parent_id, n)
);
insert into parent select g, g from generate_series(1, {PARENTS}) g;
analyze parent;
"""
DERIVE = (
    "select p.id as parent_id, g as n, md5(p.v::text || '/' || g) as h"
    " from parent p cross join generate_series(1, 3) g"
)


@pytest.fixture
def db(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text(SCHEMA))
    return engine


def job(**fields: Any) -> RecomputeJob:
    values: dict[str, Any] = {
        "name": "sliced",
        "target": "derived",
        "compute": DERIVE,
        "scope": ("parent_id",),
        "every": "1h",
        "slice_seconds": "0.05s",
    }
    values.update(fields)
    return RecomputeJob(**values)


def wrong_rows(engine: Engine, derive: str = DERIVE) -> tuple[int, int]:
    """Rows missing from the target, rows it has too many (against ``derive``)."""
    with engine.connect() as conn:
        missing = conn.execute(text(f"select count(*) from (({derive}) except table derived) x"))
        extra = conn.execute(text(f"select count(*) from (table derived except ({derive})) x"))
        return int(missing.scalar_one()), int(extra.scalar_one())


def progress_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("select count(*) from pgjobs.slice_run")).scalar_one())


# -- the job's settings --------------------------------------------------------------


def test_a_scope_makes_a_sliced_job_and_sliced_false_turns_it_off():
    assert job().slices and job().slice_target == 0.05
    assert not job(sliced=False).slices
    assert not job(scope=()).slices
    assert RecomputeJob(name="x", target="t", compute="select 1", scope="a").slice_target == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"slice_seconds": 0}, "slice_seconds: expected more than 0 and at most 10m, got 0"),
        ({"slice_seconds": "11m"}, "slice_seconds: expected more than 0 and at most 10m"),
        ({"slice_seconds": "soon"}, "slice_seconds"),
        ({"sliced": "yes"}, "sliced: expected true or false, got 'yes'"),
        ({"slice_pause": -0.5}, r"slice_pause: expected a number from 0 to 10 .*, got -0.5"),
        ({"slice_pause": 11}, r"slice_pause: expected a number from 0 to 10"),
        ({"slice_pause": "1/4"}, r"slice_pause: .*, got '1/4'"),
        ({"slice_pause": True}, r"slice_pause: .*, got True"),
        ({"scope": [1]}, r"scope: expected column names, got \[1\]"),
        ({"atomic": True}, "atomic: a sliced run"),
        ({"compute": lambda conn: []}, r"compute: a Python compute\(conn\) gives every key's rows"),
        (
            {"compute": lambda conn, keys: [], "scope": ()},
            r"compute\(conn, keys\) is for a sliced run",
        ),
    ],
)
def test_bad_settings_are_refused_naming_them(fields, message):
    with pytest.raises(ConfigError, match=message) as caught:
        job(**fields)
    assert "RecomputeJob 'sliced'" in str(caught.value)


def test_pgjobs_toml_takes_scope_sliced_and_slice_seconds(tmp_path):
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        '[jobs.totals]\nkind = "recompute"\ntarget = "derived"\nsql = "select 1"\n'
        'scope = ["parent_id"]\nslice_seconds = "3s"\nslice_pause = 0.5\n'
        '[jobs.whole]\nkind = "recompute"\ntarget = "derived"\nsql = "select 1"\n'
        'scope = "parent_id"\nsliced = false\n'
    )
    jobs = {j.name: j for j in load_config(path).jobs}
    totals, whole = jobs["totals"], jobs["whole"]
    assert isinstance(totals, RecomputeJob) and isinstance(whole, RecomputeJob)
    assert totals.slices and totals.slice_target == 3 and totals.scope == ("parent_id",)
    assert totals.slice_pause == 0.5 and whole.slice_pause == pgjobs.jobs.DEFAULT_SLICE_PAUSE
    assert not whole.slices


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('slice_seconds = "0s"', "jobs.totals.slice_seconds: expected more than 0"),
        ("sliced = 1", "jobs.totals.sliced: expected true or false, got 1"),
        ("slice_pause = -1", "jobs.totals.slice_pause: expected a number from 0 to 10"),
        ('slice_pause = "a lot"', "jobs.totals.slice_pause: .*, got 'a lot'"),
        ("scope = []", "jobs.totals.scope: expected a column name or a list"),
    ],
)
def test_pgjobs_toml_bad_slice_settings_name_the_key_and_value(tmp_path, line, message):
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        f'[jobs.totals]\nkind = "recompute"\ntarget = "derived"\nsql = "select 1"\n{line}\n'
        + ('scope = ["parent_id"]\n' if not line.startswith("scope") else "")
    )
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_a_scope_column_the_target_lacks_fails_the_run_naming_it(db):
    result = pgjobs.run_once(job(scope=("nope",)), db, force=True)
    assert result.outcome == "failed"
    assert "scope: public.derived has no column(s) nope, got ['nope']" in (result.error or "")


# -- runs ------------------------------------------------------------------------------


def test_a_sliced_run_is_exact_and_each_slice_commits_on_its_own(db):
    seen: list[tuple[int | None, int | None]] = []
    xids: set[int] = set()

    def progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices":
            seen.append((done, total))
            with db.connect() as conn:  # what another session sees now
                xids.add(conn.execute(text("select count(*) from derived")).scalar_one())

    with Runner(db) as runner:
        first = runner.tick(job(), force=True, progress=progress)
    assert first.outcome == "ran", first.error
    assert wrong_rows(db) == (0, 0)
    assert first.stats.inserted == 3 * PARENTS
    sliced = first.detail["sliced"]
    assert sliced["pieces"] == 3 and sliced["slices"] == len(seen) - 1 >= 2
    assert first.slices == sliced["slices"] and first.processes == sliced["processes"]
    assert not first.resumed
    # each slice was visible to others before the run ended
    assert len(xids) >= 3 and 0 < min(xids - {0}) < 3 * PARENTS
    assert progress_rows(db) == 0  # the last slice deleted the run's progress
    with db.begin() as conn:
        conn.execute(text("update parent set v = v + 1 where id % 100 = 0"))
    with Runner(db) as runner:
        second = runner.tick(job(), force=True)
    assert second.stats.updated == 3 * PARENTS // 100
    assert second.stats.unchanged == 3 * PARENTS - second.stats.updated
    assert wrong_rows(db) == (0, 0)


def test_vanished_keys_are_deleted_and_deleted_parents_between_slices_are_skipped(db):
    pgjobs.run_once(job(), db, force=True)
    with db.begin() as conn:
        # keys whose sources no longer give rows: their rows must go
        conn.execute(text("alter table parent add column hidden boolean not null default false"))
        conn.execute(text("update parent set hidden = true where id in (5, 2500)"))
    hidden = DERIVE + " where not p.hidden"
    deleted_between = threading.Event()

    def progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done == 1 and not deleted_between.is_set():
            # the first slice is committed; a user deletes a parent of a
            # later slice (its rows go with it, by the cascade)
            with db.begin() as conn:
                conn.execute(text("delete from parent where id = 2999"))
            deleted_between.set()

    with Runner(db) as runner:
        result = runner.tick(
            job(compute=hidden, slice_seconds="10m"), force=True, progress=progress
        )
    assert result.outcome == "ran", result.error
    assert deleted_between.is_set()
    assert result.stats.deleted == 6  # 2 keys x 3 rows
    assert wrong_rows(db, hidden) == (0, 0)


def test_rows_of_a_parent_deleted_during_a_slice_are_skipped_and_counted(db):
    """A parent deleted after the slice computed its rows, before it locks
    the parents: the rows are skipped (never a 23503), counted, and the
    next run finds nothing to do."""
    computed = threading.Event()
    deleted = threading.Event()

    def rows(conn, keys):
        out = [(k, n, "x") for (k,) in keys for n in (1, 2, 3)]
        if 1500 in {k for (k,) in keys} and not computed.is_set():
            computed.set()
            assert deleted.wait(WAIT)
        return out

    def user() -> None:
        assert computed.wait(WAIT)
        with db.begin() as conn:
            conn.execute(text("delete from parent where id = 1500"))
        deleted.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(user)
        result = pgjobs.run_once(job(compute=rows, slice_seconds="10m"), db, force=True)
        done.result(WAIT)
    assert result.outcome == "ran", result.error
    assert result.stats.skipped_missing_parent == 3
    assert result.stats.inserted == 3 * (PARENTS - 1)
    again = pgjobs.run_once(job(compute=rows), db, force=True)
    assert again.stats.inserted == again.stats.updated == again.stats.deleted == 0


def test_a_key_inserted_into_a_slice_already_done_is_left_to_the_next_run(db):
    def progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done == 1:
            with db.begin() as conn:
                conn.execute(text("insert into parent values (0, 0)"))  # the first piece's

    with Runner(db) as runner:
        first = runner.tick(job(slice_seconds="10m"), force=True, progress=progress)
    assert first.outcome == "ran"
    assert wrong_rows(db) == (3, 0)  # key 0: its slice was done before it existed
    second = pgjobs.run_once(job(), db, force=True)
    assert second.stats.inserted == 3
    assert wrong_rows(db) == (0, 0)


def test_a_keyed_sql_compute_and_a_python_compute_run_sliced(db):
    keyed = DERIVE + " where p.id = any(:keys)"
    result = pgjobs.run_once(job(compute=keyed), db, force=True)
    assert result.outcome == "ran", result.error
    assert result.stats.inserted == 3 * PARENTS and wrong_rows(db) == (0, 0)

    calls: list[int] = []

    def python_rows(conn, keys):
        calls.append(len(keys))
        ids = [k for (k,) in keys]
        found = conn.execute(text("select id, v from parent where id = any(:ids)"), {"ids": ids})
        return [{"parent_id": i, "n": n, "h": "python"} for i, v in found for n in (1, 2, 3)]

    result = pgjobs.run_once(job(compute=python_rows), db, force=True)
    assert result.outcome == "ran", result.error
    assert sum(calls) == PARENTS and len(calls) == result.detail["sliced"]["slices"]
    assert result.stats.updated == 3 * PARENTS
    with db.connect() as conn:
        assert conn.execute(text("select count(distinct h) from derived")).scalar_one() == 1


def test_a_compute_the_restriction_cannot_reach_is_refused_before_any_slice(db):
    by_value = (
        "select max(p.id) as parent_id, 1 as n, md5(p.v::text) as h from parent p group by p.v"
    )
    result = pgjobs.run_once(job(compute=by_value), db, force=True)
    assert result.outcome == "failed"
    error = result.error or ""
    assert (
        "ScopeError: job 'sliced': the restriction to a slice of the scope ('parent_id',)" in error
    )
    assert "HashAggregate" in error and "max(p.id)" in error
    assert "SQL: select max(p.id) as parent_id" in error
    assert progress_rows(db) == 0  # refused before the run was cut
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from derived")).scalar_one() == 0


def test_a_slice_failing_half_way_keeps_the_slices_before_it_and_the_next_run_resumes(db):
    with db.begin() as conn:
        conn.execute(
            text(
                "create function refuse() returns trigger language plpgsql as $$"
                " begin if new.parent_id = 2500 then raise exception 'refused 2500'; end if;"
                " return new; end $$;"
                " create trigger refuse before insert on derived for each row"
                " execute function refuse()"
            )
        )
    failing = job(every="1h", slice_seconds="10m", backoff="1s")
    failed = pgjobs.run_once(failing, db, force=True)
    assert failed.outcome == "failed" and "refused 2500" in (failed.error or "")
    with db.connect() as conn:
        written = conn.execute(text("select count(*) from derived")).scalar_one()
        run = conn.execute(text("select done, pieces from pgjobs.slice_run")).one()
        state = conn.execute(
            text("select failures from pgjobs.job_state where job = 'sliced'")
        ).scalar_one()
    assert 0 < written < 3 * PARENTS and run.done >= 1 and run.done < run.pieces
    assert state == 1  # backing off as any failure
    with db.begin() as conn:
        conn.execute(text("drop trigger refuse on derived"))
    resumed = pgjobs.run_once(failing, db, force=True)
    assert resumed.outcome == "ran", resumed.error
    assert resumed.resumed
    # one record for the run: the sums of every slice, of both ticks
    assert resumed.stats.inserted == 3 * PARENTS
    sliced = resumed.detail["sliced"]
    assert sliced["slices_here"] == sliced["slices"] - run.done  # only what was left here
    assert wrong_rows(db) == (0, 0)


def _seen_by_others(engine: Engine, tick: Any) -> tuple[str, Any, int]:
    """The tick's session as another one sees it: its state, its snapshot's
    xmin, and how many derived rows are visible (committed)."""
    pid = tick.conn.connection.driver_connection.info.backend_pid
    with engine.connect() as conn:
        state, xmin = conn.execute(
            text("select state, backend_xmin from pg_stat_activity where pid = :p"), {"p": pid}
        ).one()
        rows = conn.execute(text("select count(*) from derived")).scalar_one()
    return state, xmin, rows


def test_the_pause_after_each_slice_holds_no_transaction_the_last_has_none(db, monkeypatch):
    pauses: list[tuple[float, tuple[str, Any, int]]] = []
    rest = pgjobs.steps.Tick._rest

    def resting(tick: Any, seconds: float) -> None:
        pauses.append((seconds, _seen_by_others(db, tick)))
        rest(tick, seconds)

    monkeypatch.setattr(pgjobs.steps.Tick, "_rest", resting)
    with Runner(db) as runner:
        done = runner.tick(job(slice_pause=0.5), force=True)
    assert done.outcome == "ran", done.error
    assert wrong_rows(db) == (0, 0)
    # a pause after every slice but the last, of half the slice's time
    assert len(pauses) == done.slices - 1 >= 2
    assert all(0 < seconds < 0.5 * WAIT for seconds, _ in pauses)
    for _, (state, xmin, rows) in pauses:
        # outside any transaction: no snapshot, the slice's rows committed
        assert (state, xmin) == ("idle", None)
        assert 0 < rows < 3 * PARENTS
    with Runner(db) as runner:  # none by default
        pauses.clear()
        assert runner.tick(job(), force=True).outcome == "ran"
    assert pauses == []


def test_a_shutdown_cancel_during_the_pause_ends_it_and_the_tick_at_once(db, monkeypatch):
    waited: list[float] = []
    rest = pgjobs.steps.Tick._rest

    def resting(tick: Any, seconds: float) -> None:
        canceller = threading.Thread(target=tick.cancel)  # as the shutdown deadline does
        canceller.start()
        started = time.monotonic()
        rest(tick, WAIT)  # a long pause: the cancel ends it
        waited.append(time.monotonic() - started)
        canceller.join(WAIT)

    monkeypatch.setattr(pgjobs.steps.Tick, "_rest", resting)
    with Runner(db) as runner:
        cut = runner.tick(job(slice_pause=1, slice_seconds="10m"), force=True)
    assert cut.outcome == "cancelled", cut.error
    assert len(waited) == 1 and waited[0] < WAIT / 2
    with db.connect() as conn:
        run = conn.execute(text("select done, pieces from pgjobs.slice_run")).one()
    assert run.done == 1 < run.pieces  # the first slice stays committed
    monkeypatch.undo()
    resumed = pgjobs.run_once(job(), db, force=True)
    assert resumed.outcome == "ran" and resumed.resumed
    assert wrong_rows(db) == (0, 0)


def test_a_run_older_than_the_interval_starts_over(db):
    with db.begin() as conn:
        conn.execute(
            text(
                "create function refuse() returns trigger language plpgsql as $$"
                " begin if new.parent_id = 2500 then raise exception 'refused'; end if;"
                " return new; end $$;"
                " create trigger refuse before insert on derived for each row"
                " execute function refuse()"
            )
        )
    assert pgjobs.run_once(job(slice_seconds="10m"), db, force=True).outcome == "failed"
    with db.begin() as conn:
        conn.execute(text("drop trigger refuse on derived"))
        old = conn.execute(text("select id from pgjobs.slice_run")).scalar_one()
        conn.execute(text("update pgjobs.slice_run set touched_at = touched_at - interval '2h'"))
    again = pgjobs.run_once(job(), db, force=True)
    assert again.outcome == "ran" and not again.resumed
    assert again.detail["sliced"]["pieces"] == 3  # all of them, cut again
    assert again.stats.unchanged > 0  # the first run's slices were done again
    assert wrong_rows(db) == (0, 0)
    with db.connect() as conn:
        assert (
            conn.execute(
                text("select count(*) from pgjobs.slice where run = :r"), {"r": old}
            ).scalar_one()
            == 0
        )


def test_two_processes_share_a_run_no_piece_done_twice_none_skipped(db, monkeypatch):
    """Two runners (two processes' ticks) race for the pieces: each piece is
    done by exactly one; the one that does the last piece records the run,
    with both processes; the other ends its tick ``busy``."""
    with db.begin() as conn:
        conn.execute(
            text(f"insert into parent select g, g from generate_series({PARENTS + 1}, 12000) g")
        )
        conn.execute(text("analyze parent"))
    done_by: dict[str, list[int]] = {}
    original = pgjobs.slices.progress.Runs.done
    lock = threading.Lock()

    def spy(self, run_id, pieces, rows, seconds, sums):
        with lock:
            done_by.setdefault(self.worker, []).extend(p.n for p in pieces)
        return original(self, run_id, pieces, rows, seconds, sums)

    monkeypatch.setattr(pgjobs.slices.progress.Runs, "done", spy)
    a_first, b_first = threading.Event(), threading.Event()

    def a_progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done and not a_first.is_set():
            a_first.set()  # A's first slice is committed: B may join
            assert b_first.wait(WAIT)  # and A goes on once B has done one

    def b_progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done and not b_first.is_set():
            b_first.set()

    shared = job(slice_seconds="10m")  # one piece a slice: many slices to race for

    def tick(name: str, progress: Any, after: threading.Event | None) -> pgjobs.RunResult:
        if after is not None:
            assert after.wait(WAIT)
        with Runner(db, worker=name) as runner:
            return runner.tick(shared, force=True, progress=progress)

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(tick, "A", a_progress, None)
        b = pool.submit(tick, "B", b_progress, a_first)
        results = {a.result(WAIT).outcome, b.result(WAIT).outcome}
    ran = a.result() if a.result().outcome == "ran" else b.result()
    assert results == {"ran", "busy"}, (a.result(), b.result())
    pieces = ran.detail["sliced"]["pieces"]
    every = sorted(done_by["A"] + done_by["B"])
    assert every == list(range(pieces))  # none twice, none skipped
    assert done_by["A"] and done_by["B"]
    assert ran.processes == ["A", "B"]
    assert ran.stats.inserted == 3 * 12000
    assert wrong_rows(db) == (0, 0)
    assert progress_rows(db) == 0
    # the other tick says that it joined, and what it did
    joined = b.result() if ran is a.result() else a.result()
    assert joined.detail["sliced"]["joined"] and joined.detail["sliced"]["slices_here"] >= 1
    assert "joined its sliced run" in pgjobs.logs.quiet_line(joined)


def test_a_slice_written_in_several_commits_keeps_its_pieces_from_another_process(db, monkeypatch):
    """A slice whose difference is larger than WRITE_ROWS writes it in
    several transactions (the group's write lock to each commit). Between
    two of them another process's tick takes none of its pieces: it does
    the others and ends ``busy``; the slice ends, the run is exact, no piece
    done twice."""
    monkeypatch.setattr(pgjobs.slices.body, "WRITE_ROWS", 300)  # 100 parents a write
    done_by: dict[str, list[int]] = {}
    original_done = pgjobs.slices.progress.Runs.done
    lock = threading.Lock()

    def spy(self, run_id, pieces, rows, seconds, sums):
        with lock:
            done_by.setdefault(self.worker, []).extend(p.n for p in pieces)
        return original_done(self, run_id, pieces, rows, seconds, sums)

    monkeypatch.setattr(pgjobs.slices.progress.Runs, "done", spy)
    original_lock = pgjobs.slices.body.write_lock_now
    who = threading.local()
    a_between, b_done = threading.Event(), threading.Event()
    writes = {"A": 0}

    def write_lock(conn, name):  # type: ignore[no-untyped-def]
        if getattr(who, "name", "") == "A":
            writes["A"] += 1
            if writes["A"] == 2:  # A's first write is committed, its pieces held
                a_between.set()
                assert b_done.wait(WAIT)
        return original_lock(conn, name)

    monkeypatch.setattr(pgjobs.slices.body, "write_lock_now", write_lock)
    shared = job(slice_seconds="10m")

    def tick(name: str, after: threading.Event | None) -> pgjobs.RunResult:
        who.name = name
        if after is not None:
            assert after.wait(WAIT)
        try:
            with Runner(db, worker=name) as runner:
                return runner.tick(shared, force=True)
        finally:
            if name == "B":
                b_done.set()

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(tick, "A", None)
        b = pool.submit(tick, "B", a_between)
        ran, other = a.result(WAIT), b.result(WAIT)
    assert ran.outcome == "ran", ran.error
    assert other.outcome == "busy" and other.detail["sliced"]["joined"], other
    assert writes["A"] >= 3  # A's first slice: 3,000 rows, about 300 a write
    every = sorted(done_by["A"] + done_by["B"])
    assert every == list(range(ran.detail["sliced"]["pieces"]))  # none twice, none skipped
    assert done_by["A"] and done_by["B"]
    assert ran.stats.inserted == 3 * PARENTS
    assert wrong_rows(db) == (0, 0)
    assert progress_rows(db) == 0


def test_an_unsliced_recompute_of_the_group_waits_its_turn(db):
    """The group's recompute lock: shared by a sliced run's ticks, taken
    exclusively by an unsliced recompute, which finds it busy meanwhile."""
    inside = threading.Event()
    go = threading.Event()

    def progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done == 1:
            inside.set()
            assert go.wait(WAIT)

    def sliced() -> pgjobs.RunResult:
        with Runner(db) as runner:
            return runner.tick(job(slice_seconds="10m"), force=True, progress=progress)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sliced)
        assert inside.wait(WAIT)
        try:
            whole = pgjobs.run_once(job(name="whole", sliced=False), db, force=True)
        finally:
            go.set()
        assert running.result(WAIT).outcome == "ran"
    assert whole.outcome == "busy"
    assert wrong_rows(db) == (0, 0)


def test_status_the_page_and_the_metrics_show_a_sliced_run_in_progress(db):
    from pgjobs.cli.reading import sliced_line
    from pgjobs.metrics import Metrics
    from pgjobs.readmodel import read_status
    from pgjobs.serve import Request, Source
    from pgjobs.web import StatusPage

    between, go = threading.Event(), threading.Event()
    sliced = job(slice_seconds="10m")

    def progress(phase: str, done: int | None, total: int | None) -> None:
        if phase == "slices" and done == 1:
            between.set()
            assert go.wait(WAIT)

    def run() -> pgjobs.RunResult:
        with Runner(db, worker="host:1") as runner:
            return runner.tick(sliced, force=True, progress=progress)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run)
        try:
            assert between.wait(WAIT)
            with db.connect() as conn, conn.begin():
                found = read_status(conn, "pgjobs", jobs=["sliced"])
            source = Source(engine=db, jobs={"sliced": sliced})
            page = StatusPage(refresh=0)(source, Request("/")).body.decode()
            exposed = Metrics(cache_seconds=0).bind(source).exposition().decode()
        finally:
            go.set()
        assert running.result(WAIT).outcome == "ran"
    run_row = found.sliced["sliced"]
    assert (run_row["done"], run_row["pieces"], run_row["slices"]) == (1, 3, 1)
    assert run_row["written"] == 3000 and run_row["processes"] == ["host:1"]
    line = sliced_line(run_row, found.now)
    assert line.startswith("sliced run in progress: 1/3 pieces in 1 slices, 3,000 rows written")
    assert line.endswith("1 process(es)")
    assert "slicing 1/3" in page
    assert 'pgjobs_slices_done{job="sliced"} 1.0' in exposed
    assert 'pgjobs_slices_total{job="sliced"} 3.0' in exposed
    # over: nothing in progress any more
    with db.connect() as conn, conn.begin():
        assert read_status(conn, "pgjobs", jobs=["sliced"]).sliced == {}


def test_the_drift_check_goes_slice_by_slice_and_says_where_the_drift_is(db):
    pgjobs.run_once(job(), db, force=True)
    with db.begin() as conn:
        conn.execute(text("update derived set h = 'drift' where parent_id in (5, 2500) and n = 1"))
        conn.execute(text("delete from derived where parent_id = 2999"))
    one_piece = job(slice_seconds="10m")  # the first slices stay small
    found = pgjobs.check(one_piece, db)
    assert found.drift and (found.updated, found.inserted, found.deleted) == (2, 3, 0)
    assert found.slices is not None and found.slices >= 2
    ranges = [(d["low"], d["high"]) for d in found.drifted]
    assert all(d["updated"] + d["inserted"] > 0 for d in found.drifted)
    assert ranges[0][0] is None  # key 5: the first piece, open below
    assert "slices drifted" in found.headline()
    assert [s.key for s in found.samples["updated"]] == [
        {"parent_id": 5, "n": 1},
        {"parent_id": 2500, "n": 1},
    ]
    # nothing written, and a keyed Python compute is checked the same way
    assert wrong_rows(db) == (5, 2)  # 2 drifted rows, 3 deleted

    def python_rows(conn, keys):
        ids = [k for (k,) in keys]
        found = conn.execute(
            text(f"select * from ({DERIVE}) d where parent_id = any(:i)"), {"i": ids}
        )
        return [tuple(r) for r in found]

    keyed = pgjobs.check(job(compute=python_rows), db)
    assert (keyed.updated, keyed.deleted, keyed.inserted) == (2, 0, 3)


def test_flow_a_key_a_worker_rewrote_after_the_slice_computed_it_is_left_to_the_worker(db):
    """R1 for a slice: the queue worker rewrites X (a user's change,
    enqueued) after the slice computed X from the old sources, before the
    slice writes: the slice leaves X out (flow's exclusion, with the
    slice's own S0), the worker's rows stay, and the target ends exact."""
    x = 1500
    armed, computed, rewritten = threading.Event(), threading.Event(), threading.Event()

    def slice_rows(conn, keys):
        found = conn.execute(
            text(f"select * from ({DERIVE}) d where parent_id = any(:i)"),
            {"i": [k for (k,) in keys]},
        )
        rows = [tuple(r) for r in found]
        if armed.is_set() and x in {k for (k,) in keys}:
            computed.set()
            assert rewritten.wait(WAIT)  # the worker wrote X meanwhile
        return rows

    worker = pgjobs.QueueJob(
        name="worker",
        group="derived",
        target="derived",
        scope="parent_id",
        compute=DERIVE + " where p.id = any(:keys)",
        every="1h",
    )
    # (the registry sets worker_scope for a recompute registered beside its workers)
    sliced = job(
        compute=slice_rows, group="derived", slice_seconds="10m", worker_scope=("parent_id",)
    )
    assert pgjobs.run_once(sliced, db, force=True).outcome == "ran"
    armed.set()

    def user_and_worker() -> None:
        assert computed.wait(WAIT)
        with db.begin() as conn:
            conn.execute(text("update parent set v = v + 1000 where id = :x"), {"x": x})
            pgjobs.enqueue(conn, worker, [x])
        result = pgjobs.run_once(worker, db, force=True)
        assert result.outcome == "ran" and result.items == 1
        rewritten.set()

    with db.begin() as conn:
        conn.execute(text("update parent set v = v + 1 where id % 1000 = 7"))  # drift to repair
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(user_and_worker)
        result = pgjobs.run_once(sliced, db, force=True)
        done.result(WAIT)
    assert result.outcome == "ran", result.error
    assert result.detail["flow"] == "on"
    assert result.detail["excluded"] == 3  # X's three rows: the worker's
    assert result.stats.updated == 3 * 3  # the drift of parents 7, 1007, 2007
    assert wrong_rows(db) == (0, 0)


def test_flow_a_key_a_worker_rewrote_between_two_writes_of_a_slice_is_left_to_it(db, monkeypatch):
    """R2 for a slice written in several transactions: the slice computed X
    from the old sources; after its first write committed (the write lock
    given back), a user changes X and the worker rewrites it; the slice's
    write that holds X leaves it out (its exclusion, computed under the
    lock with the slice's S0), and the target ends exact."""
    x = 507  # drifted below, in the third write of the first slice
    armed, paused, rewritten = threading.Event(), threading.Event(), threading.Event()
    writes = {"n": 0}
    original_lock = pgjobs.slices.body.write_lock_now

    def write_lock(conn, name):  # type: ignore[no-untyped-def]
        if armed.is_set():
            writes["n"] += 1
            if writes["n"] == 2:  # the first write is committed
                paused.set()
                assert rewritten.wait(WAIT)
        return original_lock(conn, name)

    monkeypatch.setattr(pgjobs.slices.body, "write_lock_now", write_lock)
    worker = pgjobs.QueueJob(
        name="worker",
        group="derived",
        target="derived",
        scope="parent_id",
        compute=DERIVE + " where p.id = any(:keys)",
        every="1h",
    )
    sliced = job(group="derived", slice_seconds="10m", worker_scope=("parent_id",))
    assert pgjobs.run_once(sliced, db, force=True).outcome == "ran"
    with db.begin() as conn:
        conn.execute(text("update parent set v = v + 1 where id % 100 = 7"))  # drift to repair
    monkeypatch.setattr(pgjobs.slices.body, "WRITE_ROWS", 6)  # 2 parents a write
    armed.set()

    def user_and_worker() -> None:
        assert paused.wait(WAIT)
        with db.begin() as conn:
            conn.execute(text("update parent set v = v + 1000 where id = :x"), {"x": x})
            pgjobs.enqueue(conn, worker, [x])
        result = pgjobs.run_once(worker, db, force=True)
        assert result.outcome == "ran" and result.items == 1
        rewritten.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(user_and_worker)
        result = pgjobs.run_once(sliced, db, force=True)
        done.result(WAIT)
    assert result.outcome == "ran", result.error
    assert result.detail["flow"] == "on"
    assert writes["n"] >= 3
    assert result.detail["excluded"] == 3  # X's three rows: the worker's
    assert result.stats.updated == 3 * (30 - 1)  # the drift, but X
    assert wrong_rows(db) == (0, 0)


@pytest.mark.parametrize("exact", [True, False], ids=["read whole", "sampled"])
def test_the_cut_gives_pieces_in_key_order_of_about_equal_size(db, monkeypatch, exact):
    from psycopg import sql as psql

    from pgjobs.slices import cut

    if not exact:
        monkeypatch.setattr(cut, "EXACT_ROWS", 0)  # the sample's path, on a small table
    with db.begin() as conn:
        conn.execute(text("insert into parent select g, g from generate_series(3001, 12000) g"))
        conn.execute(text("analyze parent"))
        source = cut.KeySource(
            table=psql.Identifier("public", "parent"), label="p", columns=("id",)
        )
        bounds = [int(b[0]) for b in cut.cut(conn, source)]
    assert len(bounds) == 11  # 12 pieces of about 1,000 keys
    sizes = [b - a for a, b in zip([1, *bounds], [*bounds, 12001], strict=True)]
    assert bounds == sorted(bounds) and min(sizes) > 500 and max(sizes) < 2000, sizes


def test_a_keyed_compute_giving_rows_of_other_keys_fails_the_slice_naming_it(db):
    def stray(conn, keys):
        return [(k, n, "x") for (k,) in keys for n in (1, 2, 3)] + [(keys[0][0] + 5000, 1, "x")]

    result = pgjobs.run_once(job(compute=stray), db, force=True)
    assert result.outcome == "failed"
    assert "1 new row(s) lie outside the scope (parent_id) of this diff" in (result.error or "")
    with db.connect() as conn:
        assert conn.execute(text("select count(*) from derived")).scalar_one() == 0
