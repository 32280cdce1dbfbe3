"""pgjobs.contrib.django, the Django app, on a real PostgreSQL, driven as a
Django project drives it: ``examples/django_app``'s ``manage.py`` in
subprocesses (``migrate``, ``check``, ``pgjobs run``, ``test``), and
pytest-django in a subprocess of its own, so that this suite's process
never configures Django (pytest-django stays inert here: no
``DJANGO_SETTINGS_MODULE``).

Needs Django (``pip install -e '.[django]' pytest-django``):
skipped without it on a developer's machine, failed in CI
(``$PGJOBS_TEST_REQUIRE_EXTRAS=1``), whose ``test`` extra has both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from extras import required
from sqlalchemy import create_engine

from pgjobs import migrations
from pgjobs.cli import cli

try:
    import django  # noqa: F401
except ImportError:
    if required():
        raise
    pytest.skip(
        "needs Django, not installed: pip install -e '.[django]' pytest-django (the test extra has both)",
        allow_module_level=True,
    )

from pgjobs.contrib.django.conf import database_url
from pgjobs.contrib.django.generate import differences, expected, module_name
from pgjobs.errors import ConfigError
from pgjobs.testing import fresh_database

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_app"
TIMEOUT = 120  # the longest one manage.py command may take here (a loaded machine)


def _env(db_url: str, **more: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        BLOG_DATABASE_URL=db_url,
        DJANGO_SETTINGS_MODULE="blogsite.settings",
        PGJOBS_LOAD_PLUGINS="",  # the example's jobs only, not installed plugins'
        PYTHONUNBUFFERED="1",
        **more,
    )
    return env


def manage(db_url: str, *args: str, **more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env=_env(db_url, **more),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _query(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(_libpq(url)) as conn:
        return conn.execute(query.encode()).fetchall()


def _snapshot(url: str) -> dict[str, Any]:
    """pgjobs' schema as the catalog has it, and when each migration was applied."""
    return {
        "versions": _query(url, "select * from pgjobs.schema_version order by version"),
        "columns": _query(
            url,
            "select table_name, column_name, data_type, column_default, is_nullable"
            " from information_schema.columns where table_schema = 'pgjobs' order by 1, 2",
        ),
        "indexes": _query(
            url, "select indexname, indexdef from pg_indexes where schemaname = 'pgjobs' order by 1"
        ),
        "functions": _query(
            url,
            "select proname, md5(prosrc) from pg_proc"
            " where pronamespace = 'pgjobs'::regnamespace order by 1, 2",
        ),
        "constraints": _query(
            url,
            "select conname, pg_get_constraintdef(oid) from pg_constraint"
            " where connamespace = 'pgjobs'::regnamespace order by 1",
        ),
    }


# -- no database ---------------------------------------------------------------------
def test_the_migrations_are_those_generated_from_pgjobs_sql_files() -> None:
    assert differences() == [], "run: python -m pgjobs.contrib.django.generate"
    names = sorted(n for n in expected() if n != "__init__.py")
    assert names == [f"{module_name(m)}.py" for m in migrations.migrations()]


def test_a_changed_sql_folder_is_a_difference(tmp_path: Path) -> None:
    for name, text in expected().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "0012_checked_runs.py").unlink()
    (tmp_path / "0099_by_hand.py").write_text("", encoding="utf-8")
    assert differences(tmp_path) == ["extra 0099_by_hand.py", "missing 0012_checked_runs.py"]


def test_importing_pgjobs_imports_no_django() -> None:
    code = (
        "import sys, pgjobs, pgjobs.cli, pgjobs.contrib;"
        "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_databases_entry_as_a_url() -> None:
    entry = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "app",
        "USER": "me",
        "PASSWORD": "p@ss:word",
        "HOST": "db.internal",
        "PORT": "6432",
        "OPTIONS": {
            "sslmode": "verify-full",
            "sslrootcert": "/etc/ca.pem",
            "options": "-c search_path=app",
            "isolation_level": 1,  # Django's, not libpq's
            "server_side_binding": True,
        },
    }
    url = database_url(entry)
    assert url.startswith("postgresql+psycopg://me:p%40ss%3Aword@db.internal:6432/app?")
    assert "sslmode=verify-full" in url and "sslrootcert=%2Fetc%2Fca.pem" in url
    assert "options=-c+search_path%3Dapp" in url
    assert "isolation_level" not in url and "server_side_binding" not in url
    socket = database_url({**entry, "HOST": "/var/run/postgresql", "PORT": "", "OPTIONS": {}})
    assert socket == "postgresql+psycopg://me:p%40ss%3Aword@/app?host=%2Fvar%2Frun%2Fpostgresql"
    with pytest.raises(
        ConfigError, match=r"DATABASES\['default'\]: ENGINE: .*'django.db.backends.sqlite3'"
    ):
        database_url({**entry, "ENGINE": "django.db.backends.sqlite3"})


def test_a_bad_setting_is_named() -> None:
    code = """
import django
from django.conf import settings
settings.configure(
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}},
    INSTALLED_APPS=["pgjobs.contrib.django"],
    PGJOBS={"jobs": {"w": {"kind": "queue", "target": "t", "scope": "id", "sql": "select 1",
                           "every": "soon"}}},
)
django.setup()
from pgjobs.contrib.django.conf import load
for bad in (None, {"database": "postgresql://x/y"}, {"using": "other"}):
    if bad is not None:
        settings.PGJOBS = bad
    try:
        load()
    except Exception as exc:
        print(type(exc).__name__, exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=EXAMPLE
    )
    lines = out.stdout.splitlines()
    # the config parser's own message, naming the setting and the key
    assert lines[0].startswith("ConfigError settings.PGJOBS: jobs.w.every:"), lines[0]
    assert "'soon'" in lines[0]
    assert lines[1].startswith("ConfigError settings.PGJOBS: database: not here")
    assert lines[2].startswith("ConfigError settings.PGJOBS: using: no such alias in DATABASES")


# -- migrate and check ----------------------------------------------------------------
def test_migrate_from_an_empty_database_then_check_is_clean(db_url: str) -> None:
    done = manage(db_url, "migrate", "--noinput")
    assert done.returncode == 0, done.stderr
    assert "Applying pgjobs.0001_core... OK" in done.stdout
    last = module_name(migrations.migrations()[-1])
    assert f"Applying pgjobs.{last}... OK" in done.stdout
    assert "WARNINGS" not in done.stdout + done.stderr
    # pgjobs' own command agrees: nothing pending
    result = CliRunner().invoke(cli, ["migrate", "--check", "--database", db_url])
    assert result.exit_code == 0, result.output
    assert f"is current (version {migrations.code_version()})" in result.output
    check = manage(db_url, "check")
    assert check.returncode == 0, check.stderr
    assert "System check identified no issues (0 silenced)." in check.stdout
    assert check.stderr == ""
    changes = manage(db_url, "makemigrations", "--check", "--dry-run")
    assert changes.returncode == 0, changes.stdout + changes.stderr
    assert "No changes detected" in changes.stdout


def test_migrate_on_a_schema_pgjobs_migrate_brought_up_changes_nothing(db_url: str) -> None:
    result = CliRunner().invoke(cli, ["migrate", "--database", db_url])
    assert result.exit_code == 0, result.output
    before = _snapshot(db_url)
    done = manage(db_url, "migrate", "--noinput")
    assert done.returncode == 0, done.stderr
    assert _snapshot(db_url) == before  # applied_at included: nothing ran again
    recorded = _query(db_url, "select count(*) from django_migrations where app = 'pgjobs'")
    assert recorded == [(len(migrations.migrations()),)]


def test_check_reports_a_schema_behind_and_one_past_a_breaking_migration(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            migrations.migrate(conn, "pgjobs", available=migrations.migrations()[:3])
        behind = manage(db_url, "check")
        assert behind.returncode == 0  # a warning
        assert "(pgjobs.W001) pgjobs' schema 'pgjobs' is at version 3:" in behind.stderr
        assert "Run `manage.py migrate`" in behind.stderr
        with engine.connect() as conn:
            migrations.migrate(conn, "pgjobs")
            conn.exec_driver_sql(
                "insert into pgjobs.schema_version (version, kind) values (999, 'breaking')"
            )
            conn.commit()
        ahead = manage(db_url, "check")
        assert ahead.returncode == 1
        assert "(pgjobs.E001) pgjobs' schema 'pgjobs' is at version 999" in ahead.stderr
    finally:
        engine.dispose()


# -- enqueue and the worker -----------------------------------------------------------
_PUBLISH = """
import json, time
from django.db import transaction
from blog.models import Author, AuthorStats, Post
from blog.services import publish
from pgjobs.contrib.django.models import QueueItem

ann = Author.objects.create(name="ann")
try:
    with transaction.atomic():
        publish(ann.pk, "draft", 5)
        raise RuntimeError("the request failed")
except RuntimeError:
    pass
mine = QueueItem.objects.filter(job="author-stats-worker")  # the triggers enqueue post-counts:queue too
rolled_back = {"posts": Post.objects.count(), "queued": mine.count()}
with transaction.atomic():
    Post.objects.create(author=ann, title="hello", words=120)
    from pgjobs.contrib.django import enqueue
    queued = enqueue("author-stats-worker", [ann.pk])
    inside = mine.count()
committed = time.monotonic()
while not AuthorStats.objects.filter(pk=ann.pk).exists() and time.monotonic() - committed < 10:
    time.sleep(0.01)
seconds = time.monotonic() - committed
stats = AuthorStats.objects.filter(pk=ann.pk).values("posts", "words").first()
print(json.dumps({"rolled_back": rolled_back, "queued": queued, "inside": inside,
                  "seconds": seconds, "stats": stats}))
"""


class _Lines:
    """A process's stderr, read on a thread; wait for a line containing a text."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        assert process.stderr is not None
        self.thread = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(
                lambda: any(text in line for line in self.lines), timeout=timeout
            )


def test_enqueue_joins_the_transaction_and_manage_py_pgjobs_run_processes_it(
    db_url: str,
) -> None:
    assert manage(db_url, "migrate", "--noinput").returncode == 0
    _run_and_publish(db_url)
    _verbs(db_url)  # on the same database: one migrate less


def _run_and_publish(db_url: str, *, within: float = 1.0, **more: str) -> None:
    """``manage.py pgjobs run``; a publish() rolled back, one committed and
    its stats written within ``within`` seconds; SIGTERM stops the worker."""
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "pgjobs", "run", "--shutdown-timeout", "5s"],
        cwd=EXAMPLE,
        env=_env(db_url, **more),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines = _Lines(worker)
    try:
        assert lines.wait_for("pgjobs: running 4 job(s)", TIMEOUT), "".join(lines.lines)
        done = manage(db_url, "shell", "-c", _PUBLISH, **more)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.strip().splitlines()[-1])
        # rolled back: neither the post nor the item
        assert found["rolled_back"] == {"posts": 0, "queued": 0}
        # inside the transaction the item is queued, on Django's connection
        assert (found["queued"], found["inside"]) == (1, 1)
        # committed: the worker wrote the author's row in time
        assert found["stats"] == {"posts": 1, "words": 120}
        assert found["seconds"] < within, found
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT) == 0
        lines.thread.join(TIMEOUT)
        assert any("pgjobs: stopped" in line for line in lines.lines), "".join(lines.lines)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        lines.thread.join(TIMEOUT)
        assert worker.stderr is not None
        worker.stderr.close()


def _verbs(db_url: str) -> None:
    """The other verbs of manage.py pgjobs, as pgjobs' own."""
    listed = manage(db_url, "pgjobs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [j["job"] for j in json.loads(listed.stdout)] == [
        "author-stats",
        "author-stats-worker",
        "post-counts",
        "post-counts:queue",
    ]
    with psycopg.connect(_libpq(db_url), autocommit=True) as conn:
        author = conn.execute(b"insert into author (name) values ('bob') returning id").fetchone()
        assert author is not None
        conn.execute(
            b"insert into post (author_id, title, words, created_at) values (%s, 'x', 7, now())",
            [author[0]],
        )
    enqueued = manage(db_url, "pgjobs", "enqueue", "author-stats-worker", str(author[0]))
    assert enqueued.returncode == 0, enqueued.stderr
    assert "1 item(s) enqueued" in enqueued.stdout
    paused = manage(db_url, "pgjobs", "pause", "author-stats-worker", "--reason", "a test")
    assert "paused author-stats-worker (a test)" in paused.stdout
    assert (
        "resumed author-stats-worker"
        in manage(db_url, "pgjobs", "resume", "author-stats-worker").stdout
    )
    once = manage(db_url, "pgjobs", "once", "author-stats-worker")
    assert once.returncode == 0, once.stderr
    stats = _query(db_url, f"select posts, words from author_stats where author_id = {author[0]}")
    assert stats == [(1, 7)]
    status = manage(db_url, "pgjobs", "status", "--json")
    rows = {r["job"]: r for r in json.loads(status.stdout)["jobs"]}
    assert rows["author-stats-worker"]["last_outcome"] == "ran"
    bogus = manage(db_url, "pgjobs", "demo")
    assert bogus.returncode == 2
    assert "no verb 'demo' here" in bogus.stderr


_PLAIN_WRITES = """
import json, time
from django.db import transaction
from blog.models import Author, Post, PostCounts

ann = Author.objects.create(name="ann")
with transaction.atomic():
    Post.objects.create(author=ann, title="a", words=100)
    Post.objects.create(author=ann, title="b", words=20)
Post.objects.filter(title="b").update(words=25)  # a queryset update: no save(), no signal
wanted = {"posts": 2, "words": 125}
begun = time.monotonic()
while time.monotonic() - begun < 10:
    counts = PostCounts.objects.filter(pk=ann.pk).values("posts", "words").first()
    if counts == wanted:
        break
    time.sleep(0.05)
print(json.dumps({"counts": counts}))
"""


def test_a_declared_derived_table_follows_plain_orm_writes_under_manage_py_pgjobs_run(
    db_url: str,
) -> None:
    """PGJOBS["derived"]["post-counts"]: `manage.py pgjobs run` installs the
    triggers at start (auto_migrate); ORM writes with no enqueue reach
    post_counts; `manage.py pgjobs check` then finds no drift."""
    assert manage(db_url, "migrate", "--noinput").returncode == 0
    before = manage(db_url, "pgjobs", "migrate", "--check")
    assert before.returncode == 1, before.stdout  # the triggers are not there yet
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "pgjobs", "run", "--shutdown-timeout", "5s"],
        cwd=EXAMPLE,
        env=_env(db_url),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines = _Lines(worker)
    try:
        assert lines.wait_for("pgjobs: running 4 job(s)", TIMEOUT), "".join(lines.lines)
        done = manage(db_url, "shell", "-c", _PLAIN_WRITES)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.strip().splitlines()[-1])
        assert found["counts"] == {"posts": 2, "words": 125}, "".join(lines.lines)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        lines.thread.join(TIMEOUT)
        assert worker.stderr is not None
        worker.stderr.close()
    checked = manage(db_url, "pgjobs", "check", "post-counts")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no drift" in checked.stdout
    after = manage(db_url, "pgjobs", "migrate", "--check")
    assert after.returncode == 0, after.stdout + after.stderr
    assert "the derived tables' triggers agree with the declarations" in after.stdout


@pytest.mark.needs("pgbouncer")
def test_behind_pgbouncer_in_transaction_mode(pg_server: str, tmp_path: Path) -> None:
    """DATABASES pointing at a PgBouncer in transaction mode, with Django's
    DISABLE_SERVER_SIDE_CURSORS: migrate, enqueue and the worker go through
    it, and pgjobs leaves no prepared statement in its server sessions."""
    from test_pgbouncer import assert_no_prepared_statements, pgbouncer

    with fresh_database(pg_server) as direct, pgbouncer(direct, tmp_path) as bouncer:
        done = manage(bouncer.url, "migrate", "--noinput", BLOG_TRANSACTION_POOLING="1")
        assert done.returncode == 0, done.stderr
        # no LISTEN behind a transaction pooler: the worker polls at its
        # every = "1s" (docs/how-to/pgbouncer.md), not woken by the enqueue
        _run_and_publish(bouncer.url, within=5.0, BLOG_TRANSACTION_POOLING="1")
        assert_no_prepared_statements(bouncer)


# -- the example's own tests: the admin and the helpers --------------------------------
def test_the_admin_and_the_helpers_on_djangos_test_runner(db_url: str) -> None:
    done = manage(db_url, "test", "blog", "--noinput")
    assert done.returncode == 0, done.stderr
    assert "Ran 8 tests" in done.stderr and "\nOK" in done.stderr


def test_the_helpers_on_pytest_django(db_url: str) -> None:
    if importlib.util.find_spec("pytest_django") is None:
        if required():
            pytest.fail("needs pytest-django (the test extra has it)", pytrace=False)
        pytest.skip("needs pytest-django, not installed: pip install pytest-django")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "check_with_pytest.py"],
        cwd=EXAMPLE,
        env=_env(db_url),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
