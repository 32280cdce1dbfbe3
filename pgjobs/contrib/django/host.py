"""What the command, the admin and the test helpers share: pgjobs' config,
registry and database as Django's settings give them, and the jobs' bodies
wrapped so that the Django connections they open are closed after them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import Engine

from ...cli.base import Preset
from ...config import Config
from ...database import engine_for
from ...jobs import Job
from ...registry import Registry
from .conf import Settings, load, url_of

#: the fields of a job that hold the application's Python code
BODIES = ("compute", "run", "after", "claim", "finish", "has_work")


def _closing(body: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(body)
    def call(*args: Any, **kwargs: Any) -> Any:
        from django.db import close_old_connections, connections

        # A worker thread's ORM connection would otherwise outlive its job:
        # idle for hours behind PgBouncer, or on a server that failed over.
        close_old_connections()
        try:
            return body(*args, **kwargs)
        finally:
            connections.close_all()  # this thread's connections only

    return call


def closing_connections(job: Job) -> Job:
    """``job`` with each of its Python bodies run between
    ``close_old_connections()`` and closing this thread's Django
    connections (a body that uses the ORM; SQL bodies are left alone)."""
    changes = {
        name: _closing(value)
        for name in BODIES
        if callable(value := getattr(job, name, None)) and not isinstance(value, str)
    }
    return job.replace(**changes) if changes else job


def registry(config: Config) -> Registry:
    """The jobs of ``PGJOBS`` and of installed plugins, bodies wrapped."""
    return Registry.load(config).mapped(closing_connections)


def preset(settings: Settings | None = None) -> Preset:
    """What ``manage.py pgjobs`` gives the ``pgjobs`` command's code."""
    settings = settings or load()
    return Preset(config=settings.config, url=url_of(settings.using), registry=registry)


@contextmanager
def engine(settings: Settings | None = None) -> Iterator[Engine]:
    """An engine of pgjobs' own on the database of ``PGJOBS["using"]``
    (disposed of after the block), with the config's ``call_timeout``, and
    no prepared statements where ``PGJOBS["transaction_pooling"]`` says a
    transaction pooler is in between."""
    settings = settings or load()
    with engine_for(
        url_of(settings.using),
        call_timeout=settings.config.call_timeout.total_seconds(),
        pooled=settings.transaction_pooling or None,
    ) as made:
        yield made


__all__ = ["BODIES", "closing_connections", "engine", "preset", "registry"]
