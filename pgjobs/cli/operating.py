"""``pgjobs pause``, ``resume``, ``enqueue`` and ``revive``: their work and
words are in :mod:`pgjobs.operate`."""

from __future__ import annotations

import click

from .base import (
    _common,
    _errors,
    _load,
    cli,
)


# -- pause, resume, enqueue, revive (their work and words: pgjobs.operate) ------------
@cli.command()
@click.argument("job")
@click.option("--reason", metavar="TEXT", default=None, help="Why, shown by status and the page.")
@_common
def pause(job: str, reason: str | None, config_path: str | None, database: str | None) -> None:
    """Pause JOB on every scheduler of the database, from its next tick.

    Its ticks end 'paused' (counted, not logged); queue items keep
    accumulating. `pgjobs resume JOB` resumes it."""
    from ..operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).pause(job, reason=reason))


@cli.command()
@click.argument("job")
@_common
def resume(job: str, config_path: str | None, database: str | None) -> None:
    """Resume JOB, paused by `pgjobs pause`; a queue job drains what waited."""
    from ..operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).resume(job))


@cli.command(name="enqueue")
@click.argument("job")
@click.argument("keys", nargs=-1, required=True)
@click.option(
    "--json", "as_json", is_flag=True, help='Each KEY is JSON: [7, "b"] or {"a": 7, "b": "b"}.'
)
@_common
def enqueue_items(
    job: str, keys: tuple[str, ...], as_json: bool, config_path: str | None, database: str | None
) -> None:
    """Add KEYs to queue job JOB's queue, in one transaction (a dead item is revived).

    A KEY is the scope column's value as text (typed by the column); for a
    composite scope, give each as JSON with --json."""
    from ..operate import Operator

    with _errors():
        click.echo(Operator(*_load(config_path, database)).enqueue(job, keys, as_json=as_json))


@cli.command()
@click.argument("job")
@click.argument("keys", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Each KEY is JSON (as for enqueue).")
@click.option(
    "--retrying",
    is_flag=True,
    help="Also the items waiting for their retry after a failure: due now, attempts kept.",
)
@_common
def revive(
    job: str,
    keys: tuple[str, ...],
    as_json: bool,
    retrying: bool,
    config_path: str | None,
    database: str | None,
) -> None:
    """Put JOB's dead queue items back: due now, attempts reset; all of them
    when no KEY is given. With --retrying, the items waiting in their item
    backoff too: due now, their attempts kept (a failure counts on)."""
    from ..operate import Operator

    with _errors():
        operator = Operator(*_load(config_path, database))
        click.echo(operator.revive(job, keys, as_json=as_json, retrying=retrying))


__all__ = [
    "enqueue_items",
    "pause",
    "resume",
    "revive",
]
