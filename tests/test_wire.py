"""pgjobs' round trips straight through libpq's pipeline (pgjobs._wire): the
same answers as psycopg's cursors, prepared statements that survive what
psycopg does to its own, psycopg's BEGIN, and a failure that leaves the
statements before it answered. On a real server, one connection each."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs import _pg, _wire
from pgjobs.deadline import BoundedConnection, bound


@pytest.fixture
def raw(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://"))
    bound(conn, 10.0)  # a BoundedConnection, as every connection pgjobs uses
    assert isinstance(conn, BoundedConnection) and _wire.usable(conn)
    try:
        yield conn
    finally:
        conn.close()


def prepared(conn: psycopg.Connection[Any]) -> list[str]:
    """The session's prepared statements of pgjobs' (read without preparing one)."""
    cur = conn.cursor()
    cur.execute(
        "select statement from pg_prepared_statements where name like 'pgjobs%' order by name",
        prepare=False,
    )
    return [r[0] for r in cur.fetchall()]


def test_answers_as_psycopg_does(raw: psycopg.Connection[Any]) -> None:
    statements: list[tuple[Any, Any]] = [
        ("select %s::int as a, %s::text as b", (1, "x")),
        (sql.SQL("select {} as n, %(v)s::int[] as v").format(sql.Literal(7)), {"v": [1, 2]}),
        ("create temp table t (id int)", None),
        ("insert into t select generate_series(1, 3)", None),
        ("select 'a%%' as pct, %s::numeric as num", (1.5,)),
        ("select 1 where false", None),
    ]
    outcomes, error = _wire.round_trip(raw, statements)
    assert error is None
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    got = [(o.rowcount, o.rows, o.columns) for o in outcomes if o is not None]
    assert got == [
        (1, [(1, "x")], ("a", "b")),
        (1, [(7, [1, 2])], ("n", "v")),
        (-1, None, None),
        (3, None, None),
        (1, [("a%", 1.5)], ("pct", "num")),
        (0, [], ("?column?",)),
    ]
    raw.rollback()
    # psycopg's cursors on the same statements, for comparison
    for (statement, params), (rowcount, rows, _) in zip(statements[:2], got[:2], strict=True):
        cur = raw.execute(statement, params)
        assert (cur.rowcount, cur.fetchall()) == (rowcount, rows)


def test_a_failure_keeps_what_went_before_and_skips_the_rest(raw: psycopg.Connection[Any]) -> None:
    outcomes, error = _wire.round_trip(
        raw,
        [("select 1", None), ("select 1 / %s", (0,)), ("select 3", None)],
        commit=True,
    )
    assert isinstance(error, psycopg.errors.DivisionByZero)
    assert outcomes[0] is not None and outcomes[0].rows == [(1,)]
    assert outcomes[1:] == [None, None]
    # the COMMIT was skipped too: the transaction is there, aborted
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    raw.rollback()


def test_commit_in_the_round_trip(raw: psycopg.Connection[Any]) -> None:
    _wire.round_trip(raw, [("create table kept (id int)", None)], commit=True)
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(raw.info.dsn) as other:
        assert other.execute("select count(*) from kept").fetchone() == (0,)


def test_begin_is_psycopgs_own(raw: psycopg.Connection[Any]) -> None:
    raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    raw.read_only = True
    outcomes, error = _wire.round_trip(
        raw,
        [
            (
                "select current_setting('transaction_isolation'), current_setting(%s)",
                ("transaction_read_only",),
            )
        ],
    )
    assert error is None and outcomes[0] is not None
    assert outcomes[0].rows == [("repeatable read", "on")]
    raw.rollback()


def test_prepared_at_the_second_run_and_kept(raw: psycopg.Connection[Any]) -> None:
    statement = ("select %s::int + 1", (1,))
    for n in range(4):
        outcomes, error = _wire.round_trip(raw, [statement])
        assert error is None and outcomes[0] is not None and outcomes[0].rows == [(2,)]
        # counted once, prepared at the second, kept
        assert len(prepared(raw)) == (0 if n < 1 else 1)
    raw.rollback()
    assert prepared(raw) == ["select $1::int + 1"]


def test_never_prepared_where_psycopg_prepares_nothing(raw: psycopg.Connection[Any]) -> None:
    raw.prepare_threshold = None  # (behind a transaction pooler)
    for _ in range(8):
        _wire.round_trip(raw, [("select %s::int", (1,))])
    assert prepared(raw) == []
    raw.rollback()


def test_psycopgs_deallocate_all_is_followed(raw: psycopg.Connection[Any]) -> None:
    """psycopg sends DEALLOCATE ALL after a ROLLBACK (a rollback to a
    savepoint too) while it has statements of its own prepared: pgjobs'
    go with them, and are prepared again instead of failing (26000)."""
    raw.prepare_threshold = 0
    mine = ("select %s::int * 2", (2,))
    _wire.round_trip(raw, [mine])
    assert len(prepared(raw)) == 1
    raw.execute("select 42")  # prepared by psycopg (threshold 0)
    raw.execute("savepoint s")
    raw.execute("rollback to savepoint s")  # "ROLLBACK": psycopg deallocates all
    raw.execute("select 1")  # (its maintenance goes out before its next statement)
    assert prepared(raw) == []
    outcomes, error = _wire.round_trip(raw, [mine])
    assert error is None and outcomes[0] is not None and outcomes[0].rows == [(4,)]
    assert len(prepared(raw)) == 1
    raw.rollback()


def test_a_statement_gone_behind_pgjobs_back_is_prepared_again(
    raw: psycopg.Connection[Any],
) -> None:
    raw.prepare_threshold = 0
    mine = ("select %s::int * 3", (3,))
    _wire.round_trip(raw, [mine])
    raw.rollback()
    raw.pgconn.exec_(b"DEALLOCATE ALL")  # what psycopg does not see
    outcomes, error = _wire.round_trip(raw, [mine])
    assert error is not None and error.sqlstate == "26000" and outcomes == [None]
    raw.rollback()
    outcomes, error = _wire.round_trip(raw, [mine])
    assert error is None and outcomes[0] is not None and outcomes[0].rows == [(9,)]
    raw.rollback()


def test_a_tick_on_a_session_whose_statements_are_gone_is_interrupted_not_failed(
    db_url: str,
) -> None:
    """SQLSTATE 26000 in a tick (a DEALLOCATE ALL behind pgjobs' back): the
    run is ``interrupted`` and retried soon, no backoff, no item blamed; the
    next tick prepares again and runs."""
    engine: Engine = create_engine(db_url, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(text("create table item (id int primary key)"))
            conn.execute(text("create table derived (id int primary key references item, v int)"))
            conn.execute(text("insert into item select generate_series(1, 10)"))
        job = pgjobs.QueueJob(
            name="w",
            target="derived",
            scope="id",
            compute="select id, id * 10 as v from item where id = any(:keys)",
            every="1h",
        )

        def tick(item: int) -> Any:
            with engine.begin() as conn:
                pgjobs.enqueue(conn, job, [item])
            # woken: the lock's round trip first (no work check before it,
            # whose failure would be taken again on psycopg's path)
            return runner.tick(job, woken=True)

        with pgjobs.Runner(engine) as runner:
            runner.install()
            for item in range(1, 4):  # the statements prepared at their second run
                assert tick(item).outcome == "ran"
            with engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert prepared(raw), "the ticks prepared nothing"
                # behind psycopg's back (its rollback() would deallocate all itself)
                raw.pgconn.exec_(b"ROLLBACK")
                raw.pgconn.exec_(b"DEALLOCATE ALL")
            result = tick(8)
            assert result.outcome == "interrupted" and result.sqlstate == "26000", result
            again = runner.tick(job, woken=True)
            assert again.outcome == "ran" and again.items == 1, again
        with engine.connect() as conn:
            rows = conn.execute(text("select id, v from derived order by 1")).all()
            assert rows == [(i, 10 * i) for i in (1, 2, 3, 8)]
            failures = conn.execute(
                text("select failures from pgjobs.job_state where job = 'w'")
            ).scalar()
            assert failures == 0
    finally:
        engine.dispose()


def test_send_goes_through_the_wire(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """pgjobs' send() takes this path on its connections (not psycopg's
    cursors): what was queued and the statement, in one round trip."""
    engine = create_engine(db_url)
    seen: list[int] = []
    round_trip = _wire.round_trip

    def spy(conn: Any, statements: Any, **kwargs: Any) -> Any:
        seen.append(len(statements))
        return round_trip(conn, statements, **kwargs)

    monkeypatch.setattr(_wire, "round_trip", spy)
    try:
        with engine.connect() as conn:
            bound(conn.connection.driver_connection, 10.0)
            with conn.begin():
                _pg.later(conn, "select 1")
                (one,) = _pg.send(conn, ("select %s::int", (5,)))
        assert one.scalar() == 5 and seen == [2]
    finally:
        engine.dispose()


def test_a_statement_that_does_not_convert_sends_nothing(raw: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.ProgrammingError, match="placeholders"):
        _wire.round_trip(raw, [("create table never (id int)", None), ("select %s, %s", (1,))])
    # nothing went out (not even BEGIN), and the connection goes on
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    outcomes, error = _wire.round_trip(raw, [("select to_regclass('never') is null", None)])
    assert error is None and outcomes[0] is not None and outcomes[0].rows == [(True,)]
    raw.rollback()


def test_without_psycopgs_converter_a_queue_tick_goes_through_its_cursors(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback (psycopg without ``_queries.PostgresQuery``, or
    $PGJOBS_WIRE_FALLBACK set): the tick takes psycopg's cursors and
    pipeline, never this module's round trip, with the same outcome."""
    monkeypatch.setattr(_wire, "_PostgresQuery", None)

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("the round trip ran without psycopg's converter")

    monkeypatch.setattr(_wire, "round_trip", never)
    engine = create_engine(db_url, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(text("create table item (id int primary key)"))
            conn.execute(text("create table derived (id int primary key references item, v int)"))
            conn.execute(text("insert into item select generate_series(1, 5)"))
        job = pgjobs.QueueJob(
            name="w",
            target="derived",
            scope="id",
            compute="select id, id * 10 as v from item where id = any(:keys)",
            every="1h",
        )
        with pgjobs.Runner(engine) as runner:
            runner.install()
            for items in ([1], [2, 3], [5]):
                with engine.begin() as conn:
                    assert not _wire.usable(conn.connection.driver_connection)
                    pgjobs.enqueue(conn, job, items)
                result = runner.tick(job, woken=True)
                assert result.outcome == "ran" and result.items == len(items), result
        with engine.connect() as conn:
            rows = conn.execute(text("select id, v from derived order by 1")).all()
        assert rows == [(1, 10), (2, 20), (3, 30), (5, 50)]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("setup", "env", "warned"),
    [
        # psycopg without the private class (moved, renamed): pgjobs says so
        ("import psycopg._queries as q; del q.PostgresQuery", {}, True),
        # forced: nothing to warn about
        ("", {_wire.FALLBACK_ENV: "1"}, False),
        # "0" is not set
        ("", {_wire.FALLBACK_ENV: "0"}, None),
    ],
    ids=["psycopg-moved-it", "forced", "zero-is-unset"],
)
def test_the_fallback_is_taken_at_import(
    setup: str, env: dict[str, str], warned: bool | None
) -> None:
    """Whether pgjobs._wire finds psycopg's converter, in a fresh interpreter:
    none where psycopg's ``_queries`` has no ``PostgresQuery``, or where
    the fallback is forced."""
    program = f"""{setup}
import logging
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from pgjobs import _wire
print("converter:", _wire._PostgresQuery is not None)
"""
    environ = {k: v for k, v in os.environ.items() if k != _wire.FALLBACK_ENV}
    done = subprocess.run(
        [sys.executable, "-c", program],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == f"converter: {warned is None}"
    assert ("has no _queries.PostgresQuery" in done.stderr) is bool(warned), done.stderr


def test_what_pgjobs_takes_from_psycopgs_private_surface_is_there(
    raw: psycopg.Connection[Any],
) -> None:
    """The names pgjobs takes from psycopg outside its documented API
    (docs/DESIGN.md, "What pgjobs takes from its dependencies' insides"),
    each checked by name: a psycopg release that renames one fails here,
    saying which, also where pgjobs has a way around it that would
    otherwise hide the change (a fallback, a getattr default)."""
    from psycopg import _queries, connection, errors

    missing = [
        what
        for what, there in [
            ("psycopg._queries.PostgresQuery", hasattr(_queries, "PostgresQuery")),
            (
                "Connection.wait(gen, interval, timeout)",
                list(inspect.signature(psycopg.Connection.wait).parameters)
                == ["self", "gen", "interval", "timeout"],
            ),
            ("psycopg.errors._WaitTimeout", hasattr(errors, "_WaitTimeout")),
            ("psycopg.connection._WAIT_INTERVAL", hasattr(connection, "_WAIT_INTERVAL")),
            ("Connection._deallocate", hasattr(psycopg.Connection, "_deallocate")),
            ("Connection._get_tx_start_command", hasattr(raw, "_get_tx_start_command")),
            ("Connection._pipeline", hasattr(raw, "_pipeline")),
            ("Connection.lock", hasattr(raw, "lock")),
        ]
        if not there
    ]
    assert missing == []
