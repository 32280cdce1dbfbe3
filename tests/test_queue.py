"""The built-in queue and queue jobs on a real PostgreSQL, with real concurrent
connections where the test is about locks."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine, event, text

import pgjobs
import pgjobs.worker.vacuum
from pgjobs.jobs import RunContext
from pgjobs.queue import (
    drop_enqueue_trigger,
    enqueue,
    install_enqueue_trigger,
    key_json,
    queue_stats,
)
from pgjobs.worker import pending_query

SCHEMA = """
create table parent (id int primary key, factor int not null default 1);
create table source (
    id bigserial primary key,
    parent_id int not null references parent (id) on delete cascade on update cascade,
    val int not null
);
create table derived (
    parent_id int not null references parent (id) on delete cascade on update cascade,
    bucket int not null,
    total bigint not null check (total >= 0),
    n int not null,
    primary key (parent_id, bucket)
);
create table status (
    parent_id int primary key references parent (id) on delete cascade on update cascade,
    rows int not null,
    runs int not null default 1
);
"""

#: five derived rows per parent (one per bucket), scaled by the parent's factor
COMPUTE = """
select s.parent_id, s.val % 5 as bucket, sum(s.val) * p.factor as total, count(*) as n
from source s join parent p on p.id = s.parent_id
where s.parent_id = any(:keys)
group by s.parent_id, s.val % 5, p.factor
"""

#: the totals of one parent with factor 1: values 1..10 in buckets v % 5
BASE_TOTALS = (15, 7, 9, 11, 13)

FROM_SCRATCH = """
select s.parent_id, s.val % 5 as bucket, sum(s.val) * p.factor as total, count(*) as n
from source s join parent p on p.id = s.parent_id
group by s.parent_id, s.val % 5, p.factor
order by 1, 2
"""


def upsert_status(conn, keys, stats):
    conn.execute(
        text(
            "insert into status (parent_id, rows)"
            " select k, (select count(*) from derived d where d.parent_id = k)"
            " from unnest(cast(:keys as int[])) as k"
            " on conflict (parent_id) do update set rows = excluded.rows, runs = status.runs + 1"
        ),
        {"keys": [k[0] for k in keys]},
    )


def make_job(**changes):
    fields = dict(
        name="worker",
        target="derived",
        scope=("parent_id",),
        compute=COMPUTE,
        after=upsert_status,
        every="1s",
        batch_size=100,
        backoff="1s",
    )
    fields.update(changes)
    return pgjobs.QueueJob(**fields)


@pytest.fixture
def db(engine):
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.Runner(engine).install()
    return engine


def add_parents(engine, ids, *, factor=1):
    with engine.begin() as conn:
        conn.execute(
            text("insert into parent (id, factor) select unnest(cast(:ids as int[])), :f"),
            {"ids": list(ids), "f": factor},
        )
        # values 1..10: five buckets, two values each
        conn.execute(
            text(
                "insert into source (parent_id, val) select p, v"
                " from unnest(cast(:ids as int[])) p, generate_series(1, 10) v"
            ),
            {"ids": list(ids)},
        )


def derived(engine, parent_id=None):
    query = "select parent_id, bucket, total, n from derived"
    if parent_id is not None:
        query += f" where parent_id = {int(parent_id)}"
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query + " order by 1, 2"))]


def from_scratch(engine, parent_id=None):
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text(FROM_SCRATCH))]
    return [r for r in rows if parent_id is None or r[0] == parent_id]


def queue_rows(engine):
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "select job, key::text, attempts, dead_at is not null from pgjobs.queue order by 1, 2"
                )
            )
        ]


def push(engine, job, keys):
    with engine.begin() as conn:
        return enqueue(conn, job, keys)


# -- enqueue -----------------------------------------------------------------------
def test_a_thousand_enqueues_of_one_key_between_two_ticks_make_one_processing(db):
    add_parents(db, [7, 8])
    calls = []

    def compute(conn, keys):
        calls.append(list(keys))
        return COMPUTE

    job = make_job(compute=compute)
    added = []
    for _ in range(10):  # ten user transactions of a hundred enqueues each
        with db.begin() as conn:
            added.extend(enqueue(conn, job, [7]) for _ in range(100))
    assert sum(added) == 1 and len(added) == 1000
    assert queue_rows(db) == [("worker", "[7]", 0, False)]

    with pgjobs.Runner(db) as runner:
        first = runner.tick(job, force=True)
        second = runner.tick(job, force=True)
    assert first.outcome == "ran" and first.items == 1, first.error
    assert calls == [[(7,)]]
    assert first.stats.inserted == 5
    assert second.outcome == "idle"
    assert derived(db) == from_scratch(db, 7)
    with db.connect() as conn:
        assert conn.execute(text("select parent_id, rows, runs from status")).all() == [(7, 5, 1)]


def test_enqueue_dedups_within_one_call_and_counts_what_it_added(db):
    job = make_job()
    assert push(db, job, [3, 1, 3, 2, 1]) == 3
    assert push(db, job, [1, 2, 4]) == 1
    assert push(db, "worker", []) == 0
    assert [r[1] for r in queue_rows(db)] == ["[1]", "[2]", "[3]", "[4]"]


def test_enqueue_works_on_a_psycopg_connection_in_the_callers_transaction(db, db_url):
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as raw:
        assert enqueue(raw, "worker", [5, 6]) == 2
        raw.rollback()
        assert enqueue(raw, "worker", [5]) == 1
        raw.commit()
    assert [r[1] for r in queue_rows(db)] == ["[5]"]


def test_enqueue_rejects_bad_keys_and_names_the_problem(db):
    job = pgjobs.QueueJob(
        name="pairs", target="derived", scope=("parent_id", "bucket"), compute=COMPUTE
    )
    with db.begin() as conn:
        with pytest.raises(pgjobs.ConfigError, match="2 scope value"):
            enqueue(conn, job, [1])
        with pytest.raises(pgjobs.ConfigError, match="None"):
            enqueue(conn, job, [(1, None)])
        with pytest.raises(pgjobs.ConfigError, match="string"):
            enqueue(conn, "worker", "abc")
        with pytest.raises(pgjobs.ConfigError, match="bytes"):
            enqueue(conn, "worker", [b"x"])
        assert enqueue(conn, job, [(1, 2), [1, 2]]) == 1
    assert key_json((1, "a")) == '[1,"a"]'


def test_enqueue_without_the_schema_says_how_to_install_it(engine):
    with (
        engine.begin() as conn,
        pytest.raises(pgjobs.PgJobsError, match=r"pgjobs\.install\(database\)"),
    ):
        enqueue(conn, "worker", [1])


# -- processing ----------------------------------------------------------------------
def test_a_batch_is_claimed_in_key_order_computed_once_and_written_as_one_diff(db):
    add_parents(db, range(1, 8))
    calls = []

    def compute(conn, keys):
        calls.append(list(keys))
        # the temp table of the batch's keys, with the target's column types
        joined = conn.execute(text("select parent_id from pgjobs_keys order by 1")).scalars().all()
        assert joined == [k[0] for k in keys]
        return COMPUTE

    job = make_job(compute=compute, batch_size=3)
    push(db, job, [5, 1, 7, 3, 2, 6, 4])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
        assert result.outcome == "ran", result.error
        assert calls == [[(1,), (2,), (3,)]]
        assert result.items == 3 and result.stats.inserted == 15
        assert [r[1] for r in queue_rows(db)] == ["[4]", "[5]", "[6]", "[7]"]
        while runner.tick(job, force=True).outcome == "ran":
            pass
    assert calls[1:] == [[(4,), (5,), (6,)], [(7,)]]
    assert derived(db) == from_scratch(db)


def test_a_second_processing_writes_only_the_difference(db):
    add_parents(db, [1, 2])
    job = make_job()
    push(db, job, [1, 2])
    with pgjobs.Runner(db) as runner:
        runner.tick(job, force=True)
        with db.begin() as conn:
            conn.execute(text("update parent set factor = 2 where id = 1"))
            conn.execute(text("delete from source where parent_id = 2 and val in (5, 10)"))
            enqueue(conn, job, [1, 2])
        result = runner.tick(job, force=True)
    # parent 1: five totals doubled; parent 2: bucket 0 (values 5 and 10) gone
    assert (result.stats.inserted, result.stats.updated, result.stats.deleted) == (0, 5, 1)
    assert result.stats.unchanged == 4
    assert derived(db) == from_scratch(db)


def test_items_whose_parent_is_gone_are_dropped_and_counted(db):
    add_parents(db, [1, 2, 3])
    job = make_job()
    push(db, job, [1, 2, 3, 99])
    with db.begin() as conn:
        conn.execute(text("delete from parent where id = 2"))
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert result.items == 2 and result.detail["parent_gone"] == 2
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)
    with db.connect() as conn:
        assert conn.execute(text("select parent_id from status order by 1")).scalars().all() == [
            1,
            3,
        ]


def test_worker_releases_items_whose_parent_a_user_holds_and_never_waits_for_it(db):
    """A user deleting parent 2 holds it FOR UPDATE and then enqueues 2 (as a
    delete trigger would). The worker, mid-transaction, must not hold 2's
    entry meanwhile, or the two would deadlock."""
    add_parents(db, [1, 2, 3])
    in_compute, finish = threading.Event(), threading.Event()

    def compute(conn, keys):
        in_compute.set()
        assert finish.wait(10)
        return COMPUTE

    job = make_job(compute=compute)
    push(db, job, [1, 2, 3])
    user = db.connect()
    user_tx = user.begin()
    user.execute(text("set local lock_timeout = '3s'"))
    user.execute(text("select id from parent where id = 2 for update"))

    results = []
    worker = threading.Thread(
        target=lambda: results.append(pgjobs.Runner(db).tick(job, force=True))
    )
    worker.start()
    try:
        assert in_compute.wait(10)
        # The worker is inside its transaction now; 2's entry must be free.
        user.execute(text("delete from parent where id = 2"))
        assert enqueue(user, job, [2]) == 0  # pending, now locked by the user
        user_tx.commit()
    finally:
        finish.set()
        worker.join(10)
        user.close()
    (result,) = results
    assert result.outcome == "ran", result.error
    assert result.items == 2 and result.detail["deferred"] == 1
    assert [r[1] for r in queue_rows(db)] == ["[2]"]
    with pgjobs.Runner(db) as runner:
        again = runner.tick(job, force=True)
    assert again.detail["parent_gone"] == 1 and queue_rows(db) == []
    assert derived(db) == from_scratch(db)


def test_sql_compute_binds_keys_per_column_for_a_composite_scope(db):
    with db.begin() as conn:
        conn.exec_driver_sql(
            """
            create table cell (x int, y text, weight int not null, primary key (x, y));
            create table cell_total (
                x int, y text, part int, value int not null,
                primary key (x, y, part),
                foreign key (x, y) references cell (x, y) on delete cascade
            );
            insert into cell values (1, 'a', 10), (1, 'b', 20), (2, 'a', 30), (2, 'b', 40);
            """
        )
    seen = []

    def after(conn, keys, stats):
        seen.append((list(keys), stats.inserted))

    job = pgjobs.QueueJob(
        name="cells",
        target="cell_total",
        scope=("x", "y"),
        compute=(
            "select c.x, c.y, part, c.weight * part as value from cell c"
            " join unnest(cast(:keys_x as int[]), cast(:keys_y as text[])) as k(x, y)"
            " on (c.x, c.y) = (k.x, k.y)"
            " cross join generate_series(1, 2) as part"
            " where c.x = any(:keys)"
        ),
        after=after,
    )
    push(db, job, [(2, "a"), (1, "b"), (1, "b")])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert seen == [([(1, "b"), (2, "a")], 4)]
    with db.connect() as conn:
        rows = conn.execute(text("select x, y, part, value from cell_total order by 1, 2, 3")).all()
    assert [tuple(r) for r in rows] == [
        (1, "b", 1, 20),
        (1, "b", 2, 40),
        (2, "a", 1, 30),
        (2, "a", 2, 60),
    ]


# -- the race that DO NOTHING loses ---------------------------------------------------
def _user_changes_and_enqueues(db, job, *, do_nothing, enqueued, commit_now, committed):
    """The user's transaction: change parent 1, enqueue 1, wait, commit."""
    with db.connect() as user:
        with user.begin():
            user.execute(text("update parent set factor = 3 where id = 1"))
            if do_nothing:
                user.execute(
                    text(
                        "insert into pgjobs.queue (job, key) values (:job, '[1]')"
                        " on conflict (job, key) do nothing"
                    ),
                    {"job": job.name},
                )
            else:
                enqueue(user, job, [1])
            enqueued.set()
            assert commit_now.wait(10)
        committed.set()


def _race(db, *, do_nothing):
    add_parents(db, [1])
    job = make_job()
    push(db, job, [1])  # the item is pending
    enqueued, commit_now, committed = threading.Event(), threading.Event(), threading.Event()
    user = threading.Thread(
        target=_user_changes_and_enqueues,
        args=(db, job),
        kwargs=dict(
            do_nothing=do_nothing, enqueued=enqueued, commit_now=commit_now, committed=committed
        ),
    )
    user.start()
    try:
        assert enqueued.wait(10)  # the user's change and enqueue are not committed
        with pgjobs.Runner(db) as runner:
            during = runner.tick(job, force=True)  # the worker claims
            commit_now.set()
            assert committed.wait(10)  # the user commits
            after = []
            while (r := runner.tick(job, force=True)).outcome == "ran":  # the queue drains
                after.append(r)
    finally:
        commit_now.set()
        user.join(10)
    return during, after


def test_an_uncommitted_enqueue_keeps_the_worker_off_the_entry_until_commit(db):
    during, after = _race(db, do_nothing=False)
    # the entry was locked by the user: skipped, not consumed (a tick that
    # claimed nothing ends idle, no run record)
    assert during.outcome == "idle", during.error
    assert during.items == 0 and during.run_id is None
    assert sum(r.items for r in after) == 1
    assert queue_rows(db) == []
    assert derived(db, 1) == from_scratch(db, 1)
    assert {r[2] for r in derived(db, 1)} == {3 * t for t in BASE_TOTALS}


def test_do_nothing_instead_would_lose_the_users_change(db):
    """Why enqueue upserts: the same script with ON CONFLICT DO NOTHING."""
    during, after = _race(db, do_nothing=True)
    assert during.items == 1  # consumed while the user's change was uncommitted
    assert after == [] and queue_rows(db) == []  # nothing left to process it
    assert derived(db, 1) != from_scratch(db, 1)  # the derived rows are stale for good
    assert {r[2] for r in derived(db, 1)} == {t for t in BASE_TOTALS}


def _wait_until_waiting_on_a_lock(engine, pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            state = conn.execute(
                text("select wait_event_type from pg_stat_activity where pid = :pid"), {"pid": pid}
            ).scalar()
            if state == "Lock":
                return
            time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


def test_an_enqueue_while_the_worker_holds_the_entry_waits_and_requeues_it(db):
    add_parents(db, [1])
    in_compute, finish = threading.Event(), threading.Event()

    def compute(conn, keys):
        in_compute.set()
        assert finish.wait(10)
        return COMPUTE

    job = make_job(compute=compute)
    push(db, job, [1])
    results = []
    worker = threading.Thread(
        target=lambda: results.append(pgjobs.Runner(db).tick(job, force=True))
    )
    worker.start()
    assert in_compute.wait(10)  # the worker has claimed entry 1 and reads parent 1

    user_done = threading.Event()
    with db.connect() as user:
        pid = user.execute(text("select pg_backend_pid()")).scalar_one()
        user.commit()

        def user_txn():
            with user.begin():
                user.execute(
                    text("update parent set factor = 4 where id = 1")
                )  # no wait: KEY SHARE
                enqueue(user, job, [1])  # waits for the worker's entry
            user_done.set()

        t = threading.Thread(target=user_txn)
        t.start()
        try:
            _wait_until_waiting_on_a_lock(db, pid)
            assert not user_done.is_set()
        finally:
            finish.set()
            worker.join(10)
            t.join(10)
    assert user_done.is_set()
    (first,) = results
    assert first.items == 1, first.error
    assert [r[1] for r in queue_rows(db)] == ["[1]"]  # the user's enqueue survived the delete
    with pgjobs.Runner(db) as runner:
        assert runner.tick(job, force=True).items == 1
    assert derived(db, 1) == from_scratch(db, 1)
    assert {r[2] for r in derived(db, 1)} == {4 * t for t in BASE_TOTALS}


# -- per-item isolation ---------------------------------------------------------------
def delay_of(engine, key):
    with engine.connect() as conn:
        return conn.execute(
            text("select not_before - now() from pgjobs.queue where key = cast(:k as jsonb)"),
            {"k": key},
        ).scalar_one()


def make_due(engine):
    """Move the queue's clock: every waiting item becomes due."""
    with engine.begin() as conn:
        conn.execute(text("update pgjobs.queue set not_before = now()"))


def test_a_raising_item_is_retried_with_backoff_then_parked_and_the_others_are_written(db):
    add_parents(db, range(1, 11))
    bad = {7}
    calls = []

    def compute(conn, keys):
        calls.append([k[0] for k in keys])
        if bad & {k[0] for k in keys}:
            raise ValueError("cannot score item 7")
        return COMPUTE

    job = make_job(
        compute=compute, max_attempts=3, item_backoff=pgjobs.Backoff(initial="10m", factor=2)
    )
    push(db, job, range(1, 11))
    with pgjobs.Runner(db) as runner:
        first = runner.tick(job, force=True)
        assert first.outcome == "ran", first.error
        assert first.items == 9 and first.failed_items == 1
        assert calls[0] == list(range(1, 11))
        assert derived(db) == [r for r in from_scratch(db) if r[0] != 7]
        assert queue_rows(db) == [("worker", "[7]", 1, False)]
        assert timedelta(minutes=9) < delay_of(db, "[7]") <= timedelta(minutes=10)
        with db.connect() as conn:
            error = conn.execute(text("select last_error from pgjobs.queue")).scalar_one()
        assert "cannot score item 7" in error

        assert runner.tick(job, force=True).outcome == "idle"  # backing off

        make_due(db)
        second = runner.tick(job, force=True)
        assert second.failed_items == 1 and second.items == 0
        assert queue_rows(db) == [("worker", "[7]", 2, False)]
        assert timedelta(minutes=19) < delay_of(db, "[7]") <= timedelta(minutes=20)

        make_due(db)
        third = runner.tick(job, force=True)
        assert third.failed_items == 1 and third.detail["dead"] == 1
        assert queue_rows(db) == [("worker", "[7]", 3, True)]  # parked, not dropped
        with db.connect() as conn:
            (stats,) = queue_stats(conn)
        assert (stats.job, stats.depth, stats.dead, stats.retrying) == ("worker", 0, 1, 0)

        make_due(db)
        assert runner.tick(job, force=True).outcome == "idle"  # dead items are not claimed

        bad.clear()
        assert push(db, job, [7]) == 1  # enqueued again: revived
        assert queue_rows(db) == [("worker", "[7]", 0, False)]
        assert runner.tick(job, force=True).items == 1
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)


def test_failing_writes_are_isolated_by_halving_and_the_rest_commit(db):
    add_parents(db, range(1, 17))
    with db.begin() as conn:  # negative totals violate derived's check constraint
        conn.execute(text("update parent set factor = -1 where id in (3, 11, 12)"))
    job = make_job(max_attempts=5, item_backoff="1m")
    push(db, job, range(1, 17))
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert result.items == 13 and result.failed_items == 3
    assert result.stats.inserted == 13 * 5
    assert [(r[1], r[2]) for r in queue_rows(db)] == [("[11]", 1), ("[12]", 1), ("[3]", 1)]
    assert derived(db) == [r for r in from_scratch(db) if r[0] not in (3, 11, 12)]
    with db.connect() as conn:
        statuses = conn.execute(text("select parent_id from status order by 1")).scalars().all()
        errors = conn.execute(text("select distinct last_error from pgjobs.queue")).scalars().all()
    assert statuses == [i for i in range(1, 17) if i not in (3, 11, 12)]
    assert len(errors) == 3 and all("derived_total_check" in e for e in errors)


def test_a_key_that_does_not_fit_the_scope_fails_as_an_item(db):
    add_parents(db, [1, 2])
    job = make_job(max_attempts=1)
    push(db, "worker", [1, "not a number", 2])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert result.items == 2 and result.failed_items == 1 and result.detail["dead"] == 1
    assert queue_rows(db) == [("worker", '["not a number"]', 1, True)]
    assert derived(db) == from_scratch(db)


def test_a_deadlock_or_timeout_fails_the_run_instead_of_blaming_items(db):
    add_parents(db, [1, 2])

    def compute(conn, keys):
        conn.execute(text("set local statement_timeout = '10ms'"))
        conn.execute(text("select pg_sleep(1)"))
        return COMPUTE

    job = make_job(compute=compute)
    push(db, job, [1, 2])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "failed" and result.sqlstate == "57014"
    assert queue_rows(db) == [("worker", "[1]", 0, False), ("worker", "[2]", 0, False)]


# -- status and the trigger ------------------------------------------------------------
def test_queue_stats_report_depth_due_retrying_dead_and_oldest_age(db):
    push(db, "a", [1, 2, 3])
    push(db, "b", [1])
    with db.begin() as conn:
        conn.execute(
            text(
                "update pgjobs.queue set enqueued_at = now() - interval '1 hour' where key = '[1]'"
            )
        )
        conn.execute(
            text(
                "update pgjobs.queue set attempts = 2, not_before = now() + interval '1 minute'"
                " where job = 'a' and key = '[2]'"
            )
        )
        conn.execute(
            text(
                "update pgjobs.queue set attempts = 5, dead_at = now() where job = 'a' and key = '[3]'"
            )
        )
    with db.connect() as conn:
        a, b = queue_stats(conn)
    assert (a.job, a.depth, a.due, a.retrying, a.dead) == ("a", 2, 1, 1, 1)
    assert (b.job, b.depth, b.due, b.retrying, b.dead) == ("b", 1, 1, 0, 0)
    assert timedelta(minutes=59) < a.oldest_age < timedelta(minutes=61)


def test_has_work_is_index_probes(db):
    """The work check: the first entry past the cursor (queue_seq_idx), the
    earliest due retry (queue_retry_idx); never a scan of the job's queue."""
    job = make_job()
    push(db, job, range(20000))
    push(db, "other", range(100))
    with db.begin() as conn:  # all but one of the job's items wait for a retry
        conn.execute(
            text(
                "update pgjobs.queue set attempts = 1, not_before = now() + interval '1 hour'"
                " where key <> '[0]'"
            )
        )
        conn.exec_driver_sql("analyze pgjobs.queue")
    now = datetime.now(UTC)
    query, params = pending_query(job, RunContext(job=job, namespace="n", schema="pgjobs", now=now))
    with db.connect() as conn:
        raw = conn.connection.driver_connection
        plan = "\n".join(r[0] for r in raw.execute(sql.SQL("explain ") + query, params))
        assert raw.execute(query, params).fetchone()[:2] == (True, True)  # work, past the cursor
    assert "queue_seq_idx" in plan and "queue_retry_idx" in plan, plan
    assert "Seq Scan on queue " not in plan, plan  # (the sequence queue_seq is read whole)


def test_the_enqueue_trigger_queues_inserted_updated_and_deleted_keys(db):
    job = make_job()
    with db.begin() as conn:
        install_enqueue_trigger(conn, table="parent", job=job, columns=["id"])
        install_enqueue_trigger(conn, table="parent", job=job, columns=["id"])  # idempotent
    add_parents(db, [1, 2, 3])
    assert [r[1] for r in queue_rows(db)] == ["[1]", "[2]", "[3]"]
    with pgjobs.Runner(db) as runner:
        assert runner.tick(job, force=True).items == 3
        assert derived(db) == from_scratch(db)
        with db.begin() as conn:
            conn.execute(text("update parent set factor = 2 where id = 2"))
            conn.execute(text("update parent set id = 30 where id = 3"))
        assert [r[1] for r in queue_rows(db)] == ["[2]", "[30]", "[3]"]
        with db.begin() as conn:
            conn.execute(text("delete from parent where id = 1"))
        result = runner.tick(job, force=True)
    assert result.items == 2 and result.detail["parent_gone"] == 2  # 1 deleted, 3 renamed
    assert derived(db) == from_scratch(db)
    with db.begin() as conn:
        drop_enqueue_trigger(conn, table="parent", job=job)
        conn.execute(text("update parent set factor = 5"))
    assert queue_rows(db) == []


def test_the_enqueue_trigger_checks_its_columns(db):
    with db.begin() as conn, pytest.raises(pgjobs.ConfigError, match="no column"):
        install_enqueue_trigger(conn, table="parent", job="worker", columns=["nope"])


def test_a_user_holding_a_second_parent_while_enqueueing_never_deadlocks_the_worker(db):
    """Scope exam, derived rows (exam, student): a user deletes a student, the
    cascade to answers enqueues the student's exams (trigger) and so waits for
    the entry the worker holds, while the worker's writer meets the student
    the user holds. The writer must defer those rows rather than wait."""
    with db.begin() as conn:
        conn.exec_driver_sql(
            """
            create table exam (id int primary key);
            create table student (id int primary key);
            create table answer (
                exam_id int not null references exam on delete cascade,
                student_id int not null references student on delete cascade,
                score int not null
            );
            create table exam_score (
                exam_id int not null references exam on delete cascade,
                student_id int not null references student on delete cascade,
                total int not null,
                primary key (exam_id, student_id)
            );
            insert into exam values (1), (2);
            insert into student select generate_series(1, 6);
            insert into answer select e, s, e * s from generate_series(1, 2) e, generate_series(1, 6) s;
            """
        )
    in_compute, finish = threading.Event(), threading.Event()

    def compute(conn, keys):
        if not finish.is_set():
            in_compute.set()
            assert finish.wait(10)
        return (
            "select exam_id, student_id, sum(score) as total from answer"
            " where exam_id = any(:keys) group by 1, 2"
        )

    job = pgjobs.QueueJob(name="scores", target="exam_score", scope=("exam_id",), compute=compute)
    with db.begin() as conn:
        install_enqueue_trigger(conn, table="answer", job=job, columns=["exam_id"])
    push(db, job, [1, 2])
    results = []
    worker = threading.Thread(
        target=lambda: results.append(pgjobs.Runner(db).tick(job, force=True))
    )
    worker.start()
    assert in_compute.wait(10)  # the worker holds the entries of exams 1 and 2

    user_errors = []
    with db.connect() as user:
        pid = user.execute(text("select pg_backend_pid()")).scalar_one()
        user.commit()

        def delete_student():
            try:
                with user.begin():
                    user.execute(text("delete from student where id = 5"))  # -> enqueue 1, 2
            except Exception as exc:
                user_errors.append(exc)

        t = threading.Thread(target=delete_student)
        t.start()
        try:
            _wait_until_waiting_on_a_lock(db, pid)  # the trigger waits for the worker's entry
        finally:
            finish.set()
            worker.join(15)
            t.join(15)
    assert user_errors == []
    (result,) = results
    assert result.outcome == "ran", result.error
    assert result.detail["rows_deferred"] == 2 and result.detail["kept"] == 2
    assert result.stats.inserted == 10  # every row but the two of student 5
    assert [r[1] for r in queue_rows(db)] == ["[1]", "[2]"]  # kept for the next tick
    with pgjobs.Runner(db) as runner:
        again = runner.tick(job, force=True)
    assert again.items == 2 and queue_rows(db) == []
    with db.connect() as conn:
        have = conn.execute(text("select * from exam_score order by 1, 2")).all()
        want = conn.execute(
            text("select exam_id, student_id, sum(score) from answer group by 1, 2 order by 1, 2")
        ).all()
    assert [tuple(r) for r in have] == [tuple(r) for r in want] and len(want) == 10


def test_a_key_that_does_not_fit_fails_as_an_item_without_item_parents_too(db):
    with db.begin() as conn:
        conn.exec_driver_sql("create table tally (k int primary key, v int not null)")
    job = pgjobs.QueueJob(
        name="tally",
        target="tally",
        scope=("k",),
        compute="select k, k * 10 as v from pgjobs_keys",
        max_attempts=2,
    )
    push(db, "tally", [1, 2, "x", 3])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran", result.error
    assert result.items == 3 and result.failed_items == 1
    assert queue_rows(db) == [("tally", '["x"]', 1, False)]
    with db.connect() as conn:
        assert conn.execute(text("select k, v from tally order by 1")).all() == [
            (1, 10),
            (2, 20),
            (3, 30),
        ]


def test_many_failures_stop_isolating_at_a_bound_and_leave_the_rest_for_later(db):
    add_parents(db, range(1, 65))

    def compute(conn, keys):
        if any(k[0] % 2 for k in keys):
            raise ValueError("odd items fail")
        return COMPUTE

    job = make_job(compute=compute, batch_size=64, max_attempts=3, item_backoff="10m")
    push(db, job, range(1, 65))
    with pgjobs.Runner(db) as runner:
        first = runner.tick(job, force=True)
        assert first.outcome == "ran", first.error
        kept = first.detail["kept"]
        assert kept > 0  # the bound was reached
        assert first.items + first.failed_items + kept == 64
        ticks = 1
        while runner.tick(job, force=True).outcome == "ran":
            ticks += 1
    rows = {r[1]: (r[2], r[3]) for r in queue_rows(db)}
    assert set(rows) == {f"[{i}]" for i in range(1, 65, 2)}  # every odd item, none lost
    assert set(rows.values()) == {(1, False)}  # each failed once, backing off
    assert derived(db) == [r for r in from_scratch(db) if r[0] % 2 == 0]
    assert ticks > 1


@pytest.mark.parametrize("wrong", ["parent_id text", "parent_id bigint", "other int"])
def test_a_keys_table_of_another_shape_in_the_session_is_replaced_before_the_claim_counts(
    db_url, db, wrong
):
    # Every session of this engine starts with a pgjobs_keys of another shape
    # (as another job's scope would leave it): the claim, pipelined with the
    # shape check, must be undone and redone on a table of the right shape.
    engine = create_engine(db_url)

    @event.listens_for(engine, "connect")
    def wrong_keys_table(dbapi_connection, record):
        dbapi_connection.execute(f"create temp table pgjobs_keys ({wrong})")
        dbapi_connection.commit()

    try:
        add_parents(db, [1, 2, 3])
        job = make_job()
        push(db, job, [1, 2, 3])
        with pgjobs.Runner(engine) as runner:
            result = runner.tick(job, force=True)
        assert result.outcome == "ran", result.error
        assert result.items == 3 and result.detail["claimed"] == 3
        assert derived(db) == from_scratch(db)
        assert queue_rows(db) == []
    finally:
        engine.dispose()


def test_the_claim_reads_entries_in_number_order_without_sorting_the_queue(db):
    job = make_job()
    push(db, job, range(5000))  # no ANALYZE since: the planner knows nothing of them
    with db.connect() as conn:
        plan = "\n".join(
            conn.execute(
                text(
                    "explain select key from pgjobs.queue where job = :j and dead_at is null"
                    " and attempts = 0 and seq > 0 order by seq limit 100"
                ),
                {"j": job.name},
            ).scalars()
        )
    assert "queue_seq_idx" in plan and "Sort" not in plan, plan


def test_the_items_parents_stay_locked_from_the_claim_through_the_write(db, db_url):
    # The writer does not lock the items' parents again (the claim holds
    # them): they must still be held while the rows are written and `after`
    # runs, so that no user can delete or re-key them meanwhile.
    add_parents(db, [1, 2])
    held: dict[int, bool] = {}

    def after(conn, keys, stats):
        with psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://")) as other:
            for pid in (1, 2):
                try:
                    other.execute("select from parent where id = %s for update nowait", (pid,))
                except psycopg.errors.LockNotAvailable:
                    held[pid] = True
                else:
                    held[pid] = False
                other.rollback()

    job = make_job(after=after)
    push(db, job, [1])
    with pgjobs.Runner(db) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "ran" and result.items == 1, queue_rows(db)
    assert held == {1: True, 2: False}
    assert derived(db) == from_scratch(db, 1)


# -- a queue of the plugin's own -----------------------------------------------------
OWN_QUEUE = """
create table my_queue (
    parent_id int primary key,
    attempts int not null default 0,
    last_error text
);
"""


def own_queue_job(**changes):
    """A QueueJob over ``my_queue``, the plugin's table: claim locks due rows
    without waiting, finish deletes the done ones and counts failures."""

    def claim(conn, limit):
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "select parent_id from my_queue where attempts < 3 order by parent_id"
                    " limit :n for update skip locked"
                ),
                {"n": limit},
            )
        ]

    def finish(conn, done, failed):
        conn.execute(
            text("delete from my_queue where parent_id = any(cast(:done as int[]))"),
            {"done": [k[0] for k in done]},
        )
        for (key,), exc in failed.items():
            conn.execute(
                text(
                    "update my_queue set attempts = attempts + 1, last_error = :err"
                    " where parent_id = :k"
                ),
                {"k": key, "err": str(exc)},
            )

    def has_work(conn):
        return conn.execute(
            text("select exists (select from my_queue where attempts < 3)")
        ).scalar()

    return make_job(claim=claim, finish=finish, has_work=has_work, **changes)


def my_queue(engine):
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("select * from my_queue order by 1"))]


def test_a_plugin_brings_its_own_queue_table_with_claim_and_finish(db):
    """claim takes the items from the plugin's table; the parents are locked
    as for the built-in queue (a gone parent's item is done, a busy one stays);
    finish gets the done keys and the failing items with their errors."""
    with db.begin() as conn:
        conn.exec_driver_sql(OWN_QUEUE)
    add_parents(db, range(1, 11))
    with db.begin() as conn:
        conn.exec_driver_sql("insert into my_queue (parent_id) select generate_series(1, 10)")
        conn.exec_driver_sql("delete from parent where id = 9")  # gone before the tick

    def compute(conn, keys):
        if 7 in {k[0] for k in keys}:
            raise ValueError("cannot score item 7")
        return COMPUTE

    job = own_queue_job(compute=compute)
    with db.connect() as user:
        user.begin()
        user.execute(text("select id from parent where id = 3 for update"))  # a user holds 3
        with pgjobs.Runner(db) as runner:
            result = runner.tick(job)
        user.rollback()
    assert result.outcome == "ran", result.error
    assert (result.items, result.failed_items) == (7, 1)
    assert result.detail["parent_gone"] == 1 and result.detail["deferred"] == 1
    # 3 (busy) stays untouched; 7 failed once; the others, 9 included, are done
    assert my_queue(db) == [(3, 0, None), (7, 1, "cannot score item 7")]
    assert derived(db) == [r for r in from_scratch(db) if r[0] not in (3, 7)]
    assert queue_rows(db) == []  # the built-in queue is not involved

    with pgjobs.Runner(db) as runner:
        again = runner.tick(job, force=True)
    assert again.outcome == "ran", again.error
    assert (again.items, again.failed_items) == (1, 1)
    assert my_queue(db) == [(7, 2, "cannot score item 7")]
    assert derived(db) == [r for r in from_scratch(db) if r[0] != 7]


def test_claim_needs_finish_and_has_work(db):
    with pytest.raises(pgjobs.ConfigError, match=r"claim .* needs finish .* and has_work"):
        make_job(claim=lambda conn, n: [], finish=lambda conn, d, f: None)
    with pytest.raises(pgjobs.ConfigError, match="finish is for a queue of your own"):
        make_job(finish=lambda conn, d, f: None)
    with pytest.raises(pgjobs.ConfigError, match="claim: expected a callable"):
        make_job(claim="select 1", finish=lambda conn, d, f: None, has_work=lambda c: True)


def vacuum_count(engine):
    with engine.connect() as conn:
        return conn.execute(
            text("select pg_stat_get_vacuum_count('pgjobs.queue'::regclass)")
        ).scalar_one()


def test_the_worker_vacuums_the_queue_after_every_so_many_entries_it_took_off(db, monkeypatch):
    # Dead entries ahead of the live ones would make every has_work probe and
    # claim step over them until autovacuum comes (a minute, at best).
    monkeypatch.setattr(pgjobs.worker.vacuum, "VACUUM_EVERY", 25)
    add_parents(db, range(1, 41))
    job = make_job(batch_size=10)
    push(db, job, range(1, 41))
    with db.begin() as conn:  # no autovacuum to take the table from the worker's
        conn.execute(text("alter table pgjobs.queue set (autovacuum_enabled = off)"))
    before = vacuum_count(db)
    with pgjobs.Runner(db) as runner:
        counts = []
        for _ in range(4):
            assert runner.tick(job, force=True).items == 10
            counts.append(vacuum_count(db) - before)
    # 10, 20, 30 (vacuum, counter back to 0), 10
    assert counts == [0, 0, 1, 1]
    assert derived(db) == from_scratch(db)


def test_while_a_snapshot_holds_the_horizon_the_workers_vacuums_come_half_as_often_each_time(
    db, db_url, monkeypatch
):
    # A vacuum under a held horizon removes nothing and reads the whole
    # queue, which grows meanwhile: each one that leaves at least what was
    # taken off since the last doubles the entries until the next; one that
    # removes them sets it back.
    monkeypatch.setattr(pgjobs.worker.vacuum, "VACUUM_EVERY", 10)
    add_parents(db, range(1, 171))
    with db.begin() as conn:  # no autovacuum to take the table from the worker's
        conn.execute(text("alter table pgjobs.queue set (autovacuum_enabled = off)"))
    job = make_job(batch_size=10)
    push(db, job, range(1, 71))
    before = vacuum_count(db)
    holder = psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://"))
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    counts = []
    with holder, pgjobs.Runner(db) as runner:
        holder.execute("select 1").fetchone()  # its snapshot, held
        for _ in range(7):
            assert runner.tick(job, force=True).items == 10
            counts.append(vacuum_count(db) - before)
        holder.rollback()  # the horizon moves on
        push(db, job, range(71, 171))
        for _ in range(10):
            assert runner.tick(job, force=True).items == 10
            counts.append(vacuum_count(db) - before)
    # held: at 10 (then every 20), 30 (then 40), 70 (then 80); released: at
    # 150, which removes them (then every 10 again), at 160, at 170
    assert counts == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4, 5, 6]
    assert derived(db) == from_scratch(db)


def test_a_failing_vacuum_after_the_commit_leaves_the_run_and_the_connection_fine(
    db, monkeypatch, caplog
):
    def broken(conn, *, schema):
        conn.exec_driver_sql("select no_such_function()")

    monkeypatch.setattr(pgjobs.worker.vacuum, "VACUUM_EVERY", 1)
    monkeypatch.setattr(pgjobs.worker.vacuum, "vacuum_queue", broken)
    add_parents(db, [1, 2])
    job = make_job()
    push(db, job, [1])
    with pgjobs.Runner(db) as runner:
        first = runner.tick(job, force=True)
        push(db, job, [2])
        second = runner.tick(job, force=True)
    assert (first.outcome, first.items) == ("ran", 1)
    assert (second.outcome, second.items) == ("ran", 1)
    assert "after its commit" in caplog.text and "no_such_function" in caplog.text
    assert derived(db) == from_scratch(db)
    assert queue_rows(db) == []


def test_a_compute_whose_columns_change_under_a_star_is_loaded_by_its_new_names(db):
    # A queue job's SQL is loaded tick after tick with the column names it had
    # the tick before, its probe beside it: when DDL changes what "*" means,
    # the load is rolled back and done again, never written by position.
    with db.begin() as conn:
        conn.exec_driver_sql(
            "create table newrows (parent_id int, bucket int, total bigint, n int);"
            " insert into newrows values (1, 0, 10, 1), (1, 1, 11, 1), (2, 0, 20, 2)"
        )
    add_parents(db, [1, 2])
    job = make_job(compute="select * from newrows where parent_id = any(:keys)")
    with pgjobs.Runner(db) as runner:
        push(db, job, [1])
        assert runner.tick(job, force=True).stats.inserted == 2
        assert derived(db, 1) == [(1, 0, 10, 1), (1, 1, 11, 1)]
        with db.begin() as conn:
            conn.exec_driver_sql(
                "drop table newrows; create table newrows (n int, total bigint, bucket int,"
                " parent_id int); insert into newrows values (3, 30, 0, 2), (4, 40, 1, 2)"
            )
        push(db, job, [2])
        result = runner.tick(job, force=True)
    assert (result.outcome, result.stats.inserted) == ("ran", 2)
    assert derived(db, 2) == [(2, 0, 30, 3), (2, 1, 40, 4)]
    assert queue_rows(db) == []


def test_queue_stats_tell_the_oldest_live_item_from_the_oldest_due_one(db):
    """Two ages, one meaning each: an item waiting for its retry is live (in
    ``oldest_age``) but not due (not in ``oldest_due_age``)."""
    push(db, "a", [1, 2])
    with db.begin() as conn:
        conn.execute(
            text(
                "update pgjobs.queue set enqueued_at = now() - interval '2 hours', attempts = 1,"
                " not_before = now() + interval '1 minute' where key = '[1]'"
            )
        )
        conn.execute(
            text(
                "update pgjobs.queue set enqueued_at = now() - interval '1 hour' where key = '[2]'"
            )
        )
    with db.connect() as conn:
        (a,) = queue_stats(conn)
    assert timedelta(minutes=119) < a.oldest_age < timedelta(minutes=121)
    assert timedelta(minutes=59) < a.oldest_due_age < timedelta(minutes=61)
    with db.begin() as conn:
        conn.execute(text("update pgjobs.queue set not_before = now() + interval '1 minute'"))
    with db.connect() as conn:
        (a,) = queue_stats(conn)
    assert a.due == 0 and a.oldest_due_age is None and a.oldest_age is not None


# -- job_state under a held horizon ----------------------------------------------------
def _state(engine, job="worker"):
    with engine.connect() as conn:
        return conn.execute(
            text(
                "select failures, last_success_at,"
                " (select count(*) from pgjobs.run where job = :j and outcome = 'ran')"
                " from pgjobs.job_state where job = :j"
            ),
            {"j": job},
        ).one()


def test_a_queue_jobs_success_is_written_to_its_state_once_in_ten_seconds_and_logged_each_time(
    db,
):
    # Each write of job_state is one more version of the job's one row,
    # which every tick reads, and a held horizon keeps every version (19,000
    # after 240 s at 800 keys/s: 0.5-0.7 ms a read). A success that would
    # change only its times is written there once in SUCCESS_EVERY; the run
    # log has each.
    from pgjobs.steps import SUCCESS_EVERY

    now = [datetime.now(UTC)]
    runner = pgjobs.Runner(db, clock=lambda: now[0])
    job = make_job()
    add_parents(db, range(1, 5))
    first = now[0]
    for key in range(1, 5):
        push(db, job, [key])
        assert runner.tick(job, woken=True).outcome == "ran"
        assert _state(db) == (0, first, key)
        now[0] += timedelta(seconds=2)
    now[0] = first + SUCCESS_EVERY
    push(db, job, [1])
    assert runner.tick(job, woken=True).outcome == "ran"
    assert _state(db) == (0, first + SUCCESS_EVERY, 5)


def test_a_failure_recorded_late_after_a_success_only_the_run_log_has_changes_nothing(db):
    # The guard of a failure written late (its connection was lost): the
    # job succeeded since that run started, so its state is left alone.
    # That success is in the run log, not in job_state (written once in
    # SUCCESS_EVERY): the guard reads both.
    from pgjobs.records import Failure
    from pgjobs.results import Outcome, RunResult

    now = [datetime.now(UTC)]
    runner = pgjobs.Runner(db, clock=lambda: now[0])
    job = make_job()
    add_parents(db, [1])
    first = now[0]
    for _ in range(2):  # a success recorded, then one only logged
        push(db, job, [1])
        assert runner.tick(job, woken=True).outcome == "ran"
        now[0] += timedelta(seconds=2)
    assert _state(db) == (0, first, 2)

    def late(started):
        result = RunResult(
            job=job.name,
            outcome=Outcome.FAILED,
            started_at=started,
            finished_at=started,
            error="connection lost",
            next_attempt_at=started + timedelta(minutes=5),
        )
        with db.begin() as conn:
            query, params = Failure(result, 1, started).state_query(runner.store)
            conn.exec_driver_sql(query.as_string(None), params)

    late(first + timedelta(seconds=1))  # before the success only the run log has
    assert _state(db) == (0, first, 2)
    late(now[0])  # after every success: recorded, and the next success resets it
    assert _state(db)[0] == 1
    now[0] += timedelta(minutes=6)
    push(db, job, [1])
    assert runner.tick(job, woken=True).outcome == "ran"
    assert _state(db) == (0, now[0], 3)
