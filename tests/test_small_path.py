"""The small-batch path against the session tables' path (hypothesis, real
PostgreSQL): for random item sets, with item parents and other parents
deleted, parents held ``FOR UPDATE`` by a user, failing items and a
recompute of the group (flow) that computed before the user's changes and
writes after the worker's ticks, both paths must leave the same table,
the same ``DiffStats``, the same queue state and the same flow marks.

Two databases, one per path (``SMALL_KEYS = 0`` sends every batch to the
session tables' path), reset for each example; each example is scripted
the same way on both: the recompute is held between its compute and its
write by an event, the user's locks by an open transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

import pgjobs
import pgjobs.worker.small
import pgjobs.worker.tick
from pgjobs.testing import fresh_database

#: the worker's small-path write, as it is (the test counts its calls)
WRITE_SMALL = pgjobs.worker.tick.write_small
ITEMS = range(1, 9)
CATS = range(1, 4)
WAIT = 30.0

SCHEMA = """
create table parent (id int primary key, fail bool not null default false);
create table cat (id int primary key);
create table source (
    parent_id int not null references parent on delete cascade,
    bucket int not null,
    cat_id int not null,
    val int not null
);
create table derived (
    parent_id int not null references parent on delete cascade,
    bucket int not null,
    cat_id int references cat on delete cascade,
    total bigint not null,
    primary key (parent_id, bucket)
);
"""

# a failing item's compute divides by zero (22012: the item's fault, not the run's)
DERIVE = """
select s.parent_id, s.bucket, min(s.cat_id) as cat_id,
       sum(s.val) / (case when p.fail then 0 else 1 end) as total
from source s join parent p on p.id = s.parent_id
"""
COMPUTE_ITEMS = DERIVE + " where s.parent_id = any(:keys) group by s.parent_id, s.bucket, p.fail"
COMPUTE_ALL = DERIVE + " where not p.fail group by s.parent_id, s.bucket, p.fail"

source_st = st.lists(
    st.tuples(
        st.sampled_from(list(ITEMS)),
        st.integers(0, 3),
        st.sampled_from(list(CATS)),
        st.integers(0, 3),
    ),
    max_size=20,
)


@dataclass(frozen=True)
class Case:
    before: list[tuple[int, int, int, int]]  # source rows the recompute computes from
    after: list[tuple[int, int, int, int]]  # source rows once the user changed them
    stale: list[tuple[int, int, int, int]]  # derived rows before anything ran
    enqueued: frozenset[int]
    gone_items: frozenset[int]
    gone_cats: frozenset[int]
    held_items: frozenset[int]
    held_cats: frozenset[int]
    failing: frozenset[int]
    batch: int


case_st = st.builds(
    Case,
    before=source_st,
    after=source_st,
    stale=st.lists(
        st.tuples(
            st.sampled_from(list(ITEMS)),
            st.integers(0, 3),
            st.sampled_from(list(CATS)),
            st.integers(0, 9),
        ),
        max_size=10,
        unique_by=lambda r: (r[0], r[1]),
    ),
    enqueued=st.frozensets(st.sampled_from(list(ITEMS)), min_size=1),
    gone_items=st.frozensets(st.sampled_from(list(ITEMS)), max_size=2),
    gone_cats=st.frozensets(st.sampled_from(list(CATS)), max_size=1),
    held_items=st.frozensets(st.sampled_from(list(ITEMS)), max_size=2),
    held_cats=st.frozensets(st.sampled_from(list(CATS)), max_size=1),
    failing=st.frozensets(st.sampled_from(list(ITEMS)), max_size=2),
    batch=st.sampled_from([1, 3, 10]),
)


class Side:
    """One database, its jobs, and the path it takes."""

    def __init__(self, url: str, small: bool) -> None:
        self.engine = create_engine(url)
        self.small = small
        with self.engine.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        pgjobs.Runner(self.engine).install()
        self.runner = pgjobs.Runner(self.engine)
        self.recompute_runner = pgjobs.Runner(self.engine)
        self.small_writes = 0

    def jobs(self, batch: int, computed: threading.Event, go: threading.Event) -> tuple[Any, Any]:
        def compute_all(conn: Any) -> list[tuple[Any, ...]]:
            rows = [tuple(r) for r in conn.execute(text(COMPUTE_ALL))]
            computed.set()
            assert go.wait(WAIT)
            return rows

        recompute = pgjobs.RecomputeJob(
            name="r", group="g", target="derived", compute=compute_all, worker_scope=("parent_id",)
        )
        worker = pgjobs.QueueJob(
            name="w",
            group="g",
            target="derived",
            scope="parent_id",
            compute=COMPUTE_ITEMS,
            batch_size=batch,
            max_attempts=2,
        )
        return recompute, worker

    def reset(self, case: Case) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(
                "truncate derived, source, parent, cat, pgjobs.queue, pgjobs.mark, pgjobs.job_state"
            )
            conn.execute(
                text("insert into parent (id) select unnest(cast(:ids as int[]))"),
                {"ids": list(ITEMS)},
            )
            conn.execute(
                text("insert into cat (id) select unnest(cast(:ids as int[]))"), {"ids": list(CATS)}
            )
            for row in case.before:
                conn.execute(
                    text("insert into source values (:p, :b, :c, :v)"),
                    dict(zip("pbcv", row, strict=True)),
                )
            for row in case.stale:
                conn.execute(
                    text("insert into derived values (:p, :b, :c, :v)"),
                    dict(zip("pbcv", row, strict=True)),
                )

    def run(self, case: Case, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        """The scripted example; what it left, before and after the user's
        locks were given back."""
        monkeypatch.setattr(pgjobs.worker.small, "SMALL_KEYS", 100 if self.small else 0)
        self.reset(case)
        computed, go = threading.Event(), threading.Event()
        recompute, worker = self.jobs(case.batch, computed, go)
        outcome: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: outcome.setdefault(
                "r", self.recompute_runner.tick(recompute, force=True)
            )
        )
        thread.start()
        try:
            assert computed.wait(WAIT)
            with self.engine.begin() as conn:  # the user's changes, enqueued with them
                conn.exec_driver_sql("delete from source")
                for row in case.after:
                    conn.execute(
                        text("insert into source values (:p, :b, :c, :v)"),
                        dict(zip("pbcv", row, strict=True)),
                    )
                conn.execute(
                    text("update parent set fail = id = any(:f)"), {"f": sorted(case.failing)}
                )
                pgjobs.enqueue(conn, worker, sorted(case.enqueued))
            with self.engine.begin() as conn:
                conn.execute(
                    text("delete from parent where id = any(:g)"), {"g": sorted(case.gone_items)}
                )
                conn.execute(
                    text("delete from cat where id = any(:g)"), {"g": sorted(case.gone_cats)}
                )
            user = self.engine.connect()
            trans = user.begin()
            user.execute(
                text("select from parent where id = any(:h) for update"),
                {"h": sorted(case.held_items)},
            )
            user.execute(
                text("select from cat where id = any(:h) for update"), {"h": sorted(case.held_cats)}
            )
            try:
                held = self.drain(worker)
            finally:
                trans.rollback()
                user.close()
            go.set()
            thread.join(WAIT)
            assert not thread.is_alive()
            assert outcome["r"].outcome == "ran", outcome["r"]
            held["after the recompute"] = self.state()
            free = self.drain(worker)
        finally:
            go.set()
            thread.join(WAIT)
        return {"held": held, "free": free}

    def drain(self, worker: Any) -> dict[str, Any]:
        """Tick until a tick takes nothing (at most 20): the ticks' sums and
        the state they left."""
        stats = pgjobs.DiffStats()
        seen: list[tuple[Any, ...]] = []
        for _ in range(20):
            result = self.runner.tick(worker, force=True)
            assert result.outcome in ("ran", "idle"), result
            if result.outcome == "idle":
                break
            stats = stats + result.stats
            detail = result.detail
            seen.append(
                (
                    result.items,
                    result.failed_items,
                    detail["parent_gone"],
                    detail["deferred"],
                    detail["kept"],
                    detail["rows_deferred"],
                    detail["dead"],
                )
            )
            if not (result.items or result.failed_items or detail["parent_gone"]):
                break  # what is left waits for a user's lock, or backs off
        return {"stats": stats, "ticks": seen, "state": self.state()}

    def state(self) -> dict[str, Any]:
        with self.engine.begin() as conn:
            return {
                "derived": conn.exec_driver_sql(
                    "select * from derived order by parent_id, bucket"
                ).all(),
                "queue": conn.exec_driver_sql(
                    "select key::text, attempts, dead_at is not null, last_error"
                    " from pgjobs.queue order by key"
                ).all(),
                "marks": conn.exec_driver_sql(
                    "select target, key::text from pgjobs.mark order by 1, 2"
                ).all(),
            }


@pytest.fixture(scope="module")
def sides(pg_server: str) -> Iterator[tuple[Side, Side]]:
    with fresh_database(pg_server) as small_url, fresh_database(pg_server) as general_url:
        small, general = Side(small_url, True), Side(general_url, False)
        try:
            yield small, general
        finally:
            small.engine.dispose()
            general.engine.dispose()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=case_st)
def test_small_path_leaves_what_the_general_path_leaves(
    sides: tuple[Side, Side], case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    small, general = sides
    wrote_small: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = WRITE_SMALL(*args, **kwargs)
        wrote_small.append(result is not None)
        return result

    monkeypatch.setattr(pgjobs.worker.tick, "write_small", counted)
    expected = general.run(case, monkeypatch)
    assert not any(wrote_small)  # the general side never took the small path
    got = small.run(case, monkeypatch)
    assert got == expected
    # the small side took its path whenever a batch had no failing item
    if set(case.enqueued) - case.gone_items - case.held_items - case.failing:
        assert any(wrote_small)
