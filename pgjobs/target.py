"""Reflection of a derived (target) table: what the diff writer needs to know.

:func:`reflect_target` returns a frozen :class:`Target`: the diff key (the
primary key unless declared), the columns pgjobs may write (generated and
identity columns left out), how each column is compared, the target's
parents (every foreign key, composite and nullable ones included,
self-references marked, plus the parents a job declares where no foreign
key says so) and its plain btree indexes. The process keeps what it
reflected and checks it with one catalog query per run, which
:func:`prefetch_fingerprint` queues for the runner's lock round trip.

Why, and the figures: ``docs/DESIGN.md``, "Reflection".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import execute, flush, frozen, later, qualified
from .errors import ConfigError
from .jobs import Parent

#: Types whose ``=`` is missing or does not mean "the same value" (json has
#: none; box and circle compare areas; point and polygon have only ``~=``).
#: Columns of these types, of domains over them or arrays of them are
#: compared by their text form, which is what the table stores.
_TEXT_COMPARED = frozenset(
    {"json", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle"}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ColumnInfo:
    """One writable column of the target."""

    name: str
    #: the SQL type as ``format_type`` prints it (for messages)
    type: str
    type_oid: int
    #: the type psycopg dumps for ``COPY`` (a domain's base type)
    copy_oid: int
    #: ``True``: compared with ``IS DISTINCT FROM``; ``False``: by its text form
    comparable: bool
    nullable: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class ParentRef:
    """A table the target's rows depend on: each row's ``columns`` (when none is
    NULL) must match ``parent_columns`` of a row of ``table``."""

    #: (schema, table) of the parent
    table: tuple[str, str]
    #: the target's columns, in the order of ``parent_columns``
    columns: tuple[str, ...]
    #: the parent's (unique) columns
    parent_columns: tuple[str, ...]
    #: the foreign key's name; ``None`` for a declared :class:`pgjobs.Parent`
    constraint: str | None = None
    #: the target references itself
    self_reference: bool = False

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(*self.table)

    @property
    def label(self) -> str:
        return f"{self.table[0]}.{self.table[1]}({', '.join(self.parent_columns)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """A derived table as the diff writer sees it (see :func:`reflect_target`)."""

    #: (schema, table)
    name: tuple[str, str]
    oid: int
    partitioned: bool
    #: the diff key: NOT NULL columns with a unique index on (a subset of) them
    key: tuple[str, ...]
    #: writable columns in table order (generated and identity columns left out)
    columns: tuple[str, ...]
    #: the writable columns' details, by name
    types: Mapping[str, ColumnInfo] = field(default_factory=dict)
    #: parents: foreign keys (sorted by parent table, then columns), then declared ones
    parents: tuple[ParentRef, ...] = ()
    #: the key columns of the table's plain btree indexes (valid, no predicate,
    #: no expression), in index order: which lookups an index serves
    indexes: tuple[tuple[str, ...], ...] = ()

    def indexed(self, columns: Sequence[str]) -> bool:
        """Whether an index leads with ``columns`` (in any order)."""
        want = set(columns)
        return any(set(ix[: len(want)]) == want for ix in self.indexes)

    @property
    def ident(self) -> sql.Identifier:
        """The table as a qualified identifier."""
        return sql.Identifier(*self.name)

    @property
    def label(self) -> str:
        return f"{self.name[0]}.{self.name[1]}"

    @property
    def self_reference(self) -> ParentRef | None:
        """The target's foreign key to itself, if it has one."""
        return next((p for p in self.parents if p.self_reference), None)


_RELATION = """
select c.oid::int8, n.nspname, c.relname, c.relkind
from pg_class c join pg_namespace n on n.oid = c.relnamespace
where c.oid = to_regclass(%s)
"""

_COLUMNS = """
select a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid::int8, a.attnotnull,
       a.attgenerated <> '' or a.attidentity = 'a' as always_generated,
       a.attidentity = 'd' as identity_by_default
from pg_attribute a
where a.attrelid = %s and a.attnum > 0 and not a.attisdropped
order by a.attnum
"""

# A type's base (domains resolved) and, for arrays, the element's base.
_TYPES = """
with recursive base(start, oid) as (
    select t, t from unnest(%s::oid[]) as t
    union all
    select b.start, ty.typbasetype from base b join pg_type ty on ty.oid = b.oid
    where ty.typtype = 'd'
)
select b.start::int8, b.oid::int8, ty.typname, ty.typnamespace = 'pg_catalog'::regnamespace,
       ty.typelem::int8, ty.typcategory = 'A'
from base b join pg_type ty on ty.oid = b.oid
where ty.typtype <> 'd'
"""

_PRIMARY_KEY = """
select array(
    select a.attname from unnest(i.indkey::int2[]) with ordinality k(attnum, ord)
    join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum order by k.ord)
from pg_index i where i.indrelid = %s and i.indisprimary
"""

# Unique indexes usable as a diff key: no predicate, no expressions; only the
# key columns (not INCLUDE ones) make the uniqueness.
_UNIQUE = """
select array(
    select a.attname from unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) k(attnum)
    join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum)
from pg_index i
where i.indrelid = %s and i.indisunique and i.indpred is null and i.indexprs is null
"""

# Foreign keys of the target. When the referenced table is partitioned,
# PostgreSQL adds internal clones of the constraint pointing at each
# partition (their conparentid is a constraint on the same table): skip
# those. A clone inherited from a partitioned parent of the target is kept,
# so a leaf partition used as a target still has its parents.
_FOREIGN_KEYS = """
select con.conname, pn.nspname, pc.relname, con.confrelid::int8,
    array(select a.attname from unnest(con.conkey) with ordinality k(attnum, ord)
          join pg_attribute a on a.attrelid = con.conrelid and a.attnum = k.attnum order by k.ord),
    array(select a.attname from unnest(con.confkey) with ordinality k(attnum, ord)
          join pg_attribute a on a.attrelid = con.confrelid and a.attnum = k.attnum order by k.ord)
from pg_constraint con
join pg_class pc on pc.oid = con.confrelid
join pg_namespace pn on pn.oid = pc.relnamespace
where con.conrelid = %s and con.contype = 'f'
  and not exists (select 1 from pg_constraint up
                  where up.oid = con.conparentid and up.conrelid = con.conrelid)
order by pn.nspname, pc.relname, con.conname
"""


_INDEXES = """
select array(
    select a.attname from unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) with ordinality k(attnum, ord)
    join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum order by k.ord)
from pg_index i
join pg_class ic on ic.oid = i.indexrelid
join pg_am am on am.oid = ic.relam
where i.indrelid = %s and i.indisvalid and i.indpred is null and i.indexprs is null
  and am.amname = 'btree'
"""


def _resolve(conn: Connection, name: str, what: str) -> tuple[int, str, str, str]:
    try:
        ident = qualified(name)
    except ValueError as exc:
        raise ConfigError(f"{what}: not a table name: {name!r}") from exc
    regclass_text = ident.as_string(conn.connection.driver_connection)
    row = execute(conn, _RELATION, (regclass_text,)).fetchone()
    if row is None:
        raise ConfigError(f"{what}: table {name!r} does not exist (or is not on the search_path)")
    oid, schema, table, kind = row
    if kind not in ("r", "p"):
        raise ConfigError(f"{what}: {schema}.{table} is not a table (relkind {kind!r})")
    return int(oid), str(schema), str(table), str(kind)


def _column_infos(
    conn: Connection, oid: int
) -> tuple[list[ColumnInfo], dict[str, ColumnInfo], set[str], set[str]]:
    """(non-generated columns, every column by name, always-generated names,
    identity BY DEFAULT names)."""
    rows = execute(conn, _COLUMNS, (oid,)).fetchall()
    bases: dict[int, tuple[int, str, bool, int, bool]] = {}

    def load(type_oids: list[int]) -> None:
        for start, base, typname, in_catalog, elem, is_array in execute(conn, _TYPES, (type_oids,)):
            bases[int(start)] = (
                int(base),
                str(typname),
                bool(in_catalog),
                int(elem),
                bool(is_array),
            )

    load(sorted({int(r[2]) for r in rows}))

    def text_compared(type_oid: int) -> bool:
        _base, typname, in_catalog, elem, is_array = bases[type_oid]
        if is_array and elem:
            if elem not in bases:
                load([elem])
            return text_compared(elem)
        return in_catalog and typname in _TEXT_COMPARED

    candidates: list[ColumnInfo] = []
    everything: dict[str, ColumnInfo] = {}
    always: set[str] = set()
    by_default: set[str] = set()
    for name, type_name, type_oid, notnull, always_generated, identity_by_default in rows:
        info = ColumnInfo(
            name=name,
            type=type_name,
            type_oid=int(type_oid),
            copy_oid=bases[int(type_oid)][0],
            comparable=not text_compared(int(type_oid)),
            nullable=not notnull,
        )
        everything[name] = info
        if always_generated:
            always.add(name)
            continue
        if identity_by_default:
            by_default.add(name)
        candidates.append(info)
    return candidates, everything, always, by_default


# What a reflection read, as one row of catalog row versions: for the target,
# each declared parent and each table its foreign keys reference, the oid and
# row version (xmin) of its pg_class and pg_namespace rows and of every
# pg_attribute, pg_constraint and pg_index row. Every DDL that could change
# a reflection (columns added, dropped, renamed or retyped, NOT NULL, keys,
# indexes, foreign keys, tables or schemas renamed, dropped and recreated,
# another table found on the search_path) writes a new version of one of
# these rows, so a new xmin; statistics (ANALYZE, VACUUM) are written in
# place and don't. A false alarm only costs a reflection.
_RELATION_FINGERPRINT = """
select array[c.oid::text, c.xmin::text, n.xmin::text,
    (select string_agg(a.xmin::text, ',' order by a.attnum) from pg_attribute a
     where a.attrelid = c.oid),
    (select string_agg(x.oid::text || ':' || x.xmin::text, ',' order by x.oid)
     from pg_constraint x where x.conrelid = c.oid),
    (select string_agg(i.indexrelid::text || ':' || i.xmin::text, ',' order by i.indexrelid)
     from pg_index i where i.indrelid = c.oid)]
from pg_class c join pg_namespace n on n.oid = c.relnamespace where c.oid = {rel}
"""

_FINGERPRINT = (
    "select array(select to_regclass(r)::int8 from unnest({names}::text[]) as r),"
    " array(select ("
    + _RELATION_FINGERPRINT.format(rel="r.oid")
    + ") from (select distinct con.confrelid as oid from pg_constraint con"
    " where con.conrelid = to_regclass({target}) and con.contype = 'f'"
    " union select to_regclass(n) from unnest({names}::text[]) as n) as r"
    " where r.oid is not null order by r.oid)"
)

#: (server, database, user, search_path, name, key, parents) -> (fingerprint,
#: Target); bounded. Shared by the process's connections: a new connection
#: (a new pool, a CLI run) reads one fingerprint instead of reflecting again.
_reflected: dict[tuple[Any, ...], tuple[Any, Target]] = {}
_REFLECTED_SIZE = 256


#: reads a fingerprint queued ahead (see :func:`prefetch_fingerprint`)
Prefetched = Callable[[], Any]


@functools.lru_cache(maxsize=_REFLECTED_SIZE)
def _check_for(names: tuple[str, ...]) -> sql.SQL:
    """The check of one target and its parents, their names in it as
    literals: a statement without parameters, which the server plans once
    when psycopg has prepared it (after 5 runs by default; never where
    ``prepare_threshold`` is None, e.g. behind a transaction-pooling
    pgbouncer). With the names as parameters its custom plans cost 1.4 ms a
    call here, against 0.9 ms for the generic plan, and forcing the generic
    one took a statement before it and a setting given back after."""
    return frozen(
        sql.SQL(_FINGERPRINT).format(names=sql.Literal(list(names)), target=sql.Literal(names[0]))
    )


def _queue_fingerprint(conn: Connection, names: list[str]) -> Prefetched:
    check = later(conn, _check_for(tuple(names)))

    def read() -> Any:
        if check.result is None:  # not sent yet
            flush(conn)
        assert check.result is not None
        row = check.result.one()
        return None if row is None else row[:2]

    return read


def _names(pg: psycopg.Connection[Any], target: str, parents: Sequence[Parent]) -> list[str]:
    try:
        return [qualified(n).as_string(pg) for n in (target, *(p.table for p in parents))]
    except ValueError:
        return []  # _resolve raises the error


def prefetch_fingerprint(
    conn: Connection, target: str, parents: Sequence[Parent] = ()
) -> Prefetched | None:
    """Queue :func:`reflect_target`'s catalog check for the next round trip
    on ``conn`` (the runner's lock round trip); pass what this returns to
    ``reflect_target(..., prefetched=)``, in the same transaction."""
    pg = conn.connection.driver_connection
    assert isinstance(pg, psycopg.Connection)
    names = _names(pg, target, parents)
    return _queue_fingerprint(conn, names) if names else None


def _cache_key(
    pg: psycopg.Connection[Any],
    target: str,
    key: Sequence[str] | None,
    parents: Sequence[Parent],
) -> tuple[Any, ...]:
    info = pg.info
    return (
        info.host,
        info.port,
        info.dbname,
        info.user,
        info.parameter_status("search_path"),
        target,
        None if key is None else tuple(key),
        tuple(parents),
    )


def cached_target(
    conn: Connection,
    target: str,
    *,
    key: Sequence[str] | None = None,
    parents: Sequence[Parent] = (),
) -> Target | None:
    """What :func:`reflect_target` reflected last for these arguments on this
    server, unverified (no round trip): for work sent ahead on speculation,
    whose caller checks that the verified reflection is the same object."""
    pg = conn.connection.driver_connection
    assert isinstance(pg, psycopg.Connection)
    cached = _reflected.get(_cache_key(pg, target, key, parents))
    return None if cached is None else cached[1]


def reflect_target(
    conn: Connection,
    target: str,
    *,
    key: Sequence[str] | None = None,
    parents: Sequence[Parent] = (),
    prefetched: Prefetched | None = None,
) -> Target:
    """Read ``target``'s definition from the catalog.

    The process keeps what it reflected, together with the row versions of
    the catalog rows it came from (those of the target, its declared parents
    and the tables its foreign keys reference); one query compares them, and
    any change of the definition reflects the table again.

    ``key``: the diff key; defaults to the primary key. Its columns must be
    NOT NULL and covered by a unique index (a unique constraint or index on
    those columns or on a subset of them). ``parents``: parents no foreign
    key declares; they are locked and checked like reflected ones.
    ``prefetched``: the catalog check, queued ahead by :func:`prefetch_fingerprint`.

    Generated columns and identity columns are never written (identity
    columns ``BY DEFAULT`` are, when they are part of the key: the new rows
    then carry their values). Raises :class:`ConfigError` naming the table
    when it is missing, is not a table, or has no usable key.
    """
    pg = conn.connection.driver_connection
    assert isinstance(pg, psycopg.Connection)
    cache_key = _cache_key(pg, target, key, parents)
    fingerprint: Any = None
    names = _names(pg, target, parents)
    if names:
        # taken before the reflection: a change in between reflects again next time
        fingerprint = (prefetched if prefetched is not None else _queue_fingerprint(conn, names))()
        cached = _reflected.get(cache_key)
        if cached is not None and fingerprint is not None and cached[0] == fingerprint:
            return cached[1]
    result = _reflect(conn, target, key=key, parents=parents)
    if fingerprint is not None and fingerprint[0][0] == result.oid:
        if len(_reflected) >= _REFLECTED_SIZE:
            _reflected.clear()
        _reflected[cache_key] = (fingerprint, result)
    return result


def _reflect(
    conn: Connection,
    target: str,
    *,
    key: Sequence[str] | None,
    parents: Sequence[Parent],
) -> Target:
    """One reflection, in four steps: columns and types, the key, the
    parents (foreign keys, then declared ones), the indexes."""
    oid, schema, table, kind = _resolve(conn, target, "target")
    label = f"{schema}.{table}"
    candidates, everything, always, by_default = _column_infos(conn, oid)
    key_cols = _key(conn, label, oid, key, everything, always)
    key_set = set(key_cols)
    writable = [c for c in candidates if c.name not in by_default or c.name in key_set]
    types = {c.name: c for c in writable}
    refs = _foreign_keys(conn, oid)
    for declared in parents:
        ref = _declared_parent(conn, label, oid, declared, everything)
        if not any(r.table == ref.table and r.columns == ref.columns for r in refs):
            refs.append(ref)
    _check_parents(label, refs, types, key_cols)
    return Target(
        name=(schema, table),
        oid=oid,
        partitioned=kind == "p",
        key=key_cols,
        columns=tuple(c.name for c in writable),
        types=types,
        parents=tuple(refs),
        indexes=tuple(tuple(r[0]) for r in execute(conn, _INDEXES, (oid,))),
    )


def _key(
    conn: Connection,
    label: str,
    oid: int,
    key: Sequence[str] | None,
    everything: Mapping[str, ColumnInfo],
    always: set[str],
) -> tuple[str, ...]:
    """The diff key: the primary key, or ``key`` once checked (known, NOT
    NULL columns covered by a unique index); never a generated column."""
    if key is None:
        pk = execute(conn, _PRIMARY_KEY, (oid,)).fetchone()
        if pk is None:
            raise ConfigError(
                f"target {label}: no primary key; declare the diff key (key=...) on NOT NULL "
                f"columns with a unique index"
            )
        key_cols = tuple(pk[0])
    else:
        key_cols = tuple(key)
        if not key_cols:
            raise ConfigError(f"target {label}: key: expected column names, got {key!r}")
        unknown = [c for c in key_cols if c not in everything]
        if unknown:
            raise ConfigError(f"target {label}: key: no column(s) {', '.join(unknown)}")
        if len(set(key_cols)) != len(key_cols):
            raise ConfigError(f"target {label}: key: repeated column in {key_cols}")
        nullable = [c for c in key_cols if everything[c].nullable]
        if nullable:
            raise ConfigError(
                f"target {label}: key: column(s) {', '.join(nullable)} must be NOT NULL"
            )
        uniques = [set(r[0]) for r in execute(conn, _UNIQUE, (oid,))]
        if not any(u and u <= set(key_cols) for u in uniques):
            raise ConfigError(
                f"target {label}: key {key_cols}: no unique index or constraint on these columns"
            )
    generated_key = [c for c in key_cols if c in always]
    if generated_key:
        raise ConfigError(
            f"target {label}: key column(s) {', '.join(generated_key)} are generated; declare "
            f"a key the new rows can supply (key=...)"
        )
    return key_cols


def _foreign_keys(conn: Connection, oid: int) -> list[ParentRef]:
    """The parents the target's foreign keys name, in :data:`_FOREIGN_KEYS` order."""
    return [
        ParentRef(
            table=(str(pschema), str(ptable)),
            columns=tuple(cols),
            parent_columns=tuple(pcols),
            constraint=str(conname),
            self_reference=int(poid) == oid,
        )
        for conname, pschema, ptable, poid, cols, pcols in execute(conn, _FOREIGN_KEYS, (oid,))
    ]


def _declared_parent(
    conn: Connection, label: str, oid: int, declared: Parent, everything: Mapping[str, ColumnInfo]
) -> ParentRef:
    """A parent the job declares, once checked: both tables have the columns,
    and the parent's are covered by a unique index (one parent row per key)."""
    poid, pschema, ptable, _kind = _resolve(conn, declared.table, f"target {label}: parents")
    pcolumns = {r[0] for r in execute(conn, _COLUMNS, (poid,))}
    missing = [c for c in declared.columns if c not in everything]
    missing_parent = [c for c in declared.parent_columns if c not in pcolumns]
    if missing or missing_parent:
        raise ConfigError(
            f"target {label}: parents: {declared.table!r}: no column(s) "
            f"{', '.join(missing + [f'{ptable}.{c}' for c in missing_parent])}"
        )
    parent_uniques = [set(r[0]) for r in execute(conn, _UNIQUE, (poid,))]
    if not any(u and u <= set(declared.parent_columns) for u in parent_uniques):
        raise ConfigError(
            f"target {label}: parents: {pschema}.{ptable}{declared.parent_columns}: no unique "
            f"index or constraint on these columns (one parent row per key is needed)"
        )
    return ParentRef(
        table=(pschema, ptable),
        columns=declared.columns,
        parent_columns=declared.parent_columns,
        self_reference=poid == oid,
    )


def _check_parents(
    label: str,
    refs: Sequence[ParentRef],
    types: Mapping[str, ColumnInfo],
    key_cols: tuple[str, ...],
) -> None:
    """Every parent is reached through writable columns; at most one
    self-reference, and it points at the diff key."""
    for ref in refs:
        unwritable = [c for c in ref.columns if c not in types]
        if unwritable:
            raise ConfigError(
                f"target {label}: the parent {ref.label} is referenced through generated "
                f"column(s) {', '.join(unwritable)}; pgjobs needs the new rows to carry every "
                f"parent's columns"
            )
        if ref.self_reference and set(ref.parent_columns) != set(key_cols):
            raise ConfigError(
                f"target {label}: the self-reference {ref.constraint or ref.columns} must point at "
                f"the diff key {key_cols}"
            )
    if sum(r.self_reference for r in refs) > 1:
        raise ConfigError(f"target {label}: more than one self-reference is not supported")


def describe(target: Target) -> dict[str, Any]:
    """A JSON-friendly summary of ``target`` (for run details and logs)."""
    return {
        "table": target.label,
        "key": list(target.key),
        "columns": list(target.columns),
        "parents": [p.label for p in target.parents],
    }


__all__ = ["ColumnInfo", "ParentRef", "Target", "cached_target", "describe", "reflect_target"]
