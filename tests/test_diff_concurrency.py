"""The diff writer under real concurrency: several connections, real
transactions, ordered with events (never sleeps), row locks found by
another transaction trying to lock every row (``FOR UPDATE SKIP LOCKED``,
which conflicts with every row-lock mode) and relation locks in ``pg_locks``.

* a parent deleted and committed between compute and write: its rows are
  skipped, no 23503;
* 20 parents deleted while a slow compute runs: each delete completes, and
  the recompute holds no row lock (nor RowShare/RowExclusive relation lock) on
  the target or the parents meanwhile;
* a parent held by a user: the writer waits for it holding nothing (the
  user can go on to lock other parents, in any order), or defers its rows;
* the deadlock hammer: users delete and merge parents in random order while
  recomputes at 30 % and 100 % changed rows run back to back for 60 s; no
  40P01 and no 23503 anywhere.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import text

import pgjobs
from pgjobs.diff import write_diff
from pgjobs.staging import stage
from pgjobs.target import reflect_target

PARENTS = 40
PER_PARENT = 5

SCHEMA = f"""
create table parent (id int primary key, name text);
create table source (id int primary key, parent_id int not null references parent on delete cascade,
                     v int not null);
create table derived (id int primary key, parent_id int not null references parent on delete cascade,
                      v int not null);
insert into parent select i, 'p' || i from generate_series(1, {PARENTS}) i;
insert into source select p * 100 + n, p, n from generate_series(1, {PARENTS}) p,
                                               generate_series(1, {PER_PARENT}) n;
insert into derived select id, parent_id, v from source;
"""

COMPUTE = "select id, parent_id, v + 1 as v from source"


def pg_connect(db_url: str, **kw) -> psycopg.Connection:
    return psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://"), **kw)


@pytest.fixture
def db(engine, db_url):
    with pg_connect(db_url, autocommit=True) as pg:
        pg.execute(SCHEMA)
    return db_url


def rows_now(db_url: str, statement: str) -> list[tuple]:
    with pg_connect(db_url, autocommit=True) as pg:
        return [tuple(r) for r in pg.execute(statement)]


def recompute_locks(db_url: str, pid: int) -> dict[str, object]:
    """How many rows of the target and of the parents some transaction holds
    locked, in any mode (another transaction tries to lock every row ``FOR
    UPDATE SKIP LOCKED``, which conflicts with every row-lock mode, and counts
    what it had to skip), and ``pid``'s relation locks on them (pg_locks)."""
    with pg_connect(db_url, autocommit=True) as pg:
        rows = {
            rel: pg.execute(
                sql.SQL(
                    "select (select count(*) from {rel})"
                    " - (select count(*) from (select from {rel} for update skip locked) free)"
                ).format(rel=sql.Identifier(rel))
            ).fetchone()[0]
            for rel in ("parent", "derived")
        }
        rel_locks = pg.execute(
            "select relation::regclass::text, mode from pg_locks where pid = %s"
            " and locktype = 'relation' and relation in ('parent'::regclass, 'derived'::regclass)",
            (pid,),
        ).fetchall()
    return {"rows": rows, "relations": [tuple(r) for r in rel_locks]}


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll for a state another connection reaches (not a sleep standing in for
    an ordering: the predicate is the ordering)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def waiting_for_lock(db_url: str, pid: int) -> bool:
    return rows_now(
        db_url, f"select wait_event_type = 'Lock' from pg_stat_activity where pid = {int(pid)}"
    ) == [(True,)]


def test_parent_deleted_between_compute_and_write_is_skipped(engine, db):
    def compute(conn):
        rows = [tuple(r) for r in conn.execute(text(COMPUTE))]
        # computed; now a user deletes parent 3 and commits before any write
        with pg_connect(db, autocommit=True) as user:
            user.execute("delete from parent where id = 3")
        return rows

    job = pgjobs.RecomputeJob(name="r", target="derived", compute=compute)
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert result.sqlstate is None
    n = PARENTS * PER_PARENT
    assert result.stats == pgjobs.DiffStats(
        updated=n - PER_PARENT, skipped_missing_parent=PER_PARENT
    )
    assert rows_now(db, "select count(*) from derived where parent_id = 3") == [(0,)]
    assert rows_now(db, "select count(*), sum(v) from derived") == [
        (n - PER_PARENT, sum(v + 1 for v in range(1, PER_PARENT + 1)) * (PARENTS - 1))
    ]


def test_parent_deleted_after_the_difference_before_the_locks(engine, db):
    # The difference is taken (rows of parent 4 planned as updates), then the
    # user deletes parent 4, cascading to those rows, then the writer locks.
    def progress(phase, done, total):
        if phase == "lock":
            with pg_connect(db, autocommit=True) as user:
                user.execute("delete from parent where id = 4")

    job = pgjobs.RecomputeJob(name="r", target="derived", compute=COMPUTE)
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True, progress=progress)
    assert result.outcome == "ran", result.error
    n = PARENTS * PER_PARENT
    assert result.stats == pgjobs.DiffStats(
        updated=n - PER_PARENT, skipped_missing_parent=PER_PARENT
    )
    assert result.detail["parents_gone"] == 1
    assert rows_now(db, "select count(*) from derived") == [(n - PER_PARENT,)]


def test_slow_compute_holds_no_row_locks_while_users_delete_parents(engine, db):
    computing = threading.Event()
    deletes_done = threading.Event()
    pid: list[int] = []

    def compute(conn):
        pid.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
        conn.execute(text("select pg_sleep(1)"))  # the slow part of a real compute
        rows = [tuple(r) for r in conn.execute(text(COMPUTE))]
        computing.set()
        assert deletes_done.wait(60), "the deletes never finished"
        return rows

    locks_in_write: list[dict] = []

    def progress(phase, done, total):
        # positive control: after the writes, before commit, the probe does
        # see this transaction's row locks
        if phase == "write":
            locks_in_write.append(recompute_locks(db, pid[0]))

    results: list[pgjobs.RunResult] = []
    job = pgjobs.RecomputeJob(name="slow", target="derived", compute=compute)

    def run() -> None:
        with pgjobs.Runner(engine) as runner:
            results.append(runner.tick(job, force=True, progress=progress))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert computing.wait(30)
        seen = []
        victims = list(range(1, 21))
        with pg_connect(db, autocommit=True) as user:
            user.execute("set lock_timeout = '5s'")
            for victim in victims:
                seen.append(recompute_locks(db, pid[0]))
                started = time.perf_counter()
                user.execute("delete from parent where id = %s", (victim,))
                assert time.perf_counter() - started < 5
                assert thread.is_alive(), "the recompute ended before the deletes did"
            seen.append(recompute_locks(db, pid[0]))
    finally:
        deletes_done.set()
        thread.join(60)
    assert seen == [{"rows": {"parent": 0, "derived": 0}, "relations": []}] * (len(victims) + 1)
    (result,) = results
    assert result.outcome == "ran", result.error
    assert result.stats.skipped_missing_parent == 20 * PER_PARENT
    assert result.stats.updated == (PARENTS - 20) * PER_PARENT
    assert rows_now(db, "select count(distinct parent_id) from derived") == [(PARENTS - 20,)]
    (during_write,) = locks_in_write
    assert during_write["rows"] == {"parent": PARENTS - 20, "derived": (PARENTS - 20) * PER_PARENT}
    assert ("parent", "RowShareLock") in during_write["relations"]
    assert ("derived", "RowExclusiveLock") in during_write["relations"]


def test_busy_parent_is_waited_for_holding_nothing(engine, db):
    """A user holds parent 7 (deleting it, uncommitted). The writer must not
    wait for it while holding other parents: the user then deletes parent 2,
    which the writer also needs, and that must not block or deadlock."""
    pid: list[int] = []

    def compute(conn):
        pid.append(conn.execute(text("select pg_backend_pid()")).scalar_one())
        return COMPUTE

    results: list[pgjobs.RunResult] = []
    job = pgjobs.RecomputeJob(name="busy", target="derived", compute=compute, lock_timeout="30s")
    user = pg_connect(db)
    try:
        user.execute("set lock_timeout = '5s'")
        user.execute("delete from parent where id = 7")  # holds 7 FOR UPDATE, uncommitted

        def run() -> None:
            with pgjobs.Runner(engine) as runner:
                results.append(runner.tick(job, force=True))

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: bool(pid) and waiting_for_lock(db, pid[0]), what="the writer to wait")
        # waiting, and holding no row lock at all: the only locked rows are the
        # user's (parent 7 and the derived rows its cascade deleted)
        assert recompute_locks(db, pid[0])["rows"] == {"parent": 1, "derived": PER_PARENT}
        started = time.perf_counter()
        user.execute("delete from parent where id = 2")  # another parent, "out of order"
        assert time.perf_counter() - started < 5
        user.commit()
        thread.join(60)
    finally:
        user.close()
    (result,) = results
    assert result.outcome == "ran", result.error
    assert result.detail["busy_waits"] == 1 and result.detail["deferred"] == 0
    n = PARENTS * PER_PARENT
    assert result.stats == pgjobs.DiffStats(
        updated=n - 2 * PER_PARENT, skipped_missing_parent=2 * PER_PARENT
    )


def test_parent_held_past_lock_timeout_defers_its_rows(engine, db):
    user = pg_connect(db)
    try:
        user.execute("select from parent where id = 9 for update")  # held throughout
        job = pgjobs.RecomputeJob(
            name="held", target="derived", compute=COMPUTE, lock_timeout="300ms"
        )
        with pgjobs.Runner(engine) as runner:
            result = runner.tick(job, force=True)
        assert result.outcome == "ran", result.error
        assert result.detail["deferred"] == PER_PARENT
        n = PARENTS * PER_PARENT
        assert result.stats.updated == n - PER_PARENT
        # parent 9's rows kept their values; everything else is written
        assert rows_now(db, "select count(*) from derived where v = (id % 100) + 1") == [
            (n - PER_PARENT,)
        ]
        assert rows_now(
            db, "select count(*) from derived where parent_id = 9 and v = id % 100"
        ) == [(PER_PARENT,)]
    finally:
        user.rollback()
        user.close()
    with pgjobs.Runner(engine) as runner:
        again = runner.tick(job, force=True)
    assert again.outcome == "ran" and again.detail["deferred"] == 0
    assert again.stats == pgjobs.DiffStats(updated=PER_PARENT, unchanged=n - PER_PARENT)


def test_wait_busy_false_defers_without_waiting(engine, db):
    user = pg_connect(db)
    try:
        user.execute("delete from parent where id = 5")
        with engine.connect() as conn, conn.begin():
            conn.execute(text("set local lock_timeout = '30s'"))
            target = reflect_target(conn, "derived")
            staged = stage(conn, target, COMPUTE)
            started = time.perf_counter()
            result = write_diff(conn, target, staged, wait_busy=False)
            assert time.perf_counter() - started < 10
        assert result.deferred == PER_PARENT
        assert result.detail["busy_waits"] == 0
    finally:
        user.rollback()
        user.close()


# -- the hammer ----------------------------------------------------------------------
HAMMER_SECONDS = float(os.environ.get("PGJOBS_HAMMER_SECONDS", "60"))
H_PARENTS = 3000


@pytest.mark.slow
def test_deadlock_hammer(engine, db_url):
    with pg_connect(db_url, autocommit=True) as pg:
        pg.execute(
            f"""
            create table parent (id int primary key, name text);
            create table source (id bigserial primary key,
                                 parent_id int not null references parent on delete cascade, v int not null);
            create table derived (id bigint primary key,
                                  parent_id int not null references parent on delete cascade, v int not null);
            create sequence parent_ids start {H_PARENTS + 1};
            insert into parent select i, 'p' || i from generate_series(1, {H_PARENTS}) i;
            insert into source (parent_id, v) select p, n from generate_series(1, {H_PARENTS}) p,
                                                              generate_series(1, 5) n;
            """
        )
    generation = [0]

    def compute_for(pct: int):
        def compute(conn):
            generation[0] += 1
            return text(
                "select id, parent_id, v + case when (id + :gen) % 100 < :pct then :gen else 0 end as v"
                " from source"
            ).bindparams(gen=generation[0], pct=pct)

        return compute

    jobs = [
        pgjobs.RecomputeJob(
            name="r30", group="d", target="derived", compute=compute_for(30), lock_timeout="10s"
        ),
        pgjobs.RecomputeJob(
            name="r100", group="d", target="derived", compute=compute_for(100), lock_timeout="10s"
        ),
        # chunks of 100 parents (500 rows) are under 5 % of the table: keyed plans
        pgjobs.RecomputeJob(
            name="r30c",
            group="d",
            target="derived",
            compute=compute_for(30),
            chunk_parents=100,
            lock_timeout="10s",
        ),
        pgjobs.RecomputeJob(
            name="r100c",
            group="d",
            target="derived",
            compute=compute_for(100),
            chunk_parents=300,
            lock_timeout="10s",
        ),
    ]
    stop = threading.Event()
    errors: Counter[str] = Counter()
    user_ops: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()

    def user(seed: int, merges: bool) -> None:
        rnd = random.Random(seed)
        with pg_connect(db_url) as pg:
            pg.execute("set lock_timeout = '30s'")
            pg.commit()
            while not stop.is_set():
                try:
                    ids = [
                        r[0] for r in pg.execute("select id from parent order by random() limit 20")
                    ]
                    pg.commit()
                    if len(ids) < 2:
                        continue
                    started = time.perf_counter()
                    if merges:
                        a, b = rnd.sample(ids, 2)
                        # lock both parents FOR UPDATE in random order, move b's
                        # source rows to a, delete b (cascading to derived)
                        got = [
                            pg.execute(
                                "select id from parent where id = %s for update", (x,)
                            ).fetchone()
                            for x in (a, b)
                        ]
                        if all(got):
                            pg.execute(
                                "update source set parent_id = %s where parent_id = %s", (a, b)
                            )
                            pg.execute("delete from parent where id = %s", (b,))
                        op = "merge"
                    else:
                        pg.execute("delete from parent where id = %s", (rnd.choice(ids),))
                        new = pg.execute(
                            "insert into parent select nextval('parent_ids'), 'new' returning id"
                        ).fetchone()[0]
                        pg.execute(
                            "insert into source (parent_id, v) select %s, n from generate_series(1, 5) n",
                            (new,),
                        )
                        op = "delete"
                    pg.commit()
                    with lock:
                        latencies.append(time.perf_counter() - started)
                        user_ops[op] += 1
                except psycopg.Error as exc:
                    pg.rollback()
                    with lock:
                        errors[f"user {exc.sqlstate}"] += 1

    threads = [threading.Thread(target=user, args=(i, i == 0)) for i in range(4)]
    for t in threads:
        t.start()
    results: list[pgjobs.RunResult] = []
    with pgjobs.Runner(engine) as runner:
        first = runner.tick(jobs[1], force=True)
    assert first.outcome == "ran", first.error
    with pg_connect(db_url, autocommit=True) as pg:
        pg.execute("analyze derived")  # real row estimates: small passes plan keyed
    try:
        with pgjobs.Runner(engine) as runner:
            deadline = time.monotonic() + HAMMER_SECONDS
            n = 0
            while time.monotonic() < deadline:
                results.append(runner.tick(jobs[n % len(jobs)], force=True))
                n += 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    for r in results:
        if r.outcome != "ran":
            errors[f"pgjobs {r.sqlstate or r.error}"] += 1
    # a last recompute, alone: the table is exactly what the compute says
    with pgjobs.Runner(engine) as runner:
        final = runner.tick(jobs[1], force=True)
    assert final.outcome == "ran" and final.detail["deferred"] == 0
    expected = rows_now(
        db_url,
        f"select id, parent_id, v + case when (id + {generation[0]}) % 100 < 100 then {generation[0]} "
        "else 0 end from source order by id",
    )
    assert rows_now(db_url, "select id, parent_id, v from derived order by id") == expected

    latencies.sort()
    summary = {
        "runs": len(results),
        "by_job": Counter(r.job for r in results),
        "skipped": sum(r.stats.skipped_missing_parent for r in results),
        "deferred": sum(r.detail.get("deferred", 0) for r in results),
        "user_ops": dict(user_ops),
        "user_max_s": round(latencies[-1], 3) if latencies else None,
        "user_p99_s": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
        "errors": dict(errors),
    }
    print("hammer:", summary)
    assert not any(k.endswith(("40P01", "23503")) for k in errors), summary
    assert not errors, summary
    assert len(results) >= 6 and user_ops["delete"] > 100 and user_ops["merge"] > 10, summary
