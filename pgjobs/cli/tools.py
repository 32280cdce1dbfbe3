"""``pgjobs migrate`` (:mod:`pgjobs.migrations` does the work) and ``pgjobs
demo`` (:mod:`pgjobs.demo`)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from .base import (
    _common,
    _errors,
    _given,
    _load,
    _logging,
    _verbosity,
    cli,
)


# -- migrate --------------------------------------------------------------------------
@cli.command()
@_common
@_verbosity
@click.option("--check", is_flag=True, help="Apply nothing; exit 1 if migrations are pending.")
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Apply nothing; print the pending migrations' SQL (all of them for an empty database).",
)
@click.option(
    "--lock-timeout",
    default="2s",
    show_default=True,
    help="The longest one table lock request waits (replicas' statements queue behind it).",
)
@click.option(
    "--retry-for",
    default="60s",
    show_default=True,
    help="Retry attempts that found a lock taken, with backoff, this long; then give up.",
)
def migrate(
    config_path: str | None,
    database: str | None,
    verbose: int,
    check: bool,
    as_sql: bool,
    lock_timeout: str,
    retry_for: str,
) -> None:
    """Apply the migrations pgjobs' schema lacks, and say which; then make the
    derived tables' triggers agree with the declarations ([derived.NAME]):
    install what is missing or stale, drop what no declaration wants.

    --check exits 1 naming the pending migrations and the triggers that
    disagree, 0 when all is current (a deploy gate). --sql prints their
    SQL, schema name filled in, for psql -v ON_ERROR_STOP=1
    --single-transaction or a migration tool; the schema it installs is
    recognised as current. A declaration that does not fit the database
    (a missing table or column, a mapping SQL that fails, a table the SQL
    reads that is not a source) exits 2 and installs nothing of the
    triggers. docs/upgrades.md, docs/how-to/derived.md.
    """
    from ..database import engine_for
    from ..derived import check_declared, install_triggers, plan_triggers
    from ..derived import script as trigger_script
    from ..migrations import MigrateSettings, command

    if check and as_sql:
        raise click.UsageError("--check and --sql: choose one")
    with _errors(), _logging(verbose, logging.INFO):
        config, registry, url = _load(config_path, database)
        declared = registry.derived()
        settings = MigrateSettings(lock_timeout=lock_timeout, retry_for=retry_for)
        bound = config.call_timeout.total_seconds()
        with engine_for(url, call_timeout=bound) as engine, engine.connect() as conn:
            if declared:
                # refuse bad declarations before anything is applied
                check_declared(conn, declared)
            code, text = command(conn, config.schema, check=check, as_sql=as_sql, settings=settings)
            if as_sql:
                text += trigger_script(conn, declared, config.schema)
            elif check:
                with conn.begin():
                    found = plan_triggers(conn, declared, config.schema)
                if not found.agrees:
                    code = max(code, 1)
                    text += "\n" + "\n".join(found.lines())
                    text += "\n(`pgjobs migrate` makes the triggers agree)"
                elif declared:
                    text += "\nthe derived tables' triggers agree with the declarations"
            elif code == 0:
                done = install_triggers(
                    conn, declared, config.schema, settings=settings, check=False
                )
                if done.statements:
                    text += "\n" + "\n".join(
                        line.replace(" missing:", " installed:")
                        .replace(" stale (other SQL or disabled):", " updated:")
                        .replace(" left over (no declaration wants it):", " dropped:")
                        for line in done.lines()
                    )
                elif declared:
                    text += "\nthe derived tables' triggers agree with the declarations"
        click.echo(text, nl=not text.endswith("\n"))
        sys.exit(code)


# -- demo ----------------------------------------------------------------------------
@cli.command()
@click.option(
    "--database",
    metavar="URL",
    default=None,
    help="Where to run, in a schema of its own (default: $PGJOBS_DATABASE_URL, else an"
    " embedded PostgreSQL in a temporary directory).",
)
@click.option(
    "--seconds", type=float, default=30.0, show_default=True, help="How long each design runs."
)
@click.option(
    "--naive",
    is_flag=True,
    help="First run the naive design (delete all, recompute, reinsert) on a copy of the same data.",
)
@click.option("--exams", type=int, default=10_000, show_default=True, help="Parent rows to create.")
@click.option("--students", type=int, default=5, show_default=True, help="Derived rows per parent.")
@click.option(
    "--compute-seconds",
    type=float,
    default=2.0,
    show_default=True,
    help="Simulated compute time of a recompute.",
)
@click.option(
    "--recompute-every",
    type=float,
    default=5.0,
    show_default=True,
    help="Recompute interval, in seconds.",
)
@click.option("--users", type=int, default=2, show_default=True, help="Concurrent simulated users.")
@click.option("--seed", type=int, default=1, show_default=True, help="Random seed.")
def demo(**options: Any) -> None:
    """The field report's scenario: a queue worker, a periodic recompute and
    users deleting rows, naive vs pgjobs, with deadlock and FK-failure counts."""
    from ..demo import main as run_demo

    options["database"] = _given("database", options["database"])
    sys.exit(run_demo(**options))


__all__ = [
    "demo",
    "migrate",
]
