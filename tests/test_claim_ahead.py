"""The claim sent ahead: a queue tick's claim travels with the runner's lock
round trip (``pgjobs.worker.claim.claim_ahead``), on speculation, composed
from the target as last reflected. Each way it can turn out is here, on a
real database: adopted; undone because the target changed meanwhile;
failed (its keys table gone) and done the usual way; never run when the
lock is busy (only workers with flow send it, whose lock stops the round
trip); rolled back with the transaction when the job is paused. In each,
every item is processed once and the queue says so.

The small write sent after it (``claim._write_ahead``), for the keys the
claim loads: taken as the batch's write (a one-item tick in two round
trips); undone when the claim took more keys than it reads; failed with
a failing item, which is then isolated as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

import pgjobs
import pgjobs.worker.claim
import pgjobs.worker.tick
from pgjobs import _wire
from pgjobs.locking import lock_name
from pgjobs.results import Outcome

SCHEMA = """
create table parent (id int primary key);
create table source (parent_id int not null references parent on delete cascade,
                     n int not null, val int not null);
create table derived (parent_id int not null references parent on delete cascade,
                      n int not null, total bigint not null, primary key (parent_id, n));
insert into parent select generate_series(1, 20);
insert into source select p, n, p * 10 + n from generate_series(1, 20) p, generate_series(1, 2) n;
"""

COMPUTE = (
    "select parent_id, n, sum(val) as total from source where parent_id = any(:keys)"
    " group by parent_id, n"
)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url, pool_size=1, max_overflow=0)  # one session: its keys table
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.Runner(engine).install()
    yield engine
    engine.dispose()


@pytest.fixture
def adopted(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each tick that had a claim sent ahead: was it adopted (False: it
    failed and was undone, or the target changed under it)?"""
    seen: list[bool] = []
    real = pgjobs.worker.tick.claim_adopted

    def spy(t: Any, ahead: Any) -> Any:
        result = real(t, ahead)
        if ahead is not None:
            seen.append(result is not None)
        return result

    monkeypatch.setattr(pgjobs.worker.tick, "claim_adopted", spy)
    undo = pgjobs.worker.tick.ahead_undone

    def undone(conn: Any, job: Any, ahead: Any) -> Any:
        out = undo(conn, job, ahead)
        if ahead is not None and out is None:  # it failed, and was undone
            seen.append(False)
        return out

    monkeypatch.setattr(pgjobs.worker.tick, "ahead_undone", undone)
    return seen


def job(**changes: Any) -> pgjobs.QueueJob:
    fields: dict[str, Any] = dict(
        name="w", target="derived", scope=("parent_id",), compute=COMPUTE, every="1h"
    )
    fields.update(changes)
    return pgjobs.QueueJob(**fields)


def enqueue(engine: Engine, keys: list[int], name: str = "w") -> None:
    with engine.begin() as conn:
        pgjobs.enqueue(conn, name, keys)


def queued(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("select key, attempts from pgjobs.queue order by key")).all()
    return [(str(r[0]), int(r[1])) for r in rows]


def derived(engine: Engine) -> dict[tuple[int, int], int]:
    with engine.connect() as conn:
        rows = conn.execute(text("select parent_id, n, total from derived")).all()
    return {(r[0], r[1]): r[2] for r in rows}


def expected(keys: list[int]) -> dict[tuple[int, int], int]:
    return {(p, n): p * 10 + n for p in keys for n in (1, 2)}


def ran_one(engine: Engine, runner: pgjobs.Runner, w: pgjobs.QueueJob, key: int) -> None:
    """Enqueue ``key`` and run a woken tick, which processes it."""
    enqueue(engine, [key], w.name)
    result = runner.tick(w, woken=True)
    assert result.outcome is Outcome.RAN and result.items == 1, result


def test_a_claim_sent_with_the_lock_is_adopted_after_the_first_tick(
    engine: Engine, adopted: list[bool]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        for key in (1, 2, 3):
            enqueue(engine, [key])
            result = runner.tick(w, woken=True)
            assert result.outcome is Outcome.RAN and result.items == 1, result
    # the first tick knew neither the target nor the session's keys table
    assert adopted == [True, True]
    assert derived(engine) == expected([1, 2, 3]) and queued(engine) == []


def test_a_target_changed_since_its_reflection_undoes_the_claim_sent_ahead(
    engine: Engine, adopted: list[bool]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)
        # an index added: the verified reflection is another object than the
        # one the claim was composed from
        with engine.begin() as conn:
            conn.execute(text("create index derived_total on derived (total)"))
        enqueue(engine, [2])
        result = runner.tick(w, woken=True)
    assert result.outcome is Outcome.RAN and result.items == 1, result
    assert adopted == [False]
    assert derived(engine) == expected([1, 2]) and queued(engine) == []


def test_a_claim_sent_ahead_that_fails_leaves_the_tick_to_claim_as_usual(
    engine: Engine, adopted: list[bool]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)
        # the session's keys table dropped under the worker (its one connection)
        with engine.connect() as conn:
            conn.exec_driver_sql("drop table pg_temp.pgjobs_keys")
            conn.commit()
        ran_one(engine, runner, w, 2)
        enqueue(engine, [3])
        assert runner.tick(w, woken=True).items == 1  # made again, known again
    assert adopted == [False, True]
    assert derived(engine) == expected([1, 2, 3]) and queued(engine) == []


def test_a_claim_is_sent_ahead_only_behind_a_lock_that_stops_the_round_trip(
    engine: Engine, db_url: str, adopted: list[bool]
) -> None:
    """A flow worker's lock is waited for, briefly: not granted, it fails and
    the round trip stops before the claim (the entry queued as it was, no
    lock of its parent kept). A worker without flow tries its lock, which
    answers false and stops nothing: it sends no claim ahead."""
    w = job(lock_timeout="200ms")
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)
        enqueue(engine, [2])
        with psycopg.connect(url) as other:
            other.execute(
                "select pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (lock_name("pgjobs", w.group or w.name),),
            )
            assert runner.tick(w, woken=True).outcome is Outcome.BUSY
            assert queued(engine) == [("[2]", 0)]
            locked = other.execute("select id from parent where id = 2 for update nowait")
            assert locked.fetchall() == [(2,)]
            other.rollback()
        assert runner.tick(w, woken=True).items == 1
        plain = job(name="plain", flow=False)
        for key in (3, 4):
            enqueue(engine, [key], "plain")
            assert runner.tick(plain, woken=True).items == 1
    assert adopted == [True]  # the flow worker's tick after the busy one; none for "plain"
    assert derived(engine) == expected([1, 2, 3, 4]) and queued(engine) == []


def test_a_claim_sent_ahead_is_rolled_back_when_the_job_is_paused(
    engine: Engine, adopted: list[bool]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)
        enqueue(engine, [2])
        with engine.begin() as conn:
            conn.execute(text("update pgjobs.job_state set paused_at = now() where job = 'w'"))
        assert runner.tick(w, woken=True).outcome is Outcome.PAUSED
        # the claim ran ahead of the state's answer and was undone with the
        # transaction: the entry is queued as it was
        assert queued(engine) == [("[2]", 0)]
        with engine.begin() as conn:
            conn.execute(text("update pgjobs.job_state set paused_at = null where job = 'w'"))
        result = runner.tick(w, woken=True)
    assert result.outcome is Outcome.RAN and result.items == 1
    assert adopted == [True]
    assert derived(engine) == expected([1, 2]) and queued(engine) == []


def test_a_change_that_fails_the_claim_sent_ahead_and_changes_the_target_is_reflected_after_undo(
    engine: Engine, adopted: list[bool]
) -> None:
    """The parent's key column renamed: the claim sent ahead (composed with
    the old name) fails, and the target's catalog check says reflect again.
    The failed claim is rolled back first, so that the reflection runs in
    a transaction that can (it failed as aborted, and the run with it)."""
    w = job()
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)
        with engine.begin() as conn:
            conn.execute(text("alter table parent rename column id to pid"))
        ran_one(engine, runner, w, 2)
        ran_one(engine, runner, w, 3)
    assert adopted == [False, True]  # failed and undone; then one composed anew, adopted
    assert derived(engine) == expected([1, 2, 3]) and queued(engine) == []


# -- the small write sent with the claim ---------------------------------------------------
@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """For each tick whose claim had the small write sent with it: "taken"
    (the batch's write), "undone" (rolled back to the claim's savepoint),
    or "empty" (nothing claimed: it wrote nothing)."""
    seen: list[str] = []
    real = pgjobs.worker.claim.adopt_write

    def spy(t: Any, composed: Any, write: Any) -> None:
        real(t, composed, write)
        if not t.preloaded[1]:
            seen.append("empty")
        else:
            seen.append("taken" if t.ahead_write is not None else "undone")

    monkeypatch.setattr(pgjobs.worker.claim, "adopt_write", spy)
    return seen


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that counts the round trips pgjobs sends (append a 0 to start
    a new count)."""
    counts = [0]
    real = _wire.round_trip

    def counted(raw: Any, statements: Any, **kwargs: Any) -> Any:
        counts[-1] += 1
        return real(raw, statements, **kwargs)

    monkeypatch.setattr(_wire, "round_trip", counted)
    return counts


def test_the_small_write_goes_with_the_claim_a_tick_in_two_round_trips(
    engine: Engine, writes: list[str], round_trips: list[int]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        ran_one(engine, runner, w, 1)  # reflects, makes the keys table, composes the write
        ran_one(engine, runner, w, 2)  # the claim goes ahead, the write with it
        enqueue(engine, [3])
        round_trips.append(0)
        result = runner.tick(w, woken=True)
        assert round_trips[-1] == 2  # the lock, state, claim and write; the commit
        assert result.outcome is Outcome.RAN and result.items == 1
        assert result.stats.inserted == 2 and result.stats.changed == 2, result.stats
    assert writes == ["taken", "taken"]
    assert derived(engine) == expected([1, 2, 3]) and queued(engine) == []


def test_a_claim_of_more_keys_than_the_write_sent_ahead_reads_undoes_it(
    engine: Engine, writes: list[str]
) -> None:
    """The write reads at most SMALL_KEYS keys (its LIMIT): after a trickle's
    one-item claims, a burst of fifteen is claimed with it, and it is rolled
    back to the claim's savepoint; the general writer writes all fifteen,
    each row once (its stats count them once)."""
    w = job()
    with pgjobs.Runner(engine) as runner:
        for key in (1, 2, 3):
            ran_one(engine, runner, w, key)
        burst = list(range(4, 19))
        enqueue(engine, burst)
        result = runner.tick(w, woken=True)
        assert result.outcome is Outcome.RAN and result.items == 15, result
        assert result.stats.inserted == 30 and result.stats.unchanged == 0, result.stats
        # the next claim follows a claim of fifteen: no write goes ahead of it
        ran_one(engine, runner, w, 19)
        ran_one(engine, runner, w, 20)
    # ticks 2 and 3 took theirs; the burst's undone; 19 after the burst sent
    # none; 20 took it again
    assert writes == ["taken", "taken", "undone", "taken"]
    assert derived(engine) == expected(list(range(1, 21))) and queued(engine) == []


def test_an_empty_claim_leaves_the_write_sent_ahead_as_it_is(
    engine: Engine, writes: list[str]
) -> None:
    w = job()
    with pgjobs.Runner(engine) as runner:
        for key in (1, 2):
            ran_one(engine, runner, w, key)
        assert runner.tick(w, woken=True).outcome is Outcome.IDLE
        ran_one(engine, runner, w, 3)
    assert writes == ["taken", "empty", "taken"]
    assert derived(engine) == expected([1, 2, 3]) and queued(engine) == []


def test_a_failing_item_fails_the_write_sent_ahead_and_is_isolated_as_usual(
    engine: Engine, writes: list[str], adopted: list[bool]
) -> None:
    w = job()
    with engine.begin() as conn:  # parent 5's totals break it
        conn.execute(text("alter table derived add constraint small check (total < 100)"))
    with pgjobs.Runner(engine) as runner:
        for key in (1, 2):
            ran_one(engine, runner, w, key)
        with engine.begin() as conn:
            conn.execute(text("update source set val = 1000 where parent_id = 5"))
        enqueue(engine, [5])
        result = runner.tick(w, woken=True)
        # the claim and its write undone together; claimed again, the item
        # fails alone and is backed off
        assert result.outcome is Outcome.RAN and result.items == 0, result
        assert result.failed_items == 1
        assert queued(engine) == [("[5]", 1)]
        ran_one(engine, runner, w, 3)
    assert adopted == [True, False, True]
    # tick 2's; the failed one never got there, and 3's went without one: a
    # small write that failed is composed anew at the next tick
    assert writes == ["taken"]
    assert derived(engine) == expected([1, 2, 3])
