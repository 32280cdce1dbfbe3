"""What makes a small diff cheap, checked for correctness on real PostgreSQL:
session temp tables (kept per connection, emptied per call, recreated when a
rollback took them away), session staging, the process-wide reflection
cache (invalidated by any DDL that changes the definition) and the keyed
read of a small scope.
"""

from __future__ import annotations

import pytest
from psycopg import sql
from sqlalchemy import create_engine

import pgjobs
from pgjobs.diff import Scope, write_diff
from pgjobs.staging import stage
from pgjobs.target import prefetch_fingerprint, reflect_target
from pgjobs.testing import run_sql

SCHEMA = """
create table parent (id int primary key);
create table derived (
    parent_id int not null references parent on delete cascade,
    n int not null,
    v int,
    primary key (parent_id, n)
);
insert into parent select generate_series(1, 10);
"""


def rows(engine):
    with engine.connect() as conn:
        return [tuple(r) for r in conn.exec_driver_sql("select * from derived order by 1, 2")]


def keys_table(pg, keys):
    pg.execute("create temp table if not exists items (parent_id int) on commit delete rows")
    pg.execute("delete from items")
    pg.execute("insert into items select unnest(%s::int[])", (list(keys),))


def scoped_write(conn, new_rows, keys):
    """One scoped diff, staged in the session stage table."""
    pg = conn.connection.driver_connection
    keys_table(pg, keys)
    target = reflect_target(conn, "derived")
    staged = stage(conn, target, new_rows, session=True)
    scope = Scope(columns=("parent_id",), keys=sql.Identifier("items"), rows=len(keys))
    return write_diff(conn, target, staged, scope=scope, wait_busy=False)


def test_two_scoped_diffs_in_one_transaction_reuse_the_session_tables(engine):
    run_sql(engine, SCHEMA)
    settings = (
        "select current_setting('jit'), current_setting('enable_hashjoin'),"
        " current_setting('enable_mergejoin')"
    )
    with engine.connect() as conn, conn.begin():
        before = conn.exec_driver_sql(settings).one()
        first = scoped_write(conn, [(1, 1, 10), (1, 2, 20)], [1])
        # the second call must not see the first call's difference or stage
        second = scoped_write(conn, [(2, 1, 30)], [2])
        third = scoped_write(conn, [(1, 1, 11)], [1])
        # the planner settings the writer changes for a while are given back
        assert conn.exec_driver_sql(settings).one() == before
    assert first.stats == pgjobs.DiffStats(inserted=2)
    assert second.stats == pgjobs.DiffStats(inserted=1)
    assert third.stats == pgjobs.DiffStats(updated=1, deleted=1)
    assert rows(engine) == [(1, 1, 11), (2, 1, 30)]


def test_session_tables_come_back_after_a_rollback_took_them(engine):
    run_sql(engine, SCHEMA)
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        with conn.begin():
            # created inside a savepoint that is rolled back: gone again
            pg.execute("savepoint s")
            scoped_write(conn, [(1, 1, 1)], [1])
            pg.execute("rollback to savepoint s")
            result = scoped_write(conn, [(1, 1, 2)], [1])
            assert result.stats == pgjobs.DiffStats(inserted=1)
        with conn.begin():
            scoped_write(conn, [(3, 1, 3)], [3])
            conn.rollback()
        with conn.begin():
            result = scoped_write(conn, [(3, 1, 4)], [3])
        assert result.stats == pgjobs.DiffStats(inserted=1)
        with conn.begin():
            # ON COMMIT DELETE ROWS: nothing of an earlier transaction is left
            left = pg.execute(
                "select count(*) from pg_class where relnamespace = pg_my_temp_schema()"
                " and relkind = 'r' and relname ~ '^pgjobs_s'"
            ).fetchone()
            assert left is not None and left[0] > 0
    assert rows(engine) == [(1, 1, 2), (3, 1, 4)]


def test_session_stage_refuses_repeated_and_null_keys(engine):
    run_sql(engine, SCHEMA)
    with engine.connect() as conn:
        with conn.begin():
            target = reflect_target(conn, "derived")
        with conn.begin(), pytest.raises(pgjobs.JobError, match="repeat the diff key"):
            stage(conn, target, [(1, 1, 1), (1, 1, 2)], session=True)
        with conn.begin(), pytest.raises(pgjobs.JobError, match="NULL in the diff key"):
            stage(conn, target, "select 1 as parent_id, null::int as n, 1 as v", session=True)
        with conn.begin():
            staged = stage(conn, target, "select 1 as parent_id, 1 as n, 1 as v", session=True)
            assert staged.rows == 1
            again = stage(conn, target, [(2, 1, 1), (2, 2, 1)], session=True)
            assert again.table == staged.table and again.rows == 2
            pg = conn.connection.driver_connection
            count = pg.execute(sql.SQL("select count(*) from {}").format(again.table)).fetchone()
            assert count == (2,)


def test_session_stage_of_sql_text_binds_escapes_and_refuses_repeated_keys(engine):
    # SQL text runs compiled on the driver connection: binds, a literal %,
    # an escaped colon and an untyped NULL behave as through SQLAlchemy, and
    # the key's errors are the same JobErrors.
    run_sql(engine, SCHEMA)
    with engine.connect() as conn:
        with conn.begin():
            target = reflect_target(conn, "derived")
        with conn.begin(), pytest.raises(pgjobs.JobError, match="repeat the diff key"):
            stage(conn, target, "select 1 as parent_id, 1 as n union all select 1, 1", session=True)
        with conn.begin():
            staged = stage(
                conn,
                target,
                "select k as parent_id, k % 3 as n, null as v from unnest(:keys) as k"
                " where 'a\\:b' = concat('a', chr(58), 'b')",
                params={"keys": [4, 5], "unused": 1},
                session=True,
            )
            assert staged.columns == ("parent_id", "n", "v") and staged.rows == 2
            pg = conn.connection.driver_connection
            got = pg.execute(sql.SQL("select * from {} order by 1").format(staged.table)).fetchall()
            assert got == [(4, 1, None), (5, 2, None)]


def test_reflection_is_cached_until_the_definition_changes(engine):
    run_sql(engine, SCHEMA)
    with engine.connect() as conn:
        with conn.begin():
            first = reflect_target(conn, "derived")
            assert reflect_target(conn, "derived") is first
        # a new column
        run_sql(engine, "alter table derived add column w int")
        with conn.begin():
            second = reflect_target(conn, "derived")
        assert second is not first and "w" in second.columns
        # a new foreign key (a new parent to lock)
        run_sql(
            engine,
            "create table other (id int primary key); insert into other values (1);"
            " alter table derived add column other_id int references other",
        )
        with conn.begin():
            third = reflect_target(conn, "derived")
        assert [p.table for p in third.parents] == [("public", "other"), ("public", "parent")]
        # a referenced table renamed
        run_sql(engine, "alter table other rename to other2")
        with conn.begin():
            fourth = reflect_target(conn, "derived")
        assert ("public", "other2") in [p.table for p in fourth.parents]
        # a new index
        run_sql(engine, "create index derived_v on derived (v)")
        with conn.begin():
            fifth = reflect_target(conn, "derived")
        assert fifth.indexed(("v",)) and not fourth.indexed(("v",))
        # dropped and created again
        run_sql(
            engine,
            "drop table derived; create table derived (parent_id int primary key, x int)",
        )
        with conn.begin():
            sixth = reflect_target(conn, "derived")
        assert sixth.oid != first.oid and sixth.key == ("parent_id",) and sixth.parents == ()
        # statistics (written in place) keep the cache
        run_sql(engine, "analyze derived")
        with conn.begin():
            assert reflect_target(conn, "derived") is sixth
    # The cache is the process's: another connection (a new pool, here) finds
    # the same reflection, and sees a change made meanwhile.
    other_engine = create_engine(engine.url)
    try:
        with other_engine.connect() as other, other.begin():
            assert reflect_target(other, "derived") is sixth
        run_sql(engine, "alter table derived add column y int")
        with other_engine.connect() as other, other.begin():
            seventh = reflect_target(other, "derived")
        assert seventh is not sixth and "y" in seventh.columns
    finally:
        other_engine.dispose()


def test_a_fingerprint_sent_ahead_in_a_pipeline_validates_the_cache_the_same_way(engine):
    # The runner sends the catalog check with the group lock (one round trip)
    # and the job's reflection reads it.
    run_sql(engine, SCHEMA)

    def reflect_with_prefetch(conn):
        prefetched = prefetch_fingerprint(conn, "derived")
        assert prefetched is not None
        return reflect_target(conn, "derived", prefetched=prefetched)

    with engine.connect() as conn:
        with conn.begin():
            first = reflect_target(conn, "derived")
            assert reflect_with_prefetch(conn) is first
        run_sql(engine, "alter table derived add column w int")
        with conn.begin():
            second = reflect_with_prefetch(conn)
        assert second is not first and "w" in second.columns
        with conn.begin():
            assert reflect_with_prefetch(conn) is second
            assert prefetch_fingerprint(conn, "no.such.table") is None  # _resolve names the error


def test_a_small_scope_is_read_by_key_and_a_large_one_by_join(engine):
    run_sql(engine, SCHEMA)
    run_sql(
        engine,
        "insert into derived select p, n, p * n from generate_series(1, 10) p, "
        "generate_series(1, 3) n",
    )
    new = [(p, n, p * n + (1 if p == 2 else 0)) for p in (2, 3) for n in (1, 2, 3)]
    # rows=None (unknown) plans a join, rows=2 reads by key: the same result
    for hint in (None, 2):
        with engine.connect() as conn, conn.begin():
            pg = conn.connection.driver_connection
            keys_table(pg, [2, 3])
            target = reflect_target(conn, "derived")
            staged = stage(conn, target, new, session=True)
            scope = Scope(columns=("parent_id",), keys=sql.Identifier("items"), rows=hint)
            result = write_diff(conn, target, staged, scope=scope)
            assert result.stats == pgjobs.DiffStats(updated=3, unchanged=3)
            conn.rollback()


def test_scope_rows_must_be_a_count():
    with pytest.raises(pgjobs.ConfigError, match=r"Scope\.rows"):
        Scope(columns=("a",), keys=sql.Identifier("k"), rows=-1)


def session_indexes(pg) -> list[str]:
    """Indexes on this session's pgjobs session tables."""
    return [
        r[0]
        for r in pg.execute(
            "select i.relname from pg_index x join pg_class i on i.oid = x.indexrelid"
            " join pg_class t on t.oid = x.indrelid"
            " where t.relnamespace = pg_my_temp_schema() and t.relname ~ '^pgjobs_s'"
        ).fetchall()
    ]


def test_session_tables_keep_no_index_and_name_a_repeated_key(engine):
    """PostgreSQL rebuilds every index of a session's ON COMMIT DELETE ROWS
    tables at each commit: the session tables carry none between calls; a
    repeated key is still refused, naming it."""
    run_sql(engine, SCHEMA)
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        with conn.begin():
            scoped_write(conn, [(1, 1, 1), (1, 2, 2)], [1])
            assert session_indexes(pg) == []
        with conn.begin(), pytest.raises(pgjobs.JobError, match=r"\(2,1\) appears more than once"):
            scoped_write(conn, [(2, 1, 1), (2, 1, 2)], [2])
    assert rows(engine) == [(1, 1, 1), (1, 2, 2)]


def test_many_rows_of_gone_parents_in_a_session_diff(engine):
    """Over _BAD_INDEX_ROWS rows left out (their parent is gone): the bad
    table is indexed for the writes and the index dropped after them."""
    run_sql(engine, SCHEMA + "insert into parent select generate_series(11, 300);")
    keys = list(range(1, 301))
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        with conn.begin():
            scoped_write(conn, [(k, 1, 0) for k in keys], keys)
        # 200 parents vanish between compute and write: simulated by deleting
        # them in this transaction before the diff
        with conn.begin():
            pg.execute("delete from parent where id > 100")
            result = scoped_write(conn, [(k, n, 1) for k in keys for n in (1, 2)], keys)
            assert session_indexes(pg) == []
    assert result.stats.skipped_missing_parent == 400
    assert result.stats.updated == 100 and result.stats.inserted == 100
    assert rows(engine) == [(k, n, 1) for k in range(1, 101) for n in (1, 2)]


def test_staging_analyzes_with_a_small_sample_and_gives_the_setting_back(engine):
    """pgjobs' temp tables are analyzed at statistics target 10; the caller's
    own default_statistics_target is what it was afterwards."""
    run_sql(engine, SCHEMA)
    with engine.connect() as conn, conn.begin():
        conn.exec_driver_sql("set local default_statistics_target = 77")
        target = reflect_target(conn, "derived")
        staged = stage(
            conn, target, "select p as parent_id, 1 as n, p as v from generate_series(1, 2000) p"
        )
        pg = conn.connection.driver_connection
        histogram = pg.execute(
            "select cardinality(histogram_bounds::text::text[]) from pg_stats"
            " where tablename = %s and attname = 'parent_id'",
            (staged.name,),
        ).fetchone()
        setting = conn.exec_driver_sql("show default_statistics_target").scalar()
    assert histogram == (11,)  # target 10: ten buckets
    assert setting == "77"
