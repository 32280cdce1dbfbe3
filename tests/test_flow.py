"""Flow (docs/DESIGN.md, "Flow"): the scripted interleavings R1-R7 and Q.

Each case steps a recompute, a queue worker and a user through named
points between their statements, on real connections (threads, events,
no sleeps). After it the queue is drained, **with no extra recompute**,
and the target must equal a from-scratch derivation. The wrong variant
each detail guards against is built (by replacing one step of the
recompute) and shown failing in the case that guards it:

* no exclusion at all: R1, R2 and R7 end wrong;
* the exclusion computed before the write lock is granted: R2 ends wrong;
* S0 taken without the write lock: R5 ends wrong (the drift a worker
  transaction straddled is left for the next recompute).

The fourth wrong variant, marks by a clock instead of by commit
visibility, is not built: it needs the marks to hold a time where they
hold an xid. The argument: a worker transaction that began before S0 but
read X after the recompute's compute did stamps ``now()`` (its start)
before S0, so the recompute keeps its own, older, row of X and overwrites
the worker's newer one; with an xid, that transaction is in progress at
S0, so it is not visible in S0 and X is excluded. (With the start lock no
such worker transaction can be open across S0 at all: R6 shows the
recompute waiting for it.)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
import pgjobs.recompute
from pgjobs.locking import WAIT_XACT_SQL

WAIT = 30.0

SCHEMA = """
create table item (id int primary key);
create table source (
    item_id int not null references item on delete cascade,
    n int not null,
    v int not null,
    primary key (item_id, n)
);
create table derived (
    item_id int not null references item on delete cascade,
    n int not null,
    v int not null,
    primary key (item_id, n)
);
insert into item values (1), (2), (3);
insert into source select i, n, 1 from generate_series(1, 3) i, generate_series(1, 2) n;
"""

#: the derivation, from scratch
DERIVE = "select item_id, n, v * 10 as v from source"

X = 1
Z = 9


class Points:
    """Named points a job thread stops at when the script asks it to."""

    def __init__(self) -> None:
        self.wanted: set[str] = set()
        self.reached: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self.go: defaultdict[str, threading.Event] = defaultdict(threading.Event)

    def hit(self, name: str) -> None:
        if name in self.wanted:
            self.wanted.discard(name)  # once
            self.reached[name].set()
            assert self.go[name].wait(WAIT), f"nobody let {name} go"

    def stop_at(self, *names: str) -> None:
        self.wanted.update(names)

    def wait(self, name: str) -> None:
        assert self.reached[name].wait(WAIT), f"never reached {name}"

    def release(self, name: str) -> None:
        self.go[name].set()


class Case:
    """One scripted interleaving: the jobs, their points, and the checks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.points = Points()
        self.pool = ThreadPoolExecutor(max_workers=4)
        points = self.points

        def compute_all(conn: Any) -> list[tuple[Any, ...]]:
            rows = [tuple(r) for r in conn.execute(text(DERIVE))]
            points.hit("R:computed")
            return rows

        def compute_items(conn: Any, keys: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
            points.hit("W:begun")
            rows = [
                tuple(r)
                for r in conn.execute(
                    text(DERIVE + " where item_id = any(:keys)"), {"keys": [k[0] for k in keys]}
                )
            ]
            points.hit("W:read")
            return rows

        def after(conn: Any, keys: Any, stats: Any) -> None:
            points.hit("W:committing")

        self.recompute = pgjobs.RecomputeJob(
            name="r", group="g", target="derived", compute=compute_all, worker_scope=("item_id",)
        )
        self.worker = pgjobs.QueueJob(
            name="w",
            group="g",
            target="derived",
            scope="item_id",
            compute=compute_items,
            after=after,
            every="1s",
        )

    def progress(self, phase: str, done: int | None, total: int | None) -> None:
        if phase == "write-lock":
            self.points.hit("R:before-write-lock")
        elif phase == "write":
            self.points.hit("R:written")

    def start_recompute(self) -> Future[pgjobs.RunResult]:
        def run() -> pgjobs.RunResult:
            with pgjobs.Runner(self.engine) as runner:
                return runner.tick(self.recompute, force=True, progress=self.progress)

        return self.pool.submit(run)

    def start_worker(self) -> Future[pgjobs.RunResult]:
        def run() -> pgjobs.RunResult:
            with pgjobs.Runner(self.engine) as runner:
                return runner.tick(self.worker, force=True)

        return self.pool.submit(run)

    def change(self, item: int, *, enqueue: bool = True) -> None:
        """A user's change of ``item``'s source rows, enqueued with it (or not:
        drift, which only a recompute repairs)."""
        with self.engine.begin() as conn:
            conn.execute(text("update source set v = v + 1 where item_id = :i"), {"i": item})
            if enqueue:
                pgjobs.enqueue(conn, self.worker, [item])

    def waiting_for_a_lock(self) -> None:
        """Until some session waits for an advisory lock (the recompute for
        the write lock)."""
        with self.engine.connect() as conn:
            for _ in range(3000):
                waiting = conn.execute(
                    text(
                        "select count(*) from pg_locks where locktype = 'advisory' and not granted"
                    )
                ).scalar_one()
                if waiting:
                    return
                conn.rollback()
                threading.Event().wait(0.01)
        raise AssertionError("nobody waits for the write lock")

    def drain(self) -> None:
        with pgjobs.Runner(self.engine) as runner:
            for _ in range(20):
                if runner.tick(self.worker, force=True).outcome == "idle":
                    return
        raise AssertionError("the queue did not drain")

    def wrong(self) -> list[tuple[Any, ...]]:
        """Rows where the target and a from-scratch derivation differ."""
        with self.engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    text(
                        f"(select * from derived except ({DERIVE}))"
                        f" union all (({DERIVE}) except select * from derived)"
                    )
                )
            ]


@pytest.fixture
def case(engine: Engine) -> Iterator[Case]:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    c = Case(engine)
    with pgjobs.Runner(engine) as runner:  # the target, derived once
        assert runner.tick(c.recompute, force=True).outcome == "ran"
    assert c.wrong() == []
    yield c
    c.pool.shutdown(wait=True)


def ran(future: Future[pgjobs.RunResult]) -> pgjobs.RunResult:
    result = future.result(WAIT)
    assert result.outcome == "ran", result.error
    return result


# -- the wrong variants --------------------------------------------------------------------------
@contextmanager
def variant(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    flow = pgjobs.recompute._Flow
    if name == "no exclusion":

        def exclude(self: Any, writer: Any, chunk: Any) -> None:
            pgjobs._pg.send(self.conn, (WAIT_XACT_SQL, (self.write_lock,)))

        monkeypatch.setattr(flow, "exclude", exclude)
    elif name == "exclusion before the write lock":

        def exclude(self: Any, writer: Any, chunk: Any) -> None:
            self.exclude_now(writer, chunk)  # before the lock
            CURRENT.points.hit("R:excluded")
            pgjobs._pg.send(self.conn, (WAIT_XACT_SQL, (self.write_lock,)))

        monkeypatch.setattr(flow, "exclude", exclude)
    elif name == "no start lock":

        def start(cls: Any, conn: Any, job: Any, ctx: Any, target: Any, plan: Any) -> Any:
            (taken,) = pgjobs._pg.send(conn, ("select pg_current_snapshot()::text", None))
            return cls(conn, job, ctx, target, plan, str(taken.scalar()))

        monkeypatch.setattr(flow, "start", classmethod(start))
    else:
        raise AssertionError(name)
    yield


#: the case a patched variant reports its extra point to
CURRENT: Case


# -- R1: the worker rewrites X after the compute read X, before the diff --------------------------
def r1(c: Case) -> pgjobs.RunResult:
    c.points.stop_at("R:computed")
    r = c.start_recompute()
    c.points.wait("R:computed")  # R read X (old values)
    c.change(X)
    ran(c.start_worker())  # W rewrites X with the new values, commits
    c.points.release("R:computed")
    result = ran(r)
    c.drain()
    return result


def test_r1_a_worker_rewrites_x_after_the_compute_read_it(case: Case) -> None:
    result = r1(case)
    assert result.detail["excluded"] == 2  # X's two rows, left out
    assert case.wrong() == []
    # what the worker wrote is the worker's: not among what the recompute repaired
    repaired = result.detail.get("repaired", {})
    assert all(key["item_id"] != X for keys in repaired.values() for key in keys), repaired


def test_r1_without_the_exclusion_the_recompute_overwrites_the_worker(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    with variant(monkeypatch, "no exclusion"):
        assert r1(case).detail["excluded"] == 0
    assert {row[0] for row in case.wrong()} == {X}


# -- R2: the worker rewrites X after the diff, before the write phase -----------------------------
def r2(c: Case, *, extra: Callable[[], None] | None = None) -> pgjobs.RunResult:
    c.change(X, enqueue=False)  # drift: X is in R's difference
    c.points.stop_at("R:before-write-lock")
    r = c.start_recompute()
    c.points.wait("R:before-write-lock")  # the difference is taken
    c.change(X)
    if extra is not None:
        extra()
    else:
        ran(c.start_worker())
    c.points.release("R:before-write-lock")
    result = ran(r)
    c.drain()
    return result


def test_r2_a_worker_rewrites_x_after_the_diff_before_the_write_phase(case: Case) -> None:
    assert r2(case).detail["excluded"] == 2
    assert case.wrong() == []


def test_r2_without_the_exclusion_x_ends_wrong(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    with variant(monkeypatch, "no exclusion"):
        r2(case)
    assert {row[0] for row in case.wrong()} == {X}


def test_r2_with_the_exclusion_before_the_write_lock_x_ends_wrong(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    global CURRENT
    CURRENT = case

    def slip_in() -> None:
        # R computes its exclusion now, before the lock: X is not in it yet
        case.points.stop_at("R:excluded")
        case.points.release("R:before-write-lock")
        case.points.wait("R:excluded")
        ran(case.start_worker())  # ... and W rewrites X before R takes the lock
        case.points.release("R:excluded")

    with variant(monkeypatch, "exclusion before the write lock"):
        result = r2(case, extra=slip_in)
    assert result.detail["excluded"] == 0
    assert {row[0] for row in case.wrong()} == {X}


# -- R3: a user changes X after the exclusion and the parent locks; the worker tries at once ------
def test_r3_a_change_after_the_exclusion_waits_for_the_next_worker_tick(case: Case) -> None:
    case.points.stop_at("R:written")
    r = case.start_recompute()
    case.points.wait("R:written")  # excluded, parents locked, rows written; not committed
    case.change(X)
    tried = case.start_worker().result(WAIT)
    # the worker waits for the write lock (FLOW_WAIT at most), R's until it commits
    assert tried.outcome == "busy"
    case.points.release("R:written")
    ran(r)
    case.drain()
    assert case.wrong() == []


# -- R4: a worker has rewritten X, uncommitted, when the recompute starts ------------------------
def test_r4_the_recompute_waits_for_an_open_worker_transaction_to_take_s0(case: Case) -> None:
    case.change(X)
    case.points.stop_at("W:committing")
    w = case.start_worker()
    case.points.wait("W:committing")  # W rewrote X, has not committed
    case.points.stop_at("R:computed")
    r = case.start_recompute()
    case.waiting_for_a_lock()  # R waits for the write lock to take S0
    assert not case.points.reached["R:computed"].is_set()
    case.points.release("W:committing")
    ran(w)
    case.points.wait("R:computed")
    case.points.release("R:computed")
    assert ran(r).detail["excluded"] == 0  # W committed before S0: nothing to leave out
    case.drain()
    assert case.wrong() == []


# -- R5: the worker read X, a drift of X commits, the recompute starts, then the worker commits ---
def r5(c: Case, *, start_lock: bool = True) -> None:
    c.change(X)  # X pending
    c.points.stop_at("W:read")
    w = c.start_worker()
    c.points.wait("W:read")  # W read X
    c.change(X, enqueue=False)  # drift of X, which only a recompute repairs
    c.points.stop_at("R:computed")
    r = c.start_recompute()
    if start_lock:
        c.waiting_for_a_lock()
        c.points.release("W:read")
        ran(w)
        c.points.wait("R:computed")
    else:
        c.points.wait("R:computed")  # S0 taken, and X read, while W is open
        c.points.release("W:read")
        ran(w)
    c.points.release("R:computed")
    ran(r)
    c.drain()


def test_r5_drift_a_worker_straddled_is_repaired_by_the_recompute(case: Case) -> None:
    r5(case)
    assert case.wrong() == []


def test_r5_without_the_start_lock_the_drift_is_left_wrong(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    with variant(monkeypatch, "no start lock"):
        r5(case, start_lock=False)
    assert {row[0] for row in case.wrong()} == {X}


# -- R6: a worker transaction begins before the recompute starts ----------------------------------
def test_r6_a_worker_transaction_open_at_the_start_is_waited_for(case: Case) -> None:
    case.change(X)
    case.points.stop_at("W:begun")
    w = case.start_worker()
    case.points.wait("W:begun")  # W holds the shared write lock, has not read X
    case.points.stop_at("R:computed")
    r = case.start_recompute()
    case.waiting_for_a_lock()  # R cannot take S0, let alone read X, before W ends
    case.change(X, enqueue=False)
    case.points.release("W:begun")
    ran(w)
    case.points.wait("R:computed")
    case.points.release("R:computed")
    ran(r)
    case.drain()
    assert case.wrong() == []


# -- R7: a user creates item Z after the compute read the items; the worker processes Z ----------
def r7(c: Case) -> pgjobs.RunResult:
    c.points.stop_at("R:computed")
    r = c.start_recompute()
    c.points.wait("R:computed")  # R's rows have no Z
    with c.engine.begin() as conn:
        conn.execute(text("insert into item values (:z)"), {"z": Z})
        conn.execute(text("insert into source values (:z, 1, 5), (:z, 2, 5)"), {"z": Z})
        pgjobs.enqueue(conn, c.worker, [Z])
    ran(c.start_worker())  # W inserts Z's rows
    c.points.release("R:computed")
    result = ran(r)
    c.drain()
    return result


def test_r7_an_item_created_after_the_compute_keeps_its_rows(case: Case) -> None:
    assert r7(case).detail["excluded"] == 2  # the deletes of Z's rows, left out
    assert case.wrong() == []


def test_r7_without_the_exclusion_the_new_items_rows_are_deleted(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    with variant(monkeypatch, "no exclusion"):
        assert r7(case).detail["excluded"] == 0
    assert {row[0] for row in case.wrong()} == {Z}


# -- Q: an uncommitted re-enqueue of a pending item --------------------------------------------
def test_q_a_pending_item_changed_and_enqueued_again_uncommitted_waits_for_the_commit(
    case: Case,
) -> None:
    case.change(X)  # X pending
    with case.engine.connect() as user:
        user.begin()
        user.execute(text("update source set v = v + 1 where item_id = :i"), {"i": X})
        pgjobs.enqueue(user, case.worker, [X])  # locks the pending entry
        tried = case.start_worker().result(WAIT)
        assert tried.outcome in ("idle", "ran") and tried.items == 0  # X skipped, not lost
        user.commit()
    case.drain()
    assert case.wrong() == []


# -- a short soak ---------------------------------------------------------------------------------
def test_a_short_soak_ends_exact_with_no_error(db_url: str) -> None:
    """benchmarks/flow_soak.py, short: two schedulers running the worker,
    users changing, inserting and deleting items with their enqueue, a
    recompute with drift every 2 s. No error; right after each recompute
    commits every item is exact, or pending, or one that recompute's own
    compute drifted after its S0 (FLOW.md's invariant: a worker that read
    it before the drift and committed after S0 excluded it; the next
    recompute repairs it; they are counted apart. One item wrong right after
    a recompute failed this test once in a whole suite's run, when drift
    was not told apart); after the queue drained, with no extra recompute, every
    item is exact. (Its lag figures are the benchmark's business, not this
    test's.)"""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("flow_soak", bench / "flow_soak.py")
        assert spec is not None and spec.loader is not None
        soak = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(soak)
    finally:
        sys.path.remove(str(bench))
    engine = pgjobs.Runner(db_url).engine
    with engine.begin() as conn:
        conn.exec_driver_sql(soak.SCHEMA.format(items=500))
    engine.dispose()
    args = argparse.Namespace(
        items=500,
        seconds=8.0,
        drift=0.05,
        compute_seconds=1.0,
        recompute_every=2.0,
        workers=2,
        job_workers=2,  # two replicas of two workers each
        flow="on",
    )
    result = soak.Soak(db_url, args).run()
    assert result["errors"] == {}
    assert result["recomputes"] >= 2
    assert result["monitor_max"] == 0
    assert result["strict"] == 0
    assert result["lags"] > 0


def test_a_recompute_whose_s0_fails_does_not_keep_the_write_lock(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S0's statement runs after the session-level write lock's grant and
    gives the lock back; when it fails, the lock would outlive the rollback
    on a pooled connection, and every worker of the group would wait for it.
    The connection is dropped instead: the worker runs right after."""
    failing = "select 1 / (%s = %s)::int, null, null"
    monkeypatch.setattr(
        pgjobs.recompute, "snapshot_query", lambda schema, label, unlock: (failing, (1, 2))
    )
    result = case.start_recompute().result(WAIT)
    assert result.outcome in ("failed", "interrupted"), result
    with case.engine.connect() as conn:
        held = conn.execute(
            text(
                "select count(*) from pg_locks where locktype = 'advisory' and granted"
                " and database = (select oid from pg_database where datname = current_database())"
            )
        ).scalar_one()
    assert held == 0
    case.change(X)
    assert ran(case.start_worker()).items == 1
