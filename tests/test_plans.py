"""Plan guards (as PgQueuer's test_query_plan_regression): on a queue of
1 M entries and a ``job_state`` of 10k jobs, the statements that a real
queue tick and the status read send use the indexes they were built for.

The statements are the real ones: a cursor class and a spy on the round
trips (tests/statements.py) record every statement (and its parameters)
that pgjobs sends on the connection, and each one that
reads ``queue``, ``run`` or ``job_state`` is explained afterwards on the same
session (its session tables still there), with the same parameters.

What each must use, and why (docs/DESIGN.md, "The queue and its worker"):

* has_work: ``queue_seq_idx`` (job, seq) where dead_at is null and
  attempts = 0, from the cursor, and ``queue_retry_idx`` (job, not_before)
  where dead_at is null and attempts > 0: one probe each, however many wait
  (migration 015);
* the claim: ``queue_seq_idx`` read in number order from the cursor and
  stopped after batch_size entries (no sort of every due entry), the due
  retries by ``queue_retry_idx``, each entry then locked by its ctid (a TID
  scan: one version, where the primary key walks every version of the key
  that a held horizon keeps);
* the status read (``pgjobs status``, the page): each job's latest run by
  one probe of ``run_job_started_idx`` (job, started_at desc); its last
  check (a run ``checked``, rare among its runs) by one probe of
  ``run_checked_idx`` (job, started_at desc) where outcome = 'checked'
  (migration 012), not a walk back through the job's runs.

No plan over ``queue`` or ``run`` may read the table whole (Seq Scan).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import statements
from psycopg import sql
from schema_tools import libpq
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.readmodel import read_status

ENTRIES = 1_000_000
JOBS = 10_000
RUNS_PER_JOB = 5

FILL = f"""
create table item (id int primary key, v int not null);
create table derived (id int primary key, v int not null);
create table derived_fk (id int primary key references item (id), v int not null);
insert into item select g, g from generate_series(1, 1000) g;
-- the worker's 600k entries (due, then 10k not yet due, then 1k dead), and
-- 400k of 99 other jobs, in one statement
-- (the retrying and the dead have failed attempts; every entry its number)
insert into pgjobs.queue (job, key, enqueued_at, not_before, dead_at, attempts, seq)
select case when g <= 600000 then 'worker' else 'other-' || (g % 99) end,
       jsonb_build_array(g), now() - interval '1 hour',
       case when g between 580001 and 590000 then now() + interval '1 hour'
            else now() - interval '1 minute' end,
       case when g > 599000 and g <= 600000 then now() end,
       case when g between 580001 and 600000 then 1 else 0 end, g
from generate_series(1, {ENTRIES}) g;
select setval('pgjobs.queue_seq', {ENTRIES});
insert into pgjobs.job_state (job, next_attempt_at, failures, last_success_at)
select 'job-' || g, now() + interval '1 minute', 0, now() from generate_series(1, {JOBS}) g;
insert into pgjobs.run (job, outcome, started_at, finished_at)
select 'job-' || (g % {JOBS} + 1), 'ran', now() - g * interval '1 s', now() - g * interval '1 s'
from generate_series(1, {JOBS * RUNS_PER_JOB}) g;
-- a drift check, older than the job's runs, for one job in ten
insert into pgjobs.run (job, outcome, started_at, finished_at)
select 'job-' || g, 'checked', now() - interval '1 day', now() - interval '1 day'
from generate_series(1, {JOBS}, 10) g;
analyze pgjobs.job_state; analyze pgjobs.run;
"""
INDEXES = (
    "select indexname, indexdef from pg_indexes where schemaname = 'pgjobs'"
    " and tablename = 'queue' order by 1"
)


@pytest.fixture(autouse=True)
def _recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # the round trips pgjobs sends straight through libpq, on engines of Recording
    def seen(raw: psycopg.Connection[Any], text: str, params: Any) -> None:
        if raw.cursor_factory is Recording:
            Recording.seen.append((text, params))

    statements.spy(monkeypatch, seen, execute=False)


class Recording(psycopg.Cursor[Any]):
    """Records each statement executed through it (a class attribute: the
    connection's cursors come and go)."""

    seen: list[tuple[str, Any]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else query.as_string(self)
        Recording.seen.append((text, params))
        return super().execute(query, params, **kwargs)


@pytest.fixture(scope="module")
def big(pg_server: str) -> Iterator[Engine]:
    from pgjobs.testing import fresh_database

    with fresh_database(pg_server, prefix="pgjobs_plans") as url:
        pgjobs.install(url)
        started = time.monotonic()
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            # The queue's indexes built after the rows, not row by row: the
            # fill takes a third of the time. The same indexes, checked.
            indexes = conn.execute(INDEXES).fetchall()
            conn.execute(
                "set maintenance_work_mem = '256MB'; set synchronous_commit = off;"
                " alter table pgjobs.queue drop constraint queue_pkey;"
                " drop index pgjobs.queue_seq_idx, pgjobs.queue_retry_idx"
            )
            conn.execute(FILL.encode())
            conn.execute(
                "alter table pgjobs.queue add constraint queue_pkey primary key (job, key)"
            )
            for name, definition in indexes:
                if name != "queue_pkey":
                    conn.execute(definition)
            assert conn.execute(INDEXES).fetchall() == indexes
            conn.execute("analyze pgjobs.queue")
        print(f"filled {ENTRIES:,} entries in {time.monotonic() - started:.1f} s")
        engine = create_engine(url, connect_args={"cursor_factory": Recording})
        try:
            yield engine
        finally:
            engine.dispose()


def plans(
    conn: Any, tables: tuple[str, ...], starting: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """EXPLAIN (FORMAT JSON) of each recorded statement that names one of
    ``tables`` (or begins with ``starting``), on ``conn``'s session, in a
    transaction rolled back."""
    raw = conn.connection.driver_connection
    out = []
    recorded, Recording.seen = Recording.seen, []
    for text, params in recorded:
        words = text.lower()
        if starting is not None:
            if not words.lstrip().startswith(starting):
                continue
        elif not any(f'"pgjobs"."{t}"' in words for t in tables):
            continue
        if not words.lstrip().startswith(("select", "with", "insert", "update", "delete")):
            continue
        with raw.transaction(force_rollback=True):
            row = raw.execute(
                sql.SQL("explain (format json) ") + sql.SQL(text),  # type: ignore[arg-type]
                params,
            ).fetchone()
        assert row is not None
        out.append((text, row[0][0]["Plan"]))
    Recording.seen = []
    return out


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from nodes(child)


def scans(plan: dict[str, Any], table: str) -> list[tuple[str, str | None]]:
    """(node type, index) of each scan of ``table`` in ``plan``."""
    return [
        (n["Node Type"], n.get("Index Name"))
        for n in nodes(plan)
        if n.get("Relation Name") == table
    ]


def _reads(plan: dict[str, Any], table: str) -> bool:
    """Does ``plan`` read ``table`` itself, not through a limit or a CTE (an
    InitPlan) that hands on only a batch?"""
    for child in plan.get("Plans", ()):
        if child["Node Type"] == "Limit" or child.get("Parent Relationship") == "InitPlan":
            continue
        if child.get("Relation Name") == table or _reads(child, table):
            return True
    return False


def show(found: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"{t[:200]}\n{json.dumps(p)[:2000]}" for t, p in found)


@pytest.mark.parametrize(
    ("name", "target"),
    [("worker", "derived"), ("other-1", "derived_fk")],
    ids=["claim-alone", "claim-with-parents"],
)
def test_the_queue_ticks_statements_use_their_indexes(big: Engine, name: str, target: str) -> None:
    # A target without parents is claimed by one statement; one with a
    # foreign key by the claim that locks the parents first.
    job = pgjobs.QueueJob(
        name=name,
        target=target,
        scope="id",
        compute="select id, v from item where id = any(:keys)",
        every="1h",
        batch_size=100,
    )
    runner = pgjobs.Runner(big)
    with big.connect() as conn:
        runner.store.ensure(conn)
        Recording.seen = []
        result = runner.tick_on(conn, job)
        assert result.outcome == "ran" and result.detail["claimed"] == 100, result
        found = plans(conn, ("queue",))
    assert found, "no statement of the tick read the queue"
    for text, plan in found:
        assert ("Seq Scan", None) not in scans(plan, "queue"), show([(text, plan)])

    has_work = [(t, p) for t, p in found if "seq > %s order by seq limit 1" in t.lower()]
    assert has_work, show(found)
    for text, plan in has_work:
        used = {index for _, index in scans(plan, "queue")}
        assert used == {"queue_seq_idx", "queue_retry_idx"}, show([(text, plan)])

    claims = [(t, p) for t, p in found if "skip locked" in t.lower()]
    assert claims, show(found)
    for text, plan in claims:
        found_scans = scans(plan, "queue")
        used = [index for _, index in found_scans]
        # the due retries, the entries past the cursor in number order
        # (stopping at the batch), then the entries claimed locked by their
        # ctid (a TID scan)
        assert "queue_seq_idx" in used and "queue_retry_idx" in used, show([(text, plan)])
        assert ("Tid Scan", None) in found_scans, show([(text, plan)])
        allowed = {
            ("Index Scan", "queue_seq_idx"),
            ("Index Scan", "queue_retry_idx"),
            ("Tid Scan", None),
        }
        assert set(found_scans) <= allowed, show([(text, plan)])
        # no sort over a read of the queue's entries (the claim's order
        # is the index's, and it stops at the batch); what is sorted past a
        # limit or from a CTE is a batch (the item parents, to be locked in
        # key order; the claim's own rows)
        sorted_queue = [n for n in nodes(plan) if n["Node Type"] == "Sort" and _reads(n, "queue")]
        assert not sorted_queue, show([(text, plan)])


_PLACEHOLDER = re.compile(r"%%|%\((\w+)\)s|%s")


def generic_plan(raw: psycopg.Connection[Any], text: str, params: Any) -> dict[str, Any]:
    """The plan PostgreSQL keeps for ``text`` once it plans it generically
    (from a statement's sixth run, when its custom plans look no cheaper;
    ``plan_cache_mode = force_generic_plan`` here): PREPAREd with ``$n``
    parameters, then EXPLAIN EXECUTE with ``params`` as literals."""
    numbers: dict[str, int] = {}
    values: list[Any] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name is None:  # positional
            values.append(params[len(values)])
            return f"${len(values)}"
        if name not in numbers:
            values.append(params[name])
            numbers[name] = len(values)
        return f"${numbers[name]}"

    prepared = _PLACEHOLDER.sub(number, text)
    with raw.transaction(force_rollback=True):
        raw.execute("set local plan_cache_mode = force_generic_plan")
        raw.execute(f"prepare pgjobs_generic as {prepared}")  # type: ignore[arg-type]
        try:
            (types,) = raw.execute(
                "select parameter_types::text[] from pg_prepared_statements"
                " where name = 'pgjobs_generic'"
            ).fetchone()  # type: ignore[misc]
            args = ", ".join(f"%s::{t}" for t in types)
            row = (
                psycopg.ClientCursor(raw)
                .execute(
                    f"explain (format json) execute pgjobs_generic({args})",  # type: ignore[arg-type]
                    values,
                )
                .fetchone()
            )
        finally:
            raw.execute("deallocate pgjobs_generic")
    assert row is not None
    return row[0][0]["Plan"]  # type: ignore[no-any-return]


def test_the_claim_keeps_to_its_indexes_and_the_delete_is_planned_each_time(db_url: str) -> None:
    # pgjobs prepares its statements, and from their sixth run PostgreSQL
    # may keep one plan made without the parameters' values. On a queue
    # whose statistics say it is nearly empty (as a queue that keeps up
    # is), two such plans walked the job's whole index, every version a
    # held horizon keeps in it (10 ms a tick each after 100 s of a held
    # horizon at 800 keys/s, auto_explain in benchmarks/horizon_bench.py):
    # the entries read again by number, planned as a walk of queue_seq_idx
    # by ``job`` joined with the numbers, and the delete of the claimed
    # entries, planned as a walk of the primary key by ``job`` with the
    # ctids as a filter. The claim's read is now a probe a number whatever
    # the plan; the delete by ctid alone is a sequential scan while the
    # queue fits a page and a TID scan after, so it is never prepared.
    # Here the queue as such a horizon leaves it: 20,000 entries processed
    # while another session's snapshot is held (dead, not removable), one
    # waiting when it was vacuumed and analyzed (a queue that keeps up: the
    # statistics say the job has a row), 69 enqueued since. With 70 waiting
    # when analyzed, the flattened join was planned well: the statistics
    # decide. (The 1 M-entry queue above, its entries all live, gets the
    # good plans anyway.)
    pgjobs.install(db_url)
    holder = psycopg.connect(libpq(db_url))
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    with contextlib.ExitStack() as stack:
        stack.enter_context(holder)
        holder.execute("select 1").fetchone()  # the snapshot, held to the end
        _the_claim_and_the_delete_under_a_held_horizon(db_url)


def _the_claim_and_the_delete_under_a_held_horizon(db_url: str) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as setup:
        setup.execute(
            "create table item (id int primary key, v int not null);"
            " create table derived (id int primary key, v int not null);"
            " insert into item select g, g from generate_series(1, 100) g"
        )
        pgjobs.enqueue(setup, "worker", list(range(1000, 21000)))
        setup.execute("delete from pgjobs.queue")
        pgjobs.enqueue(setup, "worker", [1])
        setup.execute("vacuum analyze pgjobs.queue")
        pgjobs.enqueue(setup, "worker", list(range(2, 71)))
        # what the planner sees: many pages, few entries
        (pages, entries) = setup.execute(
            "select relpages, reltuples from pg_class where oid = 'pgjobs.queue'::regclass"
        ).fetchone()  # type: ignore[misc]
        assert pages >= 100 and entries < 1000, (pages, entries)
    job = pgjobs.QueueJob(
        name="worker",
        target="derived",
        scope=("id",),
        compute="select id, v from item where id = any(:keys)",
        every="1h",
        batch_size=10,
    )
    engine = create_engine(db_url, connect_args={"cursor_factory": Recording})
    runner = pgjobs.Runner(engine)
    with contextlib.ExitStack() as stack:
        stack.callback(engine.dispose)
        conn = stack.enter_context(engine.connect())
        runner.store.ensure(conn)
        Recording.seen = []
        for _ in range(7):  # past PostgreSQL's five custom plans
            result = runner.tick_on(conn, job)
            assert result.outcome == "ran" and result.detail["claimed"] == 10, result
        recorded, Recording.seen = Recording.seen, []
        raw = conn.connection.driver_connection
        prepared = [text for (text,) in raw.execute("select statement from pg_prepared_statements")]
        raw.rollback()
        claims = [(t, p) for t, p in recorded if "skip locked" in t.lower()]
        deletes = [t for t, _ in recorded if t.startswith('delete from "pgjobs"."queue"')]
        assert len(deletes) == 7 and claims, [t[:80] for t, _ in recorded]
        assert any("skip locked" in text for text in prepared), prepared
        assert not [t for t in prepared if t.startswith('delete from "pgjobs"."queue"')], prepared
        for text, params in claims[-1:]:
            plan = generic_plan(raw, text, params)
            found = scans(plan, "queue")
            assert ("Seq Scan", None) not in found, show([(text, plan)])
            # the queue's indexes (the cursor's sample reads catalogs of its own)
            used = {
                n["Index Name"] for n in nodes(plan) if n.get("Index Name", "").startswith("queue_")
            }
            assert used == {"queue_seq_idx", "queue_retry_idx"}, show([(text, plan)])
            # every read of queue_seq_idx bounded by the entry's number: from
            # the cursor (seq > low) or one probe a number (seq = r.seq, an
            # index scan or a bitmap's)
            by_number = [
                n.get("Index Cond", "")
                for n in nodes(plan)
                if n.get("Index Name") == "queue_seq_idx"
            ]
            assert len(by_number) == 2, show([(text, plan)])
            assert all("seq" in cond for cond in by_number), show([(text, plan)])


def test_the_status_read_probes_each_jobs_latest_run(big: Engine) -> None:
    with big.connect() as conn, conn.begin():
        Recording.seen = []
        status = read_status(conn, "pgjobs")
        assert len(status.states) >= JOBS and len(status.last) >= JOBS
        found = plans(conn, ("run",))
    latest = [(text, plan) for text, plan in found if "limit 1" in text]
    assert len(latest) == 3, show(found)  # each job's last run; its last that ran; checked
    for text, plan in latest:
        run = scans(plan, "run")
        # the run log by its (job, started_at) index, never read whole: the
        # last check by the partial index of the checked runs (migration 012)
        assert run and ("Seq Scan", None) not in run, show([(text, plan)])
        used = {n["Index Name"] for n in nodes(plan) if "Index Name" in n}
        index = "run_checked_idx" if "'checked'" in text else "run_job_started_idx"
        assert used == {index}, show([(text, plan)])
        assert scans(plan, "job_state") == [("Seq Scan", None)], show([(text, plan)])


SMALL = """
create table parent (id int primary key);
create table source (parent_id int not null references parent, v int not null);
create table derived (
    parent_id int not null references parent, bucket int not null, v int not null,
    primary key (parent_id, bucket)
);
insert into parent select generate_series(1, 2000);
insert into source select p, b from generate_series(1, 2000) p, generate_series(1, 100) b;
insert into derived select parent_id, v, v from source;
analyze;
"""


def test_the_small_write_is_planned_for_its_handful_of_keys(db_url: str) -> None:
    # The keys table is never analyzed on the small path (a handful of keys:
    # an ANALYZE would cost more than the write), so the planner takes it at
    # its empty size's guess, 2,550 rows. Times the target's 100 rows a key,
    # that was a statement estimated past jit_above_cost: JIT compiled it
    # for some 120 ms, tick after tick, once autovacuum had analyzed the
    # target (a trickle's p50 went from 5 ms to 170 ms). The statement reads
    # the keys through a LIMIT of SMALL_KEYS, the most the path takes.
    from pgjobs.worker.small import SMALL_KEYS

    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(SMALL.encode())
    pgjobs.install(db_url)
    engine = create_engine(db_url, connect_args={"cursor_factory": Recording})
    job = pgjobs.QueueJob(
        name="small",
        target="derived",
        scope="parent_id",
        compute="select parent_id, v as bucket, v + 1 as v from source where parent_id = any(:keys)",
        every="1h",
    )
    try:
        runner = pgjobs.Runner(engine)
        with engine.begin() as conn:
            pgjobs.enqueue(conn, job, [7])
        with engine.connect() as conn:
            Recording.seen = []
            result = runner.tick_on(conn, job)
            assert result.outcome == "ran" and result.stats.updated == 100, result
            # the small path's statement (the general writer sends none such)
            found = plans(conn, (), starting="with k as materialized")
            limit = float(conn.exec_driver_sql("show jit_above_cost").scalar_one())
    finally:
        engine.dispose()
    assert len(found) == 1, [t[:80] for t, _ in found]
    ((_, plan),) = found
    keys = [n for n in nodes(plan) if n.get("Subplan Name") == "CTE k"]
    assert keys and keys[0]["Plan Rows"] <= SMALL_KEYS, show(found)
    assert plan["Total Cost"] < limit, show(found)


def test_the_small_write_is_planned_once(db_url: str) -> None:
    # With the batch's keys as a parameter, PostgreSQL planned the small
    # write again at each execution: its custom plans (for the one key
    # given) looked cheaper than a generic plan, so it never kept one, and
    # the planning took 1.1 ms of a one-item tick's 2.5 ms on the server.
    # The statement now reads the keys from the keys table inside it and
    # has no parameter: after psycopg prepares it, every execution runs the
    # one plan kept (pg_prepared_statements counts the plans of each kind).
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(SMALL.encode())
    pgjobs.install(db_url)
    engine = create_engine(db_url, pool_size=1, max_overflow=0)
    job = pgjobs.QueueJob(
        name="small",
        target="derived",
        scope="parent_id",
        compute="select parent_id, v as bucket, v + 1 as v from source where parent_id = any(:keys)",
        every="1h",
    )
    try:
        runner = pgjobs.Runner(engine)
        with engine.connect() as conn:
            for key in range(1, 13):  # psycopg prepares at the 6th; 7 more
                with conn.begin():
                    pgjobs.enqueue(conn, job, [key])
                result = runner.tick_on(conn, job, force=True)
                assert result.outcome == "ran" and result.stats.updated == 100, result
            prepared = conn.exec_driver_sql(
                "select generic_plans, custom_plans from pg_prepared_statements"
                " where starts_with(statement, 'with k as materialized')"
            ).all()
    finally:
        engine.dispose()
    assert len(prepared) == 1, prepared
    ((generic, custom),) = prepared
    assert custom == 0 and generic >= 6, prepared
