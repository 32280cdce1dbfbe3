"""The one operation of the app's Django migrations: apply one of pgjobs'
own migrations (``pgjobs/sql/NNN_name.sql``) with pgjobs' migrator, so that
``manage.py migrate`` and ``pgjobs migrate`` keep one record of what is
applied, ``<schema>.schema_version``: a migration either tool applied is
skipped by the other."""

from __future__ import annotations

from typing import Any

from django.db.migrations.operations.base import Operation

from ... import migrations as pgjobs_migrations
from ...database import engine_for
from ...errors import MigrationError
from .conf import database_url, load


class ApplyMigration(Operation):
    """Apply ``pgjobs/sql/<name>.sql`` (and any earlier one still pending),
    read from the installed pgjobs at run time, on the database being
    migrated when it is the one ``PGJOBS["using"]`` names. In its own
    transaction, on a connection of its own: pgjobs' migrator takes its
    advisory lock, bounds each table lock and retries (docs/upgrades.md);
    the Django migration holding it is ``atomic = False``. Irreversible."""

    reversible = False
    reduces_to_sql = False

    def __init__(self, name: str) -> None:
        self.name = name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return self.__class__.__name__, [self.name], {}

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # pgjobs' tables are no models' state

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        from django.db import router

        settings = load()
        connection = schema_editor.connection
        if connection.alias != settings.using:
            return  # pgjobs lives in one database
        if not router.allow_migrate(connection.alias, app_label):
            return  # the project's database routers say no, as RunSQL obeys them
        url = database_url(connection.settings_dict, alias=connection.alias)
        apply(
            url,
            self.name,
            schema=settings.config.schema,
            call_timeout=settings.config.call_timeout.total_seconds(),
            pooled=settings.transaction_pooling or None,
        )

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        raise NotImplementedError("pgjobs' migrations are not reversed")

    def describe(self) -> str:
        return f"pgjobs' migration {self.name} (pgjobs/sql/{self.name}.sql)"


def apply(
    url: str, name: str, *, schema: str, call_timeout: float, pooled: bool | None = None
) -> list[str]:
    """Apply pgjobs' migrations up to ``name`` that ``schema`` lacks; the names applied."""
    shipped = pgjobs_migrations.migrations()
    names = [m.name for m in shipped]
    if name not in names:
        raise MigrationError(
            f"pgjobs.contrib.django: migration {name!r} has no pgjobs/sql/{name}.sql in this"
            " pgjobs-derived; install the release that generated it"
        )
    upto = shipped[: names.index(name) + 1]
    with (
        engine_for(url, call_timeout=call_timeout, pooled=pooled) as engine,
        engine.connect() as conn,
    ):
        with conn.begin():
            installed = pgjobs_migrations.read(conn, schema)
        if upto[-1].number in installed.versions:
            return []  # applied already (by `pgjobs migrate`, or a job's first tick)
        return [m.name for m in pgjobs_migrations.migrate(conn, schema, available=upto)]


__all__ = ["ApplyMigration", "apply"]
