"""Derived tables declared once (``[derived.NAME]``, :class:`pgjobs.Derived`).

The field report's schema: exam, submission, answer -> exam_score ->
exam_rank. Users write through plain SQL, never enqueue; the triggers do,
in the users' transactions. Unit tests first (no database), then the
triggers on a real PostgreSQL.
"""

from __future__ import annotations

import re
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.cli import cli
from pgjobs.derived import Derived, chain_order, plan_triggers
from pgjobs.registry import Registry

SCHEMA = """
create table exam (exam_id bigint primary key, title text not null default '');
create table submission (
    submission_id bigint primary key,
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null);
create table answer (
    answer_id bigint primary key,
    submission_id bigint not null references submission on delete cascade,
    points int not null);
create table exam_score (
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null, score bigint not null,
    primary key (exam_id, student_id));
create table exam_rank (
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null, rank bigint not null,
    primary key (exam_id, student_id));
"""

SCORE_SQL = (
    "select s.exam_id, s.student_id, sum(a.points) as score from submission s"
    " join answer a on a.submission_id = s.submission_id group by 1, 2"
)
RANK_SQL = (
    "select exam_id, student_id, rank() over (partition by exam_id order by score desc) as rank"
    " from exam_score"
)
ANSWER_MAP = "select s.exam_id from submission s where s.submission_id = answer.submission_id"

# the issue's form, as the held-out check uses it
TOML = f"""
[derived.exam_score]
target = "exam_score"
scope = ["exam_id"]
sql = "{SCORE_SQL}"
every = "1h"

[derived.exam_score.sources]
submission = ["exam_id"]        # the changed row carries the key: its columns, in scope order
answer = "{ANSWER_MAP}"

[derived.exam_rank]             # a chain: it reads exam_score
target = "exam_rank"
scope = ["exam_id"]
sql = "{RANK_SQL}"

[derived.exam_rank.sources]
exam_score = ["exam_id"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pgjobs.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def declared(tmp_path: Path, text: str = TOML) -> list[Derived]:
    return Registry.load(pgjobs.load_config(write(tmp_path, text)), entry_points=False).derived()


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# -- the declaration (no database) ---------------------------------------------------------
def test_the_issue_form_makes_two_jobs_per_declaration(tmp_path: Path) -> None:
    registry = Registry.load(pgjobs.load_config(write(tmp_path, TOML)), entry_points=False)
    assert [d.name for d in registry.derived()] == ["exam_score", "exam_rank"]
    score = registry.get("exam_score")
    assert isinstance(score, pgjobs.RecomputeJob)
    assert (score.target, score.compute, score.schedule) == ("exam_score", SCORE_SQL, "every 1h")
    queue = registry.get("exam_score:queue")
    assert isinstance(queue, pgjobs.QueueJob)
    assert (queue.scope, queue.group) == (("exam_id",), score.group)
    assert isinstance(queue.compute, str)
    assert SCORE_SQL in queue.compute and "pgjobs_keys" in queue.compute
    assert registry.entry("exam_rank:queue").derived == registry.derived()[1]


def test_job_settings_go_to_the_jobs_they_fit(tmp_path: Path) -> None:
    text = TOML.replace(
        'every = "1h"\n',
        'every = "1h"\nbatch_size = 20\nbackoff = "5m"\nchunk_rows = 500\nlock_timeout = "2s"\n',
    )
    registry = Registry.load(pgjobs.load_config(write(tmp_path, text)), entry_points=False)
    score, queue = registry.get("exam_score"), registry.get("exam_score:queue")
    assert isinstance(score, pgjobs.RecomputeJob) and isinstance(queue, pgjobs.QueueJob)
    assert (score.chunk_rows, queue.batch_size) == (500, 20)
    assert score.backoff == queue.backoff
    assert score.lock_timeout == queue.lock_timeout


def test_the_python_form_registers_the_same_jobs(tmp_path: Path) -> None:
    from_file = declared(tmp_path)[0]
    derived = pgjobs.Derived(
        name="exam_score",
        target="exam_score",
        scope=("exam_id",),
        sql=SCORE_SQL,
        every="1h",
        sources={"submission": ["exam_id"], "answer": ANSWER_MAP},
    )
    assert derived.jobs() == from_file.jobs()
    registry = Registry.from_jobs([derived])
    assert sorted(j.name for j in registry.jobs()) == ["exam_score", "exam_score:queue"]

    class Plugin:
        @staticmethod
        @pgjobs.hookimpl
        def pgjobs_register_jobs(register: Any) -> None:
            register(derived)

    loaded = Registry.load(plugins=[Plugin], entry_points=False)
    assert loaded.derived() == [derived]
    assert loaded.owner("exam_score:queue") == loaded.owner("exam_score")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('submission = ["exam_id"]', 'submission = ["exam_id", "student_id"]'),
            "derived.exam_score.sources.submission: the scope is ['exam_id']: give as many",
        ),
        (
            ('submission = ["exam_id"]', "submission = 7"),
            "derived.exam_score.sources.submission: expected a list of the key's columns",
        ),
        (('every = "1h"', 'every = "1h"\nbogus = 1'), "derived.exam_score.bogus: unknown key"),
        (('every = "1h"', 'every = "soon"'), "derived.exam_score.every"),
        (('every = "1h"', 'every = "1h"\nbatch_size = 0'), "derived.exam_score.batch_size"),
        (('scope = ["exam_id"]\nsql', "sql"), "derived.exam_score.scope: required"),
        ((f'answer = "{ANSWER_MAP}"', 'answer = "  "'), "derived.exam_score.sources.answer"),
    ],
)
def test_bad_declarations_name_the_key_and_value(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    text = TOML.replace(*change, 1)
    with pytest.raises(pgjobs.ConfigError) as refused:
        declared(tmp_path, text)
    assert expected in str(refused.value)
    assert str(tmp_path / "pgjobs.toml") in str(refused.value)


def test_a_cycle_is_refused_naming_it(tmp_path: Path) -> None:
    text = TOML + "\n[derived.exam_score.sources.exam_rank]\n"
    text = TOML.replace(
        "[derived.exam_score.sources]\n", '[derived.exam_score.sources]\nexam_rank = ["exam_id"]\n'
    )
    with pytest.raises(pgjobs.ConfigError) as refused:
        declared(tmp_path, text)
    message = str(refused.value)
    assert "a cycle of derived tables" in message
    assert "derived.exam_rank (exam_rank) -> derived.exam_score (exam_score)" in message
    # a table that reads itself is a cycle too
    alone = pgjobs.Derived(
        name="x", target="x", scope="k", sql="select k from x", sources={"x": ["k"]}
    )
    with pytest.raises(pgjobs.ConfigError, match=r"derived.x \(x\) -> derived.x \(x\)"):
        chain_order([alone])


def test_the_cli_exits_2_on_a_bad_declaration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, TOML.replace('every = "1h"', 'every = "1h"\nworkers = "many"'))
    result = CliRunner().invoke(cli, ["--config", str(path), "list"])
    assert result.exit_code == 2
    assert "derived.exam_score.workers" in result.output


# -- on a real PostgreSQL -------------------------------------------------------------------
@pytest.fixture
def exams(engine: Engine, tmp_path: Path) -> Iterator[tuple[Engine, Registry]]:
    """The field report's schema, pgjobs installed, the triggers of the
    issue's declarations installed."""
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    registry = Registry.load(pgjobs.load_config(write(tmp_path, TOML)), entry_points=False)
    pgjobs.install(engine, derived=registry.derived())
    yield engine, registry


def queued(engine: Engine, job: str) -> set[tuple[Any, ...]]:
    with engine.begin() as conn:
        rows = conn.exec_driver_sql(
            "select key from pgjobs.queue where job = %s and dead_at is null", (job,)
        ).fetchall()
    return {tuple(r[0]) for r in rows}


def clear(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("delete from pgjobs.queue")


def seed(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "insert into exam values (1), (2), (3);"
            "insert into submission values (10, 1, 100), (11, 1, 101), (20, 2, 100), (30, 3, 102);"
            "insert into answer values (1, 10, 5), (2, 10, 3), (3, 11, 9), (4, 20, 1), (5, 30, 4);"
        )


def drain(engine: Engine, registry: Registry) -> None:
    """Run the queue jobs, upstream first, until both queues are empty."""
    for _ in range(10):
        for derived in registry.derived():
            pgjobs.run_once(registry.get(derived.queue_name), database=engine)
        if not any(queued(engine, d.queue_name) for d in registry.derived()):
            return
    raise AssertionError("the queues did not drain")


def from_scratch(engine: Engine) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    with engine.begin() as conn:
        score = conn.exec_driver_sql("select * from exam_score order by 1, 2").fetchall()
        fresh_score = conn.exec_driver_sql(f"select * from ({SCORE_SQL}) q order by 1, 2")
        rank = conn.exec_driver_sql("select * from exam_rank order by 1, 2").fetchall()
        fresh_rank = conn.exec_driver_sql(
            f"select * from ({RANK_SQL.replace('exam_score', f'({SCORE_SQL}) s')}) q order by 1, 2"
        )
        return score, fresh_score.fetchall(), rank, fresh_rank.fetchall()


def test_plain_sql_writes_reach_both_levels_of_the_chain(
    exams: tuple[Engine, Registry],
) -> None:
    engine, registry = exams
    seed(engine)
    assert queued(engine, "exam_score:queue") == {(1,), (2,), (3,)}
    drain(engine, registry)
    with engine.begin() as conn:
        conn.exec_driver_sql("update answer set points = 50 where answer_id = 4")  # via a join
        conn.exec_driver_sql("delete from answer where answer_id = 3")
        conn.exec_driver_sql("update submission set student_id = 103 where submission_id = 30")
        conn.exec_driver_sql("delete from exam where exam_id = 1")  # cascades
        conn.exec_driver_sql(
            "insert into exam values (4); insert into submission values (40, 4, 100)"
        )
        conn.exec_driver_sql("insert into answer values (6, 40, 7)")
    drain(engine, registry)
    score, fresh_score, rank, fresh_rank = from_scratch(engine)
    assert score == fresh_score and rank == fresh_rank
    assert (4, 100, 7) in score and not any(r[0] == 1 for r in score)


def test_an_update_that_moves_a_row_enqueues_both_keys(exams: tuple[Engine, Registry]) -> None:
    engine, _ = exams
    seed(engine)
    clear(engine)
    with engine.begin() as conn:  # answer 1 moves from exam 1's submission to exam 3's
        conn.exec_driver_sql("update answer set submission_id = 30 where answer_id = 1")
    assert queued(engine, "exam_score:queue") == {(1,), (3,)}
    clear(engine)
    with engine.begin() as conn:  # a key column itself changes
        conn.exec_driver_sql("update submission set exam_id = 2 where submission_id = 11")
    assert queued(engine, "exam_score:queue") == {(1,), (2,)}


def test_a_delete_enqueues_the_old_key(exams: tuple[Engine, Registry]) -> None:
    engine, _ = exams
    seed(engine)
    clear(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("delete from answer where answer_id = 4")
    assert queued(engine, "exam_score:queue") == {(2,)}


def test_a_bulk_statement_of_10000_rows_is_one_upsert(exams: tuple[Engine, Registry]) -> None:
    engine, _ = exams
    seed(engine)
    clear(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("set local track_functions = 'all'")
        conn.exec_driver_sql(
            "insert into answer select 100 + g, case when g %% 2 = 0 then 10 else 20 end, 1"
            " from generate_series(1, 10000) g"
        )
        calls = conn.exec_driver_sql(
            "select calls from pg_stat_xact_user_functions"
            " where schemaname = 'pgjobs' and funcname = 'enqueue'"
        ).scalar_one()
    assert calls == 1
    assert queued(engine, "exam_score:queue") == {(1,), (2,)}


def test_truncate_of_a_source_enqueues_every_key_of_the_target(
    exams: tuple[Engine, Registry],
) -> None:
    engine, registry = exams
    seed(engine)
    drain(engine, registry)
    with engine.begin() as conn:
        conn.exec_driver_sql("truncate answer")
    assert queued(engine, "exam_score:queue") == {(1,), (2,), (3,)}
    drain(engine, registry)
    score, fresh_score, rank, fresh_rank = from_scratch(engine)
    assert score == fresh_score == [] and rank == fresh_rank == []


def test_a_table_with_a_rule_still_enqueues(exams: tuple[Engine, Registry]) -> None:
    engine, _ = exams
    seed(engine)
    clear(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "create table answer_log (answer_id bigint, at timestamptz default now());"
            "create rule log_answer as on insert to answer"
            " do also insert into answer_log (answer_id) values (new.answer_id)"
        )
        conn.exec_driver_sql("insert into answer values (7, 20, 2)")
    assert queued(engine, "exam_score:queue") == {(2,)}


def test_a_partitioned_source_and_its_partitions(engine: Engine, tmp_path: Path) -> None:
    partitioned = SCHEMA.replace(
        "create table answer (\n    answer_id bigint primary key,",
        "create table answer (\n    answer_id bigint not null,",
    ).replace(
        "    points int not null);\ncreate table exam_score",
        "    points int not null) partition by range (answer_id);\n"
        "create table answer_low partition of answer for values from (0) to (1000);\n"
        "create table answer_high partition of answer for values from (1000) to (maxvalue);\n"
        "create table exam_score",
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(partitioned)
    derived = declared(tmp_path)
    pgjobs.install(engine, derived=derived)
    seed(engine)  # through the partitioned table
    assert queued(engine, "exam_score:queue") == {(1,), (2,), (3,)}
    clear(engine)
    with engine.begin() as conn:  # straight into a partition
        conn.exec_driver_sql("insert into answer_high values (1001, 30, 1)")
        conn.exec_driver_sql("delete from answer_low where answer_id = 4")
    assert queued(engine, "exam_score:queue") == {(2,), (3,)}
    clear(engine)
    with engine.begin() as conn:  # moved across partitions, through the parent
        conn.exec_driver_sql(
            "update answer set answer_id = 2000, submission_id = 20 where answer_id = 1"
        )
    assert queued(engine, "exam_score:queue") == {(1,), (2,)}
    # a partition created later has no trigger until pgjobs migrate: reported
    with engine.begin() as conn:
        conn.exec_driver_sql("create table answer_mid (like answer_low)")
        conn.exec_driver_sql("alter table answer detach partition answer_high")
        conn.exec_driver_sql(
            "alter table answer attach partition answer_mid for values from (1000) to (1500)"
        )
        found = plan_triggers(conn, derived, "pgjobs")
    assert [line for line in found.lines() if "answer_mid" in line] == [
        "derived.exam_score: trigger on public.answer_mid missing: insert, update, delete, truncate"
    ]
    assert any("answer_high" in line and "left over" in line for line in found.lines())
    pgjobs.install(engine, derived=derived)
    with engine.begin() as conn:
        assert plan_triggers(conn, derived, "pgjobs").agrees


def test_a_restricted_application_role_writes_to_every_source(
    exams: tuple[Engine, Registry],
) -> None:
    engine, registry = exams
    seed(engine)
    drain(engine, registry)
    role = f"app_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"create role {role} nologin")
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"grant select, insert, update, delete on exam, submission, answer to {role};"
                f"create schema {role}_own authorization {role}"
            )
        with engine.begin() as conn:
            conn.exec_driver_sql(f"set local role {role}")
            conn.exec_driver_sql("insert into exam values (5)")
            conn.exec_driver_sql("insert into submission values (50, 5, 100)")
            conn.exec_driver_sql("insert into answer values (8, 50, 3), (9, 20, 1)")
            conn.exec_driver_sql("update answer set points = 4 where answer_id = 8")
            conn.exec_driver_sql("delete from answer where answer_id = 5")
        assert queued(engine, "exam_score:queue") == {(2,), (3,), (5,)}
        drain(engine, registry)
        score, fresh_score, _, _ = from_scratch(engine)
        assert score == fresh_score

        def refused(statement: str, *, usage: bool = False) -> str:
            with engine.connect() as conn, conn.begin():
                if usage:
                    conn.exec_driver_sql(f"grant usage on schema pgjobs to {role}")
                conn.exec_driver_sql(f"set local role {role}")
                with pytest.raises(Exception) as caught:
                    conn.exec_driver_sql(statement)
                return str(caught.value)

        # nothing else: not the queue, not the enqueue, not the trigger function
        assert "permission denied" in refused("select * from pgjobs.queue")
        assert "permission denied" in refused("select pgjobs.enqueue('exam_score:queue', '[1]')")
        own = f"{role}_own.t"
        attach = (
            f"create table {own} (k int); create trigger x after insert on {own}"
            " for each statement execute function"
            " pgjobs.derived_trigger('j', 'pg_catalog', 'select 1')"
        )
        assert "permission denied for schema pgjobs" in refused(attach)
        # even a role that can see pgjobs' schema may not attach the function
        assert "permission denied for function pgjobs.derived_trigger" in refused(
            attach, usage=True
        )
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"drop owned by {role}; drop role {role}")


def test_the_completeness_check_names_what_the_sql_reads(engine: Engine, tmp_path: Path) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    # the SQL now joins exam, which is not a source
    text = TOML.replace(
        "from submission s join answer a",
        "from exam e join submission s on s.exam_id = e.exam_id join answer a",
    )
    with pytest.raises(pgjobs.ConfigError) as refused:
        pgjobs.install(engine, derived=declared(tmp_path, text))
    message = str(refused.value)
    assert "derived.exam_score.sources: the SQL reads public.exam (from its plan)" in message
    assert "static" in message
    with engine.begin() as conn:  # nothing installed
        assert (
            conn.exec_driver_sql(
                "select count(*) from pg_trigger where not tgisinternal"
            ).scalar_one()
            == 0
        )
    # the pre-flight check of `pgjobs once` (and run) reports it too
    url = engine.url.render_as_string(hide_password=False)
    once = invoke("--config", str(write(tmp_path, text)), "--database", url, "once", "exam_score")
    assert once.exit_code == 2
    assert "the SQL reads public.exam (from its plan)" in once.output
    static = text.replace('every = "1h"\n', 'every = "1h"\nstatic = ["exam"]\n', 1)
    pgjobs.install(engine, derived=declared(tmp_path, static))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            (f'answer = "{ANSWER_MAP}"', f'answr = "{ANSWER_MAP}"'),
            "derived.exam_score.sources.answr: no table 'answr'",
        ),
        (
            ('submission = ["exam_id"]', 'submission = ["exam"]'),
            "derived.exam_score.sources.submission: 'submission' has no column(s) exam",
        ),
        (
            ("from submission s where", "from submissions s where"),
            "derived.exam_score.sources.answer: the mapping SQL fails: relation"
            ' "submissions" does not exist',
        ),
        (
            ("s.submission_id = answer.submission_id", "s.submission_id = answer.nope"),
            "derived.exam_score.sources.answer: the mapping SQL fails: column answer.nope",
        ),
        (
            (
                "select s.exam_id from submission s where",
                "select s.exam_id / (answer.points - answer.points) from submission s where",
            ),
            "derived.exam_score.sources.answer: the mapping SQL fails on 'answer''s rows: division by zero",
        ),
        (
            (
                "select s.exam_id from submission s where",
                "select s.exam_id, 1 from submission s where",
            ),
            "the mapping SQL gives 2 column(s); it must give the scope's 1",
        ),
        (
            ("select s.exam_id, s.student_id, sum", "select s.exam_id as exam, s.student_id, sum"),
            "derived.exam_score.sql: its output lacks the scope's column(s) exam_id",
        ),
        (("sum(a.points) as score", "sum(a.points) as points"), "derived.exam_score.sql:"),
        (
            ("partition by exam_id order by", "order by"),
            "derived.exam_rank.sql: the queue job's compute (this SQL restricted to a batch's"
            " keys) would compute every key",
        ),
    ],
)
def test_bad_input_against_the_database_installs_nothing(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    db_url: str,
    change: tuple[str, str],
    expected: str,
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    seed(engine)
    path = write(tmp_path, TOML.replace(*change, 1))
    result = CliRunner().invoke(cli, ["--config", str(path), "--database", db_url, "migrate"])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert str(path) in result.output
    with engine.begin() as conn:
        assert (
            conn.exec_driver_sql(
                "select count(*) from pg_trigger where not tgisinternal"
            ).scalar_one()
            == 0
        )


def test_migrate_check_after_a_declaration_changed(
    engine: Engine, tmp_path: Path, db_url: str
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    path = write(tmp_path, TOML)
    args = ["--config", str(path), "--database", db_url]
    assert invoke(*args, "migrate", "--check").exit_code == 1
    done = invoke(*args, "migrate")
    assert done.exit_code == 0
    assert "derived.exam_score: trigger on public.answer installed" in done.output
    current = invoke(*args, "migrate", "--check")
    assert current.exit_code == 0, current.output
    assert "triggers agree" in current.output
    # the mapping changes: the answer's triggers are stale
    write(
        tmp_path, TOML.replace("where s.submission_id", "where s.exam_id > 0 and s.submission_id")
    )
    stale = invoke(*args, "migrate", "--check")
    assert stale.exit_code == 1
    assert "derived.exam_score: trigger on public.answer stale" in stale.output
    assert "submission" not in stale.output.split("stale")[0].split("\n")[-1]
    assert "s.exam_id > 0" in invoke(*args, "migrate", "--sql").output
    status = invoke(*args, "status")
    assert status.exit_code == 1 and "trigger on public.answer stale" in status.output
    checked = invoke(*args, "check", "exam_score")
    assert checked.exit_code == 1 and "trigger on public.answer stale" in checked.output
    assert invoke(*args, "migrate").exit_code == 0
    assert invoke(*args, "migrate", "--check").exit_code == 0
    # a declaration that is gone: its triggers are left over, then dropped
    write(tmp_path, TOML.split("[derived.exam_rank]")[0])
    gone = invoke(*args, "migrate", "--check")
    assert gone.exit_code == 1
    assert "derived.exam_rank: trigger on public.exam_score left over" in gone.output
    assert invoke(*args, "migrate").exit_code == 0
    with engine.begin() as conn:
        names = conn.exec_driver_sql(
            "select tgrelid::regclass::text from pg_trigger where not tgisinternal"
        ).fetchall()
    assert {n[0] for n in names} == {"submission", "answer"}


def test_a_chain_recomputes_in_dependency_order_under_the_scheduler(
    exams: tuple[Engine, Registry],
) -> None:
    engine, registry = exams
    seed(engine)
    clear(engine)  # only the recomputes fill the tables
    results: list[pgjobs.RunResult] = []
    ranked = threading.Event()

    def on_result(result: pgjobs.RunResult) -> None:
        if result.job in ("exam_score", "exam_rank"):
            results.append(result)
            if result.job == "exam_rank" and result.outcome is pgjobs.Outcome.RAN:
                ranked.set()

    with pgjobs.Scheduler(registry, engine, on_result=on_result, heartbeat_every="1h"):
        assert ranked.wait(30), [(r.job, r.outcome) for r in results]
    score = next(r for r in results if r.job == "exam_score")
    rank = next(r for r in results if r.job == "exam_rank")
    assert score.outcome is pgjobs.Outcome.RAN and score.stats.inserted == 4
    assert rank.started_at >= score.finished_at  # the rank read the scores written
    # (the rank's rows were written by it, or just before by its queue job:
    # the scores' recompute enqueued their keys through the triggers)
    assert rank.stats.deleted == rank.stats.skipped_missing_parent == 0
    drain(engine, registry)
    score_rows, fresh_score, rank_rows, fresh_rank = from_scratch(engine)
    assert score_rows == fresh_score and rank_rows == fresh_rank


def test_the_how_to_works_as_written(engine: Engine, tmp_path: Path, db_url: str) -> None:
    """docs/how-to/derived.md: a schema written by others, declared in
    pgjobs.toml alone, through two joins and a chain; migrate, then plain SQL."""
    page = (Path(__file__).resolve().parent.parent / "docs/how-to/derived.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", page, flags=re.M | re.S)
    schema = next(text for lang, text in blocks if lang == "sql" and "create table" in text)
    toml = next(text for lang, text in blocks if lang == "toml")
    writes = next(text for lang, text in blocks if lang == "sql" and "insert into answer" in text)
    with engine.begin() as conn:
        conn.exec_driver_sql(schema)
        conn.exec_driver_sql(
            "insert into course values (1), (2); insert into exam values (3, 1), (9, 2), (5, 1);"
            "insert into submission values (4, 3, 100), (6, 5, 101), (7, 9, 100);"
            "insert into answer values (1, 4, 5), (2, 6, 7), (3, 7, 2)"
        )
    path = write(tmp_path, toml)
    args = ["--config", str(path), "--database", db_url]
    assert invoke(*args, "migrate", "--check").exit_code == 1
    assert invoke(*args, "migrate").exit_code == 0
    registry = Registry.load(pgjobs.load_config(path), entry_points=False)
    for name in ("course_total", "course_rank"):
        assert pgjobs.run_once(registry.get(name), database=engine).outcome is pgjobs.Outcome.RAN
    with engine.begin() as conn:
        conn.exec_driver_sql(re.sub(r"--[^\n]*", "", writes))
    with engine.begin() as conn:
        keys = conn.exec_driver_sql(
            "select distinct key from pgjobs.queue where job = 'course_total:queue'"
        ).fetchall()
    assert sorted(k[0] for k in keys) == [[1], [2]]
    for _ in range(5):
        for name in ("course_total:queue", "course_rank:queue"):
            pgjobs.run_once(registry.get(name), database=engine)
    sql_of = {d.name: d.sql for d in registry.derived()}
    with engine.begin() as conn:
        for name in ("course_total", "course_rank"):
            fresh = sql_of[name].replace("from course_total", f"from ({sql_of['course_total']}) t")
            got = conn.exec_driver_sql(f"select * from {name} order by 1, 2").fetchall()
            want = conn.exec_driver_sql(f"select * from ({fresh}) q order by 1, 2").fetchall()
            assert got == want, name
        assert conn.exec_driver_sql("select count(*) from pgjobs.queue").scalar_one() == 0


def test_installing_waits_for_a_users_write_at_most_lock_timeout(
    engine: Engine, tmp_path: Path
) -> None:
    """CREATE TRIGGER queues behind a user's open write to the table (and
    users' writes would queue behind it): the install waits at most
    lock_timeout per attempt, retries, gives up naming the lock, and leaves
    nothing installed; once the user commits it goes through."""
    from pgjobs.derived import install_triggers
    from pgjobs.migrations import MigrateSettings

    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    seed(engine)
    derived = declared(tmp_path)
    settings = MigrateSettings(lock_timeout="200ms", retry_for="600ms")
    user = engine.connect()
    user.begin()
    user.exec_driver_sql("insert into answer values (99, 10, 1)")  # ROW EXCLUSIVE on answer
    try:
        with engine.connect() as conn, pytest.raises(pgjobs.MigrationError) as gave_up:
            install_triggers(conn, derived, "pgjobs", settings=settings)
        assert "installing the derived tables' triggers: a lock was not granted" in str(
            gave_up.value
        )
        with engine.begin() as conn:  # one transaction: submission's were rolled back too
            count = "select count(*) from pg_trigger where not tgisinternal"
            assert conn.exec_driver_sql(count).scalar_one() == 0
    finally:
        user.commit()
        user.close()
    with engine.connect() as conn:
        done = install_triggers(conn, derived, "pgjobs", settings=settings)
    assert len(done.missing) == 12  # 4 events x (submission, answer, exam_score)


def test_the_scheduler_installs_the_triggers_at_start(engine: Engine, tmp_path: Path) -> None:
    """With auto_migrate (the default), as pgjobs' schema at start, the
    scheduler makes its derived tables' triggers agree; a user's plain SQL
    then reaches the table with no `pgjobs migrate` run."""
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    seed(engine)
    registry = Registry.load(pgjobs.load_config(write(tmp_path, TOML)), entry_points=False)
    written = threading.Event()

    def on_result(result: pgjobs.RunResult) -> None:
        if result.job == "exam_score:queue" and result.stats.updated:
            written.set()

    filled = threading.Event()

    def on_fill(result: pgjobs.RunResult) -> None:
        if result.job == "exam_rank" and result.outcome is pgjobs.Outcome.RAN:
            filled.set()
        on_result(result)

    with pgjobs.Scheduler(registry, engine, on_result=on_fill, heartbeat_every="1h"):
        with engine.begin() as conn:
            assert plan_triggers(conn, registry.derived(), "pgjobs").agrees
        assert filled.wait(30)  # the first fill of both levels
        with engine.begin() as conn:
            conn.exec_driver_sql("update answer set points = 40 where answer_id = 5")
        assert written.wait(30)
    with engine.begin() as conn:
        score = conn.exec_driver_sql("select score from exam_score where exam_id = 3").scalar_one()
    assert score == 40


def test_a_statement_whose_keys_were_pending_still_wakes_the_workers(
    exams: tuple[Engine, Registry], db_url: str
) -> None:
    """enqueue notifies only for new entries; a derived trigger whose keys
    were all pending notifies anyway, at its commit: a worker may have
    skipped an entry that the statement's transaction held locked."""
    import psycopg

    from pgjobs.database import normalize_url
    from pgjobs.queue import channel

    engine, _ = exams
    seed(engine)  # exam 2's key is pending now
    listener = psycopg.connect(
        normalize_url(db_url).replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )
    try:
        listener.execute(f'listen "{channel("pgjobs", "exam_score:queue")}"')
        with engine.begin() as conn:
            conn.exec_driver_sql("insert into answer values (60, 20, 1)")  # exam 2 again
        heard = [n.channel for n in listener.notifies(timeout=5, stop_after=1)]
    finally:
        listener.close()
    assert heard == [channel("pgjobs", "exam_score:queue")]
    assert queued(engine, "exam_score:queue") == {(1,), (2,), (3,)}
