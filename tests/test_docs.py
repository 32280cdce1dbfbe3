"""The documentation site names every public setting: each key of
``pgjobs.toml``, each metric, each CLI command. (``.ci/run`` builds the site
with ``mkdocs build --strict``: a broken link or a missing API reference
fails it.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from pgjobs import config
from pgjobs.cli import cli
from pgjobs.database import normalize_url
from pgjobs.testing import run_sql

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _page(name: str) -> str:
    return (DOCS / "reference" / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("key", [k for k in config._TOP_KEYS if k != "jobs"])
def test_every_top_level_key_of_the_config_file_is_documented(key: str) -> None:
    assert f"| `{key}` |" in _page("config.md")


@pytest.mark.parametrize("key", sorted(config.SETTINGS))
def test_every_job_setting_is_documented(key: str) -> None:
    assert re.search(rf"`{re.escape(key)}`", _page("config.md")), key


def test_every_metric_is_documented() -> None:
    source = (Path(config.__file__).parent / "metrics.py").read_text(encoding="utf-8")
    names = set(re.findall(r'"(pgjobs_[a-z_]+)"', source))
    assert names, "no metric names found in pgjobs/metrics.py"
    page = _page("metrics.md")
    assert sorted(n for n in names if n not in page) == []


def test_every_cli_command_is_in_the_cli_at_a_glance() -> None:
    page = _page("cli.md")
    assert sorted(c for c in cli.commands if f"`pgjobs {c}" not in page) == []


def _blocks(page: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a page, as (language, text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", page, flags=re.M | re.S)


def test_getting_started_works_as_written(env_db: str, tmp_path: Path) -> None:
    """The page's tables, jobs and config, used as they stand: the first fill
    with ``pgjobs once``, then ``pgjobs run`` woken by the page's enqueue."""
    page = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    blocks = _blocks(page)
    (schema,) = [t for lang, t in blocks if lang == "sql"]
    (jobs,) = [t for lang, t in blocks if lang == "python" and t.startswith("# myjobs.py")]
    (toml,) = [t for lang, t in blocks if lang == "toml" and t.startswith("# pgjobs.toml")]
    (enqueue,) = [t for lang, t in blocks if lang == "python" and "pgjobs.enqueue(" in t]
    (tmp_path / "myjobs.py").write_text(jobs)
    (tmp_path / "pgjobs.toml").write_text(toml)
    engine = create_engine(env_db)
    try:
        run_sql(engine, schema)
        run_sql(engine, "insert into post values (1, 'first'), (2, 'second')")
        # PGJOBS_LOAD_PLUGINS="" (conftest) leaves out the installed plugins,
        # which a new user does not have; pgjobs.toml's plugins still load
        env = dict(os.environ)
        env["PGJOBS_DATABASE_URL"] = env_db
        command = [sys.executable, "-m", "pgjobs.cli"]
        listed = subprocess.run(
            [*command, "list"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert listed.returncode == 0, listed.stderr
        assert "post-scores" in listed.stdout and "post-score-worker" in listed.stdout
        once = subprocess.run(
            [*command, "once", "post-scores"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert once.returncode == 0, once.stderr
        with engine.connect() as conn:
            rows = conn.execute(text("select * from post_score order by 1")).all()
        assert [tuple(r) for r in rows] == [(1, 0, 0), (2, 0, 0)]
        run = subprocess.Popen(
            [*command, "run"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
        )
        try:
            # listening: the enqueue's notification will wake it
            _wait(
                engine,
                "select exists (select from pg_stat_activity"
                " where datname = current_database() and query like 'listen %')",
            )
            snippet = enqueue.replace(
                '"postgresql+psycopg://localhost/app"', repr(normalize_url(env_db))
            )
            # the application: a process of its own, as yours would be
            app = subprocess.run(
                [sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=60
            )
            assert app.returncode == 0, app.stderr
            _wait(engine, "select score = 1 and votes = 1 from post_score where post_id = 1")
            # the operator's enqueue, as the page writes it
            (shell,) = [t for lang, t in blocks if lang == "sh" and "pgjobs enqueue" in t]
            line = next(x for x in shell.splitlines() if x.startswith("pgjobs enqueue"))
            run_sql(engine, "insert into vote values (2, 'bob', 3)")
            words = line.split("#")[0].split()[1:]
            queued = subprocess.run(
                [*command, *words],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert queued.returncode == 0, queued.stderr
            _wait(engine, "select score = 3 and votes = 1 from post_score where post_id = 2")
        finally:
            run.terminate()
            _, err = run.communicate(timeout=30)
        assert run.returncode == 0, err
        assert "Traceback" not in err
    finally:
        engine.dispose()


# -- the how-to pages, followed as a new user does ------------------------------------------
# Each page's files are written from its code blocks (a block's first line
# names the file: "# exams-plugin/pyproject.toml"), its commands run, its
# shown output compared. `psql -f FILE` is run with run_sql (a new user's
# machine may have no psql); `pip install -e ./exams-plugin` installs into a
# directory of the test's own (--target, on PYTHONPATH), not into the venv the
# other tests run in.
_FILE = re.compile(r"^(?:#|--) ((?:exams-plugin|exams-app)/\S+?):?(?:\s|$)")


def _page_text(name: str) -> str:
    return (DOCS / "how-to" / name).read_text(encoding="utf-8")


def _how_to(name: str) -> list[tuple[str, str]]:
    return _blocks(_page_text(name))


def _write_files(page: str, root: Path) -> list[str]:
    """The page's files under ``root``; their paths, as the page names them."""
    written = []
    for _, body in _how_to(page):
        match = _FILE.match(body.splitlines()[0])
        if match:
            path = root / match.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
            written.append(match.group(1))
    return written


def _commands(page: str) -> list[str]:
    """The page's shell commands, comments off."""
    return [
        line.split("  #")[0].strip()
        for lang, body in _how_to(page)
        if lang == "sh"
        for line in body.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _shown(page: str, first_word: str) -> list[list[str]]:
    """A ``text`` block of the page that starts with ``first_word``, as words per line."""
    (block,) = [t for lang, t in _how_to(page) if lang == "text" and t.startswith(first_word)]
    return [line.split() for line in block.splitlines()]


@pytest.fixture(scope="module")
def exams_plugin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The plugin of how-to/plugin.md, written from the page and installed
    with pip (the directory it is installed in, for PYTHONPATH)."""
    root = tmp_path_factory.mktemp("new-user")
    written = _write_files("plugin.md", root)
    assert sorted(written) == [
        "exams-plugin/exams_plugin/__init__.py",
        "exams-plugin/pyproject.toml",
        "exams-plugin/schema.sql",
    ]
    (install,) = [c for c in _commands("plugin.md") if c.startswith("pip install")]
    assert install == "pip install -e ./exams-plugin"
    site = root / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            "./exams-plugin",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    return root, site


def _env(db_url: str, site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PGJOBS_DATABASE_URL"] = db_url
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # a new user's environment: no test-suite selection of plugins
    env.pop("PGJOBS_LOAD_PLUGINS", None)
    return env


def _pgjobs(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert command.startswith("pgjobs "), command
    done = subprocess.run(
        [sys.executable, "-m", "pgjobs.cli", *command.split()[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{command}: {done.stderr}"
    return done


def _apply(engine: Engine, command: str, cwd: Path) -> None:
    """``psql "$PGJOBS_DATABASE_URL" -f FILE``, as the page writes it."""
    words = command.split()
    assert words[0] == "psql" and words[2] == "-f", command
    run_sql(engine, (cwd / words[3]).read_text(encoding="utf-8"))


_DATA = (
    "insert into exam values (1, 'algebra', null), (2, 'history', null);"
    " insert into submission values (10, 1, 100), (11, 1, 101), (12, 2, 100);"
    " insert into answer values (10, 1, 3), (10, 2, 4), (11, 1, 5), (12, 1, 2)"
)


def test_the_plugin_page_works_as_written(exams_plugin: tuple[Path, Path], env_db: str) -> None:
    """The plugin installs, `pgjobs list` shows what the page shows (among the
    venv's other installed plugins), the recompute fills the table, and the
    page's enqueue makes the worker rewrite the exam and its `after` mark it."""
    root, site = exams_plugin
    env = _env(env_db, site)
    engine = create_engine(env_db)
    try:
        for command in _commands("plugin.md"):
            if command.startswith("psql"):
                _apply(engine, command, root)
                run_sql(engine, _DATA)  # the exams the page's users would have
            elif command == "pgjobs list":
                listed = _pgjobs(command, root, env).stdout
                rows = [line.split() for line in listed.splitlines()]
                for line in _shown("plugin.md", "JOB"):
                    assert line in rows, listed
            elif command.startswith("pgjobs"):
                _pgjobs(command, root, env)
        with engine.connect() as conn:
            scores = conn.execute(text("select * from exam_score order by 1, 2")).all()
        assert [tuple(r) for r in scores] == [(1, 100, 7), (1, 101, 5), (2, 100, 2)]
        (enqueue,) = [t for lang, t in _how_to("plugin.md") if "pgjobs.enqueue(conn" in t]
        app = enqueue.replace('"postgresql+psycopg://localhost/app"', repr(normalize_url(env_db)))
        assert app != enqueue
        ran = subprocess.run(
            [sys.executable, "-c", app], env=env, capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0, ran.stderr
        (once,) = re.findall(r"`(pgjobs once exam-worker)`", _page_text("plugin.md"))
        _pgjobs(once, root, env)
        with engine.connect() as conn:
            score = conn.execute(
                text("select score from exam_score where exam_id = 1 and student_id = 100")
            )
            assert score.scalar() == 9  # 3 + 4, and the page's new 2 points
            scored = conn.execute(text("select exam_id from exam where scored_at is not null"))
            assert scored.scalars().all() == [1]  # after() bound the keys as the page says
    finally:
        engine.dispose()


def test_the_testing_page_works_as_written(exams_plugin: tuple[Path, Path], pg_server: str) -> None:
    """The page's conftest and tests, in the plugin's directory, pass with
    the page's command, on the server this suite uses."""
    root, site = exams_plugin
    written = _write_files("testing.md", root)
    assert sorted(written) == ["exams-plugin/tests/conftest.py", "exams-plugin/tests/test_exams.py"]
    commands = _commands("testing.md")
    assert commands[0] == "pip install pytest"  # here: the suite's own pytest
    assert commands[1] == "cd exams-plugin"
    words = commands[2].split()
    assert words[0].startswith("PGJOBS_TEST_DSN=") and words[1:4] == ["python", "-m", "pytest"]
    env = _env(pg_server, site)
    env["PGJOBS_TEST_DSN"] = pg_server
    ran = subprocess.run(
        [sys.executable, *words[2:], "-p", "no:cacheprovider"],
        cwd=root / "exams-plugin",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (shown,) = _shown("testing.md", "2 passed")
    assert " ".join(shown) in ran.stdout, ran.stdout


def _exams_app(root: Path, engine: Engine) -> Path:
    """The application of how-to/config-jobs.md, its tables applied."""
    written = _write_files("config-jobs.md", root)
    assert sorted(written) == [
        "exams-app/pgjobs.toml",
        "exams-app/sql/exam_summary.sql",
        "exams-app/summary.sql",
    ]
    run_sql(engine, (root / "exams-plugin" / "schema.sql").read_text(encoding="utf-8"))
    return root / "exams-app"


def test_the_config_page_works_as_written(
    exams_plugin: tuple[Path, Path], env_db: str, tmp_path: Path
) -> None:
    """The application loads the plugin it names and not pgjobs-example,
    installed in this venv too (``entry_points``); the override applies; the
    declared job reads its SQL relative to the file."""
    root, site = exams_plugin
    env = _env(env_db, site)
    engine = create_engine(env_db)
    try:
        app = _exams_app(root, engine)
        run_sql(engine, _DATA)
        commands = _commands("config-jobs.md")
        assert commands[0] == "cd exams-app"
        for command in commands[1:]:
            if command.startswith("psql"):
                _apply(engine, command, app)
            elif command == "pgjobs list":
                listed = _pgjobs(command, app, env).stdout
                assert [line.split() for line in listed.splitlines()] == _shown(
                    "config-jobs.md", "JOB"
                ), listed
                # pgjobs-example is installed here, and named nowhere
                everything = _pgjobs(command, tmp_path, env).stdout
                assert "example-expire-sessions" in everything
            else:
                _pgjobs(command, app, env)
        with engine.connect() as conn:
            summary = conn.execute(text("select * from exam_summary order by 1")).all()
        assert [tuple(r) for r in summary] == [(1, 2, 7), (2, 1, 2)]
    finally:
        engine.dispose()


_CLIENT = """
import json, sys, time
from fastapi.testclient import TestClient
from app import app

out = []
with TestClient(app) as client:
    for method, path, wait_for in json.loads(sys.argv[1]):
        deadline = time.monotonic() + 30
        while True:
            answer = client.request(method, path)
            if wait_for is None or answer.text == wait_for or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the worker runs on its own thread: poll, bounded
        out.append(answer.text)
print(json.dumps(out))
"""


def test_the_fastapi_page_works_as_written(exams_plugin: tuple[Path, Path], env_db: str) -> None:
    """The page's app, in the config page's application, through FastAPI's
    TestClient (its lifespan runs as under uvicorn): the page's requests give
    the page's answers, and the log shows the worker's run."""
    root, site = exams_plugin
    env = _env(env_db, site)
    engine = create_engine(env_db)
    try:
        app = _exams_app(root, engine)
        assert _write_files("fastapi.md", root) == ["exams-app/app.py"]
        setup = re.search(r"`(insert into exam .*?)`", _page_text("fastapi.md"), flags=re.S)
        assert setup is not None
        run_sql(engine, setup.group(1).replace("\n", " "))
        run_sql(engine, (app / "summary.sql").read_text(encoding="utf-8"))
        commands = _commands("fastapi.md")
        assert commands[0] == "pip install fastapi uvicorn"  # both: the suite has fastapi
        assert commands[1] == "uvicorn app:app --port 8000"
        requests = []
        for command in commands[2:]:
            words = command.replace("'", "").split()
            assert words[0] == "curl", command
            method = words[words.index("-X") + 1] if "-X" in words else "GET"
            requests.append([method, "/" + words[-1].split("/", 1)[1]])
        shown = [" ".join(line) for line in _shown("fastapi.md", "{")]
        # the GET answers once the worker has run (the page: "a moment later")
        requests = [
            [m, p, None if m == "POST" else want]
            for (m, p), want in zip(requests, shown, strict=True)
        ]
        ran = subprocess.run(
            [sys.executable, "-c", _CLIENT, json.dumps(requests)],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout.splitlines()[-1]) == shown, ran.stderr
        (log,) = [t for lang, t in _how_to("fastapi.md") if t.startswith("... INFO")]
        for line in log.splitlines():
            # the page's line, its durations as any
            parts = re.split(r"\d+(?:\.\d+)?(?= m?s\b)", line.removeprefix("... "))
            pattern = r"[\d.]+".join(map(re.escape, parts))
            assert re.search(pattern, ran.stderr), (line, ran.stderr)
    finally:
        engine.dispose()


def _wait(engine: Engine, query: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            if conn.execute(text(query)).scalar():
                return
        assert time.monotonic() < deadline, f"not within {timeout} s: {query}"
        time.sleep(0.05)


def test_every_public_name_has_its_reference() -> None:
    import pgjobs

    page = _page("api.md")
    documented = set(re.findall(r"^::: pgjobs\.(\w+)$", page, flags=re.M))
    assert sorted(set(pgjobs.__all__) - documented) == []
