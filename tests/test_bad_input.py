"""Bad durations, limits and names: refused on construction (a ConfigError
naming the field and the value) and from ``pgjobs.toml`` (exit 2 naming the
file, the key and the value, with nothing written to the database)."""

from __future__ import annotations

import math
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.cli import cli
from pgjobs.config import load_config
from pgjobs.registry import Registry
from pgjobs.testing import fresh_database, run_tick


def noop(conn: Any) -> None:
    return None


def task(**kw: Any) -> pgjobs.TaskJob:
    return pgjobs.TaskJob(name=kw.pop("name", "t"), run=noop, **kw)


def recompute(**kw: Any) -> pgjobs.RecomputeJob:
    fields: dict[str, Any] = {"name": "r", "target": "t", "compute": "select 1", **kw}
    return pgjobs.RecomputeJob(**fields)


def queue(**kw: Any) -> pgjobs.QueueJob:
    fields: dict[str, Any] = {"name": "q", "target": "t", "scope": "id", "compute": "select 1"}
    return pgjobs.QueueJob(**{**fields, **kw})


def parent(table: str = "p", column: str = "a") -> pgjobs.Parent:
    return pgjobs.Parent(table=table, columns=(column,), parent_columns=("id",))


# -- on construction ------------------------------------------------------------------
CONSTRUCTION: list[tuple[str, Callable[[], object], str, str]] = [
    # (case, what raises, the field named, the value's repr)
    ("every-huge", lambda: task(every="99999999999d"), "every", "'99999999999d'"),
    ("every-inf", lambda: task(every=math.inf), "every", "inf"),
    ("every-nan", lambda: task(every=math.nan), "every", "nan"),
    ("every-huge-int", lambda: task(every=10**30), "every", str(10**30)),
    ("every-long-digits", lambda: task(every="9" * 400 + "s"), "every", "'999"),
    ("every-timedelta", lambda: task(every=timedelta(days=40000)), "every", "days=40000"),
    ("cron-range", lambda: task(every=None, cron="61 * * * *"), "cron: minute", "'61 * * * *'"),
    ("cron-never", lambda: task(every=None, cron="0 0 30 2 *"), "never fires", "'0 0 30 2 *'"),
    ("cron-step-0", lambda: task(every=None, cron="*/0 * * * *"), "cron: minute", "'*/0"),
    ("cron-bad-name", lambda: task(every=None, cron="0 0 * * mon-fri/2"), "day_of_week", "fri/2"),
    ("cron-nul", lambda: task(every=None, cron="* * * * *\x00"), "cron", "\\x00"),
    ("backoff-huge", lambda: task(backoff="999999999d"), "backoff", "'999999999d'"),
    ("backoff-inf", lambda: task(backoff=math.inf), "backoff", "inf"),
    ("busy-retry-huge", lambda: task(busy_retry="99999999999d"), "busy_retry", "'99999999999d'"),
    ("statement-timeout-30d", lambda: task(statement_timeout="30d"), "statement_timeout", "'30d'"),
    ("lock-timeout-25d", lambda: task(lock_timeout="25d"), "lock_timeout", "'25d'"),
    ("lock-timeout-0.5ms", lambda: task(lock_timeout="0.5ms"), "lock_timeout", "'0.5ms'"),
    (
        "statement-timeout-sub-ms",
        lambda: task(statement_timeout=timedelta(microseconds=400)),
        "statement_timeout",
        "microseconds=400",
    ),
    ("name-nul", lambda: task(name="a\x00"), "TaskJob.name", "'a\\x00'"),
    ("group-nul", lambda: task(group="g\x00"), "group", "'g\\x00'"),
    ("description-nul", lambda: task(description="x\x00"), "description", "'x\\x00'"),
    ("enabled-not-bool", lambda: task(enabled="no"), "enabled", "'no'"),
    ("target-nul", lambda: recompute(target="t\x00"), "target", "'t\\x00'"),
    ("target-shape", lambda: recompute(target="a.b.c"), "target", "'a.b.c'"),
    ("key-nul", lambda: recompute(key=("a\x00",)), "key", "'a\\x00'"),
    ("key-empty", lambda: recompute(key=()), "key", "()"),
    ("compute-nul", lambda: recompute(compute="select 1\x00"), "compute", "\\x00"),
    ("parent-table-nul", lambda: parent(table="p\x00"), "parents.table", "'p\\x00'"),
    ("parent-column-nul", lambda: parent(column="a\x00"), "parents.columns", "'a\\x00'"),
    ("chunk-parents-huge", lambda: recompute(chunk_parents=10**12), "chunk_parents", "10000000"),
    ("chunk-parents-bool", lambda: recompute(chunk_parents=True), "chunk_parents", "True"),
    ("batch-size-huge", lambda: queue(batch_size=10**12), "batch_size", "1000000000000"),
    ("max-attempts-huge", lambda: queue(max_attempts=10**9), "max_attempts", "1000000000"),
    ("item-backoff-huge", lambda: queue(item_backoff="999999999d"), "item_backoff", "'999999"),
    ("scope-nul", lambda: queue(scope=("id\x00",)), "scope", "'id\\x00'"),
    ("backoff-factor-inf", lambda: pgjobs.Backoff(factor=math.inf), "backoff.factor", "inf"),
    ("backoff-factor-nan", lambda: pgjobs.Backoff(factor=math.nan), "backoff.factor", "nan"),
    ("backoff-factor-bool", lambda: pgjobs.Backoff(factor=True), "backoff.factor", "True"),
    ("backoff-jitter-nan", lambda: pgjobs.Backoff(jitter=math.nan), "backoff.jitter", "nan"),
    ("backoff-initial-inf", lambda: pgjobs.Backoff(initial=math.inf), "backoff.initial", "inf"),
    ("backoff-max-huge", lambda: pgjobs.Backoff(factor=2, max="1000000d"), "backoff.max", "'1000"),
    ("backoff-max-short", lambda: pgjobs.Backoff(initial="1h", max="1m"), "backoff.max", "'1m'"),
    ("runner-namespace", lambda: pgjobs.Runner(None, namespace="a\x00"), "namespace", "'a\\x00'"),
    ("runner-schema", lambda: pgjobs.Runner(None, schema="s\x00"), "schema", "'s\\x00'"),
    (
        "scheduler-namespace",
        lambda: pgjobs.Scheduler([task()], None, namespace="a\x00"),
        "namespace",
        "'a\\x00'",
    ),
    (
        "config-keep-runs",
        lambda: pgjobs.Config(keep_runs=timedelta(days=10**6)),
        "keep_runs",
        "days=1000000",
    ),
    (
        "scheduler-keep-runs",
        lambda: pgjobs.Scheduler([task()], None, keep_runs=math.inf),
        "keep_runs",
        "inf",
    ),
]


@pytest.mark.parametrize(
    ("case", "factory", "field", "value"), CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION]
)
def test_construction_refuses_naming_the_field_and_the_value(
    case: str, factory: Callable[[], object], field: str, value: str
) -> None:
    with pytest.raises(pgjobs.ConfigError) as info:
        factory()
    message = str(info.value)
    assert field in message and value in message, message


def test_the_largest_values_are_accepted() -> None:
    job = queue(
        every="36525d",
        backoff=pgjobs.Backoff(initial="1s", factor=10, max="36525d"),
        lock_timeout=timedelta(milliseconds=2**31 - 1),
        statement_timeout=0,
        batch_size=100_000,
        max_attempts=1_000,
    )
    assert job.interval == timedelta(days=36525) and job.statement_timeout == timedelta(0)
    assert recompute(chunk_parents=100_000).chunk_parents == 100_000
    assert task(lock_timeout="1ms").lock_timeout == timedelta(milliseconds=1)
    assert task(busy_retry=0).busy_retry is None  # 0 turns the retry off rather than spin


# -- backoff arithmetic that used to overflow ----------------------------------------------
@pytest.mark.parametrize("failures", [1_100, 10**6, 2**31 - 1, 10**30])
def test_a_growing_backoff_stops_at_its_cap_however_many_failures(failures: int) -> None:
    backoff = pgjobs.Backoff(initial="1s", factor=2, max="36525d", jitter=0.5)
    delay = backoff.delay(failures)
    assert timedelta(days=36525 / 2) <= delay <= timedelta(days=36525 * 1.5)
    # ... and now + delay is still a datetime
    assert datetime.now(UTC) + delay > datetime.now(UTC)


def test_a_failed_job_with_the_longest_backoff_records_it_and_backs_off(engine: Engine) -> None:
    def fail(conn: Any) -> None:
        raise RuntimeError("boom")

    job = pgjobs.TaskJob(
        name="f", run=fail, backoff=pgjobs.Backoff(initial="1m", factor=2, max="36525d")
    )
    first = run_tick(job, engine)
    assert first.outcome == "failed" and first.next_attempt_at is not None
    # A failure count in the billions (years of failing every tick) still backs off.
    with engine.begin() as conn:
        conn.execute(text("update pgjobs.job_state set failures = 2000000000 where job = 'f'"))
    again = run_tick(job, engine, force=True)
    assert again.outcome == "failed" and again.next_attempt_at is not None
    assert again.next_attempt_at - datetime.now(UTC) > timedelta(days=36000)
    assert run_tick(job, engine).outcome == "backing_off"
    with engine.connect() as conn:
        failures = conn.execute(text("select failures from pgjobs.job_state where job = 'f'"))
        assert failures.scalar_one() == 2000000001


# -- the scheduler names the config key of a cron APScheduler refuses ------------------------
def _bypass_cron(job: pgjobs.Job, cron: str) -> None:
    # The job's own check would refuse it; this is the scheduler's second line.
    object.__setattr__(job, "every", None)
    object.__setattr__(job, "cron", cron)


def test_the_scheduler_names_the_job_of_a_cron_it_cannot_parse(tmp_path: Path) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text("[jobs.t]\nkind = 'task'\nsql = 'select 1'\ncron = '0 * * * *'\n")
    config = load_config(path)
    _bypass_cron(config.jobs[0], "61 * * * *")
    registry = Registry.load(config, entry_points=False)
    with pytest.raises(pgjobs.ConfigError) as info:
        pgjobs.Scheduler(registry, "postgresql://nobody@127.0.0.1:1/none")
    assert str(info.value).startswith(f"{path}: jobs.t.cron: "), info.value
    assert "'61 * * * *'" in str(info.value)
    job = task()
    _bypass_cron(job, "61 * * * *")
    with pytest.raises(pgjobs.ConfigError, match=r"^job 't' \(plugin 'application'\): cron: "):
        pgjobs.Scheduler([job], "postgresql://nobody@127.0.0.1:1/none")


# -- from pgjobs.toml, through the CLI ------------------------------------------------------
TASK = "[jobs.t]\nkind = 'task'\nsql = 'select 1'\n"
RECOMPUTE = "[jobs.r]\nkind = 'recompute'\ntarget = 'score'\nsql = 'select 1 as id'\n"
QUEUE = "[jobs.q]\nkind = 'queue'\ntarget = 'score'\nscope = 'id'\nsql = 'select 1 as id'\n"

PLUGIN = """
import pgjobs

@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.RecomputeJob(name="p-recompute", target="score", compute="select 1 as id"))
    register(pgjobs.QueueJob(name="p-queue", target="score", scope="id", compute="select 1"))
    register(pgjobs.TaskJob(name="p-task", run=lambda conn: None))
"""

#: (case, file body, job to run, the key path, the value as the message shows it)
BAD_FILES: list[tuple[str, str, str, str, str]] = [
    ("namespace-nul", 'namespace = "app\\u0000"\n' + TASK, "t", "namespace", "'app\\x00'"),
    ("schema-nul", 'schema = "s\\u0000"\n' + TASK, "t", "schema", "'s\\x00'"),
    ("keep-runs-huge", 'keep_runs = "99999999999d"\n' + TASK, "t", "keep_runs", "'99999999999d'"),
    ("prune-every-inf", "prune_every = inf\n" + TASK, "t", "prune_every", "inf"),
    ("keep-runs-nan", "keep_runs = nan\n" + TASK, "t", "keep_runs", "nan"),
    ("every-huge", TASK + 'every = "99999999999d"\n', "t", "jobs.t.every", "'99999999999d'"),
    ("every-inf", TASK + "every = inf\n", "t", "jobs.t.every", "inf"),
    ("every-nan", TASK + "every = nan\n", "t", "jobs.t.every", "nan"),
    ("every-huge-int", TASK + "every = 99999999999999\n", "t", "jobs.t.every", "99999999999999"),
    ("every-negative", TASK + "every = -1\n", "t", "jobs.t.every", "-1"),
    (
        "statement-timeout-30d",
        TASK + 'statement_timeout = "30d"\n',
        "t",
        "jobs.t.statement_timeout",
        "'30d'",
    ),
    (
        "lock-timeout-sub-ms",
        TASK + 'lock_timeout = "0.5ms"\n',
        "t",
        "jobs.t.lock_timeout",
        "'0.5ms'",
    ),
    ("backoff-huge", TASK + 'backoff = "999999999d"\n', "t", "jobs.t.backoff", "'999999999d'"),
    (
        "backoff-factor-inf",
        TASK + 'backoff = { initial = "1s", factor = inf }\n',
        "t",
        "jobs.t.backoff",
        "inf",
    ),
    (
        "backoff-factor-nan",
        TASK + 'backoff = { initial = "1s", factor = nan }\n',
        "t",
        "jobs.t.backoff",
        "nan",
    ),
    (
        "backoff-max-huge",
        TASK + 'backoff = { factor = 2, max = "1000000d" }\n',
        "t",
        "jobs.t.backoff.max",
        "'1000000d'",
    ),
    (
        "backoff-max-short",
        TASK + 'backoff = { initial = "1h", max = "1m" }\n',
        "t",
        "jobs.t.backoff",
        "'1m'",
    ),
    (
        "busy-retry-huge",
        TASK + 'busy_retry = "99999999999d"\n',
        "t",
        "jobs.t.busy_retry",
        "'99999999999d'",
    ),
    ("cron-out-of-range", TASK + 'cron = "61 * * * *"\n', "t", "jobs.t.cron", "'61 * * * *'"),
    ("cron-never-fires", TASK + 'cron = "0 0 31 2 *"\n', "t", "jobs.t.cron", "'0 0 31 2 *'"),
    ("cron-step-0", TASK + 'cron = "*/0 * * * *"\n', "t", "jobs.t.cron", "'*/0 * * * *'"),
    ("group-nul", TASK + 'group = "g\\u0000"\n', "t", "jobs.t.group", "'g\\x00'"),
    ("description-nul", TASK + 'description = "d\\u0000"\n', "t", "jobs.t.description", "'d\\x00'"),
    (
        "sql-nul",
        TASK.replace("'select 1'", '"select 1\\u0000"'),
        "t",
        "jobs.t.sql",
        "'select 1\\x00'",
    ),
    ("name-nul", TASK.replace("jobs.t", 'jobs."t\\u0000"'), "t", "jobs.t\\x00", "'t\\x00'"),
    (
        "target-nul",
        RECOMPUTE.replace("'score'", '"score\\u0000"'),
        "r",
        "jobs.r.target",
        "'score\\x00'",
    ),
    ("key-nul", RECOMPUTE + 'key = ["id\\u0000"]\n', "r", "jobs.r.key[0]", "'id\\x00'"),
    (
        "parents-table-nul",
        RECOMPUTE
        + 'parents = [{ table = "p\\u0000", columns = ["id"], parent_columns = ["id"] }]\n',
        "r",
        "jobs.r.parents[0].table",
        "'p\\x00'",
    ),
    (
        "chunk-parents-huge",
        RECOMPUTE + "chunk_parents = 1000000000000\n",
        "r",
        "jobs.r.chunk_parents",
        "1000000000000",
    ),
    ("chunk-parents-on-queue", QUEUE + "chunk_parents = 10\n", "q", "jobs.q.chunk_parents", "10"),
    (
        "batch-size-huge",
        QUEUE + "batch_size = 1000000000000\n",
        "q",
        "jobs.q.batch_size",
        "1000000000000",
    ),
    ("batch-size-on-recompute", RECOMPUTE + "batch_size = 10\n", "r", "jobs.r.batch_size", "10"),
    (
        "max-attempts-huge",
        QUEUE + "max_attempts = 1000000000\n",
        "q",
        "jobs.q.max_attempts",
        "1000000000",
    ),
    (
        "item-backoff-huge",
        QUEUE + 'item_backoff = "999999999d"\n',
        "q",
        "jobs.q.item_backoff",
        "'999999999d'",
    ),
    (
        "scope-nul",
        QUEUE.replace("scope = 'id'", 'scope = "id\\u0000"'),
        "q",
        "jobs.q.scope",
        "'id\\x00'",
    ),
    ("key-on-task", TASK + "key = 'id'\n", "t", "jobs.t.key", "'id'"),
    # overrides of a plugin's jobs
    ("override-every-inf", "[jobs.p-task]\nevery = inf\n", "p-task", "jobs.p-task.every", "inf"),
    (
        "override-timeout-30d",
        '[jobs.p-recompute]\nstatement_timeout = "30d"\n',
        "p-recompute",
        "jobs.p-recompute.statement_timeout",
        "'30d'",
    ),
    (
        "override-backoff-huge",
        '[jobs.p-queue]\nbackoff = "999999999d"\n',
        "p-queue",
        "jobs.p-queue.backoff",
        "'999999999d'",
    ),
    (
        "override-cron",
        '[jobs.p-task]\ncron = "0 25 * * *"\n',
        "p-task",
        "jobs.p-task.cron",
        "'0 25 * * *'",
    ),
    (
        "override-batch-size-huge",
        "[jobs.p-queue]\nbatch_size = 1000000000000\n",
        "p-queue",
        "jobs.p-queue.batch_size",
        "1000000000000",
    ),
    (
        "override-max-attempts-0",
        "[jobs.p-queue]\nmax_attempts = 0\n",
        "p-queue",
        "jobs.p-queue.max_attempts",
        "0",
    ),
    (
        "override-chunk-parents-on-queue",
        "[jobs.p-queue]\nchunk_parents = 10\n",
        "p-queue",
        "jobs.p-queue: chunk_parents: applies to recompute jobs; 'p-queue' is a queue job",
        "10",
    ),
    (
        "override-batch-size-on-recompute",
        "[jobs.p-recompute]\nbatch_size = 10\n",
        "p-recompute",
        "jobs.p-recompute: batch_size: applies to queue jobs; 'p-recompute' is a recompute job",
        "10",
    ),
    (
        "override-key-on-task",
        "[jobs.p-task]\nkey = 'id'\n",
        "p-task",
        "jobs.p-task: key: applies to recompute and queue jobs; 'p-task' is a task job",
        "'id'",
    ),
    (
        "override-item-backoff-on-task",
        '[jobs.p-task]\nitem_backoff = "1m"\n',
        "p-task",
        "jobs.p-task: item_backoff: applies to queue jobs",
        "'1m'",
    ),
    (
        "override-target",
        '[jobs.p-recompute]\ntarget = "other"\n',
        "p-recompute",
        "jobs.p-recompute.target: only a job declared here",
        "'other'",
    ),
    (
        "override-parents-nul",
        '[jobs.p-queue]\nparents = [{ table = "p\\u0000", columns = ["id"], parent_columns = ["id"] }]\n',
        "p-queue",
        "jobs.p-queue.parents[0].table",
        "'p\\x00'",
    ),
]


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[str]:
    name = f"badinput_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("case", "body", "job", "key", "value"), BAD_FILES, ids=[b[0] for b in BAD_FILES]
)
def test_a_bad_config_file_exits_2_naming_file_key_and_value_and_writes_nothing(
    pg_server: str,
    tmp_path: Path,
    plugin: str,
    case: str,
    body: str,
    job: str,
    key: str,
    value: str,
) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text(f'plugins = ["{plugin}"]\n' + body)
    with fresh_database(pg_server) as url:
        for args in (["list"], ["once", job, "--no-check", "--database", url]):
            result = CliRunner().invoke(cli, [args[0], "-c", str(path), *args[1:]])
            assert result.exit_code == 2, (args, result.output, result.exception)
            message = result.stderr
            assert message.startswith(f"pgjobs: error: {path}: "), message
            assert f"{path}: {key}" in message and value in message, message
            assert "Traceback" not in result.output
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                assert not conn.execute(
                    text("select exists (select from pg_namespace where nspname = 'pgjobs')")
                ).scalar()
        finally:
            engine.dispose()


def test_the_table_covers_every_limit() -> None:
    # Each setting with a limit has a bad file above (a new limit needs a case).
    keys = {b[3].split(":")[0].split(".")[-1].split("[")[0] for b in BAD_FILES}
    assert {
        "every",
        "cron",
        "backoff",
        "busy_retry",
        "keep_runs",
        "prune_every",
        "lock_timeout",
        "statement_timeout",
        "batch_size",
        "chunk_parents",
        "max_attempts",
        "item_backoff",
        "namespace",
        "schema",
        "group",
        "target",
        "key",
        "scope",
        "table",
    } <= keys
