"""A compute restricted to some keys of its scope, and the plan check that
says whether the restriction reaches the rows.

Used by the sliced recompute (a range of keys per slice, :mod:`pgjobs.slices`)
and by derived tables computed per key (a list or a table of keys). The
reasons are in ``docs/DESIGN.md``, "Slices".

* :func:`restrict` wraps the user's one full SQL text::

      select * from (<sql>) as pgjobs_q where <scope restricted>

  PostgreSQL pushes such a condition below the joins and the aggregates that
  group by the scope, down to the scans of the tables, for most SQL; then a
  slice reads only its keys' rows.
* :func:`check_plan` asks PostgreSQL where the condition went (``EXPLAIN``
  of the generic plan, once) and raises :class:`~pgjobs.errors.ScopeError`
  when it stayed above the work (an aggregate over every key, a ``WITH``
  computed whole, a join of everything): each slice would compute every key.
  A slice that reads a whole large table is logged once as a warning, with
  the index that would help.

Example::

    restricted = restrict(text, ("parent_id",), KeyRange(low=(1,), high=(1001,)))
    check_plan(conn, restricted, job_name="totals", scope=("parent_id",))
    rows = execute(conn, restricted.statement, restricted.params)
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from psycopg import sql

from ._pg import execute, qualified, send, swap_settings
from .errors import ConfigError, ScopeError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

log = logging.getLogger(__name__)

#: the alias of the user's SQL inside the restricted statement
ALIAS = "pgjobs_q"
#: a table of at least this many rows (``pg_class.reltuples``) read whole by
#: every slice is worth a warning
LARGE_ROWS = 100_000
#: how much of the user's SQL an error message quotes
_QUOTE = 300


@dataclass(frozen=True, kw_only=True, slots=True)
class KeyRange:
    """The keys from ``low`` (included) to ``high`` (excluded), in the scope
    columns' order (row comparison: ``(a, b) >= (1, 2)``); ``None``: open at
    that end. A slice of the key space."""

    low: tuple[Any, ...] | None = None
    high: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, tuple) or not value):
                raise ConfigError(f"KeyRange.{name}: expected a tuple of key values, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KeyList:
    """The keys given, each a tuple of the scope columns' values; they travel
    as one array parameter per column."""

    keys: tuple[tuple[Any, ...], ...]

    def __post_init__(self) -> None:
        keys = tuple(tuple(k) for k in self.keys)
        if len({len(k) for k in keys}) > 1:
            raise ConfigError(f"KeyList.keys: every key needs the same columns, got {keys[:5]!r}")
        object.__setattr__(self, "keys", keys)


@dataclass(frozen=True, kw_only=True, slots=True)
class KeysTable:
    """The keys in a table of the session (``pg_temp.keys``) whose columns
    are named as the scope's; read by the statement itself, so the keys do
    not travel."""

    table: str

    def __post_init__(self) -> None:
        if not isinstance(self.table, str) or not self.table.strip():
            raise ConfigError(f"KeysTable.table: expected a table name, got {self.table!r}")


Restriction: TypeAlias = KeyRange | KeyList | KeysTable


@dataclass(frozen=True, kw_only=True, slots=True)
class Restricted:
    """What :func:`restrict` makes: the statement and its parameters, the
    names of the parameters that carry the scope (``marks``) and the
    statement :func:`check_plan` explains (the same, or for a keys table its
    twin with the keys as arrays: the same conditions, in a form the plan
    shows as parameters)."""

    statement: sql.Composed
    params: dict[str, Any]
    marks: frozenset[str]
    checked: sql.Composed
    #: the user's SQL, for messages
    source: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """What :func:`check_plan` found: where the restriction landed (plan
    nodes, described) and the warnings it logged (tables read whole)."""

    reached: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _placeholder(name: str) -> sql.Placeholder:
    return sql.Placeholder(name)


def restrict(query: str, scope: Sequence[str], how: Restriction) -> Restricted:
    """``query`` (SQL text ready for psycopg: its own binds as ``%(name)s``,
    a literal ``%`` doubled) restricted to the keys ``how`` names, on the
    ``scope`` columns of its output::

        select * from (<query>) as pgjobs_q where <restriction>

    A :class:`KeyRange` of several columns also bounds the first column
    alone (``a >= low_a and a <= high_a``): a row comparison over columns
    of two tables can only be checked after their join, a bound on one
    column reaches that column's table. A :class:`KeyList` or
    :class:`KeysTable` of several columns tests each column with ``= any``
    (which reaches the tables) and the whole key with ``in`` (exact)."""
    if not scope or not all(isinstance(c, str) and c for c in scope):
        raise ConfigError(f"restrict: scope: expected column names, got {scope!r}")
    columns = [sql.Identifier(ALIAS, c) for c in scope]
    params: dict[str, Any] = {}
    conds: list[sql.Composable] = []
    checked_conds: list[sql.Composable] | None = None
    if isinstance(how, KeyRange):
        conds, params = _range_conditions(columns, how)
    elif isinstance(how, KeyList):
        if how.keys and len(how.keys[0]) != len(scope):
            raise ConfigError(
                f"KeyList: keys of {len(how.keys[0])} values for a scope of {len(scope)}"
                f" columns {tuple(scope)}"
            )
        names = [f"pgjobs_keys_{n}" for n in range(len(scope))]
        params = {name: [k[n] for k in how.keys] for n, name in enumerate(names)}
        conds = _list_conditions(columns, [_placeholder(n) for n in names])
    else:
        source = qualified(how.table) if "." in how.table else sql.Identifier(how.table)
        arrays: list[sql.Composable] = [
            sql.SQL("array(select {} from {})").format(sql.Identifier(c), source) for c in scope
        ]
        conds = _list_conditions(columns, arrays, exact_from=source, scope=scope)
        names = [f"pgjobs_keys_{n}" for n in range(len(scope))]
        checked_conds = _list_conditions(columns, [_placeholder(n) for n in names])
        params = {}
        marks = frozenset(names)
    statement = _wrap(query, conds)
    if isinstance(how, KeysTable):
        checked = _wrap(query, checked_conds or conds)
        return Restricted(
            statement=statement, params=params, marks=marks, checked=checked, source=query
        )
    return Restricted(
        statement=statement,
        params=params,
        marks=frozenset(params),
        checked=statement,
        source=query,
    )


def _wrap(query: str, conds: list[sql.Composable]) -> sql.Composed:
    where = sql.SQL(" and ").join(conds) if conds else sql.SQL("true")
    return sql.SQL("select * from ({}) as {} where {}").format(
        sql.SQL(query), sql.Identifier(ALIAS), where
    )


def _row(items: Sequence[sql.Composable]) -> sql.Composable:
    if len(items) == 1:
        return items[0]
    return sql.SQL("({})").format(sql.SQL(", ").join(items))


def range_condition(
    columns: Sequence[sql.Identifier], how: KeyRange, *, literal: bool = False
) -> tuple[sql.Composable, dict[str, Any]]:
    """The condition ``columns`` in ``how`` (as :func:`restrict` writes it),
    for a table of the caller's, and its parameters; ``literal``: the values
    inlined (``sql.Literal``), no parameters."""
    conds, params = _range_conditions(list(columns), how)
    where: sql.Composable = sql.SQL(" and ").join(conds) if conds else sql.SQL("true")
    if literal:
        where = sql.SQL(_inline(where.as_string(None), params))
        params = {}
    return where, params


def _inline(text: str, params: dict[str, Any]) -> str:
    """``text``'s ``%(name)s`` placeholders replaced by their values, quoted."""
    return _PYFORMAT.sub(
        lambda m: "%" if m.group(1) is None else sql.Literal(params[m.group(1)]).as_string(None),
        text,
    )


def _range_conditions(
    columns: list[sql.Identifier], how: KeyRange
) -> tuple[list[sql.Composable], dict[str, Any]]:
    conds: list[sql.Composable] = []
    params: dict[str, Any] = {}
    for bound, op, first_op, prefix in (
        (how.low, ">=", ">=", "pgjobs_lo"),
        (how.high, "<", "<=", "pgjobs_hi"),
    ):
        if bound is None:
            continue
        if len(bound) != len(columns):
            raise ConfigError(
                f"KeyRange: a bound of {len(bound)} values for a scope of {len(columns)} columns"
            )
        names = [f"{prefix}_{n}" for n in range(len(bound))]
        params.update(zip(names, bound, strict=True))
        holders = [_placeholder(n) for n in names]
        if len(columns) > 1:
            conds.append(sql.SQL("{} {} {}").format(columns[0], sql.SQL(first_op), holders[0]))
        conds.append(sql.SQL("{} {} {}").format(_row(columns), sql.SQL(op), _row(holders)))
    return conds, params


def _list_conditions(
    columns: list[sql.Identifier],
    arrays: Sequence[sql.Composable],
    *,
    exact_from: sql.Identifier | None = None,
    scope: Sequence[str] = (),
) -> list[sql.Composable]:
    conds: list[sql.Composable] = [
        sql.SQL("{} = any({})").format(c, a) for c, a in zip(columns, arrays, strict=True)
    ]
    if len(columns) > 1:
        # each column's "= any" lets more through (every combination of
        # the columns' values); the key as a whole is tested here
        if exact_from is not None:
            keys: sql.Composable = sql.SQL("select {} from {}").format(
                sql.SQL(", ").join(map(sql.Identifier, scope)), exact_from
            )
        else:
            keys = sql.SQL("select * from unnest({})").format(sql.SQL(", ").join(arrays))
        conds.append(sql.SQL("{} in ({})").format(_row(columns), keys))
    return conds


# -- the plan check --------------------------------------------------------------------
#: plan nodes that read a table's rows: the restriction has reached the rows
#: when it is a condition of one of these
_RELATION_SCANS = frozenset(
    {
        "Seq Scan",
        "Index Scan",
        "Index Only Scan",
        "Bitmap Heap Scan",
        "Bitmap Index Scan",
        "Tid Scan",
        "Tid Range Scan",
        "Sample Scan",
        "Foreign Scan",
    }
)
#: where a plan node says what it tests
_CONDITIONS = (
    "Index Cond",
    "Recheck Cond",
    "Filter",
    "Join Filter",
    "Hash Cond",
    "Merge Cond",
    "TID Cond",
    "One-Time Filter",
)
#: what describes a node that is not a scan
_DETAILS = ("Group Key", "Partition By", "CTE Name", "Subquery Scan", "Hash Cond", "Merge Cond")
#: psycopg's placeholders in composed text, and a doubled percent sign
#: EXPLAIN's names of the aggregate strategies (its JSON says "Aggregate")
_AGGREGATES = {"Hashed": "HashAggregate", "Sorted": "GroupAggregate", "Mixed": "MixedAggregate"}
_PYFORMAT = re.compile(r"%%|%\((\w+)\)s")
_PARAM = re.compile(r"\$(\d+)\b")
_STATEMENT = "pgjobs_scope_check"


def numbered(text: str) -> tuple[str, list[str]]:
    """psycopg text (``%(name)s`` binds, ``%`` doubled) as PostgreSQL's own
    (``$1``, ``$2``, ``%``), and the names in the order of their numbers."""
    order: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    return _PYFORMAT.sub(replace, text), order


def explain_generic(conn: Connection, checked: sql.Composed) -> tuple[dict[str, Any], list[str]]:
    """The generic plan of ``checked`` (``EXPLAIN (FORMAT JSON, VERBOSE)``
    of a prepared statement under ``plan_cache_mode = force_generic_plan``,
    every parameter NULL: nothing runs) and its parameters' names in the
    order of their numbers. A generic plan shows each parameter where it
    went, as ``$n``; a custom plan would show its value, which could be
    anyone's constant. Where a condition goes does not depend on the
    values. Runs in the caller's transaction, under a savepoint rolled back
    after it."""
    text, order = numbered(checked.as_string(None))
    change, back = swap_settings({"plan_cache_mode": "force_generic_plan"})
    nulls = sql.SQL(", ").join(sql.SQL("null") for _ in order)
    execute_it = (
        sql.SQL("explain (format json, verbose) execute {}({})").format(
            sql.Identifier(_STATEMENT), nulls
        )
        if order
        else sql.SQL("explain (format json, verbose) execute {}").format(sql.Identifier(_STATEMENT))
    )
    send(conn, (sql.SQL("savepoint pgjobs_scope_check"), None), *((c, None) for c in change))
    prepared = False
    try:
        # no parameters: psycopg sends the text as it is ($n, a single %)
        execute(conn, sql.SQL("prepare {} as {}").format(sql.Identifier(_STATEMENT), sql.SQL(text)))
        prepared = True
        row = execute(conn, execute_it).fetchone()
    finally:
        send(conn, (sql.SQL("rollback to savepoint pgjobs_scope_check"), None))
        if prepared:
            execute(conn, sql.SQL("deallocate {}").format(sql.Identifier(_STATEMENT)))
        send(conn, (back, None), (sql.SQL("release savepoint pgjobs_scope_check"), None))
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return plan[0]["Plan"], order


def _nodes(
    node: dict[str, Any], above: tuple[dict[str, Any], ...] = ()
) -> Iterator[tuple[dict[str, Any], tuple[dict[str, Any], ...]]]:
    """Each node of the plan with the nodes above it, nearest first."""
    yield node, above
    for child in node.get("Plans", ()):
        yield from _nodes(child, (node, *above))


def _carries(node: dict[str, Any], numbers: set[str]) -> list[str]:
    """The conditions of ``node`` that test one of the parameters ``numbers``."""
    found = []
    for name in _CONDITIONS:
        value = node.get(name)
        if isinstance(value, str) and any(m in numbers for m in _PARAM.findall(value)):
            found.append(f"{name}: {value}")
    return found


def _describe(node: dict[str, Any]) -> str:
    text = str(node.get("Node Type", "?"))
    if text == "Aggregate":
        text = _AGGREGATES.get(str(node.get("Strategy")), text)
    relation = node.get("Relation Name")
    if relation:
        schema = node.get("Schema")
        text += f" on {schema}.{relation}" if schema else f" on {relation}"
    elif node.get("CTE Name"):
        text += f" on {node['CTE Name']}"
    details = []
    for name in _DETAILS:
        value = node.get(name)
        if value and name != "CTE Name":
            details.append(f"{name}: {', '.join(value) if isinstance(value, list) else value}")
    return text + (f" ({'; '.join(details)})" if details else "")


def _quote(source: str) -> str:
    flat = " ".join(source.split())
    return flat if len(flat) <= _QUOTE else flat[: _QUOTE - 3] + "..."


def check_plan(
    conn: Connection,
    restricted: Restricted,
    *,
    job_name: str,
    scope: Sequence[str],
    large_rows: int = LARGE_ROWS,
) -> PlanReport:
    """Check where the restriction of ``restricted`` lands in its plan.

    Raises :class:`~pgjobs.errors.ScopeError` (naming the job, the SQL and
    the plan node) when some node tests the restriction with no scan under
    it that tests it too: that node (an aggregate over every group, a
    ``WITH`` computed whole, a join of every row) does the work of every
    key for each slice. Logs a warning, and returns it in the report, for
    each table of at least ``large_rows`` rows (its statistics) that the
    plan reads whole (a ``Seq Scan``), naming the index that would let a
    slice read only its rows (logged once per process; always returned). Call it once per run: it plans the statement
    (no row is read), under a savepoint of the caller's transaction."""
    plan, order = explain_generic(conn, restricted.checked)
    numbers = {str(order.index(m) + 1) for m in restricted.marks if m in order}
    reached: list[str] = []
    offenders: list[tuple[dict[str, Any], list[str]]] = []

    def walk(node: dict[str, Any]) -> bool:
        below = [walk(child) for child in node.get("Plans", ())]
        conds = _carries(node, numbers)
        if conds and node.get("Node Type") in _RELATION_SCANS:
            reached.append(_describe(node))
            return True
        if conds and not any(below):
            offenders.append((node, conds))
        return any(below)

    walk(plan)
    where = f"job {job_name!r}"
    if offenders:
        node, conds = offenders[0]
        raise ScopeError(
            f"{where}: the restriction to a slice of the scope {tuple(scope)} does not reach"
            f" the rows: it stays at {_describe(node)} ({conds[0]}), so each slice would"
            f" compute every key. SQL: {_quote(restricted.source)}. Give the scope columns"
            " as plain columns of the tables the SQL reads (not aggregates, window results"
            " or a WITH computed whole), or run the job unsliced (sliced = false)."
        )
    warnings = _whole_reads(conn, plan, numbers, where, scope, large_rows)
    for warning in warnings:
        if warning not in _told:  # once per process: every run would say it again
            _told.add(warning)
            log.warning("pgjobs: %s", warning)
    return PlanReport(reached=tuple(reached), warnings=tuple(warnings))


#: the warnings logged already by this process
_told: set[str] = set()

_COLUMN_TESTED = re.compile(r"([\w.\"]+)\s*(?:>=|<=|<|>|=)\s*(?:ANY\s*\()?\$(\d+)")


def _whole_reads(
    conn: Connection,
    plan: dict[str, Any],
    numbers: set[str],
    where: str,
    scope: Sequence[str],
    large_rows: int,
) -> list[str]:
    scans = [
        (node, above)
        for node, above in _nodes(plan)
        if node.get("Node Type") == "Seq Scan" and node.get("Relation Name")
    ]
    if not scans:
        return []
    names = [
        sql.Identifier(n.get("Schema") or "public", n["Relation Name"]).as_string(None)
        for n, _ in scans
    ]
    sizes = dict(
        execute(
            conn,
            sql.SQL(
                "select n, (select reltuples from pg_class where oid = to_regclass(n))"
                " from unnest(%s::text[]) as n"
            ),
            [names],
        ).fetchall()
    )
    warnings = []
    for (node, above), name in zip(scans, names, strict=True):
        rows = sizes.get(name)
        if rows is None or rows < 0:
            rows = node.get("Plan Rows", 0)
        if rows < large_rows:
            continue
        alias = str(node.get("Alias") or node["Relation Name"])
        conds = _carries(node, numbers)
        if conds:
            tested = [
                c.split(".")[-1].strip('"')
                for c, n in _COLUMN_TESTED.findall(conds[0])
                if n in numbers
            ]
            columns = tuple(dict.fromkeys(tested)) or tuple(scope)
            why = "to find the slice's rows"
        else:
            join = next((n for n in above if _join_text(n)), None)
            columns = _join_columns(join, alias)
            why = f"for {_describe(join)}" if join else "whole"
        index = f"an index on {name} ({', '.join(columns)})" if columns else "an index"
        warnings.append(
            f"{where}: each slice reads all of {name} (about {int(rows):,} rows, a Seq Scan"
            f" {why}); {index} would let a slice read only its own rows"
        )
    return warnings


def _join_text(node: dict[str, Any]) -> str:
    return " ".join(str(node.get(name) or "") for name in ("Hash Cond", "Merge Cond")).strip()


def _join_columns(join: dict[str, Any] | None, alias: str) -> tuple[str, ...]:
    """The columns of ``alias`` that ``join`` matches on."""
    if join is None:
        return ()
    text = _join_text(join)
    pattern = re.compile(rf"(?<![\w.]){re.escape(alias)}\.(\w+|\"[^\"]+\")")
    return tuple(dict.fromkeys(m.strip('"') for m in pattern.findall(text)))


__all__ = [
    "ALIAS",
    "LARGE_ROWS",
    "KeyList",
    "KeyRange",
    "KeysTable",
    "PlanReport",
    "Restricted",
    "Restriction",
    "check_plan",
    "explain_generic",
    "numbered",
    "range_condition",
    "restrict",
]
