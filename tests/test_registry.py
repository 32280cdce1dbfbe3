"""The registry: plugins from entry points and config modules, owners,
duplicates, group conflicts, and checks against a real database."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs.checks import check_jobs
from pgjobs.config import Config, load_config
from pgjobs.registry import Registry, get_registry, set_registry


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Module names a test creates; forgotten afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def plugin_module(directory: Path, modules: list[str], body: str, prefix: str = "plug") -> str:
    """Write a plugin module into ``directory``; return its (unique) name."""
    name = unique(prefix)
    (directory / f"{name}.py").write_text(
        "import pgjobs\n\n" + textwrap.dedent(body), encoding="utf-8"
    )
    modules.append(name)
    return name


def plugin(body: str) -> types.ModuleType:
    """An in-memory plugin module."""
    module = types.ModuleType(unique("mem"))
    exec("import pgjobs\n\n" + textwrap.dedent(body), module.__dict__)
    return module


def fake_distribution(site: Path, modules: list[str], dist: str, entry: str, body: str) -> str:
    """An installed distribution with a ``pgjobs`` entry point, as pip would
    leave it: ``<dist>.dist-info`` with METADATA and entry_points.txt."""
    module = plugin_module(site, modules, body, prefix=dist.replace("-", "_"))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[pgjobs]\n{entry} = {module}\n")
    return module


TASK = """
@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.TaskJob(name={name!r}, run=lambda conn: None, every="1m"))
"""


# -- config modules and plugin objects -------------------------------------------------
def test_config_modules_are_loaded_from_next_to_the_config_file(
    tmp_path: Path, modules: list[str]
) -> None:
    name = plugin_module(tmp_path, modules, TASK.format(name="nightly"))
    path = tmp_path / "pgjobs.toml"
    path.write_text(f'plugins = ["{name}"]\n\n[jobs.nightly]\nevery = "2h"\ngroup = "g"\n')
    registry = Registry.load(load_config(path))
    job = registry.get("nightly")
    assert registry.owner("nightly") == name
    assert job.schedule == "every 2h" and job.group == "g"  # the override applied
    assert registry.plugins() == [name]
    assert str(tmp_path) not in sys.path  # only while importing


def test_plugin_objects_and_owners(tmp_path: Path) -> None:
    a = plugin(TASK.format(name="a"))
    b = plugin(
        """
        @pgjobs.hookimpl
        def pgjobs_register_jobs(register):
            register(pgjobs.TaskJob(name="b1", run=lambda conn: None))
            register(pgjobs.RecomputeJob(name="b2", target="t", compute="select 1"))
        """
    )
    registry = Registry.load(plugins=[a, b], entry_points=False)
    assert [(e.job.name, e.owner) for e in registry.entries()] == [
        ("a", a.__name__),
        ("b1", b.__name__),
        ("b2", b.__name__),
    ]
    assert (
        "b2" in registry and len(registry) == 3 and [j.name for j in registry] == ["a", "b1", "b2"]
    )


def test_mapped_changes_each_job_and_keeps_its_owner() -> None:
    a = plugin(TASK.format(name="a"))
    registry = Registry.load(plugins=[a], entry_points=False)
    mapped = registry.mapped(lambda job: job.replace(description=f"wrapped {job.name}"))
    assert [(e.job.name, e.owner, e.job.description) for e in mapped.entries()] == [
        ("a", a.__name__, "wrapped a")
    ]
    assert registry.get("a").description != "wrapped a"  # the original is left as it was


def test_a_duplicate_name_is_refused_naming_both_owners() -> None:
    a, b = plugin(TASK.format(name="same")), plugin(TASK.format(name="same"))
    with pytest.raises(pgjobs.PluginError) as info:
        Registry.load(plugins=[a, b], entry_points=False)
    assert f"job 'same' is registered twice: by '{a.__name__}' and by '{b.__name__}'" in str(
        info.value
    )


def test_a_config_job_with_a_plugins_name_is_refused_naming_both(tmp_path: Path) -> None:
    a = plugin(TASK.format(name="scores"))
    path = tmp_path / "pgjobs.toml"
    path.write_text("[jobs.scores]\nkind = 'task'\nsql = 'select 1'\n")
    with pytest.raises(pgjobs.ConfigError) as info:
        Registry.load(load_config(path), plugins=[a], entry_points=False)
    message = str(info.value)
    assert message.startswith(f"{path}: jobs.scores: job 'scores' is registered twice")
    assert f"by '{a.__name__}' and by '{path}'" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            """
            @pgjobs.hookimpl
            def pgjobs_register_jobs(register):
                register("scores")
            """,
            "registered 'scores': expected a pgjobs.RecomputeJob, QueueJob, TaskJob or Derived",
        ),
        (
            """
            @pgjobs.hookimpl
            def pgjobs_register_jobs(register):
                raise RuntimeError("no settings file")
            """,
            "pgjobs_register_jobs failed: RuntimeError: no settings file",
        ),
        (
            """
            @pgjobs.hookimpl
            def pgjobs_register_jobs(register):
                register(pgjobs.TaskJob(name="x", run=lambda conn: None, every="soon"))
            """,
            "pgjobs_register_jobs failed: ConfigError: TaskJob 'x': every: expected a duration",
        ),
        (
            """
            @pgjobs.hookimpl
            def pgjobs_register_job(register):
                pass
            """,
            "unknown hook 'pgjobs_register_job'",
        ),
        (
            """
            @pgjobs.hookimpl
            def pgjobs_register_jobs(add):
                pass
            """,
            "hook 'pgjobs_register_jobs'",
        ),
    ],
    ids=["not-a-job", "hook-raises", "invalid-job", "misspelt-hook", "wrong-argument"],
)
def test_a_broken_plugin_is_a_plugin_error_naming_it(body: str, expected: str) -> None:
    bad = plugin(body)
    with pytest.raises(pgjobs.PluginError) as info:
        Registry.load(plugins=[bad], entry_points=False)
    assert bad.__name__ in str(info.value)
    assert expected in str(info.value)


def test_a_missing_config_module_is_a_plugin_error(tmp_path: Path, modules: list[str]) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text('plugins = ["no_such_module_here"]\n')
    with pytest.raises(
        pgjobs.PluginError, match=r"plugins\[0\]: no module named 'no_such_module_here'"
    ):
        Registry.load(load_config(path))
    broken = plugin_module(tmp_path, modules, "import no_such_dependency_xyz\n")
    path.write_text(f'plugins = ["{broken}"]\n')
    with pytest.raises(pgjobs.PluginError, match=f"module '{broken}' failed to import"):
        Registry.load(load_config(path))


# -- entry points ------------------------------------------------------------------------
@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: list[str]) -> Path:
    """Two installed plugin distributions: pgjobs-fake-a (job a) and pgjobs-fake-b (job b)."""
    site = tmp_path / "site"
    site.mkdir()
    fake_distribution(site, modules, "pgjobs-fake-a", "fake-a", TASK.format(name="a"))
    fake_distribution(site, modules, "pgjobs-fake-b", "fake-b", TASK.format(name="b"))
    monkeypatch.syspath_prepend(str(site))
    return site


def test_installed_plugins_load_from_the_entry_point_group(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGJOBS_LOAD_PLUGINS")
    registry = Registry.load()
    assert {"a", "b"} <= {job.name for job in registry.jobs()}
    assert registry.owner("a") == "pgjobs-fake-a" and registry.owner("b") == "pgjobs-fake-b"


@pytest.mark.parametrize(
    ("load", "disable", "expected"),
    [
        ("fake-a,fake-b", None, {"a", "b"}),
        ("pgjobs-fake-a", None, {"a"}),  # a distribution name works too
        ("", None, set()),  # tests load none
        ("fake-a,fake-b", "fake-b", {"a"}),
        ("fake-a,fake-b", "pgjobs_fake_a", {"b"}),  # spelt like the distribution
        ("fake-a,fake-b", "fake-a, fake-b", set()),
    ],
)
def test_load_and_disable_plugins_by_name(
    site: Path, load: str, disable: str | None, expected: set[str]
) -> None:
    env = {"PGJOBS_LOAD_PLUGINS": load}
    if disable is not None:
        env["PGJOBS_DISABLE_PLUGINS"] = disable
    registry = Registry.load(env=env)
    assert {job.name for job in registry.jobs()} == expected


def test_loading_an_unknown_plugin_is_an_error_naming_it(site: Path) -> None:
    with pytest.raises(pgjobs.PluginError, match=r"no installed plugin named 'fake-c'"):
        Registry.load(env={"PGJOBS_LOAD_PLUGINS": "fake-a,fake-c"})


def test_a_plugin_that_fails_to_import_is_named(
    tmp_path: Path, site: Path, modules: list[str]
) -> None:
    fake_distribution(
        site, modules, "pgjobs-broken", "broken", "raise ImportError('needs numpy')\n"
    )
    with pytest.raises(pgjobs.PluginError) as info:
        Registry.load(env={"PGJOBS_LOAD_PLUGINS": "broken"})
    assert "plugin 'broken' (from pgjobs-broken) cannot be loaded: ImportError: needs numpy" in str(
        info.value
    )


def test_an_override_of_an_unregistered_job_is_an_error_unless_plugins_are_filtered(
    tmp_path: Path, site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pgjobs.toml"
    path.write_text("[jobs.b]\nevery = '5m'\n")
    config = load_config(path)
    assert Registry.load(config, env={"PGJOBS_LOAD_PLUGINS": "fake-a,fake-b"}).get(
        "b"
    ).schedule == ("every 5m")
    with pytest.raises(pgjobs.ConfigError) as info:
        Registry.load(load_config(path), entry_points=False, env={})
    assert f"{path}: jobs.b: no registered job is named 'b' (registered: none)" in str(info.value)
    # b's plugin switched off on purpose: its override must not stop everything.
    with caplog.at_level(logging.WARNING, logger="pgjobs.registry"):
        registry = Registry.load(
            config, env={"PGJOBS_DISABLE_PLUGINS": "fake-b", "PGJOBS_LOAD_PLUGINS": "fake-a"}
        )
    assert [j.name for j in registry.jobs()] == ["a"]
    assert "jobs.b overrides no registered job" in caplog.text


# -- an application names the installed plugins it loads: entry_points -----------------
def _app(tmp_path: Path, modules: list[str], entry_points: str | None) -> Path:
    """An application: its own jobs module and a pgjobs.toml naming it."""
    app = tmp_path / f"app{len(modules)}"
    app.mkdir()
    name = plugin_module(app, modules, TASK.format(name="mine"))
    lines = [f'plugins = ["{name}"]']
    if entry_points is not None:
        lines.append(f"entry_points = {entry_points}")
    path = app / "pgjobs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("entry_points", "expected"),
    [
        (None, {"mine", "a", "b"}),  # absent: every installed plugin, as before
        ("[]", {"mine"}),
        ('["fake-a"]', {"mine", "a"}),
        ('["pgjobs_fake_b"]', {"mine", "b"}),  # the distribution's name, spelt either way
    ],
)
def test_the_config_names_the_installed_plugins_it_loads(
    tmp_path: Path, site: Path, modules: list[str], entry_points: str | None, expected: set[str]
) -> None:
    config = load_config(_app(tmp_path, modules, entry_points))
    registry = Registry.load(config, env={})
    assert {"a", "b", "mine"} & {job.name for job in registry.jobs()} == expected


def test_the_argument_wins_over_the_environment_and_the_file(
    tmp_path: Path, site: Path, modules: list[str], engine: Engine
) -> None:
    path = _app(tmp_path, modules, '["fake-a"]')
    # the operator's environment over the file's ["fake-a"]
    registry = Registry.load(load_config(path), env={"PGJOBS_LOAD_PLUGINS": "fake-b"})
    assert {j.name for j in registry.jobs()} == {"mine", "b"}
    # the embedder's argument over both (conftest sets PGJOBS_LOAD_PLUGINS="")
    scheduler = pgjobs.Scheduler.from_config(path, database=engine, entry_points=[])
    assert [j.name for j in scheduler.registry.jobs()] == ["mine"]
    scheduler = pgjobs.Scheduler.from_config(path, database=engine, entry_points=["fake-b"])
    assert {j.name for j in scheduler.registry.jobs()} == {"mine", "b"}
    with pytest.raises(pgjobs.ConfigError, match="entry_points: expected a list"):
        pgjobs.Scheduler.from_config(path, database=engine, entry_points="fake-a")
    with pytest.raises(pgjobs.ConfigError, match="a registry or entry_points, not both"):
        pgjobs.Scheduler.from_config(
            path, database=engine, registry=Registry.from_jobs([]), entry_points=[]
        )

    async def app_lifespan() -> set[str]:
        async with pgjobs.lifespan(path, database=engine, entry_points=["fake-b"]) as state:
            return {j.name for j in state["pgjobs"].registry.jobs()}

    assert asyncio.run(app_lifespan()) == {"mine", "b"}


def test_load_plugins_accepts_a_module_of_the_config(
    tmp_path: Path, site: Path, modules: list[str]
) -> None:
    """``PGJOBS_LOAD_PLUGINS=myjobs``: just the application's own jobs."""
    path = _app(tmp_path, modules, None)
    config = load_config(path)
    (mine,) = config.plugins
    registry = Registry.load(config, env={"PGJOBS_LOAD_PLUGINS": mine})
    assert [j.name for j in registry.jobs()] == ["mine"]
    registry = Registry.load(config, env={"PGJOBS_DISABLE_PLUGINS": mine})
    assert "mine" not in registry and "a" in registry


def test_an_unknown_name_in_entry_points_names_the_file_and_the_key(
    tmp_path: Path, site: Path, modules: list[str]
) -> None:
    path = _app(tmp_path, modules, '["fake-a", "fake-c"]')
    with pytest.raises(pgjobs.ConfigError) as info:
        Registry.load(load_config(path), env={})
    message = str(info.value)
    assert message.startswith(f"{path}: entry_points: no installed plugin named 'fake-c'")
    assert "fake-a" in message.split("installed: ")[1]  # what there is to choose from
    path.write_text('entry_points = "fake-a"\n')
    with pytest.raises(pgjobs.ConfigError, match=r"pgjobs.toml: entry_points: expected a list"):
        load_config(path)
    with pytest.raises(pgjobs.ConfigError, match=r"entry_points: expected a list.*'fake-a'"):
        Config(entry_points="fake-a")  # type: ignore[arg-type]  # an embedder's mistake


def test_an_application_does_not_load_another_applications_installed_plugin(
    tmp_path: Path, modules: list[str]
) -> None:
    """pgjobs-example is installed (as the README's command and CI install
    it): an application whose pgjobs.toml says ``entry_points = []`` does not
    load it; one that names it does."""
    example = {"example-expire-sessions", "example-user-sessions"}
    installed = Registry.load(load_config(_app(tmp_path, modules, None)), env={})
    assert example <= {j.name for j in installed.jobs()}, "pgjobs-example is not installed"
    alone = Registry.load(load_config(_app(tmp_path, modules, "[]")), env={})
    assert [j.name for j in alone.jobs()] == ["mine"]
    assert alone.plugins() == [alone.owner("mine")]
    named = Registry.load(load_config(_app(tmp_path, modules, '["pgjobs-example"]')), env={})
    assert example <= {j.name for j in named.jobs()}
    assert named.owner("example-expire-sessions") == "pgjobs-example"


# -- groups ------------------------------------------------------------------------------
def test_jobs_writing_one_table_from_different_groups_are_refused(tmp_path: Path) -> None:
    a = plugin(
        """
        @pgjobs.hookimpl
        def pgjobs_register_jobs(register):
            register(pgjobs.RecomputeJob(name="full", target="exam_score", compute="select 1"))
        """
    )
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        "[jobs.worker]\nkind = 'queue'\ntarget = 'public.exam_score'\nscope = 'exam_id'\n"
        "sql = 'select 1'\ngroup = 'exams'\n"
    )
    with pytest.raises(pgjobs.ConfigError) as info:
        Registry.load(load_config(path), plugins=[a], entry_points=False)
    message = str(info.value)
    assert f"job 'full' (plugin '{a.__name__}') (group 'exam_score')" in message
    assert f"{path}: jobs.worker (group 'exams')" in message
    assert "both write table 'exam_score': jobs that write one table must share a group" in message

    # The same group (here by overriding the plugin's) is fine.
    path.write_text(path.read_text() + "\n[jobs.full]\ngroup = 'exams'\n")
    registry = Registry.load(load_config(path), plugins=[a], entry_points=False)
    assert {j.group for j in registry.jobs()} == {"exams"}


def test_from_jobs_validates_the_same_way() -> None:
    job = pgjobs.TaskJob(name="t", run=lambda conn: None)
    assert Registry.from_jobs([job]).get("t") is job
    with pytest.raises(pgjobs.ConfigError, match="must share a group"):
        Registry.from_jobs(
            [
                pgjobs.RecomputeJob(name="x", target="s.t", compute="select 1"),
                pgjobs.RecomputeJob(name="y", target="s.t", group="other", compute="select 1"),
            ]
        )
    with pytest.raises(pgjobs.ConfigError, match=r"no job named 'nope' \(registered: t\)"):
        Registry.from_jobs([job]).get("nope")


# -- the process-wide registry -------------------------------------------------------------
def test_run_once_finds_a_name_in_the_process_registry(engine: Engine) -> None:
    seen: list[int] = []
    job = pgjobs.TaskJob(name="by-name", run=lambda conn: seen.append(1))
    set_registry(Registry.from_jobs([job]))
    try:
        assert get_registry().get("by-name") is job
        result = pgjobs.run_once("by-name", engine)
    finally:
        set_registry(None)
    assert result.outcome == "ran" and seen == [1]


# -- checks against the database --------------------------------------------------------------
def _schema(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("create table exam (id int primary key)"))
        conn.execute(
            text(
                "create table exam_score (exam_id int not null references exam on delete cascade,"
                " student text not null, score int, primary key (exam_id, student))"
            )
        )
        conn.execute(text("create table loose (a int, b int)"))
        conn.execute(text("insert into exam values (1)"))


def _pgjobs_schema_exists(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("select exists (select from pg_namespace where nspname = 'pgjobs')")
            ).scalar()
        )


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            pgjobs.RecomputeJob(name="j", target="nope", compute="select 1"),
            "table 'nope' does not exist",
        ),
        (
            pgjobs.RecomputeJob(name="j", target="loose", compute="select 1 as a"),
            "no primary key",
        ),
        (
            pgjobs.RecomputeJob(name="j", target="loose", key="a", compute="select 1 as a"),
            "must be NOT NULL",
        ),
        (
            pgjobs.RecomputeJob(name="j", target="exam_score", key="student", compute="select 1"),
            "no unique index or constraint",
        ),
        (
            pgjobs.QueueJob(name="j", target="exam_score", scope="exam", compute="select 1"),
            "scope: 'exam_score' has no column(s) exam",
        ),
        (
            pgjobs.RecomputeJob(
                name="j", target="exam_score", compute="select exam_id from nowhere"
            ),
            'compute: the query fails: relation "nowhere" does not exist (SQLSTATE 42P01)',
        ),
        (
            pgjobs.RecomputeJob(
                name="j", target="exam_score", compute="select 1 as exam_id, 'x' as nme"
            ),
            "returns column(s) nme",
        ),
    ],
    ids=[
        "missing-table",
        "no-key",
        "nullable-key",
        "key-not-unique",
        "scope",
        "sql-fails",
        "sql-columns",
    ],
)
def test_check_names_the_job_and_what_is_wrong_and_writes_nothing(
    engine: Engine, job: pgjobs.Job, expected: str
) -> None:
    _schema(engine)
    owner = plugin(TASK.format(name="other"))
    registry = Registry.from_jobs([job], owner=owner.__name__)
    with pytest.raises(pgjobs.ConfigError) as info:
        check_jobs(engine, registry.entries())
    assert str(info.value).startswith(f"job 'j' (plugin '{owner.__name__}')"), info.value
    assert expected in str(info.value)
    assert not _pgjobs_schema_exists(engine)


def test_check_passes_good_jobs(engine: Engine) -> None:
    _schema(engine)
    registry = Registry.from_jobs(
        [
            pgjobs.RecomputeJob(
                name="scores",
                target="exam_score",
                compute="select id as exam_id, 'ann' as student, 1 as score from exam;",
            ),
            pgjobs.QueueJob(
                name="worker",
                target="exam_score",
                scope="exam_id",
                compute="select * from exam_score where exam_id = any(:keys)",
            ),
            pgjobs.TaskJob(name="anything", run=lambda conn: None),
        ]
    )
    check_jobs(engine, registry.entries())
    check_jobs(engine, [registry.entry("scores")])
    assert not _pgjobs_schema_exists(engine)
    with engine.connect() as conn:
        assert conn.execute(text("select count(*) from exam_score")).scalar() == 0


def test_check_names_the_config_key_for_config_jobs(engine: Engine, tmp_path: Path) -> None:
    _schema(engine)
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        "[jobs.scores]\nkind = 'recompute'\ntarget = 'exam_score'\n"
        "sql = 'select exam_id, student, scor from exam_score'\n"
    )
    registry = Registry.load(load_config(path), entry_points=False)
    with pytest.raises(pgjobs.ConfigError) as info:
        check_jobs(engine, registry.entries())
    assert str(info.value).startswith(f'{path}: jobs.scores.sql: the query fails: column "scor"')


def test_an_empty_config_and_no_plugins_is_an_empty_registry() -> None:
    registry = Registry.load(Config(), env={"PGJOBS_LOAD_PLUGINS": ""})
    assert len(registry) == 0 and registry.plugins() == []
