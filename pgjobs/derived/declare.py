"""A derived table declared once: :class:`Derived` and its :class:`Source` s.

One SQL text gives the table's whole contents; pgjobs makes of it a
recompute job (named after the declaration) and a queue job
(``<name>:queue``) whose keyed compute is the same text restricted to the
batch's keys, and puts statement-level triggers on every source
(:mod:`pgjobs.derived.triggers`) that enqueue the keys a user's statement
touched. A derived table may be the source of another (a chain):
:func:`chain_order` orders them and refuses a cycle, naming it.

Why it is built so: ``docs/DESIGN.md``, "Derived tables".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..durations import Duration
from ..errors import ConfigError
from ..jobs import (
    Job,
    QueueJob,
    RecomputeJob,
    check_name,
    check_table,
)
from .keyed import keyed_sql

#: the queue job of declaration ``exam_score`` is ``exam_score:queue``
QUEUE_SUFFIX = ":queue"

#: the job settings a declaration takes besides its own keys, and which of
#: its two jobs each goes to (``every``/``cron``/``timezone`` are the
#: recompute's schedule; the queue job looks every 30 s when nothing wakes it)
SETTINGS_FOR: dict[str, tuple[str, ...]] = {
    "cron": ("recompute",),
    "timezone": ("recompute",),
    "group": ("recompute", "queue"),
    "backoff": ("recompute", "queue"),
    "lock_timeout": ("recompute", "queue"),
    "statement_timeout": ("recompute", "queue"),
    "busy_retry": ("recompute", "queue"),
    "synchronous_commit": ("recompute", "queue"),
    "enabled": ("recompute", "queue"),
    "description": ("recompute", "queue"),
    "key": ("recompute", "queue"),
    "parents": ("recompute", "queue"),
    "columns": ("recompute", "queue"),
    "flow": ("recompute", "queue"),
    "chunk_parents": ("recompute",),
    "chunk_rows": ("recompute",),
    "atomic": ("recompute",),
    "verify_every": ("recompute",),
    "batch_size": ("queue",),
    "workers": ("queue",),
    "max_attempts": ("queue",),
    "item_backoff": ("queue",),
}
#: what only the Python form takes (callables stay in Python): the queue
#: job's ``after(conn, keys, stats)``, called in each batch's transaction
#: once its rows are written
PYTHON_SETTINGS: dict[str, tuple[str, ...]] = {"after": ("queue",)}


def _sql_text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{field}: expected SQL text, got {value!r}")
    if "\x00" in value:
        raise ConfigError(f"{field}: SQL text must not contain a NUL byte, got {value!r}")
    # a trailing semicolon would end the subquery pgjobs wraps the text in
    return value.strip().rstrip(";").rstrip()


def _columns(value: object, field: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if (
        not isinstance(items, list | tuple)
        or not items
        or not all(isinstance(v, str) and v and "\x00" not in v for v in items)
    ):
        raise ConfigError(f"{field}: expected a list of column names, got {value!r}")
    return tuple(items)


def table_name(table: str) -> str:
    """The name a table's rows are visible under in a mapping SQL: its
    name without the schema."""
    return table.split(".")[-1]


def same_table(a: str, b: str) -> bool:
    """Conservatively, as the registry compares targets: ``x`` and ``s.x``
    may be one table (search_path)."""
    if a == b:
        return True
    pa, pb = a.split("."), b.split(".")
    return pa[-1] == pb[-1] and (len(pa) == 1 or len(pb) == 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """A table the derived table reads, and how a changed row of it maps to keys.

    ``columns``: the changed row carries the key itself, in these columns
    (in the scope's order). ``sql``: an SQL text that maps the changed rows,
    visible under the table's name (without its schema), to keys (its
    output columns, in the scope's order); it may join other tables::

        Source(table="submission", columns=("exam_id",))
        Source(table="answer", sql="select s.exam_id from submission s"
                                   " where s.submission_id = answer.submission_id")
    """

    table: str
    columns: tuple[str, ...] | None = None
    sql: str | None = None

    def __post_init__(self) -> None:
        check_table(self.table, "sources")
        where = f"sources.{self.table}"
        if (self.columns is None) == (self.sql is None):
            raise ConfigError(
                f"{where}: give the key's columns (a list) or an SQL text that maps a changed "
                f"row to keys, got columns={self.columns!r}, sql={self.sql!r}"
            )
        if self.columns is not None:
            object.__setattr__(self, "columns", _columns(self.columns, where))
        if self.sql is not None:
            object.__setattr__(self, "sql", _sql_text(self.sql, where))

    @classmethod
    def of(cls, table: str, value: object) -> Source:
        """The source ``table`` from what a declaration maps it to: a list
        of columns, SQL text, or a :class:`Source`."""
        if isinstance(value, Source):
            if value.table != table:
                raise ConfigError(
                    f"sources.{table}: the Source names the table {value.table!r}, got {value!r}"
                )
            return value
        if isinstance(value, str):
            return cls(table=table, sql=value)
        if isinstance(value, list | tuple):
            return cls(table=table, columns=tuple(value))
        raise ConfigError(
            f"sources.{table}: expected a list of the key's columns or an SQL text, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Derived:
    """A derived table declared once: pgjobs keeps ``target`` equal to ``sql``.

    ``scope``: the key columns (an item of the queue); ``sql``: the
    table's whole contents; ``every``: the recompute's schedule (a
    backstop: the triggers on ``sources`` keep it current between
    recomputes); ``sources``: every table the SQL reads, each mapped to
    keys (:class:`Source`: a list of columns, or SQL text); ``static``:
    tables the SQL reads whose changes need no capture (the completeness
    check reports any other table the SQL's plan reads); ``settings``: any
    other job setting, as in ``[jobs.NAME]`` (``batch_size``, ``backoff``,
    ``lock_timeout``, ``group``, ...), and, in Python only, the queue job's
    ``after``. ``pgjobs.toml``'s ``[derived.NAME]`` builds the same object::

        pgjobs.Derived(
            name="exam_score", target="exam_score", scope=("exam_id",),
            sql="select s.exam_id, s.student_id, sum(a.points) as score"
                " from submission s join answer a using (submission_id) group by 1, 2",
            every="1h",
            sources={
                "submission": ["exam_id"],
                "answer": "select s.exam_id from submission s"
                          " where s.submission_id = answer.submission_id",
            },
        )

    Register it like a job (``register(derived)`` in
    ``pgjobs_register_jobs``): pgjobs registers its recompute job
    (``name``) and its queue job (``name + ":queue"``).
    """

    name: str
    target: str
    scope: tuple[str, ...]
    sql: str
    sources: Mapping[str, Any] | tuple[Source, ...]
    every: Duration | None = "1h"
    static: tuple[str, ...] = ()
    #: (a mapping: left out of the hash)
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: where it was declared, for error messages (the config file)
    origin: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_name(self.name, "derived.name")
        where = self.where
        try:
            check_table(self.target, "target")
            object.__setattr__(self, "scope", _columns(self.scope, "scope"))
            object.__setattr__(self, "sql", _sql_text(self.sql, "sql"))
            object.__setattr__(self, "sources", self._sources(self.sources))
            static = (self.static,) if isinstance(self.static, str) else tuple(self.static)
            for table in static:
                check_table(table, "static")
            object.__setattr__(self, "static", static)
            if not isinstance(self.settings, Mapping):
                raise ConfigError(f"settings: expected a mapping, got {self.settings!r}")
            known = {**SETTINGS_FOR, **PYTHON_SETTINGS}
            for name in self.settings:
                if name not in known:
                    raise ConfigError(
                        f"{name}: unknown setting (expected one of: {', '.join(known)}), "
                        f"got {self.settings[name]!r}"
                    )
            object.__setattr__(self, "settings", dict(self.settings))
            if self.every is not None and "cron" in self.settings:
                # cron given as a setting replaces the default schedule
                object.__setattr__(self, "every", None)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None
        for source in self.all_sources:
            if source.columns is not None and len(source.columns) != len(self.scope):
                raise ConfigError(
                    f"{where}.sources.{source.table}: the scope is {list(self.scope)}: give "
                    f"as many columns, in its order, got {list(source.columns)}"
                )
        # the jobs check the rest (schedule, group, settings), naming the key
        self.jobs()

    def _sources(self, value: object) -> tuple[Source, ...]:
        if isinstance(value, Mapping):
            items = [Source.of(table, v) for table, v in value.items()]
        elif isinstance(value, list | tuple) and all(isinstance(v, Source) for v in value):
            items = list(value)
        else:
            raise ConfigError(
                f'sources: expected a table of sources (table = [columns] or table = "sql"), '
                f"got {value!r}"
            )
        if not items:
            raise ConfigError("sources: required: every table the SQL reads, mapped to keys")
        for i, a in enumerate(items):
            for b in items[i + 1 :]:
                if same_table(a.table, b.table):
                    raise ConfigError(
                        f"sources.{b.table}: the table is given twice ({a.table!r} and "
                        f"{b.table!r}), got {b!r}"
                    )
        return tuple(items)

    # -- views ----------------------------------------------------------------
    @property
    def where(self) -> str:
        """How errors about this declaration start: ``pgjobs.toml: derived.NAME``."""
        return f"{self.origin}: derived.{self.name}" if self.origin else f"derived.{self.name}"

    @property
    def all_sources(self) -> tuple[Source, ...]:
        """``sources`` as :class:`Source` values (the field holds them once built)."""
        assert isinstance(self.sources, tuple)
        return self.sources

    @property
    def queue_name(self) -> str:
        """The queue job's name: ``<name>:queue``."""
        return self.name + QUEUE_SUFFIX

    # -- what pgjobs makes of it ---------------------------------------------------
    def jobs(self) -> tuple[RecomputeJob, QueueJob]:
        """The recompute job (named after the declaration) and the queue job
        (``<name>:queue``, its compute the SQL restricted to the batch's
        keys); :class:`ConfigError` naming the key when a setting does not fit."""
        common = {"name": self.name, "target": self.target}
        recompute: dict[str, Any] = {**common, "compute": self.sql, "every": self.every}
        queue: dict[str, Any] = {
            **common,
            "name": self.queue_name,
            "scope": self.scope,
            "compute": keyed_sql(self.sql, self.scope),
        }
        for name, value in self.settings.items():
            for kind in {**SETTINGS_FOR, **PYTHON_SETTINGS}[name]:
                (recompute if kind == "recompute" else queue)[name] = value
        try:
            return RecomputeJob(**recompute), QueueJob(**queue)
        except ConfigError as exc:
            # "RecomputeJob 'x': backoff: ..." -> "derived.x.backoff: ..."
            text = str(exc)
            for prefix in (f"RecomputeJob {self.name!r}: ", f"QueueJob {self.queue_name!r}: "):
                text = text.removeprefix(prefix)
            raise ConfigError(f"{self.where}.{text}") from None

    def reads(self, table: str) -> bool:
        """Whether ``table`` is one of this declaration's sources."""
        return any(same_table(s.table, table) for s in self.all_sources)


def chain_order(declared: Iterable[Derived]) -> list[Derived]:
    """``declared`` in dependency order: a derived table after every derived
    table it reads (its sources that are another declaration's target).
    A cycle is a :class:`ConfigError` naming it."""
    items = list(declared)
    reads: dict[str, list[Derived]] = {
        d.name: [e for e in items if d.reads(e.target)] for d in items
    }
    order: list[Derived] = []
    done: set[str] = set()
    path: list[Derived] = []

    def visit(d: Derived) -> None:
        if d.name in done:
            return
        if d in path:
            cycle = [*path[path.index(d) :], d]
            shown = " -> ".join(f"derived.{c.name} ({c.target})" for c in cycle)
            raise ConfigError(
                f"{cycle[0].where}: a cycle of derived tables: {shown}; each reads the one "
                "before it, so no order can compute them: remove one of these sources"
            )
        path.append(d)
        for upstream in reads[d.name]:
            visit(upstream)
        path.pop()
        done.add(d.name)
        order.append(d)

    for d in sorted(items, key=lambda d: d.name):
        visit(d)
    return order


def upstream_of(derived: Derived, declared: Sequence[Derived]) -> list[Derived]:
    """The declarations whose target ``derived`` reads."""
    return [d for d in declared if d is not derived and derived.reads(d.target)]


def is_derived_job(job: Job, declared: Iterable[Derived]) -> bool:
    """Whether ``job`` is one of the jobs a declaration made."""
    return any(job.name in (d.name, d.queue_name) for d in declared)


__all__ = [
    "PYTHON_SETTINGS",
    "QUEUE_SUFFIX",
    "SETTINGS_FOR",
    "Derived",
    "Source",
    "chain_order",
    "is_derived_job",
    "same_table",
    "table_name",
    "upstream_of",
]
