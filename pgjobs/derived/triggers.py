"""The derived tables' triggers in the database: checked, planned, installed.

For every source of every declaration (and every partition or inheritance
child of a source: a statement on a partition fires that partition's
statement triggers, not its parent's) four statement-level triggers call
``<schema>.derived_trigger()`` (migration 016): after INSERT, UPDATE and
DELETE with transition tables, and after TRUNCATE. Each carries, as its
arguments, the queue job, the search_path its SQL is read under, and one
statement composed here that answers the keys as a jsonb array:

* a source given as columns: those columns of ``new_rows`` / ``old_rows``
  (an UPDATE: both, so a row moved to another key enqueues both keys);
* a source given as SQL: that SQL, with the changed rows bound to the
  table's name (``with answer as (select * from new_rows) ...``);
* TRUNCATE (no rows to read): every key the target holds, so the workers
  rewrite each of them in turn (a derivation that a truncate would *add*
  rows to, by counting an absence, waits for the next recompute).

The triggers' arguments are the whole of what they do, so comparing them
with the declarations (:func:`plan_triggers`) says exactly which are
missing, stale, disabled or left over from a declaration that is gone.
:func:`check_declared` refuses bad input before anything is installed;
:func:`install_triggers` applies a plan in one transaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import errors, sql
from sqlalchemy.engine import Connection

from .._pg import driver, error_text, qualified
from ..deadline import DEFAULT_CALL_TIMEOUT, bound_of, bounded
from ..errors import ConfigError
from ..migrations import DEFAULT_SETTINGS, MigrateSettings, install_bound, lock_key, retrying
from ..queue import TRIGGER_EVENTS, TRUNCATE_EVENT, trigger_name, trigger_statements
from ..staging import check_coverage, check_sql
from ..target import reflect_target
from .declare import Derived, Source, chain_order, table_name
from .keyed import check_keyed

log = logging.getLogger(__name__)

#: the trigger function of migration 016
FUNCTION = "derived_trigger"
#: insert, update, delete (with transition tables) and truncate
EVENTS = (*TRIGGER_EVENTS, TRUNCATE_EVENT)
#: rows of a source a mapping SQL is tried on by :func:`check_declared`
SAMPLE_ROWS = 100
#: pg_trigger.tgtype's bits for the events
_TYPE_BITS = {"insert": 4, "delete": 8, "update": 16, "truncate": 32}


@dataclass(frozen=True, slots=True)
class Table:
    """A table as the database names it."""

    oid: int
    schema: str
    name: str

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @property
    def shown(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True, slots=True)
class Trigger:
    """One trigger: expected by a declaration, or found installed."""

    table: Table
    name: str
    event: str
    #: (queue job, search_path, statement)
    args: tuple[str, ...]
    #: the declaration that wants it (``None``: found installed, its job's)
    derived: str | None = None
    enabled: bool = True

    @property
    def job(self) -> str:
        return self.args[0] if self.args else "?"

    @property
    def key(self) -> tuple[int, str]:
        return (self.table.oid, self.name)


@dataclass(frozen=True, slots=True)
class TriggerPlan:
    """The derived tables' triggers: what the declarations want against what
    the database holds, and the statements that make them agree."""

    expected: tuple[Trigger, ...] = ()
    #: wanted and not installed
    missing: tuple[Trigger, ...] = ()
    #: installed with other arguments, or disabled (the wanted ones)
    stale: tuple[Trigger, ...] = ()
    #: installed and wanted by no declaration (one that is gone, or renamed)
    orphans: tuple[Trigger, ...] = ()
    statements: tuple[sql.Composed, ...] = field(default=(), repr=False)

    @property
    def agrees(self) -> bool:
        return not (self.missing or self.stale or self.orphans)

    def lines(self) -> list[str]:
        """What disagrees, one line per table and job (empty when all agree)."""
        out: list[str] = []
        for what, items in (
            ("missing", self.missing),
            ("stale (other SQL or disabled)", self.stale),
            ("left over (no declaration wants it)", self.orphans),
        ):
            seen: dict[tuple[str, str], list[str]] = {}
            for t in items:
                seen.setdefault((t.table.shown, t.job), []).append(t.event)
            for (table, job), events in seen.items():
                owner = f"derived.{job.removesuffix(':queue')}"
                out.append(f"{owner}: trigger on {table} {what}: {', '.join(events)}")
        return out


# -- reading the catalog ------------------------------------------------------------
def _raw(conn: Connection | psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    return conn if isinstance(conn, psycopg.Connection) else driver(conn)


def resolve(raw: psycopg.Connection[Any], name: str) -> tuple[Table, str] | None:
    """``name`` as the database resolves it now (search_path), with its kind."""
    row = raw.execute(
        "select c.oid, n.nspname, c.relname, c.relkind from pg_class c"
        " join pg_namespace n on n.oid = c.relnamespace where c.oid = to_regclass(%s)",
        (qualified(name).as_string(raw),),
    ).fetchone()
    if row is None:
        return None
    return Table(int(row[0]), row[1], row[2]), row[3]


def tree(raw: psycopg.Connection[Any], table: Table) -> list[Table]:
    """``table`` and its partitions and inheritance children, at every depth."""
    rows = raw.execute(
        "with recursive t(oid) as (select %s::oid union"
        " select i.inhrelid from pg_inherits i join t on i.inhparent = t.oid)"
        " select c.oid, n.nspname, c.relname from t join pg_class c on c.oid = t.oid"
        " join pg_namespace n on n.oid = c.relnamespace order by n.nspname, c.relname",
        (table.oid,),
    ).fetchall()
    return [Table(int(r[0]), r[1], r[2]) for r in rows]


def _columns_of(raw: psycopg.Connection[Any], table: Table) -> set[str]:
    rows = raw.execute(
        "select attname from pg_attribute where attrelid = %s and attnum > 0 and not attisdropped",
        (table.oid,),
    ).fetchall()
    return {r[0] for r in rows}


def search_path(raw: psycopg.Connection[Any]) -> str:
    """The search_path a declaration's SQL is read under in its triggers:
    the installing session's schemas, pg_catalog first and pg_temp last
    (the trigger function runs as its owner: no schema a writer controls
    may come before the catalog)."""
    row = raw.execute(
        "select array_to_string(array(select quote_ident(s)"
        " from unnest(current_schemas(false)) as s where s <> 'pg_catalog'), ', ')"
    ).fetchone()
    middle = row[0] if row and row[0] else ""
    return ", ".join(p for p in ("pg_catalog", middle, "pg_temp") if p)


def installed(raw: psycopg.Connection[Any], schema: str) -> list[Trigger]:
    """Every trigger that calls ``<schema>.derived_trigger()``."""
    function = sql.Identifier(schema, FUNCTION).as_string(raw) + "()"
    rows = raw.execute(
        "select c.oid, n.nspname, c.relname, t.tgname, t.tgtype, t.tgargs, t.tgenabled <> 'D'"
        " from pg_trigger t join pg_class c on c.oid = t.tgrelid"
        " join pg_namespace n on n.oid = c.relnamespace"
        " where t.tgfoid = to_regprocedure(%s) order by n.nspname, c.relname, t.tgname",
        (function,),
    ).fetchall()
    out = []
    for oid, nsp, rel, name, tgtype, tgargs, enabled in rows:
        args = tuple(a.decode() for a in bytes(tgargs).split(b"\x00")[:-1])
        event = next((e for e, bit in _TYPE_BITS.items() if tgtype & bit), "?")
        out.append(Trigger(Table(int(oid), nsp, rel), name, event, args, None, bool(enabled)))
    return out


# -- the statements the triggers run --------------------------------------------------
def _keys_from(
    rel: sql.Composable, cols: Sequence[sql.Identifier], *, rename: bool = False
) -> sql.Composed:
    """The keys of ``rel``'s rows (``cols`` in scope order) as one jsonb
    array, rows with a null in their key left out (a null names no item).
    ``rename``: ``rel``'s output columns are named ``cols`` by position."""
    return sql.SQL(
        "select pg_catalog.jsonb_agg(distinct pg_catalog.jsonb_build_array({})) from {} as r{}"
        " where {}"
    ).format(
        sql.SQL(", ").join(sql.SQL("r.{}").format(c) for c in cols),
        rel,
        sql.SQL("({})").format(sql.SQL(", ").join(cols)) if rename else sql.SQL(""),
        sql.SQL(" and ").join(sql.SQL("r.{} is not null").format(c) for c in cols),
    )


def _changed(event: str, columns: sql.Composable) -> sql.Composed:
    """The rows a statement changed, as a relation."""
    if event == "insert":
        return sql.SQL("(select {} from new_rows)").format(columns)
    if event == "delete":
        return sql.SQL("(select {} from old_rows)").format(columns)
    return sql.SQL("(select {} from old_rows union all select {} from new_rows)").format(
        columns, columns
    )


def statement(derived: Derived, source: Source, event: str) -> sql.Composed:
    """What the trigger on ``source`` for ``event`` runs: the keys to enqueue."""
    if event == "truncate":
        return _keys_from(qualified(derived.target), [sql.Identifier(c) for c in derived.scope])
    if source.columns is not None:
        cols = [sql.Identifier(c) for c in source.columns]
        return _keys_from(_changed(event, sql.SQL(", ").join(cols)), cols)
    assert source.sql is not None
    return _mapped(derived, source, _changed(event, sql.SQL("*")))


def _mapped(derived: Derived, source: Source, rows: sql.Composable) -> sql.Composed:
    """A mapping SQL run for each of ``rows``, which it reads under its
    table's name (``answer.submission_id``, as a row trigger reads NEW): a
    LATERAL subquery, which PostgreSQL plans as one join over all the
    statement's rows. Its output columns are the key's, by position."""
    assert source.sql is not None
    names = [sql.Identifier(f"pgjobs_k{i + 1}") for i in range(len(derived.scope))]
    # _keys_from aliases the last FROM item, the lateral subquery, as r(keys)
    rel = sql.SQL("{} as {}, lateral ({})").format(
        rows, sql.Identifier(table_name(source.table)), sql.SQL(source.sql)
    )
    return _keys_from(rel, names, rename=True)


# -- checking declarations ---------------------------------------------------------------
def check_declared(conn: Connection, declared: Sequence[Derived]) -> None:
    """Refuse bad declarations before anything is installed, each error
    naming the key and the value: a source or target that is missing, a
    source's columns that are not there, a mapping SQL that does not give
    the scope's number of columns or fails on the source's rows (tried on
    :data:`SAMPLE_ROWS` of them), an SQL whose output lacks the scope's or
    the target's columns, and the tables the SQL reads (from its plan) that
    are neither sources nor ``static`` (the completeness check). A chain
    cycle is refused too. Runs in a read-only transaction rolled back."""
    chain_order(declared)
    with conn.begin() as trans:
        raw = _raw(conn)
        raw.execute("set transaction read only")
        raw.execute("set local statement_timeout = '15s'")
        raw.execute("set local lock_timeout = '5s'")
        for derived in declared:
            _check_one(conn, raw, derived)
        trans.rollback()


def check_one(conn: Connection, derived: Derived, schema: str) -> None:
    """:func:`check_declared` for one declaration, inside the caller's
    (read-only) transaction, its statements under savepoints; and a
    warning in the log for each of its triggers that disagrees with it
    (the pre-flight check of ``pgjobs run`` and ``pgjobs once``)."""
    raw = _raw(conn)
    _check_one(conn, raw, derived)
    found = plan_triggers(conn, [derived], schema)
    for line in replace(
        found, orphans=tuple(t for t in found.orphans if t.job == derived.queue_name)
    ).lines():
        log.warning("pgjobs: %s (`pgjobs migrate` makes it agree)", line)


def _try(conn: Connection, key: str, value: object, what: str, query: sql.Composed) -> Any:
    try:
        with conn.begin_nested():
            cursor = _raw(conn).execute(query)
            return cursor
    except psycopg.Error as exc:
        message = error_text(exc, first=True, sqlstate=True)
        raise ConfigError(f"{key}: {what}: {message}, got {value!r}") from None


def _check_one(conn: Connection, raw: psycopg.Connection[Any], derived: Derived) -> None:
    where = derived.where
    found = resolve(raw, derived.target)
    if found is None:
        raise ConfigError(f"{where}.target: no table {derived.target!r}, got {derived.target!r}")
    target_cols = _columns_of(raw, found[0])
    missing = [c for c in derived.scope if c not in target_cols]
    if missing:
        raise ConfigError(
            f"{where}.scope: the target {derived.target!r} has no column(s) "
            f"{', '.join(missing)}, got {list(derived.scope)}"
        )
    sources: list[Table] = []
    for source in derived.all_sources:
        key = f"{where}.sources.{source.table}"
        value: object = source.sql if source.sql is not None else list(source.columns or ())
        resolved = resolve(raw, source.table)
        if resolved is None:
            raise ConfigError(f"{key}: no table {source.table!r}, got {value!r}")
        table, relkind = resolved
        if relkind not in ("r", "p"):
            raise ConfigError(
                f"{key}: {source.table!r} is not a table (a view, a foreign table ...):"
                f" declare the tables it reads instead, got {value!r}"
            )
        sources.extend(tree(raw, table))
        if source.columns is not None:
            present = _columns_of(raw, table)
            absent = [c for c in source.columns if c not in present]
            if absent:
                raise ConfigError(
                    f"{key}: {source.table!r} has no column(s) {', '.join(absent)}, got {value!r}"
                )
            continue
        assert source.sql is not None
        probe = sql.SQL(
            "select q.* from (select * from {} limit 0) as {}, lateral ({}) as q limit 0"
        )
        cursor = _try(
            conn,
            key,
            value,
            "the mapping SQL fails",
            probe.format(
                table.ident, sql.Identifier(table_name(source.table)), sql.SQL(source.sql)
            ),
        )
        width = len(cursor.description or ())
        if width != len(derived.scope):
            raise ConfigError(
                f"{key}: the mapping SQL gives {width} column(s); it must give the scope's "
                f"{len(derived.scope)} ({', '.join(derived.scope)}), in its order, got {value!r}"
            )
        sample = sql.SQL("(select * from {} limit {})").format(
            table.ident, sql.Literal(SAMPLE_ROWS)
        )
        _try(
            conn,
            key,
            value,
            f"the mapping SQL fails on {source.table!r}'s rows",
            _mapped(derived, source, sample),
        )
    # the SQL itself: its columns, then what it reads
    key = f"{where}.sql"
    cursor = _try(
        conn,
        key,
        derived.sql,
        "the query fails",
        sql.SQL("select * from ({}) as q limit 0").format(sql.SQL(derived.sql)),
    )
    produced = [d.name for d in cursor.description or ()]
    lacking = [c for c in derived.scope if c not in produced]
    if lacking:
        raise ConfigError(
            f"{key}: its output lacks the scope's column(s) {', '.join(lacking)} (it gives"
            f" {', '.join(produced)}), got {derived.sql!r}"
        )
    recompute, _queue = derived.jobs()
    try:
        with conn.begin_nested():
            target = reflect_target(
                conn, recompute.target, key=recompute.key, parents=recompute.parents
            )
            check_coverage(target, check_sql(conn, target, derived.sql), recompute.columns, "SQL")
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}, got {derived.sql!r}") from None
    check_keyed(conn, derived.sql, derived.scope, where=key)
    _check_complete(conn, raw, derived, sources)


def _relations(plan: Any) -> Iterable[tuple[str, str]]:
    if isinstance(plan, dict):
        if "Relation Name" in plan and "Schema" in plan:
            yield plan["Schema"], plan["Relation Name"]
        for value in plan.values():
            yield from _relations(value)
    elif isinstance(plan, list):
        for item in plan:
            yield from _relations(item)


def reads(conn: Connection, query: str) -> list[Table]:
    """The tables ``query``'s plan reads, each as its root (a partition as
    its partitioned table, an inheritance child as its parent)."""
    raw = _raw(conn)
    with conn.begin_nested():
        (row,) = raw.execute(
            sql.SQL("explain (format json, verbose, costs off) select * from ({}) as q").format(
                sql.SQL(query)
            )
        ).fetchall()
    plan = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    names = sorted(set(_relations(plan)))
    out: dict[int, Table] = {}
    for schema, name in names:
        found = raw.execute(
            "with recursive up(oid) as (select to_regclass(%s)::oid union"
            " select i.inhparent from pg_inherits i join up on i.inhrelid = up.oid)"
            " select c.oid, n.nspname, c.relname from up join pg_class c on c.oid = up.oid"
            " join pg_namespace n on n.oid = c.relnamespace"
            " where not exists (select 1 from pg_inherits i where i.inhrelid = up.oid)",
            (sql.Identifier(schema, name).as_string(raw),),
        ).fetchall()
        for oid, nsp, rel in found:
            out[int(oid)] = Table(int(oid), nsp, rel)
    return sorted(out.values(), key=lambda t: t.shown)


def _check_complete(
    conn: Connection, raw: psycopg.Connection[Any], derived: Derived, sources: list[Table]
) -> None:
    declared = {t.oid for t in sources}
    for name in derived.static:
        resolved = resolve(raw, name)
        if resolved is None:
            raise ConfigError(f"{derived.where}.static: no table {name!r}, got {name!r}")
        declared.update(t.oid for t in tree(raw, resolved[0]))
    try:
        read = reads(conn, derived.sql)
    except psycopg.Error as exc:
        message = error_text(exc, first=True, sqlstate=True)
        raise ConfigError(f"{derived.where}.sql: the query fails: {message}") from None
    uncaptured = [t.shown for t in read if t.oid not in declared]
    if uncaptured:
        raise ConfigError(
            f"{derived.where}.sources: the SQL reads {', '.join(uncaptured)} (from its plan),"
            " not declared as sources: its changes would not reach the table; declare each"
            f" under [derived.{derived.name}.sources], or in static = [...] if its changes"
            f" need no capture, got sources {[s.table for s in derived.all_sources]}"
        )


# -- the plan ------------------------------------------------------------------------
def expected(raw: psycopg.Connection[Any], declared: Sequence[Derived]) -> list[Trigger]:
    """The triggers the declarations want (sources that do not resolve are
    left out: :func:`check_declared` names them)."""
    path = search_path(raw)
    out = []
    for derived in declared:
        for source in derived.all_sources:
            resolved = resolve(raw, source.table)
            if resolved is None:
                continue
            for table in tree(raw, resolved[0]):
                for event, _ in EVENTS:
                    query = statement(derived, source, event).as_string(raw)
                    out.append(
                        Trigger(
                            table,
                            trigger_name(derived.queue_name, event),
                            event,
                            (derived.queue_name, path, query),
                            derived.name,
                        )
                    )
    return out


def plan_triggers(
    conn: Connection | psycopg.Connection[Any],
    declared: Sequence[Derived],
    schema: str,
    *,
    drop: bool = True,
) -> TriggerPlan:
    """The declarations' triggers against the installed ones, and the
    statements (drop, then create, per table and job; drop the left-over
    ones, unless ``drop`` is off) that make them agree. Reads only."""
    raw = _raw(conn)
    wanted = expected(raw, declared)
    found = {t.key: t for t in installed(raw, schema)}
    by_key = {t.key: t for t in wanted}
    missing = [t for t in wanted if t.key not in found]
    stale = [
        t
        for t in wanted
        if t.key in found and (found[t.key].args != t.args or not found[t.key].enabled)
    ]
    orphans = [t for key, t in found.items() if key not in by_key]
    statements: list[sql.Composed] = []
    redo: dict[tuple[int, str], Trigger] = {}
    for t in [*missing, *stale]:
        redo.setdefault((t.table.oid, t.job), t)
    for t in redo.values():
        args = {w.event: w.args for w in wanted if (w.table.oid, w.job) == (t.table.oid, t.job)}
        statements.extend(
            trigger_statements(
                t.job,
                t.table.ident,
                schema,
                args=lambda event, _a=args: _a[event],  # type: ignore[misc]
                function=FUNCTION,
                events=EVENTS,
            )
        )
    for t in orphans if drop else ():
        statements.append(
            sql.SQL("drop trigger if exists {} on {}").format(sql.Identifier(t.name), t.table.ident)
        )
    return TriggerPlan(
        tuple(wanted), tuple(missing), tuple(stale), tuple(orphans), tuple(statements)
    )


def read_plan(engine: Any, declared: Sequence[Derived], schema: str) -> TriggerPlan:
    """:func:`plan_triggers` on a connection of ``engine`` (a SQLAlchemy
    ``Engine``), in a read-only transaction: what ``pgjobs status`` and
    ``pgjobs check`` report."""
    with engine.connect() as conn, conn.begin():
        _raw(conn).execute("set transaction read only")
        return plan_triggers(conn, declared, schema)


def install_triggers(
    conn: Connection,
    declared: Sequence[Derived],
    schema: str,
    *,
    settings: MigrateSettings = DEFAULT_SETTINGS,
    check: bool = True,
    drop: bool = True,
) -> TriggerPlan:
    """Make the installed triggers agree with ``declared``: check them
    (:func:`check_declared`, unless ``check`` is off), then, in one
    transaction under the migrations' advisory lock, each table lock
    waiting at most ``settings.lock_timeout`` (retried as migrations are),
    create what is missing or stale and drop what no declaration wants
    (unless ``drop`` is off: a scheduler that knows only some of them).
    Nothing is installed half: an error rolls all of it back. Returns the
    plan that was applied."""
    if check:
        check_declared(conn, declared)

    def attempt() -> TriggerPlan:
        with conn.begin():
            raw = _raw(conn)
            raw.execute(
                "select set_config('lock_timeout', %s, true)", (settings.millis("retry_for"),)
            )
            raw.execute(
                "select pg_advisory_xact_lock(hashtextextended(%s, 0))", (lock_key(schema),)
            )
            raw.execute(
                "select set_config('lock_timeout', %s, true)", (settings.millis("lock_timeout"),)
            )
            raw.execute(
                "select set_config('statement_timeout', %s, true)",
                (settings.millis("statement_timeout"),),
            )
            found = plan_triggers(conn, declared, schema, drop=drop)
            for statement_ in found.statements:
                try:
                    raw.execute(statement_)
                except errors.InsufficientPrivilege as exc:
                    raise ConfigError(
                        f"installing the derived tables' triggers: {error_text(exc, first=True)}"
                        f" (statement: {statement_.as_string(raw)})"
                    ) from None
        return found

    # each round trip under the install deadline, as a migration's (the
    # advisory lock may wait up to retry_for), not the bookkeeping one
    call_timeout = bound_of(conn) or DEFAULT_CALL_TIMEOUT
    with bounded(conn, install_bound(settings, call_timeout)):
        return retrying(attempt, "installing the derived tables' triggers", settings=settings)


def script(conn: Connection, declared: Sequence[Derived], schema: str) -> str:
    """:func:`plan_triggers`'s statements as SQL text, for ``pgjobs migrate --sql``."""
    with conn.begin():
        found = plan_triggers(conn, declared, schema)
        raw = _raw(conn)
    if not found.statements:
        return "-- the derived tables' triggers agree with the declarations: nothing to do\n"
    head = ["", "-- the derived tables' triggers (pgjobs.derived)"]
    head += [f"-- {line}" for line in found.lines()]
    body = [s.as_string(raw).strip() + ";" for s in found.statements]
    return "\n".join(head + body) + "\n"


__all__ = [
    "EVENTS",
    "FUNCTION",
    "SAMPLE_ROWS",
    "Table",
    "Trigger",
    "TriggerPlan",
    "check_declared",
    "check_one",
    "expected",
    "install_triggers",
    "installed",
    "plan_triggers",
    "read_plan",
    "reads",
    "resolve",
    "script",
    "search_path",
    "statement",
    "tree",
]
