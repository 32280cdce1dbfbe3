"""The documentation site names every public setting: each key of
``pgjobs.toml``, each metric, each CLI command. (``.ci/run`` builds the site
with ``mkdocs build --strict``: a broken link or a missing API reference
fails it.)"""

from __future__ import annotations

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
