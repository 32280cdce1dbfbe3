"""pgjobs' own schema: its migrations, what the database holds, and applying them.

The migrations are ``pgjobs/sql/NNN_name.sql``, numbered (numbers may be
skipped: 006 was, long ago). Each begins with a line that says whether code
older than it keeps working beside it::

    -- pgjobs-migration: additive      (older code runs on beside it)
    -- pgjobs-migration: breaking      (older code must stop first)

A file without that line is an error (:class:`MigrationError`, and a unit
test): the line is what older code reads, from the database, to decide.

Each applied migration is a row of ``<schema>.schema_version``: its number,
when it was applied and its ``kind`` (additive or breaking), so that code
older than the schema knows, without the file, whether it may run: past a
breaking migration it refuses (:class:`SchemaError`, naming both
versions, nothing written); past additive ones it warns once and runs.
The ``kind`` column is bookkeeping of this module, not a numbered
migration: the previous release's ``schema_version`` lacks it, so it is
added (``add column if not exists``, default ``'additive'``, true of every
migration before it) by the first migration run of this release. The
previous release reads and writes the table without knowing the column.

Applying (:func:`migrate`): every pending migration in one transaction,
under the advisory lock ``pgjobs-store:<schema>`` (the previous release
takes the same one), with a short ``lock_timeout`` on each table lock: a
migration's ALTER queued behind a replica's long run would otherwise hold
every later statement on that table behind its ACCESS EXCLUSIVE request.
A lock not granted in time rolls the whole transaction back (nothing is
half-applied) and the attempt is retried with backoff, a log line each
time, for at most ``retry_for``. :func:`script` gives the same statements as
SQL text (``pgjobs migrate --sql``). Why: ``docs/DESIGN.md``, "Schema
safety"; how to upgrade: ``docs/upgrades.md``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from importlib import resources
from typing import Any, TypeVar

from psycopg import errors, sql
from sqlalchemy.engine import Connection

from ._pg import driver, execute
from .deadline import DEFAULT_CALL_TIMEOUT, INSTALL_TIMEOUT, bound_of, bounded
from .durations import Duration, format_duration, parse_duration, setting_ms
from .errors import ConfigError, MigrationError, SchemaError

log = logging.getLogger(__name__)

ADDITIVE, BREAKING = "additive", "breaking"
KINDS = (ADDITIVE, BREAKING)

_HEADER = re.compile(r"--\s*pgjobs-migration:\s*(\S+)\s*")
_FILE = re.compile(r"(\d+)_[A-Za-z0-9_]+\.sql")


@dataclass(frozen=True, slots=True)
class Migration:
    """One ``pgjobs/sql/NNN_name.sql``: its number, name, kind and text."""

    number: int
    #: the file name without ``.sql``: ``001_core``
    name: str
    #: ``additive`` (older code keeps working beside it) or ``breaking``
    kind: str
    text: str

    def statement(self, schema: str) -> sql.Composed:
        """The migration's SQL with ``{schema}`` and ``{schema_name}`` filled in."""
        return sql.SQL(self.text).format(
            schema=sql.Identifier(schema), schema_name=sql.Literal(schema)
        )


def parse(filename: str, text: str) -> Migration:
    """The migration in ``filename`` (``NNN_name.sql``); its first line must
    say ``-- pgjobs-migration: additive`` or ``breaking``."""
    match = _FILE.fullmatch(filename)
    if match is None:
        raise MigrationError(f"pgjobs/sql/{filename}: expected a name NNN_name.sql")
    first = text.split("\n", 1)[0].strip()
    header = _HEADER.fullmatch(first)
    if header is None or header.group(1) not in KINDS:
        raise MigrationError(
            f"pgjobs/sql/{filename}: its first line must be '-- pgjobs-migration: additive'"
            " (code older than it keeps working beside it) or '-- pgjobs-migration: breaking',"
            f" got {first!r}"
        )
    return Migration(int(match.group(1)), filename[: -len(".sql")], header.group(1), text)


def load(files: Sequence[tuple[str, str]]) -> tuple[Migration, ...]:
    """Migrations from ``(filename, text)`` pairs, in order; two files of one
    number are an error."""
    found = sorted((parse(name, text) for name, text in files), key=lambda m: m.number)
    for before, after in itertools.pairwise(found):
        if before.number == after.number:
            raise MigrationError(
                f"pgjobs/sql: {before.name}.sql and {after.name}.sql have the same number"
            )
    return tuple(found)


@functools.cache
def migrations() -> tuple[Migration, ...]:
    """The migrations shipped with this code, in order."""
    folder = resources.files("pgjobs").joinpath("sql")
    return load(
        [
            (entry.name, entry.read_text(encoding="utf-8"))
            for entry in folder.iterdir()
            if entry.name.endswith(".sql")
        ]
    )


def code_version() -> int:
    """The number of this code's latest migration."""
    return migrations()[-1].number


# -- what the database holds ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Installed:
    """``<schema>.schema_version`` as read: each applied version and its kind
    (``None`` where the table has no ``kind`` column: the previous release's)."""

    schema: str
    exists: bool = False
    has_kind: bool = False
    versions: dict[int, str | None] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """The latest applied version (0: not installed)."""
        return max(self.versions, default=0)


def read(conn: Connection, schema: str) -> Installed:
    """What ``schema`` holds, in one statement; a missing schema or table is
    an empty :class:`Installed`. Call it inside a transaction (a savepoint
    keeps the transaction usable when the table is missing)."""
    table = sql.Identifier(schema, "schema_version")
    # to_jsonb(row) reads the kind column where it exists and null where it
    # does not: one statement for this release's table and the previous one's.
    query = sql.SQL(
        "select v.version, to_jsonb(v) ->> 'kind', to_jsonb(v) ? 'kind' from {} as v"
    ).format(table)
    try:
        with conn.begin_nested():
            rows = execute(conn, query).fetchall()
    except (errors.UndefinedTable, errors.InvalidSchemaName):
        return Installed(schema)
    return Installed(
        schema,
        exists=True,
        has_kind=bool(rows) and bool(rows[0][2]),
        versions={int(r[0]): r[1] for r in rows},
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """The database's schema against this code's migrations."""

    installed: Installed
    #: this code's migrations that the database lacks, in order
    pending: tuple[Migration, ...]
    #: versions the database has past this code's latest, with their kinds
    newer: dict[int, str | None]

    @property
    def code_version(self) -> int:
        return code_version()

    @property
    def breaking(self) -> list[int]:
        """The newer versions that older code may not run beside (a version
        without a recorded kind counts as breaking: nothing says otherwise)."""
        return sorted(n for n, kind in self.newer.items() if kind != ADDITIVE)

    def too_new(self) -> str | None:
        """The refusal's message where the schema is past a breaking migration."""
        if not self.breaking:
            return None
        listed = ", ".join(f"{n:03d}" for n in self.breaking)
        return (
            f"pgjobs' schema {self.installed.schema!r} is at version"
            f" {self.installed.version}, newer than this code's version {self.code_version},"
            f" past breaking migration(s) {listed}: this code cannot run beside it; deploy the"
            " pgjobs-derived release that applied it (nothing was written)"
        )

    def pending_names(self) -> str:
        return ", ".join(m.name for m in self.pending)


def plan(installed: Installed, available: Sequence[Migration] | None = None) -> Plan:
    """What ``installed`` lacks of ``available`` (default: this code's), and
    what it has beyond them. A recorded version below this code's latest that
    the code has no file for (a number skipped) is history, not news."""
    shipped = migrations() if available is None else tuple(available)
    latest = shipped[-1].number if shipped else 0
    pending = tuple(m for m in shipped if m.number not in installed.versions)
    newer = {n: k for n, k in installed.versions.items() if n > latest}
    return Plan(installed, pending, newer)


_warned: set[tuple[str, int]] = set()
_warned_lock = threading.Lock()


def _warn_newer(found: Plan) -> None:
    """Say once per process and schema version that the schema is newer (additive)."""
    key = (found.installed.schema, found.installed.version)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(
        "pgjobs: schema %r is at version %d, newer than this code's version %d; its newer"
        " migrations (%s) are additive, so this code runs on beside them: upgrade"
        " pgjobs-derived when you can",
        found.installed.schema,
        found.installed.version,
        found.code_version,
        ", ".join(f"{n:03d}" for n in sorted(found.newer)),
    )


# -- settings ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class MigrateSettings:
    """How a migration waits.

    ``lock_timeout``: the longest any table lock request of a migration waits
    (and so the longest the replicas' statements on that table queue behind
    it); ``retry_for``: how long attempts that found a lock taken are retried,
    with backoff, before giving up; ``statement_timeout``: the longest one
    migration statement may run (an index on a large queue takes a while).
    """

    lock_timeout: Duration = "2s"
    retry_for: Duration = "60s"
    statement_timeout: Duration = "15m"

    def __post_init__(self) -> None:
        for name in ("lock_timeout", "retry_for", "statement_timeout"):
            value = parse_duration(getattr(self, name), field=name)
            if name != "retry_for" and value < timedelta(milliseconds=1):
                raise ConfigError(f"{name}: must be at least 1ms, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)

    def millis(self, name: str) -> str:
        value = getattr(self, name)
        assert isinstance(value, timedelta)
        return setting_ms(value.total_seconds())


DEFAULT_SETTINGS = MigrateSettings()


# -- the statements -----------------------------------------------------------------
def lock_key(schema: str) -> str:
    # the previous release takes the same lock: old and new migrators queue
    return f"pgjobs-store:{schema}"


def _bookkeeping(schema: str, installed: Installed) -> list[sql.Composed]:
    """The schema and its ``schema_version`` table, or the ``kind`` column the
    previous release's table lacks; nothing where both are there already
    (an ALTER would take the table's ACCESS EXCLUSIVE lock for nothing)."""
    table = sql.Identifier(schema, "schema_version")
    kind = sql.SQL("kind text not null default 'additive' check (kind in ('additive', 'breaking'))")
    if not installed.exists:
        return [
            sql.SQL("create schema if not exists {}").format(sql.Identifier(schema)),
            sql.SQL(
                "create table if not exists {} (version integer primary key,"
                " applied_at timestamptz not null default now(), {})"
            ).format(table, kind),
        ]
    if not installed.has_kind:
        return [sql.SQL("alter table {} add column if not exists {}").format(table, kind)]
    return []


def _record(schema: str, migration: Migration) -> sql.Composed:
    return sql.SQL("insert into {} (version, kind) values ({}, {})").format(
        sql.Identifier(schema, "schema_version"),
        sql.Literal(migration.number),
        sql.Literal(migration.kind),
    )


def statements(
    schema: str, installed: Installed, pending: Sequence[Migration]
) -> list[tuple[Migration | None, sql.Composed]]:
    """What applying ``pending`` to ``installed`` executes, after the lock:
    the bookkeeping (migration ``None``), then each migration and its row in
    ``schema_version``."""
    out: list[tuple[Migration | None, sql.Composed]] = [
        (None, s) for s in _bookkeeping(schema, installed)
    ]
    for migration in pending:
        out.append((migration, migration.statement(schema)))
        out.append((migration, _record(schema, migration)))
    return out


def script(
    conn: Connection | None,
    schema: str,
    installed: Installed,
    pending: Sequence[Migration],
    *,
    settings: MigrateSettings = DEFAULT_SETTINGS,
) -> str:
    """``pending`` as one SQL script, for ``psql -v ON_ERROR_STOP=1
    --single-transaction -f FILE`` or a migration tool's transaction: the
    same statements :func:`migrate` executes, the schema name filled in, the
    rows of ``schema_version`` included (so pgjobs sees the schema as current
    afterwards)."""
    context: Any = driver(conn) if conn is not None else None
    if not pending:
        return f"-- pgjobs' schema {schema!r} is current: no migration is pending\n"
    head = [
        f"-- pgjobs' migrations {pending[0].name} .. {pending[-1].name} for schema {schema!r}"
        f" (it is at version {installed.version}).",
        "-- Run in one transaction: psql -v ON_ERROR_STOP=1 --single-transaction -f FILE,",
        "-- or your migration tool's. Each migration adds its row to schema_version.",
        f"set local lock_timeout = '{settings.millis('lock_timeout')}';",
        f"set local statement_timeout = '{settings.millis('statement_timeout')}';",
        sql.SQL("select pg_advisory_xact_lock(hashtextextended({}, 0));")
        .format(sql.Literal(lock_key(schema)))
        .as_string(context),
    ]
    body: list[str] = []
    current: Migration | None = None
    for migration, statement in statements(schema, installed, pending):
        if migration is not None and migration is not current:
            current = migration
            body.append(f"\n-- {migration.name} ({migration.kind})")
        text = statement.as_string(context).strip()
        body.append(text if text.endswith(";") else text + ";")
    return "\n".join(head + body) + "\n"


# -- applying ---------------------------------------------------------------------
def install_bound(settings: MigrateSettings, call_timeout: float) -> float:
    """Seconds: the deadline of each round trip of :func:`migrate`. At least
    :data:`~pgjobs.deadline.INSTALL_TIMEOUT`, and as long as the server may
    take by ``settings`` (the advisory lock waits up to ``retry_for``, a
    migration's statement up to ``statement_timeout``) + ``call_timeout`` as
    a margin, as a tick's deadline (``records.tick_bound``): a statement the
    server still allows is not cut short by the client."""
    longest = max(_td(settings.retry_for), _td(settings.statement_timeout)).total_seconds()
    return max(INSTALL_TIMEOUT, call_timeout, longest + call_timeout)


def _set(conn: Connection, name: str, value: str) -> None:
    execute(conn, "select set_config(%s, %s, true)", (name, value))


def _attempt(
    conn: Connection, schema: str, available: Sequence[Migration], settings: MigrateSettings
) -> tuple[Plan, list[Migration]]:
    """One transaction: the advisory lock (waiting at most ``retry_for`` for
    another migrator), then what is pending, each table lock waiting at most
    ``lock_timeout``. Raises LockNotAvailable (rolled back) when one is not
    granted in time."""
    with conn.begin():
        _set(conn, "lock_timeout", settings.millis("retry_for"))
        execute(
            conn,
            "select pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (lock_key(schema),),
        )
        _set(conn, "lock_timeout", settings.millis("lock_timeout"))
        _set(conn, "statement_timeout", settings.millis("statement_timeout"))
        # never wait for a synchronous standby (docs/failover.md)
        _set(conn, "synchronous_commit", "local")
        found = plan(read(conn, schema), available)
        refusal = found.too_new()
        if refusal is not None:
            raise SchemaError(refusal)
        if not found.pending:
            return found, []
        current: Migration | None = None
        for migration, statement in statements(schema, found.installed, found.pending):
            if migration is not None and migration is not current:
                current = migration
                log.info("pgjobs: applying migration %s in schema %s", migration.name, schema)
            execute(conn, statement)
    return found, list(found.pending)


def migrate(
    conn: Connection,
    schema: str,
    *,
    settings: MigrateSettings = DEFAULT_SETTINGS,
    available: Sequence[Migration] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Migration]:
    """Apply what ``schema`` lacks of ``available`` (default: this code's
    migrations) and return what was applied. A lock not granted within
    ``settings.lock_timeout`` rolls everything back and the attempt is
    retried, with backoff and a log line, for ``settings.retry_for``; then
    :class:`MigrationError`. A schema past a breaking migration of newer
    code: :class:`SchemaError`.

    Each round trip has the install deadline (:func:`install_bound`, the
    connection's own bound as ``call_timeout``: 10 s where it has none),
    not the bookkeeping one it came with, whoever calls: ``pgjobs migrate``,
    a job's first tick, ``pgjobs pause``; the connection's bound afterwards."""
    call_timeout = bound_of(conn) or DEFAULT_CALL_TIMEOUT
    with bounded(conn, install_bound(settings, call_timeout)):
        return _migrate(conn, schema, settings, available, sleep)


def _migrate(
    conn: Connection,
    schema: str,
    settings: MigrateSettings,
    available: Sequence[Migration] | None,
    sleep: Callable[[float], None],
) -> list[Migration]:
    shipped = migrations() if available is None else tuple(available)
    found, applied = retrying(
        lambda: _attempt(conn, schema, shipped, settings),
        f"migrating schema {schema}",
        settings=settings,
        sleep=sleep,
    )
    if found.newer:
        _warn_newer(found)
    return applied


_R = TypeVar("_R")


def retrying(
    attempt: Callable[[], _R],
    what: str,
    *,
    settings: MigrateSettings = DEFAULT_SETTINGS,
    sleep: Callable[[float], None] = time.sleep,
) -> _R:
    """``attempt()`` (one transaction whose table locks wait at most
    ``settings.lock_timeout``), retried with backoff and a log line while a
    lock is not granted in time, for ``settings.retry_for``; then
    :class:`MigrationError` saying nothing was applied. Migrations and the
    derived tables' triggers (:mod:`pgjobs.derived`) both install so."""
    retry_for = settings.retry_for
    assert isinstance(retry_for, timedelta)
    deadline = time.monotonic() + retry_for.total_seconds()
    delay, count = 0.1, 1
    while True:
        try:
            return attempt()
        except errors.LockNotAvailable as exc:
            left = deadline - time.monotonic()
            held = (exc.diag.message_primary or str(exc)).strip()
            if left <= 0:
                raise MigrationError(
                    f"pgjobs: {what}: a lock was not granted within"
                    f" {format_duration(_td(settings.lock_timeout))} ({held}), attempt"
                    f" {count}; gave up after {format_duration(retry_for)}. Nothing was"
                    " applied: another transaction holds a lock on pgjobs' tables (a long"
                    " run?); try again, or with a longer --retry-for"
                ) from exc
            wait = min(delay * (1 + random.random() / 2), left)
            log.warning(
                "pgjobs: %s: a lock was not granted within %s (%s), attempt"
                " %d rolled back; retrying in %.1f s (gives up %.0f s from now)",
                what,
                format_duration(_td(settings.lock_timeout)),
                held,
                count,
                wait,
                left,
            )
            sleep(wait)
            delay, count = min(delay * 2, 5.0), count + 1


def _td(value: Duration) -> timedelta:
    assert isinstance(value, timedelta)
    return value


def ensure(
    conn: Connection,
    schema: str,
    *,
    auto_migrate: bool = True,
    settings: MigrateSettings = DEFAULT_SETTINGS,
) -> Plan:
    """What a job does before its first tick: read the schema's versions
    (one statement, no lock); refuse a schema past a breaking migration of
    newer code, warn once about additive ones; apply what is pending, or,
    with ``auto_migrate`` off, refuse naming ``pgjobs migrate``."""
    with conn.begin():
        found = plan(read(conn, schema))
    refusal = found.too_new()
    if refusal is not None:
        raise SchemaError(refusal)
    if found.pending:
        if not auto_migrate:
            raise SchemaError(
                f"pgjobs' schema {schema!r} is at version {found.installed.version}; this code"
                f" needs migration(s) {found.pending_names()}, and automatic migration is off"
                " (auto_migrate = false): run `pgjobs migrate` first"
            )
        migrate(conn, schema, settings=settings)
        with conn.begin():
            found = plan(read(conn, schema))
    elif found.newer:
        _warn_newer(found)
    return found


# -- the command --------------------------------------------------------------------
def command(
    conn: Connection,
    schema: str,
    *,
    check: bool = False,
    as_sql: bool = False,
    settings: MigrateSettings = DEFAULT_SETTINGS,
) -> tuple[int, str]:
    """``pgjobs migrate``: ``(exit code, what to print)``. Applies what is
    pending; ``check``: exit 1 naming the pending migrations (or a newer,
    breaking schema), 0 when current; ``as_sql``: the pending migrations'
    SQL (:func:`script`), nothing applied."""
    with conn.begin():
        found = plan(read(conn, schema))
    if as_sql:
        with conn.begin():
            return 0, script(conn, schema, found.installed, found.pending, settings=settings)
    refusal = found.too_new()
    if check:
        if refusal is not None:
            return 1, refusal
        if found.pending:
            return 1, (
                f"pgjobs' schema {schema!r} is at version {found.installed.version}:"
                f" {len(found.pending)} migration(s) pending: {found.pending_names()}"
                " (`pgjobs migrate` applies them)"
            )
        return 0, f"pgjobs' schema {schema!r} is current (version {found.installed.version})"
    applied = migrate(conn, schema, settings=settings)
    with conn.begin():
        version = read(conn, schema).version
    if not applied:
        return 0, f"pgjobs' schema {schema!r} is current (version {version}): nothing to apply"
    names = ", ".join(m.name for m in applied)
    return 0, f"pgjobs: applied {names} to schema {schema!r}; it is at version {version}"


__all__ = [
    "DEFAULT_SETTINGS",
    "KINDS",
    "Installed",
    "MigrateSettings",
    "Migration",
    "Plan",
    "code_version",
    "command",
    "ensure",
    "install_bound",
    "load",
    "lock_key",
    "migrate",
    "migrations",
    "parse",
    "plan",
    "read",
    "retrying",
    "script",
    "statements",
]
