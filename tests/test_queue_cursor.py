"""The queue's cursor (pgjobs/worker/cursor.py, migration 015): claims read
from where the live entries are, not from the start of an index full of
entries processed while another session held the xmin horizon; and no
entry is passed over, whatever order transactions commit in. Real
connections and transactions throughout, ordered by the test, no sleeps."""

from __future__ import annotations

import json
import random
import threading
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
import pgjobs.worker.cursor
from pgjobs.jobs import RunContext
from pgjobs.migrations import migrate, migrations
from pgjobs.worker import has_pending, pending_query
from pgjobs.worker.cursor import FRESH, RECHECK, RECHECK_MAX, Cursor, sample_sql
from tests.test_queue import (
    SCHEMA,
    add_parents,
    derived,
    from_scratch,
    make_job,
    push,
    queue_rows,
)
from tests.test_wake import wait_until


def libpq(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False).replace(
        "postgresql+psycopg://", "postgresql://"
    )


@pytest.fixture
def db(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.Runner(engine).install()
    return engine


def context(job: pgjobs.QueueJob, runner: pgjobs.Runner) -> RunContext:
    """What a tick of ``runner`` gives ``job``'s body, its cursors included."""
    return RunContext(
        job=job, namespace="n", schema="pgjobs", now=datetime.now(UTC), queue_cursors=runner.cursors
    )


def claim_buffers(engine: Engine, runner: pgjobs.Runner, job: pgjobs.QueueJob) -> int:
    """Buffers of the queue the job's work check touches (EXPLAIN ANALYZE),
    read from where this runner's cursor is."""
    query, params = pending_query(job, context(job, runner))
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        plan = raw.execute(
            sql.SQL("explain (analyze, buffers, format json) ") + query, params
        ).fetchone()[0]
    doc = plan if isinstance(plan, list) else json.loads(plan)

    def scans(node: dict) -> int:
        own = 0
        if node.get("Relation Name") == "queue":  # an index scan of the queue (no children)
            own = int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))
        return own + sum(scans(child) for child in node.get("Plans", ()))

    return scans(doc[0]["Plan"])


# -- what a held horizon costs --------------------------------------------------------------
def test_entries_processed_under_a_held_snapshot_are_not_walked_again(db: Engine) -> None:
    """A REPEATABLE READ transaction of another session holds the horizon
    while 3,000 items are processed: their entries stay in the indexes
    (vacuum may not remove them), but the work check reads from the cursor,
    past them; from the start (a full pass) it walks them all."""
    keys = list(range(1, 3001))
    add_parents(db, keys)
    job = make_job(batch_size=100)
    with psycopg.connect(libpq(db)) as holder:
        holder.execute("begin isolation level repeatable read")
        holder.execute("select count(*) from parent")  # the snapshot is taken
        with pgjobs.Runner(db) as runner:
            for chunk in range(0, len(keys), 500):
                push(db, job, keys[chunk : chunk + 500])
                while runner.tick(job, force=True).items:
                    pass
            assert queue_rows(db) == []
            with db.connect() as conn:  # the entries are dead, and still there
                dead = conn.execute(
                    text("select n_dead_tup from pg_stat_user_tables where relname = 'queue'")
                ).scalar_one()
            cursor = runner.cursors.of("pgjobs", job.name)
            from_cursor = claim_buffers(db, runner, job)
            low = cursor.low
            cursor.low = 0
            from_start = claim_buffers(db, runner, job)
            cursor.low = low
        holder.rollback()
    assert low >= 3000, low
    print(f"buffers of the queue read: {from_cursor} from the cursor, {from_start} from the start")
    assert from_cursor <= 6, (from_cursor, from_start, dead)
    assert from_start >= 10 * from_cursor, (from_cursor, from_start, dead)
    assert derived(db) == from_scratch(db)


# -- nothing passed over ----------------------------------------------------------------
def test_an_enqueue_that_commits_after_a_later_one_was_claimed_is_claimed(db: Engine) -> None:
    """A transaction draws the lower number and commits after one with a
    higher number was claimed: the cursor does not pass it while that
    transaction runs (its xid is among the running ones the sample read)."""
    add_parents(db, [1, 2, 3])
    job = make_job()
    with pgjobs.Runner(db) as runner, psycopg.connect(libpq(db)) as late:
        late.execute("select pgjobs.enqueue('worker', '[[1]]')")  # number 1, not committed
        push(db, job, [2])  # number 2, committed
        first = runner.tick(job, force=True)
        assert first.items == 1 and [r[1] for r in queue_rows(db)] == []  # [1] not visible
        push(db, job, [3])
        assert runner.tick(job, force=True).items == 1
        assert runner.tick(job, force=True).outcome == "idle"
        cursor = runner.cursors.of("pgjobs", job.name)
        assert cursor.low < 1 or cursor.safe < 1, (cursor.low, cursor.safe)
        late.commit()
        result = runner.tick(job, force=True)
        assert result.items == 1, result
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)


def test_a_second_sample_in_one_transaction_sees_the_transactions_begun_since_the_first(
    db: Engine,
) -> None:
    """A session reads the others' activity once a transaction and answers
    from that copy after: a claim redone in the same transaction (after a
    rollback to a savepoint) would pair the sequence's new value with the
    xids running at the first, missing an enqueue that drew a number
    between the two. The sample throws the copy away first."""
    last, running = sample_sql("pgjobs")
    sample = sql.SQL("select l.v, {} from {}").format(running, last)
    with psycopg.connect(libpq(db)) as worker, psycopg.connect(libpq(db)) as user:
        _, before = worker.execute(sample).fetchone()  # type: ignore[misc]
        user.execute("select pgjobs.enqueue('worker', '[[1]]')")  # an xid, then a number
        (xid,) = user.execute("select pg_current_xact_id()::text::bigint").fetchone()  # type: ignore[misc]
        value, after = worker.execute(sample).fetchone()  # type: ignore[misc]
        assert xid not in (before or [])
        assert value >= 1 and xid in after, (value, after, xid)
        worker.rollback()
        user.rollback()


def test_a_claim_moves_the_cursor_only_as_far_as_was_safe_when_it_was_sent() -> None:
    """Two workers of a job share its cursor. One's sample, read while the
    other's claim ran (after that claim's snapshot), says a number is safe:
    the other claim may not have seen what committed in between, and does
    not move ``low`` past what was safe when it was sent."""
    cursor = cursor_at(10)
    b = cursor.params()  # worker B's claim is sent: safe is 10
    b.limit, b.count = 100, 0  # it read all there was (in its snapshot)
    cursor.sample(50, 1.0, [])  # worker A's sample, read after B's snapshot
    assert cursor.safe == 50
    cursor.advance(b)
    assert cursor.low == 10  # not 50: B's snapshot may miss a commit below 50
    a = cursor.params()
    a.limit, a.count = 100, 0
    cursor.advance(a)
    assert cursor.low == 50


def test_an_entry_a_users_transaction_holds_is_claimed_after_its_commit(db: Engine) -> None:
    """A user's enqueue of a pending item locks its entry (the lost-update
    guard of 002_queue.sql): the claim skips it, never waiting, and the
    cursor moves on past it (its number was safe before the user came);
    the entry is read again by its number until it is claimed."""
    add_parents(db, [1, 2, 3])
    job = make_job()
    push(db, job, [1, 2, 3])
    with pgjobs.Runner(db) as runner, psycopg.connect(libpq(db)) as user:
        with db.begin() as conn:  # a work check: nobody runs, numbers up to 3 are safe
            assert has_pending(conn, job, context(job, runner))
        cursor = runner.cursors.of("pgjobs", job.name)
        assert cursor.safe >= 3
        user.execute("update source set val = val + 100 where parent_id = 2")
        user.execute("select pgjobs.enqueue('worker', '[[2]]')")  # locks the pending entry
        first = runner.tick(job, force=True)
        assert first.items == 2, first
        assert cursor.low >= 3 and len(cursor.recheck) == 1, (cursor.low, cursor.recheck)
        push(db, job, [1])  # a number past the cursor; [2]'s is read again, still held
        assert runner.tick(job, force=True).items == 1
        assert len(cursor.recheck) == 1
        user.commit()
        result = runner.tick(job, force=True)
        assert result.items == 1, result
        assert not cursor.recheck
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)  # the user's change is in


def test_an_entry_held_at_the_claim_is_claimed_soon_after_its_commit_which_wakes_nobody(
    db: Engine,
) -> None:
    """The user's enqueue of an item already queued adds nothing, so its
    commit notifies nobody: the tick that found the entry held (and nothing
    else) asks for another within seconds, not at the job's interval."""
    add_parents(db, [2])
    job = make_job(every="1h")
    push(db, job, [2])
    results: list[pgjobs.RunResult] = []
    with psycopg.connect(libpq(db)) as user:
        user.execute("update source set val = val + 1 where parent_id = 2")
        user.execute("select pgjobs.enqueue('worker', '[[2]]')")  # holds the queued entry
        with pgjobs.Scheduler([job], db, on_result=results.append):
            wait_until(
                lambda: (
                    any(r.detail.get("held") for r in results)
                    or any(r.outcome == "idle" and r.retry_after for r in results)
                ),
                what="a tick that found the entry held",
            )
            assert queue_rows(db) != []
            user.commit()
            wait_until(lambda: queue_rows(db) == [], timeout=15.0, what="the entry claimed")
    assert derived(db) == from_scratch(db)


def test_an_item_whose_parent_a_user_holds_is_claimed_once_released(db: Engine) -> None:
    add_parents(db, [1, 2, 3])
    job = make_job()
    push(db, job, [1, 2, 3])
    with pgjobs.Runner(db) as runner, psycopg.connect(libpq(db)) as user:
        user.execute("select from parent where id = 2 for update")
        first = runner.tick(job, force=True)
        assert first.items == 2 and first.detail["deferred"] == 1, first
        push(db, job, [3])
        assert runner.tick(job, force=True).items == 1
        user.commit()
        assert runner.tick(job, force=True).items == 1
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)


def test_the_items_of_a_tick_that_rolls_back_are_claimed_by_the_next(db: Engine) -> None:
    add_parents(db, [1, 2])
    fail = {"now": True}

    def after(conn, keys, stats):
        if fail["now"]:
            raise pgjobs.ConfigError("after is misconfigured")  # the whole run fails

    job = make_job(after=after)
    push(db, job, [1, 2])
    with pgjobs.Runner(db) as runner:
        assert runner.tick(job, force=True).outcome == "failed"
        push(db, job, [])  # nothing new
        fail["now"] = False
        assert runner.tick(job, force=True).items == 2
    assert queue_rows(db) == []


def test_a_replica_that_finds_nothing_moves_its_cursor_on(db: Engine) -> None:
    """Two runners (two processes' worth of cursors): one drains, the other
    finds nothing to claim, and its cursor still moves past what the first
    processed, so its claims do not walk those entries."""
    add_parents(db, range(1, 201))
    job = make_job(batch_size=50)
    with pgjobs.Runner(db) as busy, pgjobs.Runner(db) as idle:
        push(db, job, range(1, 201))
        while busy.tick(job, force=True).items:
            pass
        assert idle.tick(job, force=True).outcome == "idle"
        assert idle.tick(job, force=True).outcome == "idle"
        assert idle.cursors.of("pgjobs", job.name).low >= 200


def test_a_revived_item_gets_a_new_number_and_is_claimed(db: Engine) -> None:
    add_parents(db, [1, 2])

    def compute(conn, keys):
        if any(k[0] == 1 for k in keys):
            raise ValueError("item 1 fails")
        return make_job().compute

    job = make_job(compute=compute, max_attempts=1)
    push(db, job, [1, 2])
    with pgjobs.Runner(db) as runner:
        first = runner.tick(job, force=True)
        assert first.items == 1 and first.failed_items == 1
        assert [r[3] for r in queue_rows(db)] == [True]  # [1] dead
        with db.connect() as conn:
            before = conn.execute(text("select seq from pgjobs.queue")).scalar_one()
        job_ok = make_job()
        with db.begin() as conn:
            conn.execute(text("select pgjobs.enqueue('worker', '[[1]]')"))  # revives it
            after = conn.execute(text("select seq from pgjobs.queue")).scalar_one()
        assert after > before
        assert runner.tick(job_ok, force=True).items == 1
    assert queue_rows(db) == []


def test_users_racing_a_worker_lose_no_item_without_the_full_pass(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four users change and enqueue overlapping keys (a pending entry is
    locked, not written, by a second enqueue; one transaction in ten rolls
    back; some enqueue first and change after) while a worker ticks, one
    tick in four rolled back whole, with the full pass (the backstop) off:
    when the users are done, the worker drains the queue to nothing and the
    derived rows are exact."""
    monkeypatch.setattr(pgjobs.worker.cursor, "FULL_PASS_SECONDS", 1e9)
    keys = list(range(1, 61))
    add_parents(db, keys)
    calls = iter(range(10**9))

    def after(conn, keys, stats):  # one tick in four fails whole: rolled back
        if next(calls) % 4 == 3:
            raise pgjobs.ConfigError("this tick fails")

    job = make_job(batch_size=10, after=after)
    done = threading.Event()
    errors: list[BaseException] = []

    def user(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(libpq(db)) as conn:
                for n in range(150):
                    chosen = sorted(rng.sample(keys, 3))
                    try:
                        change(conn, n, chosen)
                    except psycopg.errors.DeadlockDetected:
                        conn.rollback()  # users among themselves (enqueue first, or change first)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def change(conn: psycopg.Connection, n: int, chosen: list[int]) -> None:
        enqueue = "select pgjobs.enqueue('worker', %s::jsonb)"
        items = json.dumps([[k] for k in chosen])
        if n % 3 == 0:  # enqueue first, change after (the entry held longer)
            conn.execute(enqueue, (items,))
        conn.execute("update parent set factor = factor %% 7 + 1 where id = any(%s)", (chosen,))
        if n % 3 != 0:
            conn.execute(enqueue, (items,))
        if n % 10 == 9:
            conn.rollback()
        else:
            conn.commit()

    users = [threading.Thread(target=user, args=(seed,)) for seed in range(4)]
    with pgjobs.Runner(db) as runner:

        def work() -> None:
            try:
                while not done.is_set():
                    runner.tick(job, force=True, woken=True)
            except BaseException as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=work)
        worker.start()
        for u in users:
            u.start()
        for u in users:
            u.join(120)
        done.set()
        worker.join(60)
        assert not errors, errors
        for _ in range(200):  # the rest, however many ticks it takes
            if runner.tick(job, force=True).outcome == "idle" and not queue_rows(db):
                break
    assert queue_rows(db) == []
    assert derived(db) == from_scratch(db)


# -- the migration, with items in the queue -------------------------------------------------
def test_migration_015_numbers_the_queued_pending_retrying_and_dead_items(db_url: str) -> None:
    engine = pgjobs.database.resolve_engine(db_url, call_timeout=10.0)[0]
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        before = [m for m in migrations() if m.number < 15]
        with engine.connect() as conn:
            migrate(conn, "pgjobs", available=before)
        add_parents(engine, [1, 2, 3, 4])
        with engine.begin() as conn:  # as 014's code leaves them: pending, retrying, dead
            conn.execute(
                text(
                    "insert into pgjobs.queue (job, key, attempts, not_before, dead_at) values"
                    " ('worker', '[3]', 0, now(), null), ('worker', '[1]', 0, now(), null),"
                    " ('worker', '[2]', 1, now() + interval '1 hour', null),"
                    " ('worker', '[4]', 3, now(), now())"
                )
            )
        with engine.connect() as conn:
            applied = migrate(conn, "pgjobs")
        assert applied[0].name == "015_queue_seq"
        with engine.connect() as conn:
            numbered = conn.execute(
                text("select key::text, seq from pgjobs.queue order by seq")
            ).all()
            indexes = set(
                conn.execute(
                    text("select indexname from pg_indexes where tablename = 'queue'")
                ).scalars()
            )
        assert [k for k, _ in numbered] == ["[1]", "[2]", "[3]", "[4]"]  # in key order
        assert indexes == {"queue_pkey", "queue_seq_idx", "queue_retry_idx"}
        job = make_job(max_attempts=3)
        with pgjobs.Runner(engine) as runner:
            first = runner.tick(job, force=True)
            assert first.items == 2  # [1] and [3]; [2] waits for its retry, [4] is dead
            with engine.begin() as conn:
                conn.execute(text("update pgjobs.queue set not_before = now() where key = '[2]'"))
            assert runner.tick(job, force=True).items == 1
            with engine.begin() as conn:
                conn.execute(text("select pgjobs.enqueue('worker', '[[4], [5]]')"))
                # a new number past every old one
                rows = conn.execute(text("select key::text, seq from pgjobs.queue")).all()
            assert min(s for _, s in rows) > numbered[-1][1]
            assert runner.tick(job, force=True).items == 1  # [4]; [5] has no parent: dropped
        assert queue_rows(engine) == []
    finally:
        engine.dispose()


# -- the cursor's own bookkeeping (no database) ---------------------------------------------
def test_past_its_bound_the_cursor_stays_below_the_entries_it_no_longer_keeps() -> None:
    cursor = Cursor()
    cursor.sample(5000, 1.0, [])  # nobody running: up to 5,000 is safe
    read = cursor.params()
    read.limit, read.count = 100, 50  # read everything there was
    read.rows = [(n, FRESH, False) for n in range(1, RECHECK_MAX + 11)]  # none taken
    cursor.advance(read)
    assert len(cursor.recheck) == RECHECK_MAX
    assert cursor.low == RECHECK_MAX  # below the first one it let go
    assert min(cursor.recheck) == 1 and max(cursor.recheck) == RECHECK_MAX


def cursor_at(number: int) -> Cursor:
    """A cursor past ``number``: safe up to it, and a claim that read everything."""
    cursor = Cursor()
    cursor.sample(number, 1.0, [])
    read = cursor.params()
    read.limit, read.count = 100, 0
    cursor.advance(read)
    assert cursor.low == number
    return cursor


def test_a_sequence_behind_the_cursor_resets_it_and_a_read_from_before_changes_nothing() -> None:
    cursor = cursor_at(900)
    before = cursor.params()  # sent before the database was made again
    before.limit, before.count = 100, 0
    cursor.sample(3, 1.0, [])  # the sequence is at 3: another database under the name
    assert cursor.low == 0
    cursor.advance(before)
    assert cursor.low == 0


def test_what_a_tick_claimed_is_read_again_when_it_does_not_commit() -> None:
    cursor = Cursor()
    cursor.sample(10, 1.0, [])
    read = cursor.params()
    read.limit, read.count = 100, 3
    read.rows = [(8, FRESH, True), (9, FRESH, True), (10, FRESH, False)]
    token = cursor.advance(read)
    assert cursor.low == 10 and list(cursor.recheck) == [10]
    cursor.ended(token, committed=False)
    assert sorted(cursor.recheck) == [8, 9, 10]


def test_a_sample_is_safe_once_none_of_its_running_xids_runs() -> None:
    cursor = Cursor()
    cursor.sample(10, 1.0, [501, 502])
    assert cursor.safe == 0
    cursor.sample(20, 1.0, [502, 503])
    assert cursor.safe == 0  # 502 still runs
    cursor.sample(30, 1.0, [503])
    assert cursor.safe == 10  # 501 and 502 ended: every drawer up to 10 ended
    cursor.sample(40, 1.0, [])
    assert cursor.safe == 40


def test_a_work_check_that_finds_nothing_from_the_start_is_the_full_pass() -> None:
    cursor = Cursor()
    low, _, sent = cursor.peek()
    assert low == 0 and sent[2]  # the first check of a process reads from the start
    cursor.sample(70, 1.0, [])
    cursor.nothing_past(sent)  # nothing there
    low, _, sent = cursor.peek()
    assert not sent[2]  # not again before FULL_PASS_SECONDS
    cursor.nothing_past(sent)
    assert cursor.peek()[0] == 70


def test_entries_to_read_again_that_a_full_batch_left_out_are_kept() -> None:
    cursor = Cursor()
    cursor.sample(500, 1.0, [])
    cursor.recheck = dict.fromkeys([10, 20, 30])
    read = cursor.params()
    read.limit, read.count = 2, 2  # a full batch: 10 and 20 came back claimed
    read.rows = [(10, RECHECK, True), (20, RECHECK, True)]
    cursor.advance(read)
    assert list(cursor.recheck) == [30]  # not read: kept
    read = cursor.params()
    read.limit, read.count = 2, 0  # all there was: 30 is gone
    cursor.advance(read)
    assert not cursor.recheck


def test_a_sample_from_another_server_sends_the_cursor_back_to_the_start() -> None:
    """After a failover the primary is another server: a commit this cursor
    saw may not have reached it (asynchronous replication), and its numbers
    may have gone back; what it passed is read again."""
    cursor = cursor_at(900)
    cursor.sample(905, 2.0, [])  # the new primary
    assert cursor.low == 0 and cursor.params().full
