"""``manage.py check``: pgjobs' schema against this code's migrations, as
``pgjobs migrate --check`` reads it.

* ``pgjobs.W001`` migrations pending (``manage.py migrate`` applies them);
* ``pgjobs.W002`` the schema is newer, additive migrations only (this
  code runs on beside it);
* ``pgjobs.E001`` the schema is past a breaking migration of newer code
  (this code refuses to run);
* ``pgjobs.E002`` the ``PGJOBS`` setting or the database entry is wrong.

A database that cannot be reached is not this check's business (Django
says so when it is used): nothing is reported. ``manage.py migrate`` runs
the system checks before it applies anything: the pending migrations it is
about to apply are not reported then (the check looks for Django's migrate
command on its call stack: the arguments Django passes do not tell it).
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from ...errors import ConfigError
from ...migrations import plan, read

log = logging.getLogger(__name__)


def schema_check(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The check registered by the app (tag ``pgjobs``)."""
    from sqlalchemy.exc import DBAPIError

    from .conf import load
    from .host import engine

    try:
        settings = load()
        with engine(settings) as made, made.connect() as conn, conn.begin():
            found = plan(read(conn, settings.config.schema))
    except ConfigError as exc:
        return [Error(str(exc), id="pgjobs.E002")]
    except DBAPIError as exc:
        log.debug("pgjobs: the schema check could not reach the database: %s", exc)
        return []
    refusal = found.too_new()
    if refusal is not None:
        return [Error(refusal, id="pgjobs.E001")]
    if found.newer:
        newer = ", ".join(f"{n:03d}" for n in sorted(found.newer))
        return [
            Warning(
                f"pgjobs' schema {found.installed.schema!r} is at version"
                f" {found.installed.version}, newer than this code's {found.code_version}"
                f" (additive migrations {newer}): this code runs on beside it",
                hint="Upgrade pgjobs-derived when you can.",
                id="pgjobs.W002",
            )
        ]
    if found.pending and not _in_migrate():
        return [
            Warning(
                f"pgjobs' schema {found.installed.schema!r} is at version"
                f" {found.installed.version}: {len(found.pending)} migration(s) pending:"
                f" {found.pending_names()}",
                hint="Run `manage.py migrate` (or `pgjobs migrate`).",
                id="pgjobs.W001",
            )
        ]
    return []


def _in_migrate() -> bool:
    """Is this check run by ``manage.py migrate`` (or a subclass of its
    command, or ``call_command("migrate")``)? Django 5.2 runs the checks from
    the command's ``handle()``, Django 6 from ``execute()``: a frame of
    either has the command as ``self``."""
    from django.core.management.commands.migrate import Command as Migrate

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back
    return False


__all__ = ["schema_check"]
