"""``pgjobs once`` (one tick of a job now) and ``pgjobs check`` (what a
recompute would write, nothing written)."""

from __future__ import annotations

import json
import logging
import sys

import click

from ..progress import Display
from ..results import Outcome, RunResult
from .base import (
    EXIT_DATABASE,
    EXIT_FAILED,
    _common,
    _errors,
    _jsonable,
    _load,
    _logging,
    _verbosity,
    cli,
)


# -- once ----------------------------------------------------------------------------
def _summary(result: RunResult) -> str:
    s = result.stats
    head = f"{result.job}: {result.outcome} in {result.seconds:.2f}s"
    if result.outcome is Outcome.RAN:
        parts = [
            f"inserted {s.inserted:,}",
            f"updated {s.updated:,}",
            f"deleted {s.deleted:,}",
            f"unchanged {s.unchanged:,}",
        ]
        if s.skipped_missing_parent:
            parts.append(f"skipped (parent gone) {s.skipped_missing_parent:,}")
        if result.items or result.failed_items:
            parts.append(f"items {result.items:,} ({result.failed_items:,} failed)")
        timing = (
            f"compute {result.compute_seconds:.2f}s, write {result.write_seconds:.2f}s, "
            f"rows locked {result.lock_seconds:.2f}s"
        )
        return f"{head}: {', '.join(parts)}; {timing}"
    if result.outcome in (Outcome.FAILED, Outcome.INTERRUPTED, Outcome.TRANSIENT):
        state = f" (SQLSTATE {result.sqlstate})" if result.sqlstate else ""
        when = (
            f"; next scheduled attempt {result.next_attempt_at:%Y-%m-%d %H:%M:%S %Z}"
            if result.next_attempt_at
            else ""
        )
        return f"{head}: {result.error}{state}{when}"
    if result.outcome is Outcome.BUSY:
        return f"{head}: another transaction holds the group lock; nothing was done"
    if result.outcome is Outcome.IDLE:
        return f"{head}: nothing to do (has_work said no)"
    if result.outcome is Outcome.PAUSED:
        from ..operate import paused_line

        return paused_line(result)
    return head


@cli.command()
@click.argument("job")
@_common
@_verbosity
@click.option("--json", "as_json", is_flag=True, help="Print the RunResult as JSON.")
@click.option("--no-check", is_flag=True, help="Skip checking the job against the database first.")
@click.option("--force", is_flag=True, help="Run the tick even if the job is paused.")
def once(
    job: str,
    config_path: str | None,
    database: str | None,
    verbose: int,
    as_json: bool,
    no_check: bool,
    force: bool,
) -> None:
    """Run one tick of JOB now, forced: its schedule and backoff are ignored
    (a job that is not due, or backing off after a failure, runs anyway),
    never its group lock (busy: exit 1), nor a pause (``pgjobs pause``: exit
    1; --force runs it anyway). pgjobs.run_once() is not forced by default:
    it honours all of them, as the scheduler does.

    Phases and progress go to stderr (redrawn in place on a terminal, a line
    per phase otherwise); the outcome to stdout. Exit 1 if the tick failed
    (transiently too: a lock timeout, a deadlock), or items of it failed, or
    it found the job's group busy; 3 if the database cannot be reached.
    """
    from ..checks import check_jobs
    from ..runner import Runner

    # The summary below reports a failure; the runner's traceback is for -v.
    with _errors(), _logging(verbose, logging.WARNING, quiet=("pgjobs.runner",)):
        config, registry, url = _load(config_path, database)
        target = registry.get(job)
        if not target.enabled:
            click.echo(
                f"pgjobs: note: {job} is disabled (enabled = false); running it anyway", err=True
            )
        with Runner(
            url,
            namespace=config.namespace,
            schema=config.schema,
            auto_migrate=config.auto_migrate,
            call_timeout=config.call_timeout,
        ) as runner:
            if not no_check:
                check_jobs(runner.engine, [registry.entry(job)])
            with Display(job, sys.stderr) as progress:
                result = runner.tick(target, force=True, run_paused=force, progress=progress)
        if as_json:
            click.echo(json.dumps(_jsonable(result), indent=2))
        else:
            click.echo(_summary(result))
        if result.failed_items:
            # the others committed; these back off (their item backoff) or are parked
            click.echo(
                f"pgjobs: {job}: {result.failed_items:,} item(s) failed; they stay queued"
                " (pgjobs status shows them, pgjobs revive --retrying runs them again now)",
                err=True,
            )
        if result.failed_items or result.outcome in _NOT_DONE:
            sys.exit(EXIT_FAILED)


#: outcomes of a tick that did not do its work: ``pgjobs once`` exits 1
_NOT_DONE = (
    Outcome.FAILED,
    Outcome.BUSY,
    Outcome.PAUSED,
    Outcome.INTERRUPTED,
    Outcome.TRANSIENT,
)


# -- check ---------------------------------------------------------------------------
@cli.command()
@click.argument("job")
@_common
@_verbosity
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option(
    "--sample",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="N",
    help="Keys shown for each kind of change (the first N in key order).",
)
@click.option(
    "--keys",
    multiple=True,
    metavar="K",
    help="A queue job's items to check; a JSON array for a composite scope: '[7, \"b\"]'.",
)
@click.argument("more_keys", nargs=-1, metavar="[K ...]")
def check(
    job: str,
    config_path: str | None,
    database: str | None,
    verbose: int,
    as_json: bool,
    sample: int,
    keys: tuple[str, ...],
    more_keys: tuple[str, ...],
) -> None:
    """Show what a recompute of JOB would write now, writing nothing: rows it
    would insert, update, delete or skip (parent gone), with a sample of keys
    and the old and new values of updated rows (docs/drift.md). No row lock,
    no write; the job's timeouts apply. Rows of items queued or in flight are
    shown apart: they are on their way. A queue job is checked for --keys.

    Exit 0 without drift, 1 with drift, 2 for a bad config or job, 3 if the
    database cannot be reached (or the check failed there).
    """
    import psycopg

    from .. import drift, drift_text
    from .._pg import first_line
    from ..api import check as check_job

    if more_keys and not keys:
        raise click.UsageError(f"unexpected {' '.join(more_keys)}: keys go after --keys")
    with _errors(), _logging(verbose, logging.WARNING):
        config, registry, url = _load(config_path, database)
        target = registry.get(job)
        items = drift_text.parse_keys([*keys, *more_keys]) if keys else None
        workers = drift.workers_of(target, registry.jobs())
        try:
            result = check_job(
                target,
                url,
                keys=items,
                sample=sample,
                workers=workers,
                schema=config.schema,
                call_timeout=config.call_timeout,
            )
        except psycopg.Error as exc:  # the check's own statement (its timeout, the SQL)
            click.echo(f"pgjobs: the check failed: {first_line(exc)}", err=True)
            sys.exit(EXIT_DATABASE)
        out = json.dumps(_jsonable(result.as_dict()), indent=2) if as_json else None
        click.echo(out or drift_text.summary(result))
        if result.drift:
            sys.exit(EXIT_FAILED)


__all__ = [
    "check",
    "once",
]
