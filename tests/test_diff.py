"""The diff writer on real PostgreSQL: what it writes, what it counts, what it refuses.

Concurrency (parents deleted during a run, locks, the deadlock hammer) lives in
``test_diff_concurrency.py``; the property test in ``test_diff_property.py``.
"""

from __future__ import annotations

import json

import pytest
from psycopg import sql
from sqlalchemy import column, null, select, table

import pgjobs
from pgjobs.diff import Scope, write_diff
from pgjobs.errors import ConfigError
from pgjobs.staging import stage
from pgjobs.target import reflect_target
from pgjobs.testing import run_sql

SCHEMA = """
create table parent (id int primary key, name text);
create table tag (id int primary key);
create table derived (
    id int primary key,
    parent_id int not null references parent on delete cascade,
    tag_id int references tag on delete set null,
    score numeric,
    doc json
);
insert into parent select i, 'p' || i from generate_series(1, 10) i;
insert into tag select generate_series(1, 3);
"""


def setup(engine, ddl: str = SCHEMA) -> None:
    run_sql(engine, ddl)


def contents(
    engine, query: str = "select id, parent_id, tag_id, score, doc::text from derived order by id"
):
    with engine.connect() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(query)]


def tick(engine, job, **kw):
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True, **kw)
    assert result.outcome == "ran", result.error
    return result


def test_first_run_inserts_then_nothing_changes(engine):
    setup(engine)
    rows = [(i, 1 + i % 10, None, i * 1.5, {"n": i}) for i in range(1, 21)]
    job = pgjobs.RecomputeJob(name="r", target="derived", compute=lambda conn: rows)

    first = tick(engine, job)
    assert first.stats == pgjobs.DiffStats(inserted=20)
    assert contents(engine) == [
        (i, 1 + i % 10, None, pytest.approx(i * 1.5), json.dumps({"n": i})) for i in range(1, 21)
    ]

    second = tick(engine, job)
    assert second.stats == pgjobs.DiffStats(unchanged=20)


def test_insert_update_delete_counted_exactly(engine):
    setup(engine)
    run_sql(
        engine,
        "insert into derived select i, 1 + i % 10, null, i, null from generate_series(1, 10) i",
    )
    # 1-5 unchanged, 6-8 changed, 9-10 vanish, 11-12 new
    new = [(i, 1 + i % 10, None, i, None) for i in range(1, 6)]
    new += [(i, 1 + i % 10, 2, i, None) for i in range(6, 9)]
    new += [(i, 1, None, None, None) for i in (11, 12)]
    job = pgjobs.RecomputeJob(name="r", target="derived", compute=lambda conn: new)

    result = tick(engine, job)

    assert result.stats == pgjobs.DiffStats(inserted=2, updated=3, deleted=2, unchanged=5)
    assert [r[:4] for r in contents(engine)] == [(r[0], r[1], r[2], r[3]) for r in sorted(new)]
    assert result.compute_seconds > 0 and result.write_seconds > 0 and result.lock_seconds > 0


def test_sql_text_and_selectable_sources(engine):
    setup(engine)
    sql_job = pgjobs.RecomputeJob(
        name="sql",
        target="derived",
        compute="select p.id * 10 as id, p.id as parent_id, null::int as tag_id, "
        "length(p.name) as score from parent p",
        columns=("tag_id", "score"),  # derived.doc is not this job's
    )
    assert tick(engine, sql_job).stats.inserted == 10
    assert contents(engine, "select id, parent_id, score from derived order by id")[:2] == [
        (10, 1, 2),
        (20, 2, 2),
    ]

    parent = table("parent", column("id"), column("name"))
    query = select(
        (parent.c.id * 10).label("id"),
        parent.c.id.label("parent_id"),
        null().label("tag_id"),
        (parent.c.id + 0.5).label("score"),
    ).where(parent.c.id <= 5)
    sel_job = pgjobs.RecomputeJob(
        name="sel", target="derived", compute=lambda conn: query, columns=("tag_id", "score")
    )
    result = tick(engine, sel_job)
    assert result.stats == pgjobs.DiffStats(updated=5, deleted=5)
    assert contents(engine, "select id, score from derived order by id") == [
        (10 * i, pytest.approx(i + 0.5)) for i in range(1, 6)
    ]


def test_a_job_whose_rows_leave_out_a_column_it_does_not_name_fails_naming_it(engine):
    setup(engine)
    job = pgjobs.RecomputeJob(
        name="forgot",
        target="derived",
        compute="select p.id * 10 as id, p.id as parent_id, null::int as tag_id,"
        " length(p.name) as score from parent p",
    )
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True)
        assert result.outcome == "failed"
        assert "the new rows lack column(s) doc; name the columns the job maintains" in result.error
        assert contents(engine, "select count(*) from derived") == [(0,)]
        named = job.replace(columns=("tag_id", "score", "nope"))
        result = runner.tick(named, force=True)
        assert result.outcome == "failed" and "names column(s) nope" in result.error


def test_columns_left_out_keep_their_values(engine):
    setup(engine)
    run_sql(engine, "insert into derived values (1, 1, 3, 1, '[1]')")
    job = pgjobs.RecomputeJob(
        name="r",
        target="derived",
        compute=lambda conn: [{"id": 1, "parent_id": 1, "tag_id": 3, "score": 2}],
        columns=("tag_id", "score"),
    )
    assert tick(engine, job).stats == pgjobs.DiffStats(updated=1)
    assert contents(engine) == [(1, 1, 3, 2, "[1]")]


def test_scoped_diff_touches_only_its_items(engine):
    setup(engine)
    run_sql(
        engine,
        "insert into derived select i, 1 + i % 3, null, i, null from generate_series(1, 9) i",
    )
    before = contents(engine)
    with engine.connect() as conn, conn.begin():
        pg = conn.connection.driver_connection
        pg.execute("create temp table items (parent_id int) on commit drop")
        pg.execute("insert into items values (2)")
        target = reflect_target(conn, "derived")
        # parent 2 owned 1, 4, 7: keep 1 changed, drop 4 and 7, add 100
        staged = stage(
            conn,
            target,
            "select id, parent_id, tag_id, score + 1 as score from derived "
            "where parent_id = any(:keys) and id = 1 union all select 100, 2, null, 0",
            params={"keys": [2], "unused": 1},
        )
        result = write_diff(
            conn, target, staged, scope=Scope(columns=("parent_id",), keys=sql.Identifier("items"))
        )
    assert result.stats == pgjobs.DiffStats(inserted=1, updated=1, deleted=2)
    after = contents(engine)
    untouched = [r for r in before if r[1] != 2]
    assert [r for r in after if r[1] != 2] == untouched
    assert [r[:4] for r in after if r[1] == 2] == [(1, 2, None, 2), (100, 2, None, 0)]


def test_scoped_rows_outside_the_scope_are_refused(engine):
    setup(engine)
    with engine.connect() as conn, conn.begin():
        pg = conn.connection.driver_connection
        pg.execute("create temp table items (parent_id int) on commit drop")
        pg.execute("insert into items values (2)")
        target = reflect_target(conn, "derived")
        staged = stage(conn, target, [(1, 3, None, 1, None)])
        with pytest.raises(pgjobs.JobError, match="outside the scope"):
            write_diff(
                conn,
                target,
                staged,
                scope=Scope(columns=("parent_id",), keys=sql.Identifier("items")),
            )
    assert contents(engine) == []


def test_duplicate_key_fails_naming_the_key_and_writes_nothing(engine):
    setup(engine)
    run_sql(engine, "insert into derived values (1, 1, null, 1, null)")
    job = pgjobs.RecomputeJob(
        name="dup",
        target="derived",
        compute=lambda conn: [(5, 1, None, 1, None), (5, 2, None, 2, None)],
    )
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "failed"
    assert "repeat the diff key (id)" in result.error and "(id)=(5)" in result.error
    assert contents(engine) == [(1, 1, None, 1, None)]


def test_null_key_fails_clearly(engine):
    setup(engine)
    job = pgjobs.RecomputeJob(
        name="n", target="derived", compute=lambda conn: [(None, 1, None, 1, None)]
    )
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job, force=True)
    assert result.outcome == "failed"
    assert "NULL in the diff key (id)" in result.error


def test_reflection_errors_name_the_table(engine):
    setup(
        engine,
        SCHEMA
        + "create table nokey (a int, b int); create table nullable_u (a int unique, b int);"
        + "create table nouniq (a int not null, b int);"
        + "create table gen_fk (id int primary key, x int,"
        + " p int generated always as (x) stored references parent);"
        + "create view v as select 1 as id;",
    )
    with engine.connect() as conn, conn.begin():
        with pytest.raises(ConfigError, match="'missing' does not exist"):
            reflect_target(conn, "missing")
        with pytest.raises(ConfigError, match=r"public\.nokey: no primary key"):
            reflect_target(conn, "nokey")
        with pytest.raises(ConfigError, match=r"nouniq: key \('a',\): no unique index"):
            reflect_target(conn, "nouniq", key=("a",))
        with pytest.raises(ConfigError, match=r"nullable_u: key: column\(s\) a must be NOT NULL"):
            reflect_target(conn, "nullable_u", key=("a",))
        with pytest.raises(ConfigError, match="not a table"):
            reflect_target(conn, "v")
        with pytest.raises(ConfigError, match="no column"):
            reflect_target(conn, "derived", key=("nope",))
        not_unique = pgjobs.Parent(table="nouniq", columns=("parent_id",), parent_columns=("a",))
        with pytest.raises(ConfigError, match=r"nouniq\('a',\): no unique index"):
            reflect_target(conn, "derived", parents=(not_unique,))
        with pytest.raises(ConfigError, match=r"through generated column\(s\) p"):
            reflect_target(conn, "gen_fk")
        missing = pgjobs.Parent(table="nowhere", columns=("parent_id",), parent_columns=("id",))
        with pytest.raises(ConfigError, match="'nowhere' does not exist"):
            reflect_target(conn, "derived", parents=(missing,))


def test_declared_key_and_wrong_columns(engine):
    setup(
        engine, SCHEMA + "create table k2 (a int not null, b int not null, v int, unique (a, b));"
    )
    with engine.connect() as conn, conn.begin():
        t = reflect_target(conn, "k2", key=("a", "b"))
        assert t.key == ("a", "b") and t.columns == ("a", "b", "v")
        with pytest.raises(ConfigError, match="lacks column"):
            stage(conn, t, "select 1 as a, 2 as v")
        with pytest.raises(ConfigError, match="does not have"):
            stage(conn, t, [{"a": 1, "b": 2, "zzz": 3}])
        with pytest.raises(ConfigError, match="has 2 values"):
            stage(conn, t, [(1, 2)])
