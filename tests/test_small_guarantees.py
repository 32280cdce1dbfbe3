"""Each guarantee of a queue tick, on the small-batch path (one statement
writes the batch), scripted with events between its statements: the job's
compute is a function returning SQL text, called between the claim and
the write statement, where it signals and waits while another connection
acts.

Every test asserts that the batch took the small path (``write_small``
wrote it), so that none passes on the general writer by accident.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

import pgjobs
import pgjobs.worker.tick

WAIT = 30.0
WRITE_SMALL = pgjobs.worker.tick.write_small

SCHEMA = """
create table parent (id int primary key, fail bool not null default false);
create table cat (id int primary key);
create table source (parent_id int not null references parent on delete cascade,
                     bucket int not null, cat_id int not null, val int not null);
create table derived (
    parent_id int not null references parent on delete cascade,
    bucket int not null,
    cat_id int references cat on delete cascade,
    total bigint not null,
    primary key (parent_id, bucket)
);
insert into parent (id) select generate_series(1, 4);
insert into cat values (1), (2);
insert into source select p, b, b, p * 10 + b from generate_series(1, 4) p, generate_series(1, 2) b;
"""

COMPUTE = (
    "select s.parent_id, s.bucket, s.cat_id, sum(s.val) / (case when p.fail then 0 else 1 end)"
    " as total from source s join parent p on p.id = s.parent_id"
    " where s.parent_id = any(:keys) group by s.parent_id, s.bucket, s.cat_id, p.fail"
)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.Runner(engine).install()
    yield engine
    engine.dispose()


@pytest.fixture
def small_writes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each batch's small-path write wrote it."""
    wrote: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = WRITE_SMALL(*args, **kwargs)
        wrote.append(result is not None)
        return result

    monkeypatch.setattr(pgjobs.worker.tick, "write_small", counted)
    return wrote


class Pause:
    """A compute that, between the claim and the write, says it is there
    and waits to be let go; it returns the job's SQL text."""

    def __init__(self) -> None:
        self.there = threading.Event()
        self.go = threading.Event()
        self.keys: list[Any] = []

    def __call__(self, conn: Any, keys: Any) -> str:
        self.keys.append(list(keys))
        self.there.set()
        assert self.go.wait(WAIT)
        return COMPUTE


def job(compute: Any = COMPUTE, **changes: Any) -> pgjobs.QueueJob:
    fields: dict[str, Any] = dict(
        name="w", target="derived", scope="parent_id", compute=compute, batch_size=10
    )
    fields.update(changes)
    return pgjobs.QueueJob(**fields)


def tick_in_thread(engine: Engine, worker: pgjobs.QueueJob) -> tuple[threading.Thread, dict]:
    out: dict[str, Any] = {}

    def run() -> None:
        with pgjobs.Runner(engine) as runner:
            out["result"] = runner.tick(worker, force=True)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def rows(engine: Engine, query: str) -> list[tuple[Any, ...]]:
    with engine.begin() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(query)]


def waiting_for_lock(engine: Engine, pid: int) -> bool:
    with engine.begin() as conn:
        return bool(
            conn.execute(
                text("select wait_event_type = 'Lock' from pg_stat_activity where pid = :p"),
                {"p": pid},
            ).scalar()
        )


def test_item_parent_locked_first_a_users_delete_waits(
    engine: Engine, small_writes: list[bool]
) -> None:
    """The claim holds the item's parent FOR KEY SHARE before anything is
    written: a user's delete of it, begun between the claim and the write,
    waits for the tick's commit, and then cascades."""
    pause = Pause()
    worker = job(pause)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [1])
    thread, out = tick_in_thread(engine, worker)
    assert pause.there.wait(WAIT)
    user = engine.connect()
    pid = user.execute(text("select pg_backend_pid()")).scalar()
    deleted = threading.Thread(
        target=lambda: (user.execute(text("delete from parent where id = 1")), user.commit())
    )
    deleted.start()
    try:
        for _ in range(3000):  # bounded: the delete reaches its lock wait
            if waiting_for_lock(engine, int(pid)):
                break
        assert waiting_for_lock(engine, int(pid))
    finally:
        pause.go.set()
        thread.join(WAIT)
        deleted.join(WAIT)
        user.close()
    result = out["result"]
    assert result.outcome == "ran" and result.items == 1
    assert small_writes == [True]
    assert result.stats.inserted == 2
    assert rows(engine, "select count(*) from derived") == [(0,)]  # the cascade after the commit


def test_a_parent_a_user_holds_defers_the_rows_and_nothing_waits(
    engine: Engine, small_writes: list[bool]
) -> None:
    """Between the claim and the write a user takes a (non-item) parent FOR
    UPDATE: that parent is skipped by SKIP LOCKED, its rows are deferred,
    the item stays queued; the user's lock was never waited for."""
    pause = Pause()
    worker = job(pause)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [1])
    thread, out = tick_in_thread(engine, worker)
    assert pause.there.wait(WAIT)
    user = engine.connect()
    user.execute(text("select from cat where id = 2 for update"))
    try:
        pause.go.set()
        thread.join(WAIT)
        assert not thread.is_alive()
    finally:
        user.rollback()
        user.close()
    result = out["result"]
    assert small_writes == [True]
    assert result.outcome == "ran"
    assert result.items == 0 and result.detail["kept"] == 1 and result.detail["rows_deferred"] == 1
    assert rows(engine, "select parent_id, bucket from derived") == [(1, 1)]  # cat 1's row
    assert rows(engine, "select key::text from pgjobs.queue") == [("[1]",)]
    with pgjobs.Runner(engine) as runner:  # the lock given back: the next tick finishes it
        again = runner.tick(worker, force=True)
    assert again.items == 1 and again.stats.inserted == 1 and again.stats.unchanged == 1
    assert rows(engine, "select count(*) from pgjobs.queue") == [(0,)]


def test_rows_of_a_vanished_parent_are_skipped_and_counted(
    engine: Engine, small_writes: list[bool]
) -> None:
    """A parent deleted (and committed) between the claim and the write:
    its rows are skipped, counted, and the item is done."""
    pause = Pause()
    worker = job(pause)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [2])
    thread, out = tick_in_thread(engine, worker)
    assert pause.there.wait(WAIT)
    with engine.begin() as conn:
        conn.execute(text("delete from cat where id = 2"))
    pause.go.set()
    thread.join(WAIT)
    result = out["result"]
    assert small_writes == [True]
    assert result.items == 1
    assert result.stats.skipped_missing_parent == 1 and result.stats.inserted == 1
    assert rows(engine, "select parent_id, bucket, cat_id from derived") == [(2, 1, 1)]
    assert rows(engine, "select count(*) from pgjobs.queue") == [(0,)]


def test_an_item_parent_gone_drops_the_item(engine: Engine, small_writes: list[bool]) -> None:
    worker = job()
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [3, 4])
        conn.execute(text("delete from parent where id = 3"))
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(worker, force=True)
    assert small_writes == [True]
    assert result.items == 1 and result.detail["parent_gone"] == 1
    assert rows(engine, "select distinct parent_id from derived") == [(4,)]
    assert rows(engine, "select count(*) from pgjobs.queue") == [(0,)]


def test_a_failing_item_is_isolated_without_taking_its_batch_down(
    engine: Engine, small_writes: list[bool]
) -> None:
    worker = job()
    with engine.begin() as conn:
        conn.execute(text("update parent set fail = true where id = 2"))
        pgjobs.enqueue(conn, worker, [1, 2, 3])
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(worker, force=True)
    assert result.outcome == "ran"
    assert result.items == 2 and result.failed_items == 1
    assert True in small_writes  # the items that do not fail, in one statement each half
    assert rows(engine, "select distinct parent_id from derived order by 1") == [(1,), (3,)]
    queue = rows(engine, "select key::text, attempts, last_error from pgjobs.queue")
    assert len(queue) == 1 and queue[0][:2] == ("[2]", 1)
    assert "division by zero" in queue[0][2] and "22012" in queue[0][2]


def test_flow_marks_the_items_it_wrote(engine: Engine, small_writes: list[bool]) -> None:
    worker = job(flow=True)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [1, 4])
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(worker, force=True)
    assert small_writes == [True] and result.items == 2
    marks = rows(
        engine, "select target, key::text, xid::text::bigint > 0 from pgjobs.mark order by 2"
    )
    assert marks == [("public.derived", "[1]", True), ("public.derived", "[4]", True)]


def test_after_sees_the_keys_table_and_the_stats(engine: Engine, small_writes: list[bool]) -> None:
    seen: list[Any] = []

    def after(conn: Any, keys: Any, stats: Any) -> None:
        table = [
            tuple(r) for r in conn.execute(text("select parent_id from pgjobs_keys order by 1"))
        ]
        seen.append((list(keys), table, stats))

    worker = job(after=after)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, worker, [4, 2])
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(worker, force=True)
    assert small_writes == [True]
    assert seen == [([(2,), (4,)], [(2,), (4,)], result.stats)]
    assert result.stats.inserted == 4


def test_each_item_once_beside_another_worker(engine: Engine, small_writes: list[bool]) -> None:
    """A worker paused between its claim and its write holds its items: a
    second worker, ticking meanwhile, takes the others, never the same."""
    pause = Pause()
    paused = job(pause, batch_size=2, workers=2, flow=True)
    other_keys: list[Any] = []

    def other_compute(conn: Any, keys: Any) -> str:
        other_keys.append(list(keys))
        return COMPUTE

    other = paused.replace(compute=other_compute)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, paused, [1, 2, 3, 4])
    thread, out = tick_in_thread(engine, paused)
    assert pause.there.wait(WAIT)
    with pgjobs.Runner(engine) as runner:
        beside = runner.tick(other, force=True)
    pause.go.set()
    thread.join(WAIT)
    assert out["result"].items == 2 and beside.items == 2
    taken = [k for batch in (*pause.keys, *other_keys) for (k,) in batch]
    assert sorted(taken) == [1, 2, 3, 4]
    assert small_writes == [True, True]
    assert rows(engine, "select count(*) from derived") == [(8,)]


def test_a_keys_table_dropped_under_the_worker_is_made_again(db_url: str, engine: Engine) -> None:
    """The worker remembers, per session, that its keys table fits; a table
    dropped behind its back fails that claim, which is rolled back, and
    the table made again: the item is processed all the same."""
    one = create_engine(db_url, pool_size=1, max_overflow=0)
    worker = job()
    try:
        with pgjobs.Runner(one) as runner:
            with one.begin() as conn:
                pgjobs.enqueue(conn, worker, [1])
            assert runner.tick(worker, force=True).items == 1
            with one.begin() as conn:  # the same session: the pool holds one
                conn.exec_driver_sql("drop table pg_temp.pgjobs_keys")
                pgjobs.enqueue(conn, worker, [2])
            result = runner.tick(worker, force=True)
        assert result.outcome == "ran" and result.items == 1 and result.stats.inserted == 2
    finally:
        one.dispose()


PARTITIONED = """
create table item (id int primary key);
create table scored (item_id int not null references item on delete cascade,
                     n int not null, v int not null, primary key (item_id, n))
    partition by range (item_id);
create table scored_low partition of scored for values from (0) to (100);
create table scored_high partition of scored for values from (100) to (200);
insert into item values (1), (101);
insert into scored values (1, 1, 1), (101, 1, 1);
"""


@pytest.mark.parametrize("small", [False, True], ids=["as-is", "small-path-forced"])
def test_a_partitioned_target_keeps_the_rows_of_other_items(
    db_url: str, monkeypatch: pytest.MonkeyPatch, small: bool
) -> None:
    # Item 1's rows all go (its new rows are none). Item 101's row sits in
    # another partition at the same row version (ctid): matched by ctid
    # alone, the one statement deleted it too. A partitioned target takes
    # the general writer; forced onto the small path, its delete matches
    # by key as well.
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(PARTITIONED)
            pos = conn.exec_driver_sql(
                "select (select ctid from scored_low) = (select ctid from scored_high)"
            ).scalar()
        assert pos, "both rows at one row version: the case under test"
        runner = pgjobs.Runner(engine)
        runner.install()
        wrote: list[bool] = []
        if small:
            monkeypatch.setattr(pgjobs.worker.tick, "small_enough", lambda t, keys: True)

        def spy(*args: Any, **kwargs: Any) -> Any:
            result = WRITE_SMALL(*args, **kwargs)
            wrote.append(result is not None)
            return result

        monkeypatch.setattr(pgjobs.worker.tick, "write_small", spy)
        job = pgjobs.QueueJob(
            name="scores",
            target="scored",
            scope="item_id",
            compute="select item_id, n, v from scored where false and item_id = any(:keys)",
            every="1h",
        )
        with engine.begin() as conn:
            pgjobs.enqueue(conn, "scores", [1])
        result = runner.tick(job, force=True)
        runner.close()
        assert result.outcome == "ran", result.error
        assert result.stats.deleted == 1
        assert wrote == ([True] if small else [])
        with engine.connect() as conn:
            rows = conn.execute(text("select item_id, n, v from scored order by 1")).all()
        assert [tuple(r) for r in rows] == [(101, 1, 1)]
    finally:
        engine.dispose()


def test_each_scope_columns_keys_and_a_percent_sign_on_the_small_path(
    db_url: str, small_writes: list[bool]
) -> None:
    """The small path reads ``:keys_<column>`` from the keys table inside
    its statement (no parameter): each column's own values, and the
    compute's ``%`` operator left as it is."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "create table src (a int, b text, v int);"
                " insert into src select a, b, v from generate_series(1, 3) a,"
                " unnest(array['x', 'y']) b, generate_series(1, 7) v;"
                " create table out2 (a int, b text, r int, n int, primary key (a, b, r))"
            )
        pgjobs.Runner(engine).install()
        worker = pgjobs.QueueJob(
            name="two",
            target="out2",
            scope=["a", "b"],
            compute=(
                "select a, b, v % 3 as r, count(*)::int as n from src"
                " where (a, b) in (select * from unnest(cast(:keys_a as int[]), cast(:keys_b as text[]))) and a = any(:keys)"
                " group by a, b, v % 3"
            ),
            batch_size=10,
        )
        with engine.begin() as conn:
            pgjobs.enqueue(conn, worker, [(1, "x"), (3, "y")])
        with pgjobs.Runner(engine) as runner:
            result = runner.tick(worker, force=True)
        assert small_writes == [True]
        assert result.items == 2 and result.stats.inserted == 6, result
        got = rows(engine, "select a, b, r, n from out2 order by 1, 2, 3")
        # v % 3 over v = 1..7: residue 0 twice (3, 6), 1 three times, 2 twice
        assert got == [
            (a, b, r, n) for a, b in ((1, "x"), (3, "y")) for r, n in enumerate((2, 3, 2))
        ]
    finally:
        engine.dispose()


def test_a_compute_that_wants_its_keys_as_psycopg_types_them_takes_them_as_parameters(
    db_url: str, small_writes: list[bool]
) -> None:
    """Keys read from the keys table inside the statement are typed as the
    scope's columns (``int[]`` here); as parameters, psycopg types small
    integers ``int2[]``. This compute calls a function of ``int2[]`` only,
    so the statement fails (42883, "function ... does not exist"): the first
    batch is written by the general writer, and the small path takes the
    keys as parameters from then on."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "create function only_int2(k int2[]) returns int2[] language sql as 'select k';"
                " create table counted (id int primary key, n int not null)"
            )
        pgjobs.Runner(engine).install()
        worker = pgjobs.QueueJob(
            name="int2",
            target="counted",
            scope="id",
            compute="select k as id, 1 as n from unnest(only_int2(:keys)) as k",
            batch_size=10,
        )
        with pgjobs.Runner(engine) as runner:
            for key in (1, 2, 3):
                with engine.begin() as conn:
                    pgjobs.enqueue(conn, worker, [key])
                result = runner.tick(worker, force=True)
                assert result.outcome == "ran" and result.items == 1, result
        assert small_writes == [False, True, True]
        assert rows(engine, "select id, n from counted order by 1") == [(1, 1), (2, 1), (3, 1)]
    finally:
        engine.dispose()
