"""Schema safety on real PostgreSQL: ``pgjobs migrate`` (apply, ``--check``,
``--sql``), ``auto_migrate = false``, a schema newer than the code (refused
past a breaking migration, a warning past additive ones), the previous
release's bookkeeping, and a migration behind a held lock (it gives up
after its timeout with nothing applied, keeps the replicas waiting no
longer than that, and succeeds once the lock is gone)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from schema_tools import client, install_as_before, libpq, schema_dump
from sqlalchemy import create_engine

import pgjobs
from pgjobs.cli import cli
from pgjobs.errors import MigrationError, SchemaError
from pgjobs.migrations import (
    MigrateSettings,
    code_version,
    install_bound,
    load,
    migrate,
    migrations,
    parse,
    read,
)
from pgjobs.testing import fresh_database


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def versions(url: str, schema: str = "pgjobs") -> list[int]:
    with psycopg.connect(libpq(url)) as conn:
        found = conn.execute("select to_regclass(%s)", (f"{schema}.schema_version",)).fetchone()
        if not found or found[0] is None:
            return []
        rows = conn.execute(f'select version from "{schema}".schema_version order by 1')
        return [r[0] for r in rows]


def job_config(tmp_path: Path, url: str, *, extra: str = "") -> Path:
    """A config-only recompute job ``totals`` on a table ``total``."""
    with psycopg.connect(libpq(url)) as conn:
        conn.execute("create table if not exists total (id int primary key, n int not null)")
    path = tmp_path / "pgjobs.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            database = "{url}"
            {extra}
            [jobs.totals]
            kind = "recompute"
            target = "total"
            sql = "select g as id, g * 2 as n from generate_series(1, 3) g"
            every = "1h"
            """
        )
    )
    return path


# -- the migration files ------------------------------------------------------------------
def test_every_shipped_migration_declares_its_kind() -> None:
    # This is the check of every migration file, the others' new ones included:
    # migrations() refuses a file without its first line.
    found = migrations()
    assert [m.number for m in found] == sorted({m.number for m in found})
    assert {m.kind for m in found} <= {"additive", "breaking"}
    assert all(m.text.startswith("-- pgjobs-migration: ") for m in found)
    assert [m.name for m in found][:8] == [
        "001_core",
        "002_queue",
        "003_run_detail",
        "004_queue_claim_idx",
        "005_quiet_ticks",
        "007_flow_marks",
        "008_wake",
        "009_outcomes",
    ]
    assert all(m.kind == "additive" for m in found if m.number <= 9)


def test_a_migration_without_its_kind_line_is_an_error() -> None:
    with pytest.raises(MigrationError, match=r"pgjobs/sql/010_x\.sql: its first line must be"):
        parse("010_x.sql", "-- the flow records\ncreate table t ();\n")
    with pytest.raises(MigrationError, match="got '-- pgjobs-migration: maybe'"):
        parse("010_x.sql", "-- pgjobs-migration: maybe\n")
    assert parse("010_x.sql", "-- pgjobs-migration: breaking\nselect 1;\n").kind == "breaking"
    with pytest.raises(MigrationError, match="have the same number"):
        load(
            [
                ("010_a.sql", "-- pgjobs-migration: additive\n"),
                ("010_b.sql", "-- pgjobs-migration: additive\n"),
            ]
        )


# -- migrate, --check, --sql ----------------------------------------------------------------
def test_migrate_check_and_apply(db_url: str) -> None:
    names = [m.name for m in migrations()]
    check = invoke("migrate", "--check", "--database", db_url)
    assert check.exit_code == 1, check.output
    assert f"{len(names)} migration(s) pending: {', '.join(names)}" in check.output
    assert versions(db_url) == []  # --check writes nothing

    applied = invoke("migrate", "--database", db_url)
    assert applied.exit_code == 0, applied.output
    assert f"applied {', '.join(names)} to schema 'pgjobs'" in applied.output
    assert versions(db_url) == [m.number for m in migrations()]

    again = invoke("migrate", "--database", db_url)
    assert again.exit_code == 0 and "nothing to apply" in again.output
    current = invoke("migrate", "--check", "--database", db_url)
    assert current.exit_code == 0
    assert f"is current (version {code_version()})" in current.output


def test_sql_applied_with_psql_gives_the_schema_migrate_gives(
    db_url: str, pg_server: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One database by `pgjobs migrate`, one by psql running `migrate --sql`:
    # both in schema "jobs" (the name filled in), compared by pg_dump.
    with fresh_database(pg_server) as sql_url:
        cfg = tmp_path / "pgjobs.toml"
        cfg.write_text('schema = "jobs"\n')
        assert invoke("migrate", "-c", str(cfg), "--database", db_url).exit_code == 0
        printed = invoke("migrate", "--sql", "-c", str(cfg), "--database", sql_url)
        assert printed.exit_code == 0, printed.output
        assert '"jobs".job_state' in printed.output and "{schema}" not in printed.output
        assert versions(sql_url, "jobs") == []  # printing applies nothing
        script = tmp_path / "install.sql"
        script.write_text(printed.output)
        done = subprocess.run(
            [
                client("psql", sql_url),
                *("-v", "ON_ERROR_STOP=1", "--single-transaction", "-q"),
                *("-f", str(script), libpq(sql_url)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert schema_dump(sql_url, "jobs") == schema_dump(db_url, "jobs")

        # Recognised as current: --check exits 0, a tick applies nothing.
        check = invoke("migrate", "--check", "-c", str(cfg), "--database", sql_url)
        assert check.exit_code == 0, check.output
        before = versions(sql_url, "jobs")
        job = pgjobs.TaskJob(name="noop", run=lambda conn: 0, every="1h")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pgjobs"):
            result = pgjobs.run_once(job, sql_url, schema="jobs")
        assert result.outcome == "ran"
        assert versions(sql_url, "jobs") == before
        assert not [r for r in caplog.records if "applying migration" in r.getMessage()]


def test_sql_of_a_schema_part_way_prints_only_what_it_lacks(db_url: str) -> None:
    install_as_before(db_url, "pgjobs", 5)
    printed = invoke("migrate", "--sql", "--database", db_url)
    assert printed.exit_code == 0
    out = printed.output
    assert "-- 007_flow_marks (additive)" in out and "-- 005_quiet_ticks" not in out
    # the previous release's bookkeeping gets its kind column first
    assert 'alter table "pgjobs"."schema_version" add column if not exists kind' in out
    assert 'insert into "pgjobs"."schema_version" (version, kind) values (7, \'additive\')' in out


# -- auto_migrate = false ------------------------------------------------------------------
def test_auto_migrate_off_refuses_naming_pgjobs_migrate(db_url: str, tmp_path: Path) -> None:
    cfg = job_config(tmp_path, db_url, extra="auto_migrate = false")
    refused = invoke("once", "totals", "-c", str(cfg))
    assert refused.exit_code == 2
    assert "run `pgjobs migrate` first" in refused.output
    assert "001_core" in refused.output and "auto_migrate = false" in refused.output
    assert versions(db_url) == []  # nothing installed
    # the operator's commands honour it too (they had taken the default, and migrated)
    paused = invoke("pause", "totals", "-c", str(cfg))
    assert paused.exit_code == 2 and "run `pgjobs migrate` first" in paused.output, paused.output
    assert versions(db_url) == []

    job = pgjobs.TaskJob(name="noop", run=lambda conn: 0, every="1h")
    with pytest.raises(SchemaError, match="pgjobs migrate"):
        pgjobs.run_once(job, db_url, auto_migrate=False)
    scheduler = pgjobs.Scheduler([job], db_url, auto_migrate=False, check=False)
    with pytest.raises(SchemaError, match="pgjobs migrate"):
        scheduler.start()
    scheduler.shutdown()
    assert versions(db_url) == []

    assert invoke("migrate", "-c", str(cfg)).exit_code == 0
    ran = invoke("once", "totals", "-c", str(cfg))
    assert ran.exit_code == 0, ran.output
    assert pgjobs.run_once(job, db_url, auto_migrate=False).outcome == "ran"


def test_auto_migrate_must_be_a_boolean(tmp_path: Path) -> None:
    cfg = tmp_path / "pgjobs.toml"
    cfg.write_text('auto_migrate = "no"\n')
    with pytest.raises(pgjobs.ConfigError, match=r"pgjobs\.toml: auto_migrate: expected true"):
        pgjobs.load_config(cfg)


# -- a schema newer than the code ----------------------------------------------------------
def mark_newer(url: str, kind: str, by: int = 1) -> int:
    newer = code_version() + by
    with psycopg.connect(libpq(url)) as conn:
        conn.execute(
            "insert into pgjobs.schema_version (version, kind) values (%s, %s)", (newer, kind)
        )
    return newer


def written(url: str) -> tuple[int, int]:
    with psycopg.connect(libpq(url)) as conn:
        row = conn.execute(
            "select (select count(*) from pgjobs.run), (select count(*) from pgjobs.job_state)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_newer_breaking_schema_is_refused_by_once_and_run(db_url: str, tmp_path: Path) -> None:
    cfg = job_config(tmp_path, db_url)
    assert invoke("migrate", "-c", str(cfg)).exit_code == 0
    newer = mark_newer(db_url, "breaking")
    message = (
        f"is at version {newer}, newer than this code's version {code_version()},"
        f" past breaking migration(s) {newer:03d}"
    )

    once = subprocess.run(
        [*pgjobs_command(), "once", "totals", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert once.returncode == 2, once.stderr
    assert message in once.stderr and "nothing was written" in once.stderr
    run = subprocess.run(
        [*pgjobs_command(), "run", "-c", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert written(db_url) == (0, 0)
    with psycopg.connect(libpq(db_url)) as conn:
        assert conn.execute("select count(*) from total").fetchone() == (0,)
    check = invoke("migrate", "--check", "-c", str(cfg))
    assert check.exit_code == 1 and message in check.output
    refused = invoke("migrate", "-c", str(cfg))
    assert refused.exit_code == 2 and message in refused.output


def test_a_newer_additive_schema_runs_with_one_warning(
    db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = job_config(tmp_path, db_url)
    assert invoke("migrate", "-c", str(cfg)).exit_code == 0
    newer = mark_newer(db_url, "additive", by=7)
    job = pgjobs.TaskJob(name="noop", run=lambda conn: 0, every="1h")
    with caplog.at_level(logging.WARNING, logger="pgjobs"):
        first = pgjobs.run_once(job, db_url)
        second = pgjobs.run_once(job, db_url, force=True)
    assert (first.outcome, second.outcome) == ("ran", "ran")
    warnings = [r.getMessage() for r in caplog.records if "newer than this code" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"at version {newer}, newer than this code's version {code_version()}" in warnings[0]
    assert "additive" in warnings[0]
    assert invoke("migrate", "--check", "-c", str(cfg)).exit_code == 0


# -- the previous release's bookkeeping ----------------------------------------------------
def test_the_previous_releases_schema_version_gets_its_kind_column(db_url: str) -> None:
    install_as_before(db_url, "pgjobs", 8)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn, conn.begin():
            before = read(conn, "pgjobs")
        assert before.exists and not before.has_kind and before.version == 8
        with engine.connect() as conn:
            applied = migrate(conn, "pgjobs")
        assert applied[0].name == "009_outcomes"
        with engine.connect() as conn, conn.begin():
            after = read(conn, "pgjobs")
        assert (
            after.has_kind and after.versions[1] == "additive" and after.versions[9] == "additive"
        )
    finally:
        engine.dispose()
    # the previous release's statements on the table still work beside the column
    with psycopg.connect(libpq(db_url)) as conn:
        assert conn.execute("select max(version) from pgjobs.schema_version").fetchone() == (
            code_version(),
        )
        conn.execute("insert into pgjobs.schema_version (version) values (%s)", (1000,))
        assert conn.execute(
            "select kind from pgjobs.schema_version where version = 1000"
        ).fetchone() == ("additive",)
        conn.rollback()


# -- a migration behind a held lock ---------------------------------------------------------
def test_a_migration_behind_a_held_lock_gives_up_then_succeeds(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # At version 4, what is pending alters job_state (005). A long run holds
    # a lock on job_state; a replica reads job_state meanwhile.
    install_as_before(db_url, "pgjobs", 4)
    holder = psycopg.connect(libpq(db_url))
    holder.execute("select count(*) from pgjobs.job_state")  # ACCESS SHARE until commit
    settings = MigrateSettings(lock_timeout="300ms", retry_for="1s")
    engine = create_engine(db_url)
    try:
        started = time.monotonic()
        with engine.connect() as conn, pytest.raises(MigrationError) as gave_up:
            migrate(conn, "pgjobs", settings=settings)
        took = time.monotonic() - started
        assert "was not granted within 300ms" in str(gave_up.value)
        assert "Nothing was applied" in str(gave_up.value)
        assert 1.0 <= took < 5.0, took
        retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert retries and all(r.levelno == logging.WARNING for r in retries)
        # nothing half-applied: still version 4, no column of 005, no table of 007
        assert versions(db_url) == [1, 2, 3, 4]
        with psycopg.connect(libpq(db_url)) as conn:
            cols = conn.execute(
                "select count(*) from information_schema.columns"
                " where table_schema = 'pgjobs' and table_name = 'job_state'"
                " and column_name = 'idle_ticks'"
            ).fetchone()
            assert cols == (0,)
            assert conn.execute("select to_regclass('pgjobs.mark')").fetchone() == (None,)
            kind = conn.execute(
                "select count(*) from information_schema.columns where table_schema = 'pgjobs'"
                " and table_name = 'schema_version' and column_name = 'kind'"
            ).fetchone()
            assert kind == (0,)

        # Again, with a replica's read of job_state queued behind the
        # migration's lock request: it waits no longer than the lock_timeout;
        # the holder commits after the first retry, and the migration succeeds.
        retried = threading.Event()

        class OnRetry(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "retrying in" in record.getMessage():
                    retried.set()

        handler = OnRetry()
        logging.getLogger("pgjobs.migrations").addHandler(handler)
        outcome: list[object] = []

        def run() -> None:
            with engine.connect() as conn:
                try:
                    outcome.append(
                        migrate(conn, "pgjobs", settings=MigrateSettings(lock_timeout="1s"))
                    )
                except Exception as exc:
                    outcome.append(exc)

        migrator = threading.Thread(target=run)
        migrator.start()
        with psycopg.connect(libpq(db_url), autocommit=True) as watch:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the migration waits on job_state
                waiting = watch.execute(
                    "select count(*) from pg_locks l join pg_class c on c.oid = l.relation"
                    " where c.relname = 'job_state' and not l.granted"
                    " and l.mode = 'AccessExclusiveLock'"
                ).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the migration never asked for job_state's lock")
            replica_started = time.monotonic()
            watch.execute("set statement_timeout = '10s'")
            watch.execute("select count(*) from pgjobs.job_state")
            replica_waited = time.monotonic() - replica_started
        print(f"gave up after {took:.2f} s; the replica's read waited {replica_waited:.2f} s")
        assert replica_waited < 1.0 + 0.5, replica_waited
        assert retried.wait(10)
        holder.commit()
        migrator.join(30)
        logging.getLogger("pgjobs.migrations").removeHandler(handler)
        assert not migrator.is_alive()
        assert isinstance(outcome[0], list), outcome
        assert [m.number for m in outcome[0]] == [m.number for m in migrations() if m.number > 4]
        assert versions(db_url) == [m.number for m in migrations()]
    finally:
        holder.close()
        engine.dispose()


def test_migrate_settings_and_flags_are_checked() -> None:
    assert MigrateSettings(lock_timeout="250ms").millis("lock_timeout") == "250ms"
    with pytest.raises(pgjobs.ConfigError, match="lock_timeout: must be at least 1ms"):
        MigrateSettings(lock_timeout=0)
    with pytest.raises(pgjobs.ConfigError, match="retry_for"):
        MigrateSettings(retry_for="soon")
    both = CliRunner().invoke(cli, ["migrate", "--check", "--sql"])
    assert both.exit_code == 2 and "--check and --sql: choose one" in both.output
    bad = CliRunner().invoke(
        cli, ["migrate", "--lock-timeout", "x", "--database", "postgresql://h/d"]
    )
    assert bad.exit_code == 2 and "lock_timeout" in bad.output


# -- the install deadline -------------------------------------------------------------------
def test_migrations_run_under_the_install_bound_whoever_applies_them(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A migration may take minutes (an index on a large run log): each of
    # its round trips has the install bound, not the bookkeeping bound its
    # connection came with (call_timeout, 10 s), on every path that applies
    # migrations: `pgjobs migrate` (outside the Runner), `pgjobs pause`
    # (pgjobs.operate), a Runner's first tick; the bound is restored after.
    from pgjobs import migrations as module
    from pgjobs.deadline import INSTALL_TIMEOUT

    assert install_bound(MigrateSettings(), 10.0) == 15 * 60 + 10.0  # statement_timeout 15m
    assert install_bound(MigrateSettings(retry_for="20m"), 2.0) == 20 * 60 + 2.0
    assert install_bound(MigrateSettings(statement_timeout="1s", retry_for="1s"), 10.0) == (
        INSTALL_TIMEOUT
    )
    seen: list[tuple[str, float]] = []
    plain = module.execute

    def spy(conn: Any, statement: Any, *args: Any, **kwargs: Any) -> Any:
        raw = conn.connection.driver_connection
        if not isinstance(statement, str):
            seen.append((statement.as_string(raw), raw.pgjobs_bound))
        return plain(conn, statement, *args, **kwargs)

    monkeypatch.setattr(module, "execute", spy)

    def applied_under() -> set[float]:
        # the bounds of the migration files' statements (012's index among them)
        found = {bound for text, bound in seen if "run_checked_idx" in text}
        assert found, [t[:80] for t, _ in seen]
        seen.clear()
        return found

    result = invoke("migrate", "--database", db_url)
    assert result.exit_code == 0 and "applied 001_core" in result.output, result.output
    assert applied_under() == {install_bound(MigrateSettings(), 10.0)}

    def drop() -> None:
        with psycopg.connect(libpq(db_url), autocommit=True) as conn:
            conn.execute("drop schema pgjobs cascade")

    drop()
    cfg = job_config(tmp_path, db_url)
    paused = invoke("pause", "totals", "--config", str(cfg))
    assert paused.exit_code == 0, paused.output
    assert applied_under() == {install_bound(MigrateSettings(), 10.0)}

    drop()
    engine = pgjobs.database.resolve_engine(db_url, call_timeout=2.0)[0]
    try:
        runner = pgjobs.Runner(engine, call_timeout=2.0)
        with runner.connect() as conn:
            runner._ensure(conn)
            assert conn.connection.driver_connection.pgjobs_bound == 2.0  # restored
    finally:
        engine.dispose()
    assert applied_under() == {install_bound(MigrateSettings(), 2.0)}
