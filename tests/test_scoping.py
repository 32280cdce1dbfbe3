"""The shared plan check (:mod:`pgjobs.scoping`): a compute restricted to
some keys, and where PostgreSQL puts the restriction, on a real server."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import text

from pgjobs import ScopeError
from pgjobs._pg import execute
from pgjobs.errors import ConfigError, JobError
from pgjobs.scoping import KeyList, KeyRange, KeysTable, check_plan, numbered, restrict

# -- no database -----------------------------------------------------------------------


def test_numbered_turns_psycopg_binds_into_postgres_parameters():
    assert numbered("select %(a)s, %(b)s, %(a)s, '5%%'") == ("select $1, $2, $1, '5%'", ["a", "b"])


def test_restrict_range_of_one_column():
    r = restrict("select 1 as id", ("id",), KeyRange(low=(10,), high=(20,)))
    assert r.statement.as_string(None) == (
        'select * from (select 1 as id) as "pgjobs_q" where "pgjobs_q"."id" >= %(pgjobs_lo_0)s'
        ' and "pgjobs_q"."id" < %(pgjobs_hi_0)s'
    )
    assert r.params == {"pgjobs_lo_0": 10, "pgjobs_hi_0": 20}
    assert r.marks == {"pgjobs_lo_0", "pgjobs_hi_0"}


def test_restrict_open_ends():
    r = restrict("select 1 as id", ("id",), KeyRange(low=None, high=(5,)))
    assert r.params == {"pgjobs_hi_0": 5}
    everything = restrict("select 1 as id", ("id",), KeyRange())
    assert everything.statement.as_string(None).endswith("where true")


def test_restrict_range_of_two_columns_bounds_the_first_alone_too():
    r = restrict("q", ("a", "b"), KeyRange(low=(1, 2), high=(3, 4)))
    where = r.statement.as_string(None).split(" where ", 1)[1]
    assert where == (
        '"pgjobs_q"."a" >= %(pgjobs_lo_0)s'
        ' and ("pgjobs_q"."a", "pgjobs_q"."b") >= (%(pgjobs_lo_0)s, %(pgjobs_lo_1)s)'
        ' and "pgjobs_q"."a" <= %(pgjobs_hi_0)s'
        ' and ("pgjobs_q"."a", "pgjobs_q"."b") < (%(pgjobs_hi_0)s, %(pgjobs_hi_1)s)'
    )


@pytest.mark.parametrize(
    ("scope", "how", "message"),
    [
        ((), KeyRange(), "scope: expected column names"),
        (("a",), KeyRange(low=(1, 2)), "a bound of 2 values for a scope of 1"),
        (("a", "b"), KeyList(keys=((1,),)), "keys of 1 values for a scope of 2"),
    ],
)
def test_restrict_refuses_a_mismatch(scope, how, message):
    with pytest.raises(ConfigError, match=message):
        restrict("q", scope, how)


def test_bad_restrictions():
    with pytest.raises(ConfigError, match=r"KeyRange.low: expected a tuple"):
        KeyRange(low=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="same columns"):
        KeyList(keys=((1,), (1, 2)))
    with pytest.raises(ConfigError, match=r"KeysTable\.table"):
        KeysTable(table=" ")


def test_scope_error_is_a_job_error():
    assert issubclass(ScopeError, JobError)


# -- a real server ---------------------------------------------------------------------
GROUPED = (
    "select p.id, count(*) as n, sum(c.v) as s from p join c on c.parent_id = p.id group by p.id"
)
UNINDEXED = "select p.id, count(*) as n from p join b on b.parent_id = p.id group by p.id"
BY_NAME = "select max(p.id) as id, p.name from p group by p.name"
MATERIALIZED = f"with x as materialized ({GROUPED}) select * from x"


@pytest.fixture
def tables(engine):
    with engine.begin() as conn:
        conn.execute(
            text(
                "create table p (id int primary key, name text);"
                " create table c (id int primary key, parent_id int references p, v int);"
                " create index on c (parent_id);"
                " create table b (id int primary key, parent_id int, v int);"
                " insert into p select g, 'n' || g from generate_series(1, 2000) g;"
                " insert into c select g, 1 + g % 2000, g from generate_series(1, 10000) g;"
                " insert into b select g, 1 + g % 2000, g from generate_series(1, 10000) g;"
                " analyze"
            )
        )
    return engine


HOWS = [
    KeyRange(low=(10,), high=(20,)),
    KeyList(keys=((10,), (11,))),
    KeysTable(table="pg_temp.keys"),
]


def _keys_table(conn):
    execute(conn, "create temp table keys (id int) on commit drop")
    execute(conn, "insert into keys values (10), (11)")


@pytest.mark.parametrize("how", HOWS, ids=["range", "list", "table"])
def test_a_restriction_that_reaches_the_rows_passes_and_computes_the_slice(tables, how):
    with tables.begin() as conn:
        _keys_table(conn)
        r = restrict(GROUPED, ("id",), how)
        report = check_plan(conn, r, job_name="totals", scope=("id",))
        assert report.reached and report.warnings == ()
        assert all(" on public.p" in node or " on public.c" in node for node in report.reached)
        got = execute(conn, r.statement, r.params).fetchall()
        ids = [row[0] for row in got]
        assert ids and set(ids) <= set(range(10, 20))
        assert sorted(got) == sorted(
            execute(conn, f"select * from ({GROUPED}) q where id = any(%s)", [ids]).fetchall()
        )
        # nothing of the check stays in the transaction: no statement, no setting
        prepared = execute(conn, "select count(*) from pg_prepared_statements").fetchone()
        assert prepared == (0,)
        assert execute(conn, "show plan_cache_mode").fetchone() == ("auto",)


@pytest.mark.parametrize("how", HOWS, ids=["range", "list", "table"])
@pytest.mark.parametrize(
    ("query", "node"),
    [(BY_NAME, "HashAggregate (Group Key: p.name)"), (MATERIALIZED, "CTE Scan on x")],
    ids=["aggregate", "with"],
)
def test_a_restriction_left_above_the_work_is_refused(tables, how, query, node):
    with tables.begin() as conn:
        _keys_table(conn)
        r = restrict(query, ("id",), how)
        with pytest.raises(ScopeError) as caught:
            check_plan(conn, r, job_name="totals", scope=("id",))
        message = str(caught.value)
        assert message.startswith("job 'totals': the restriction to a slice of the scope ('id',)")
        assert f"it stays at {node}" in message
        assert "$1" in message  # the condition as the plan shows it
        assert "SQL: " + " ".join(query.split())[:60] in message
        # the transaction is usable afterwards
        assert execute(conn, "select 1").fetchone() == (1,)


def test_a_large_table_read_whole_is_reported_with_the_index_that_helps(tables, caplog):
    with tables.begin() as conn:
        r = restrict(UNINDEXED, ("id",), KeyRange(low=(10,), high=(20,)))
        with caplog.at_level(logging.WARNING, logger="pgjobs.scoping"):
            report = check_plan(conn, r, job_name="totals", scope=("id",), large_rows=5000)
    (warning,) = report.warnings
    assert warning.startswith(
        'job \'totals\': each slice reads all of "public"."b" (about 10,000 rows, a Seq Scan'
    )
    assert (
        'an index on "public"."b" (parent_id) would let a slice read only its own rows' in warning
    )
    assert [r.getMessage() for r in caplog.records] == [f"pgjobs: {warning}"]
    # under the threshold: nothing said
    with tables.begin() as conn:
        assert check_plan(conn, r, job_name="totals", scope=("id",)).warnings == ()


def test_a_scope_column_read_whole_names_its_own_index(tables):
    with tables.begin() as conn:
        r = restrict(
            "select parent_id, id, v from b", ("parent_id",), KeyRange(low=(3,), high=(4,))
        )
        (warning,) = check_plan(
            conn, r, job_name="rows", scope=("parent_id",), large_rows=5000
        ).warnings
    assert "to find the slice's rows" in warning
    assert 'an index on "public"."b" (parent_id)' in warning


def test_two_scope_columns_over_a_join_reach_both_tables(tables):
    query = "select p.id, c.id as cid, c.v from p join c on c.parent_id = p.id"
    with tables.begin() as conn:
        r = restrict(query, ("id", "cid"), KeyRange(low=(5, 0), high=(7, 0)))
        report = check_plan(conn, r, job_name="rows", scope=("id", "cid"))
        assert any("on public.p" in n for n in report.reached)
        got = execute(conn, r.statement, r.params).fetchall()
        assert sorted(got) == sorted(
            execute(conn, f"select * from ({query}) q where id in (5, 6)").fetchall()
        )
        listed = restrict(query, ("id", "cid"), KeyList(keys=((5, 4), (5, 999))))
        check_plan(conn, listed, job_name="rows", scope=("id", "cid"))
        assert execute(conn, listed.statement, listed.params).fetchall() == [(5, 4, 4)]


def test_percent_signs_and_binds_of_the_users_text(tables):
    with tables.begin() as conn:
        r = restrict(
            "select id, name || '%%' as t from p where id > %(floor)s",
            ("id",),
            KeyRange(low=(1,), high=(4,)),
        )
        check_plan(conn, r, job_name="pct", scope=("id",))
        rows = execute(conn, r.statement, {**r.params, "floor": 1}).fetchall()
        assert rows == [(2, "n2%"), (3, "n3%")]
