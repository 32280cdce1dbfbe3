"""Tested upgrades: every earlier schema version, as the previous release
left it and filled with data (jobs, queue entries, runs, marks), migrated
by this code equals a fresh install (``pg_dump --schema-only``, see
``schema_tools.schema_dump`` for what is left out and why) with its data
intact. The previous release's code (f1b989b, from git history) installs
a schema that this code migrates to the same, and runs a recompute and a
queue job beside this release's schema, whose migrations since are
additive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

import psycopg
import pytest
from extras import ENV_REQUIRE, required
from schema_tools import install_as_before, libpq, schema_dump
from sqlalchemy import create_engine

import pgjobs
from pgjobs.migrations import migrate, migrations

#: the previous release: the commit before this round of work
PREVIOUS = "f1b989b"
ROOT = Path(__file__).resolve().parent.parent

#: data of each table, from the version that has it (columns of that version)
FILL = {
    "job_state": (
        1,
        "insert into pgjobs.job_state (job, next_attempt_at, failures, last_started_at,"
        " last_success_at, last_failure_at, last_error, last_sqlstate)"
        " select 'job-' || g, now() + g * interval '1 minute', g % 3, now(), now(),"
        " case when g % 3 > 0 then now() end, case when g % 3 > 0 then 'boom ' || g end,"
        " case when g % 3 > 0 then '40P01' end from generate_series(1, 20) g",
    ),
    "run": (
        1,
        "insert into pgjobs.run (job, outcome, started_at, finished_at, compute_ms, inserted,"
        " updated, deleted, items, error, worker) select 'job-' || (g % 20 + 1),"
        " (array['ran', 'idle', 'busy', 'failed'])[g % 4 + 1], now() - g * interval '1 s',"
        " now() - g * interval '1 s' + interval '5 ms', 1.5, g, g % 7, g % 3, g % 5,"
        " case when g % 4 = 3 then 'boom' end, 'host:1' from generate_series(1, 200) g",
    ),
    "queue": (
        2,
        "select pgjobs.enqueue('worker', (select jsonb_agg(jsonb_build_array(g))"
        " from generate_series(1, 50) g));"
        " update pgjobs.queue set attempts = 3, last_error = 'bad', dead_at = now()"
        " where key = '[7]'",
    ),
    "mark": (
        7,
        "insert into pgjobs.mark (target, key, xid) select 'derived', jsonb_build_array(g),"
        " pg_current_xact_id() from generate_series(1, 30) g",
    ),
}
ORDER = {"job_state": "job", "run": "id", "queue": "job, key", "mark": "target, key"}


def rows(url: str, table: str) -> list[dict[str, object]]:
    with psycopg.connect(libpq(url)) as conn:
        query = f"select to_jsonb(t) from pgjobs.{table} as t order by {ORDER[table]}"
        return [r[0] for r in conn.execute(query)]


@pytest.fixture(scope="module")
def fresh_dump(pg_server: str) -> str:
    """The schema as this code installs it into an empty database."""
    from pgjobs.testing import fresh_database

    with fresh_database(pg_server) as url:
        pgjobs.install(url)
        return schema_dump(url, "pgjobs")


EARLIER = [m.number for m in migrations()][:-1]


@pytest.mark.parametrize("version", EARLIER, ids=[f"from-{n:03d}" for n in EARLIER])
def test_an_earlier_schema_with_data_migrates_to_a_fresh_install(
    db_url: str, fresh_dump: str, version: int
) -> None:
    install_as_before(db_url, "pgjobs", version)
    with psycopg.connect(libpq(db_url)) as conn:
        for since, statement in FILL.values():
            if version >= since:
                conn.execute(statement)
    before = {t: rows(db_url, t) for t, (since, _) in FILL.items() if version >= since}
    assert all(before.values())

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            applied = migrate(conn, "pgjobs")
    finally:
        engine.dispose()
    assert [m.number for m in applied] == [m.number for m in migrations() if m.number > version]
    assert schema_dump(db_url, "pgjobs") == fresh_dump

    # The data intact: every row as it was, new columns with their defaults.
    for table, old in before.items():
        new = rows(db_url, table)
        assert [{k: row[k] for k in was} for row, was in zip(new, old, strict=True)] == old
    if version < 5:  # 005's counts start at zero
        assert {r["idle_ticks"] for r in rows(db_url, "job_state")} == {0}
    with psycopg.connect(libpq(db_url)) as conn:
        kinds = conn.execute("select distinct kind from pgjobs.schema_version").fetchall()
    assert kinds == [("additive",)]


# -- the previous release beside this release's schema ------------------------------------
@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The previous release's ``pgjobs`` package, from git history (``git
    archive``: nothing of the repository changes). Without the history (a
    copy of the files, as a new user's CI run makes), skipped; failed where
    ``$PGJOBS_TEST_REQUIRE_EXTRAS`` is set."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS, "pgjobs"],
        capture_output=True,
        timeout=60,
    )
    if found.returncode != 0:
        reason = f"needs git history with {PREVIOUS}: {found.stderr.decode().strip()}"
        if required():
            pytest.fail(f"{reason} (${ENV_REQUIRE} is set)", pytrace=False)
        pytest.skip(reason)
    where = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=BytesIO(found.stdout)) as tar:
        tar.extractall(where, filter="data")
    yield where


OLD_CODE = textwrap.dedent(
    """
    import json, sys
    import pgjobs
    from sqlalchemy import create_engine

    url = sys.argv[1]
    engine = create_engine(url)
    recompute = pgjobs.RecomputeJob(
        name="old-totals", target="total", every="1h",
        compute="select id, val * 2 as doubled from item",
    )
    queue = pgjobs.QueueJob(
        name="old-worker", target="total", scope="id", every="1h",
        compute="select id, val * 3 as doubled from item where id = any(:keys)",
    )
    first = pgjobs.run_once(recompute, engine, force=True)
    with engine.begin() as conn:
        conn.exec_driver_sql("update item set val = val + 1 where id <= 3")
        pgjobs.enqueue(conn, queue, [1, 2, 3])
    second = pgjobs.run_once(queue, engine)
    print(json.dumps({
        "file": pgjobs.__file__,
        "recompute": [str(first.outcome), first.stats.inserted, first.error],
        "queue": [str(second.outcome), second.items, second.stats.updated, second.error],
    }))
    """
)


def test_the_previous_release_runs_beside_this_releases_schema(
    db_url: str, previous_release: Path, tmp_path: Path
) -> None:
    additive = [m for m in migrations() if m.number > 8]
    assert additive and all(m.kind == "additive" for m in additive)
    with psycopg.connect(libpq(db_url)) as conn:
        conn.execute("create table item (id int primary key, val int not null)")
        conn.execute("create table total (id int primary key, doubled int not null)")
        conn.execute("insert into item select g, g from generate_series(1, 10) g")
    pgjobs.install(db_url)  # this release's schema
    script = tmp_path / "old.py"
    script.write_text(OLD_CODE)
    env = dict(os.environ, PYTHONPATH=str(previous_release), PGJOBS_LOAD_PLUGINS="")
    done = subprocess.run(
        [sys.executable, str(script), db_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(previous_release))
    assert report["recompute"] == ["ran", 10, None]
    assert report["queue"] == ["ran", 3, 3, None]
    with psycopg.connect(libpq(db_url)) as conn:
        got = conn.execute("select id, doubled from total where id <= 4 order by id").fetchall()
        assert got == [(1, 6), (2, 9), (3, 12), (4, 8)]
        version = conn.execute("select max(version) from pgjobs.schema_version").fetchone()
        assert version == (migrations()[-1].number,)  # the old code applied nothing
        outcomes = conn.execute(
            "select job, outcome from pgjobs.run where job like 'old-%' order by id"
        ).fetchall()
        assert outcomes == [("old-totals", "ran"), ("old-worker", "ran")]
    # and this release goes on on what the old one wrote
    job = pgjobs.RecomputeJob(
        name="old-totals", target="total", every="1h", compute="select id, val as doubled from item"
    )
    result = pgjobs.run_once(job, db_url, force=True)
    assert result.outcome == "ran" and result.stats.updated == 10


def test_the_previous_releases_own_install_migrates_to_a_fresh_install(
    db_url: str, previous_release: Path, fresh_dump: str, tmp_path: Path
) -> None:
    # install_as_before() mirrors the previous release's Store.ensure; this
    # is that release itself installing, then this one migrating.
    env = dict(os.environ, PYTHONPATH=str(previous_release), PGJOBS_LOAD_PLUGINS="")
    done = subprocess.run(
        [sys.executable, "-c", "import sys, pgjobs; pgjobs.install(sys.argv[1])", db_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(libpq(db_url)) as conn:
        old = conn.execute("select version from pgjobs.schema_version order by 1").fetchall()
    assert [v for (v,) in old] == [1, 2, 3, 4, 5, 7, 8]
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            applied = migrate(conn, "pgjobs")
    finally:
        engine.dispose()
    assert [m.number for m in applied] == [m.number for m in migrations() if m.number > 8]
    assert schema_dump(db_url, "pgjobs") == fresh_dump
