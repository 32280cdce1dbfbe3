"""The ``pgjobs`` command against real databases: list, once, status, demo,
a config-only recompute, and bad inputs that exit 2 having written nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text
from sqlalchemy.engine import Engine

from pgjobs.cli import cli


def pgjobs_command() -> list[str]:
    """The installed console script of the running environment."""
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def modules() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def plugin_module(directory: Path, modules: list[str], body: str) -> str:
    name = f"cliplug_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text("import pgjobs\n\n" + textwrap.dedent(body))
    modules.append(name)
    return name


def config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "pgjobs.toml"
    path.write_text(textwrap.dedent(body))
    return path


# -- list ---------------------------------------------------------------------------------
def test_list_shows_job_owner_kind_group_and_schedule(tmp_path: Path, modules: list[str]) -> None:
    name = plugin_module(
        tmp_path,
        modules,
        """
        @pgjobs.hookimpl
        def pgjobs_register_jobs(register):
            register(pgjobs.TaskJob(name="nightly", run=lambda c: 0, every=None, cron="0 3 * * *"))
        """,
    )
    path = config(
        tmp_path,
        f"""
        plugins = ["{name}"]

        [jobs.totals]
        kind = "recompute"
        target = "daily_total"
        sql = "select 1"
        every = "10m"
        group = "reports"
        enabled = false
        """,
    )
    result = invoke("list", "-c", str(path))
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.output.splitlines()]
    assert lines[0] == ["JOB", "OWNER", "KIND", "GROUP", "SCHEDULE", "ENABLED"]
    assert lines[1] == ["nightly", name, "task", "nightly", "cron", "0", "3", "*", "*", "*", "yes"]
    assert lines[2] == ["totals", str(path), "recompute", "reports", "every", "10m", "no"]

    as_json = json.loads(invoke("list", "-c", str(path), "--json").output)
    assert as_json[1] == {
        "job": "totals",
        "owner": str(path),
        "kind": "recompute",
        "group": "reports",
        "schedule": "every 10m",
        "enabled": False,
        "target": "daily_total",
    }


def test_list_with_nothing_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("list")
    assert result.exit_code == 0 and "no jobs" in result.output


# -- once and status ---------------------------------------------------------------------------
def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_once_runs_a_job_and_status_reports_it(
    env_db: str, engine: Engine, tmp_path: Path, modules: list[str]
) -> None:
    with engine.begin() as conn:
        conn.execute(text("create table log (n int)"))
    name = plugin_module(
        tmp_path,
        modules,
        """
        from sqlalchemy import text

        def hello(conn):
            conn.execute(text("insert into log values (1), (2)"))
            return pgjobs.DiffStats(inserted=2)

        @pgjobs.hookimpl
        def pgjobs_register_jobs(register):
            register(pgjobs.TaskJob(name="hello", run=hello, every="1h"))
        """,
    )
    path = config(
        tmp_path,
        f"""
        plugins = ["{name}"]

        [jobs.broken]
        kind = "task"
        sql = "select 1 / 0"
        backoff = "10m"
        """,
    )
    # Never run: status reads without installing anything.
    fresh = invoke("status", "-c", str(path))
    assert fresh.exit_code == 0, fresh.output
    assert [columns(line)[:2] for line in fresh.output.splitlines()[1:]] == [
        ["broken", "never ran"],
        ["hello", "never ran"],
    ]
    with engine.connect() as conn:
        assert not conn.execute(
            text("select exists (select from pg_namespace where nspname = 'pgjobs')")
        ).scalar()

    ok = invoke("once", "hello", "-c", str(path))
    assert ok.exit_code == 0, ok.output + ok.stderr
    assert ok.stdout.startswith("hello: ran in ")
    assert "inserted 2, updated 0, deleted 0" in ok.stdout
    with engine.connect() as conn:
        assert conn.execute(text("select array_agg(n order by n) from log")).scalar() == [1, 2]

    failed = invoke("once", "broken", "-c", str(path))
    assert failed.exit_code == 1
    assert failed.stdout.startswith("broken: failed in ")
    assert "division by zero" in failed.stdout and "(SQLSTATE 22012)" in failed.stdout

    status = invoke("status", "-c", str(path))
    assert status.exit_code == 1  # a job is failing
    lines = status.output.splitlines()
    assert columns(lines[0]) == [
        "JOB",
        "LAST OUTCOME",
        "WHEN",
        "NEXT ATTEMPT",
        "FAILURES",
        "ROWS CHANGED",
        "QUEUE",
    ]
    broken, hello = columns(lines[1]), columns(lines[2])
    assert broken[0:2] == ["broken", "failed"] and broken[4:] == ["1", "-", "-"]
    assert broken[3].startswith("in ") and broken[2].endswith(" ago")
    assert hello[0:2] == ["hello", "ran"] and hello[4:] == ["0", "2 (+2 ~0 -0)", "-"]
    assert (
        "broken: failing (1x) (SQLSTATE 22012): DivisionByZero: division by zero" in status.output
    )

    report = json.loads(invoke("status", "-c", str(path), "--json").output)
    jobs = {job["job"]: job for job in report["jobs"]}
    assert jobs["hello"]["last_outcome"] == "ran" and jobs["hello"]["failures"] == 0
    assert jobs["hello"]["rows_changed"] == {"inserted": 2, "updated": 0, "deleted": 0}
    assert jobs["broken"]["failures"] == 1 and jobs["broken"]["last_sqlstate"] == "22012"
    assert jobs["broken"]["rows_changed"] is None
    assert jobs["broken"]["next_attempt_at"] > report["now"]

    # Fixed: a successful run clears the failure, and status exits 0 again.
    path.write_text(path.read_text().replace("select 1 / 0", "select 1"))
    assert invoke("once", "broken", "-c", str(path)).exit_code == 0
    assert invoke("status", "-c", str(path)).exit_code == 0


def test_status_shows_queue_depth(env_db: str, engine: Engine, tmp_path: Path) -> None:
    import pgjobs
    from pgjobs.queue import enqueue

    with engine.begin() as conn:
        conn.execute(text("create table item_total (item int primary key, n int not null)"))
    path = config(
        tmp_path,
        """
        [jobs.items]
        kind = "queue"
        target = "item_total"
        scope = "item"
        sql = "select k as item, 1 as n from unnest(:keys) as k"
        """,
    )
    pgjobs.Runner(engine).install()
    with engine.begin() as conn:
        enqueue(conn, "items", [1, 2, 3])
    report = json.loads(invoke("status", "-c", str(path), "--json").output)
    assert report["jobs"][0]["queue"]["depth"] == 3
    table = invoke("status", "-c", str(path)).output
    assert table.splitlines()[1].split()[-1] == "3"


def test_status_groups_every_count_the_same_way(
    env_db: str, engine: Engine, tmp_path: Path
) -> None:
    import pgjobs

    with engine.begin() as conn:
        conn.execute(text("create table big (id int primary key, v int not null)"))
        conn.execute(text("insert into big select g, 0 from generate_series(1, 1500) g"))
        conn.execute(text("create table item_total (item int primary key, n int not null)"))
    path = config(
        tmp_path,
        """
        [jobs.big]
        kind = "recompute"
        target = "big"
        sql = "select g as id, case when g <= 2000 then 1 else 2 end as v from generate_series(1, 6000) g"

        [jobs.items]
        kind = "queue"
        target = "item_total"
        scope = "item"
        sql = "select k as item, 1 as n from unnest(:keys) as k"
        """,
    )
    # 1,500 rows updated, 4,500 inserted
    assert invoke("once", "big", "-c", str(path)).exit_code == 0
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "items", range(1234))
    lines = invoke("status", "-c", str(path)).output.splitlines()
    big, items = columns(lines[1]), columns(lines[2])
    assert big[0] == "big" and big[-2:] == ["6,000 (+4,500 ~1,500 -0)", "-"]
    assert items[0] == "items" and items[-1] == "1,234"


def test_global_options_go_before_the_command_too(
    env_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = config(tmp_path, "[jobs.a]\nkind = 'task'\nsql = 'select 1'\n")
    monkeypatch.chdir(tmp_path.parent)  # no ./pgjobs.toml: the option is what finds it
    monkeypatch.delenv("PGJOBS_DATABASE_URL")
    for args in (
        ["--config", str(path), "list"],
        ["-c", str(path), "list"],
        ["list", "--config", str(path)],
    ):
        listed = invoke(*args)
        assert listed.exit_code == 0, (args, listed.output)
        assert listed.output.splitlines()[1].split()[:3] == ["a", str(path), "task"], args
    ran = invoke("--config", str(path), "--database", env_db, "once", "a")
    assert ran.exit_code == 0, ran.output
    assert ran.stdout.startswith("a: ran in ")
    status = invoke("-c", str(path), "--database", env_db, "status")
    assert status.exit_code == 0 and columns(status.output.splitlines()[1])[:2] == ["a", "ran"]
    # Given in both places, the command's own wins.
    (tmp_path / "other").mkdir()
    other = config(tmp_path / "other", "[jobs.b]\nkind = 'task'\nsql = 'select 1'\n")
    mixed = invoke("--config", str(other), "list", "--config", str(path))
    assert mixed.exit_code == 0
    assert [line.split()[0] for line in mixed.output.splitlines()[1:]] == ["a"]
    bad = "postgresql://postgres@127.0.0.1:1/nothing"
    assert invoke("--database", bad, "status", "-c", str(path), "--database", env_db).exit_code == 0


def test_an_unreachable_database_exits_3_not_1(tmp_path: Path) -> None:
    # Exit 1 means a job failed; a database pgjobs cannot reach is another
    # matter for a health check, and says so.
    path = config(tmp_path, "[jobs.a]\nkind = 'task'\nsql = 'select 1'\n")
    bad = "postgresql://postgres@127.0.0.1:1/nothing"
    for args in (
        ["once", "a"],
        ["once", "a", "--no-check"],
        ["status"],
        ["run", "--exit-if-unreachable"],  # without it, run waits (tests/test_outage.py)
    ):
        result = invoke("--database", bad, "-c", str(path), *args)
        assert result.exit_code == 3, (args, result.output)
        assert "pgjobs: database error: connection failed" in result.stderr, args
    # (A job whose tick fails on the database is a failed job: 1, as in
    # test_once_runs_a_job_and_status_reports_it.)


def test_once_forces_and_run_once_honours_not_due(env_db: str, tmp_path: Path) -> None:
    import pgjobs

    path = config(tmp_path, "[jobs.a]\nkind = 'task'\nsql = 'select 1'\nevery = '1h'\n")
    assert invoke("once", "a", "-c", str(path)).exit_code == 0
    # ran a moment ago: run_once says not_due; pgjobs once runs it anyway
    job = pgjobs.load_config(path).jobs[0]
    assert pgjobs.run_once(job, env_db).outcome is pgjobs.Outcome.NOT_DUE
    again = invoke("once", "a", "-c", str(path))
    assert again.exit_code == 0 and again.stdout.startswith("a: ran in ")
    assert pgjobs.run_once(job, env_db, force=True).outcome is pgjobs.Outcome.RAN


def test_once_of_an_unknown_job_is_a_usage_error(env_db: str, tmp_path: Path) -> None:
    path = config(tmp_path, "[jobs.a]\nkind = 'task'\nsql = 'select 1'\n")
    result = invoke("once", "nope", "-c", str(path))
    assert result.exit_code == 2
    assert "no job named 'nope' (registered: a)" in result.stderr


# -- a config-only recompute ------------------------------------------------------------------
def test_a_config_only_recompute_runs_from_toml_with_no_user_python(
    env_db: str, engine: Engine, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("create table event (id int primary key, day date not null, amount int not null)")
        )
        conn.execute(
            text(
                "create table daily_total (day date primary key, n int not null,"
                " total bigint not null)"
            )
        )
        conn.execute(
            text(
                "insert into event select g, date '2024-01-01' + (g % 3), g"
                " from generate_series(1, 30) g"
            )
        )
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "daily.sql").write_text(
        "-- one row per day\n"
        "select day, count(*)::int as n, sum(amount) as total\nfrom event group by day;\n"
    )
    path = config(
        tmp_path,
        """
        [jobs.daily-totals]
        kind = "recompute"
        target = "daily_total"
        sql_file = "sql/daily.sql"
        every = "10m"
        """,
    )

    def expected() -> dict[date, tuple[int, int]]:
        with engine.connect() as conn:
            events = conn.execute(text("select day, amount from event")).all()
        out: dict[date, tuple[int, int]] = {}
        for day, amount in events:
            n, total = out.get(day, (0, 0))
            out[day] = (n + 1, total + amount)
        return out

    def actual() -> dict[date, tuple[int, int]]:
        with engine.connect() as conn:
            return {
                r[0]: (r[1], r[2])
                for r in conn.execute(text("select day, n, total from daily_total"))
            }

    env = {**os.environ, "PGJOBS_LOAD_PLUGINS": ""}
    first = subprocess.run(
        [*pgjobs_command(), "once", "daily-totals", "-c", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.startswith("daily-totals: ran in ")
    assert "inserted 3, updated 0, deleted 0" in first.stdout
    for phase in ("compute", "stage", "diff", "write"):
        assert f"daily-totals: {phase}" in first.stderr, first.stderr
    assert actual() == expected() and len(expected()) == 3

    with engine.begin() as conn:
        conn.execute(text("delete from event where day = date '2024-01-02'"))
        conn.execute(text("update event set amount = amount + 100 where id = 3"))
        conn.execute(text("insert into event values (100, date '2024-02-01', 5)"))
    second = subprocess.run(
        [*pgjobs_command(), "once", "daily-totals", "-c", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "inserted 1, updated 1, deleted 1, unchanged 1" in second.stdout
    assert actual() == expected()


# -- bad inputs ---------------------------------------------------------------------------------
GOOD_JOB = """
[jobs.scores]
kind = "recompute"
target = "exam_score"
sql = "select exam_id, student, 0 as score from exam_score"
"""

BAD_INPUTS = [
    # id, pgjobs.toml, extra files, arguments after `-c FILE`, what the message names
    ("unknown-key", "databse = 'x'\n" + GOOD_JOB, {}, ["once", "scores"], "databse: unknown key"),
    (
        "unknown-job-key",
        GOOD_JOB + "evry = '1m'\n",
        {},
        ["once", "scores"],
        "jobs.scores.evry: unknown key",
    ),
    (
        "bad-duration",
        GOOD_JOB + "every = 'soon'\n",
        {},
        ["once", "scores"],
        "jobs.scores.every: expected a duration such as '90s', '5m' or '1h', got 'soon'",
    ),
    (
        "bad-kind",
        GOOD_JOB.replace('"recompute"', '"matview"'),
        {},
        ["once", "scores"],
        "jobs.scores.kind: expected one of recompute, queue, task, got 'matview'",
    ),
    ("invalid-toml", GOOD_JOB + "every = \n", {}, ["once", "scores"], "not valid TOML"),
    (
        "missing-table",
        GOOD_JOB.replace('"exam_score"', '"exam_scores"'),
        {},
        ["once", "scores"],
        "jobs.scores: target: table 'exam_scores' does not exist",
    ),
    (
        "no-usable-key",
        GOOD_JOB.replace('"exam_score"', '"loose"').replace(
            "exam_id, student, 0 as score from exam_score", "1 as a"
        ),
        {},
        ["once", "scores"],
        "target public.loose: no primary key",
    ),
    (
        "nullable-key",
        GOOD_JOB.replace('"exam_score"', '"loose"').replace(
            "exam_id, student, 0 as score from exam_score", "1 as a"
        )
        + "key = 'a'\n",
        {},
        ["once", "scores"],
        "key: column(s) a must be NOT NULL",
    ),
    (
        "sql-fails",
        GOOD_JOB.replace("0 as score", "scor"),
        {},
        ["once", "scores"],
        'jobs.scores.sql: the query fails: column "scor" does not exist',
    ),
    (
        "sql-wrong-columns",
        GOOD_JOB.replace("0 as score", "0 as points"),
        {},
        ["once", "scores"],
        "jobs.scores.sql: target public.exam_score: the new rows' SQL returns column(s) points",
    ),
    (
        "missing-sql-file",
        GOOD_JOB.replace(
            'sql = "select exam_id, student, 0 as score from exam_score"', 'sql_file = "scores.sql"'
        ),
        {},
        ["once", "scores"],
        "jobs.scores.sql_file: cannot read",
    ),
    (
        "duplicate-job",
        'plugins = ["{dup}"]\n' + GOOD_JOB,
        {"dup": "scores"},
        ["once", "scores"],
        "job 'scores' is registered twice: by '{dup}' and by '{path}'",
    ),
    (
        "unknown-plugin-module",
        'plugins = ["no_such_jobs_module"]\n' + GOOD_JOB,
        {},
        ["once", "scores"],
        "plugins[0]: no module named 'no_such_jobs_module'",
    ),
    (
        "groups-differ",
        GOOD_JOB + "\n[jobs.worker]\nkind = 'queue'\ntarget = 'exam_score'\nscope = 'exam_id'\n"
        "sql = 'select 1'\ngroup = 'w'\n",
        {},
        ["once", "scores"],
        "both write table 'exam_score': jobs that write one table must share a group",
    ),
    (
        "override-unknown-job",
        GOOD_JOB + "\n[jobs.scroes]\nevery = '1m'\n",
        {},
        ["once", "scores"],
        "jobs.scroes: no registered job is named 'scroes'",
    ),
    ("unknown-job", GOOD_JOB, {}, ["once", "nope"], "no job named 'nope' (registered: scores)"),
    (
        "bad-database-url",
        GOOD_JOB,
        {},
        ["once", "scores", "--database", "mysql://x/y"],
        "pgjobs needs PostgreSQL through psycopg 3",
    ),
    ("run-nothing-enabled", GOOD_JOB + "enabled = false\n", {}, ["run"], "no enabled jobs"),
    (
        "run-strict-missing-table",
        GOOD_JOB.replace('"exam_score"', '"exam_scores"'),
        {},
        ["run", "--strict"],
        "table 'exam_scores' does not exist",
    ),
]


@pytest.mark.parametrize(
    ("case", "toml", "plugins", "args", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_exit_2_naming_what_is_wrong_and_write_nothing(
    env_db: str,
    engine: Engine,
    tmp_path: Path,
    modules: list[str],
    case: str,
    toml: str,
    plugins: dict[str, str],
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case == "override-unknown-job":
        # With installed plugins filtered out, an override of a job nobody
        # registers is only a warning (its plugin may be the one switched off).
        monkeypatch.delenv("PGJOBS_LOAD_PLUGINS")
    with engine.begin() as conn:
        conn.execute(text("create table exam (id int primary key)"))
        conn.execute(
            text(
                "create table exam_score (exam_id int not null references exam,"
                " student text not null, score int not null, primary key (exam_id, student))"
            )
        )
        conn.execute(text("create table loose (a int, b int)"))
        conn.execute(text("insert into exam values (1), (2)"))
        conn.execute(text("insert into exam_score values (1, 'ann', 7), (2, 'bob', 9)"))
    names = {
        key: plugin_module(
            tmp_path,
            modules,
            f"""
            @pgjobs.hookimpl
            def pgjobs_register_jobs(register):
                register(pgjobs.TaskJob(name={job!r}, run=lambda conn: None))
            """,
        )
        for key, job in plugins.items()
    }
    path = tmp_path / "pgjobs.toml"
    path.write_text(toml.format(**names))
    expected = message.format(path=path, **names)
    command = [*pgjobs_command(), args[0], "-c", str(path), *args[1:]]
    if args[0] == "run":
        # A real process: had the check missed, it would be running, and time out.
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        code, stderr = proc.returncode, proc.stderr
    else:
        result = CliRunner().invoke(cli, command[len(pgjobs_command()) :], catch_exceptions=False)
        code, stderr = result.exit_code, result.stderr
    assert code == 2, stderr
    assert stderr.startswith("pgjobs: error: "), stderr
    assert expected in stderr, stderr
    with engine.connect() as conn:
        assert not conn.execute(
            text("select exists (select from pg_namespace where nspname = 'pgjobs')")
        ).scalar()
        assert conn.execute(
            text("select array_agg(score order by exam_id) from exam_score")
        ).scalar() == [7, 9]


def test_usage_errors_exit_2() -> None:
    assert invoke("once").exit_code == 2
    assert invoke("frobnicate").exit_code == 2
    assert invoke("list", "--nope").exit_code == 2


# -- demo ----------------------------------------------------------------------------------
def test_demo_command_runs_the_scenario_with_its_options(env_db: str) -> None:
    result = invoke(
        "demo",
        "--seconds",
        "1.5",
        "--exams",
        "200",
        "--compute-seconds",
        "0.1",
        "--recompute-every",
        "1",
    )
    assert result.exit_code == 0, result.stderr
    assert "200 exams x 5 derived scores" in result.stdout
    assert "pgjobs: no deadlock, no FK violation" in result.stdout


def test_demo_rejects_bad_options_with_exit_2(env_db: str) -> None:
    result = invoke("demo", "--exams", "0")
    assert result.exit_code == 2
