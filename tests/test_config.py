"""pgjobs.toml parsing: no database needed."""

from __future__ import annotations

import re
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import pgjobs
from pgjobs.config import (
    OVERRIDE_KEYS,
    SETTINGS,
    Config,
    JobOverride,
    find_config,
    load_config,
    parse_config,
)
from pgjobs.registry import Registry


def write(tmp_path: Path, text: str, name: str = "pgjobs.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_full_file(tmp_path: Path) -> None:
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "totals.sql").write_text(
        "select day, count(*) as n from event group by day;\n"
    )
    path = write(
        tmp_path,
        """
        database = "postgresql://app@db/app"
        namespace = "shop"
        schema = "jobs"
        plugins = ["shop.jobs", "shop.more"]
        timezone = "Europe/Paris"
        keep_runs = "3d"
        prune_every = "30m"

        [jobs.exam-scores]
        every = "5m"
        backoff = { initial = "10m", factor = 2, max = "4h" }
        enabled = false

        [jobs.totals]
        kind = "recompute"
        target = "reporting.daily_total"
        sql_file = "sql/totals.sql"
        key = "day"
        cron = "*/10 * * * *"
        lock_timeout = "2s"
        statement_timeout = "10m"
        synchronous_commit = true

        [jobs.worker]
        kind = "queue"
        target = "exam_score"
        scope = ["exam_id"]
        sql = "select * from exam_score_source where exam_id = any(:keys)"
        batch_size = 50
        max_attempts = 3
        item_backoff = "1m"
        parents = [{ table = "exam", columns = ["exam_id"], parent_columns = ["id"] }]

        [jobs.cleanup]
        kind = "task"
        sql = "delete from session where expires_at < now()"
        every = "1h"
        """,
    )
    config = load_config(path)
    assert config.path == path
    assert config.database == "postgresql://app@db/app"
    assert (config.namespace, config.schema, config.timezone) == ("shop", "jobs", "Europe/Paris")
    assert config.plugins == ("shop.jobs", "shop.more")
    assert config.keep_runs == timedelta(days=3) and config.prune_every == timedelta(minutes=30)

    override = config.overrides["exam-scores"]
    assert override.every == timedelta(minutes=5) and override.enabled is False
    assert override.backoff == pgjobs.Backoff(initial="10m", factor=2, max="4h")

    jobs = {job.name: job for job in config.jobs}
    totals = jobs["totals"]
    assert isinstance(totals, pgjobs.RecomputeJob)
    assert totals.compute == "select day, count(*) as n from event group by day;\n"
    assert totals.target == "reporting.daily_total" and totals.key == ("day",)
    assert totals.cron == "*/10 * * * *" and totals.every is None
    assert totals.lock_timeout == timedelta(seconds=2)
    assert totals.synchronous_commit is True
    assert totals.group == "reporting.daily_total"

    worker = jobs["worker"]
    assert isinstance(worker, pgjobs.QueueJob)
    assert worker.scope == ("exam_id",) and worker.batch_size == 50 and worker.max_attempts == 3
    assert worker.parents == (
        pgjobs.Parent(table="exam", columns=("exam_id",), parent_columns=("id",)),
    )
    assert worker.item_backoff == pgjobs.Backoff(initial="1m")
    assert worker.synchronous_commit is False  # derived-data jobs commit asynchronously

    cleanup = jobs["cleanup"]
    assert isinstance(cleanup, pgjobs.TaskJob) and cleanup.interval == timedelta(hours=1)
    assert cleanup.synchronous_commit is True


def test_no_file_means_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGJOBS_CONFIG", raising=False)
    assert find_config() is None
    config = load_config()
    assert config == Config()
    assert (
        config.namespace == "pgjobs" and config.jobs == () and config.source == "<no config file>"
    )


def test_where_the_file_is_looked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = write(tmp_path, 'namespace = "local"')
    named = write(tmp_path, 'namespace = "named"', "other.toml")
    env = write(tmp_path, 'namespace = "env"', "env.toml")
    monkeypatch.delenv("PGJOBS_CONFIG", raising=False)
    assert find_config() == Path("pgjobs.toml") and local.exists()
    monkeypatch.setenv("PGJOBS_CONFIG", str(env))
    assert load_config().namespace == "env"
    assert load_config(named).namespace == "named"
    monkeypatch.setenv("PGJOBS_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(
        pgjobs.ConfigError, match=r"\$PGJOBS_CONFIG: no such config file: .*missing.toml"
    ):
        load_config()
    with pytest.raises(pgjobs.ConfigError, match=r"--config: no such config file: 'nope.toml'"):
        load_config("nope.toml")


def test_the_database_url_comes_from_the_flag_the_environment_or_the_file() -> None:
    config = Config(database="postgresql://file/db")
    assert config.database_url(env={}) == "postgresql://file/db"
    assert (
        config.database_url(env={"PGJOBS_DATABASE_URL": "postgresql://env/db"})
        == "postgresql://env/db"
    )
    assert (
        config.database_url(
            "postgresql://flag/db", env={"PGJOBS_DATABASE_URL": "postgresql://env/db"}
        )
        == "postgresql://flag/db"
    )
    assert Config().database_url(env={}) is None


BAD = [
    # (file content, what the message must contain besides the file name)
    ('databse = "postgresql://x/y"', ["databse: unknown key", "'databse'"]),
    ('database = "mysql://x/y"', ["database: expected a postgresql:// URL", "'mysql://x/y'"]),
    ("namespace = 3", ["namespace: expected a non-empty string", "3"]),
    ('plugins = "shop.jobs"', ["plugins: expected a list of module names", "'shop.jobs'"]),
    ('keep_runs = "a week"', ["keep_runs: expected a duration", "'a week'"]),
    ('timezone = "Mars/Olympus"', ["timezone: expected an IANA time zone", "'Mars/Olympus'"]),
    ("jobs = 3", ["jobs: expected a table of jobs", "3"]),
    ("[jobs.scores]\nevry = '5m'", ["jobs.scores.evry: unknown key", "'evry'"]),
    ("[jobs.scores]\nevery = 'soon'", ["jobs.scores.every: expected a duration", "'soon'"]),
    ("[jobs.scores]\nevery = -5", ["jobs.scores.every: must not be negative", "-5"]),
    ("[jobs.scores]\nevery = '0s'", ["jobs.scores.every: must be positive", "'0s'"]),
    ("[jobs.scores]\nenabled = 'no'", ["jobs.scores.enabled: expected true or false", "'no'"]),
    (
        "[jobs.scores]\nbatch_size = 'ten'",
        ["jobs.scores.batch_size: expected a positive integer", "'ten'"],
    ),
    (
        "[jobs.scores]\nbackoff = { initial = '1h', tries = 3 }",
        ["jobs.scores.backoff.tries: unknown key"],
    ),
    ("[jobs.scores]\nbackoff = { factor = 0.5 }", ["jobs.scores.backoff: backoff.factor", "0.5"]),
    (
        "[jobs.scores]\nevery = '5m'\ncron = '* * * * *'",
        ["jobs.scores: every, cron: give one of them"],
    ),
    ("[jobs.scores]", ["jobs.scores: expected settings to override"]),
    (
        "[jobs.scores]\nkind = 'materialized'",
        ["jobs.scores.kind: expected one of recompute, queue, task", "'materialized'"],
    ),
    ("[jobs.s]\nkind = 'recompute'\nsql = 'select 1'", ["jobs.s.target: required"]),
    ("[jobs.s]\nkind = 'recompute'\ntarget = 't'", ["jobs.s.sql: required"]),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 'a.b.c'\nsql = 'select 1'",
        ["jobs.s.target: expected a table name", "'a.b.c'"],
    ),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 't'\nsql = 'x'\nsql_file = 'x.sql'",
        ["jobs.s.sql_file: give sql or sql_file, not both"],
    ),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 't'\nsql_file = 'missing.sql'",
        ["jobs.s.sql_file: cannot read", "missing.sql"],
    ),
    (
        "[jobs.s]\nkind = 'task'\nsql = 'select 1'\nscope = 'id'",
        ["jobs.s.scope: applies to recompute and queue jobs, not task jobs", "'id'"],
    ),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 't'\nsql = 'select 1'\nbatch_size = 5",
        ["jobs.s.batch_size: applies to queue jobs", "5"],
    ),
    ("[jobs.s]\nkind = 'queue'\ntarget = 't'\nsql = 'select 1'", ["jobs.s.scope: required"]),
    (
        "[jobs.s]\nkind = 'queue'\ntarget = 't'\nsql = 'select 1'\nscope = []",
        ["jobs.s.scope: expected a column name", "[]"],
    ),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 't'\nsql = 'select 1'\ncron = '* *'",
        ["jobs.s.cron: expected 5 crontab fields", "'* *'"],
    ),
    (
        "[jobs.'bad name']\nkind = 'task'\nsql = 'select 1'",
        ["jobs.bad name: TaskJob.name", "'bad name'"],
    ),
    (
        "[jobs.s]\nkind = 'recompute'\ntarget = 't'\nsql = 'select 1'\n"
        "parents = [{ table = 'p', columns = ['a'] }]",
        ["jobs.s.parents[0].parent_columns: required"],
    ),
    ("namespace = \n", ["not valid TOML", "line 1"]),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[b[1][0][:40] for b in BAD])
def test_every_error_names_the_file_the_key_and_the_value(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(pgjobs.ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for part in expected:
        assert part in message, message


def test_an_override_of_every_drops_cron_and_batch_size_fits_queue_jobs_only() -> None:
    cron_job = pgjobs.TaskJob(name="t", run=lambda conn: None, every=None, cron="0 * * * *")
    changed = JobOverride(every=timedelta(seconds=30)).apply(cron_job)
    assert changed.every == timedelta(seconds=30) and changed.cron is None
    back = JobOverride(cron="*/5 * * * *").apply(changed)
    assert back.cron == "*/5 * * * *" and back.every is None
    assert JobOverride().apply(cron_job) is cron_job
    with pytest.raises(
        pgjobs.ConfigError, match="batch_size: applies to queue jobs; 't' is a task job"
    ):
        JobOverride(batch_size=10).apply(cron_job)
    queue = pgjobs.QueueJob(name="q", target="t", scope="id", compute="select 1")
    assert JobOverride(batch_size=10, group="g").apply(queue).replace().group == "g"
    assert JobOverride(batch_size=10).apply(queue).batch_size == 10  # type: ignore[attr-defined]


def test_parse_config_takes_an_already_parsed_document() -> None:
    config = parse_config({"namespace": "x", "jobs": {"a": {"kind": "task", "sql": "select 1"}}})
    assert config.namespace == "x" and [j.name for j in config.jobs] == ["a"]
    with pytest.raises(pgjobs.ConfigError, match=r"^<config>: jobs.a.kind"):
        parse_config({"jobs": {"a": {"kind": "nope"}}})


# -- every setting, on a plugin's job and on a declared one ---------------------------------
class _Plugin:
    """Registers one job of each kind, each setting unlike the overrides below."""

    @pgjobs.hookimpl
    def pgjobs_register_jobs(self, register: Any) -> None:
        register(
            pgjobs.RecomputeJob(
                name="p-recompute", target="r_target", compute="select 1", synchronous_commit=True
            )
        )
        register(
            pgjobs.QueueJob(
                name="p-queue",
                target="q_target",
                scope="id",
                compute="select 1",
                synchronous_commit=True,
            )
        )
        register(pgjobs.TaskJob(name="p-task", run=lambda conn: None))


def _registry(path: Path | None) -> Registry:
    config = load_config(path) if path is not None else Config()
    return Registry.load(config, plugins=[_Plugin()], entry_points=False)


#: (setting, its TOML value, the job's attribute, what the job then holds)
OVERRIDES: list[tuple[str, str, str, Any]] = [
    ("every", '"5m"', "interval", timedelta(minutes=5)),
    ("cron", '"*/5 * * * mon-fri"', "cron", "*/5 * * * mon-fri"),
    ("timezone", '"Europe/Paris"', "timezone", "Europe/Paris"),
    ("group", '"g"', "group", "g"),
    (
        "backoff",
        '{ initial = "10m", factor = 2, max = "4h", jitter = 0.1 }',
        "backoff",
        pgjobs.Backoff(initial="10m", factor=2, max="4h", jitter=0.1),
    ),
    ("lock_timeout", '"2s"', "lock_timeout", timedelta(seconds=2)),
    ("statement_timeout", '"10m"', "statement_timeout", timedelta(minutes=10)),
    ("busy_retry", '"1s"', "busy_retry", timedelta(seconds=1)),
    ("synchronous_commit", "false", "synchronous_commit", False),
    ("enabled", "false", "enabled", False),
    ("description", '"nightly totals"', "description", "nightly totals"),
    ("key", '["id", "day"]', "key", ("id", "day")),
    (
        "parents",
        '[{ table = "s.p", columns = ["id"], parent_columns = ["pid"] }]',
        "parents",
        (pgjobs.Parent(table="s.p", columns=("id",), parent_columns=("pid",)),),
    ),
    ("columns", '["total"]', "columns", ("total",)),
    ("flow", "false", "flow", False),
    ("chunk_parents", "500", "chunk_parents", 500),
    ("chunk_rows", "2500", "chunk_rows", 2500),
    ("atomic", "true", "atomic", True),
    ("verify_every", '"2h"', "verify_every", timedelta(hours=2)),
    ("sliced", "false", "sliced", False),
    ("slice_seconds", '"5s"', "slice_seconds", timedelta(seconds=5)),
    ("slice_pause", "0.25", "slice_pause", 0.25),
    ("batch_size", "7", "batch_size", 7),
    ("workers", "3", "workers", 3),
    ("max_attempts", "9", "max_attempts", 9),
    ("item_backoff", '"2m"', "item_backoff", pgjobs.Backoff(initial="2m")),
]
_DECLARE = {
    "recompute": "kind = 'recompute'\ntarget = 'd_target'\nsql = 'select 1'\n",
    "queue": "kind = 'queue'\ntarget = 'd_target'\nscope = 'id'\nsql = 'select 1'\n",
    "task": "kind = 'task'\nsql = 'select 1'\n",
}


def test_the_override_table_covers_every_setting() -> None:
    assert [o[0] for o in OVERRIDES] == list(OVERRIDE_KEYS) == list(SETTINGS)


@pytest.mark.parametrize(
    ("key", "value", "attr", "expected"), OVERRIDES, ids=[o[0] for o in OVERRIDES]
)
def test_every_setting_overrides_a_plugins_job_of_the_kinds_it_fits(
    tmp_path: Path, key: str, value: str, attr: str, expected: Any
) -> None:
    original = _registry(None)
    for kind in ("recompute", "queue", "task"):
        path = write(tmp_path, f"[jobs.p-{kind}]\n{key} = {value}\n")
        if kind in SETTINGS[key]:
            job = _registry(path).get(f"p-{kind}")
            assert getattr(original.get(f"p-{kind}"), attr) != expected  # it did change
            assert getattr(job, attr) == expected, kind
        else:
            with pytest.raises(pgjobs.ConfigError) as info:
                _registry(path)
            message = str(info.value)
            assert message.startswith(f"{path}: jobs.p-{kind}: {key}: applies to "), message
            assert f"'p-{kind}' is a {kind} job, got {tomllib.loads(f'v = {value}')['v']!r}" in (
                message
            )


@pytest.mark.parametrize(
    ("key", "value", "attr", "expected"), OVERRIDES, ids=[o[0] for o in OVERRIDES]
)
def test_a_declared_job_takes_the_same_settings(
    tmp_path: Path, key: str, value: str, attr: str, expected: Any
) -> None:
    for kind, head in _DECLARE.items():
        path = write(tmp_path, f"[jobs.d]\n{head}{key} = {value}\n")
        if kind in SETTINGS[key]:
            (job,) = load_config(path).jobs
            assert getattr(job, attr) == expected, kind
        else:
            with pytest.raises(
                pgjobs.ConfigError,
                match=re.escape(f"{path}: jobs.d.{key}: applies to ")
                + f".* jobs, not {kind} jobs, got ",
            ):
                load_config(path)


def test_an_override_of_busy_retry_0_turns_the_retry_off(tmp_path: Path) -> None:
    path = write(tmp_path, "[jobs.p-task]\nbusy_retry = 0\n")
    assert _registry(path).get("p-task").busy_retry is None


def test_an_override_of_a_plugin_jobs_own_parts_is_refused(tmp_path: Path) -> None:
    for key, value in (("target", "'x'"), ("sql", "'select 1'"), ("scope", "'id'")):
        path = write(tmp_path, f"[jobs.p-queue]\n{key} = {value}\n")
        with pytest.raises(
            pgjobs.ConfigError,
            match=re.escape(f"{path}: jobs.p-queue.{key}: only a job declared here"),
        ):
            load_config(path)


def test_an_overrides_values_are_checked_when_the_file_is_read(tmp_path: Path) -> None:
    # Before any plugin is loaded: the same checks as the job's constructor.
    path = write(tmp_path, "[jobs.p-queue]\nitem_backoff = { initial = '1h', max = '10m' }\n")
    with pytest.raises(pgjobs.ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: jobs.p-queue.item_backoff: backoff.max: must not be shorter than "
        "backoff.initial (1h), got '10m'"
    )
