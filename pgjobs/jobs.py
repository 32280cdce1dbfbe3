"""Job definitions: frozen value objects that validate on construction.

* :class:`RecomputeJob` — a periodic full recompute of a derived table,
  written as a difference (see :mod:`pgjobs.diff`).
* :class:`QueueJob` — a worker that rewrites the derived rows of the items
  in a queue, batch by batch (see :mod:`pgjobs.queue`).
* :class:`TaskJob` — any other body, run under the same protocol (lock
  group, check-before-lock, backoff, run log).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from .backoff import Backoff
from .durations import Duration, parse_duration
from .errors import ConfigError
from .results import DiffStats, Execution

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import Connection

    from .runner import RunContext

#: What ``compute`` may return: SQL text, a SQLAlchemy selectable, or rows.
Source: TypeAlias = Any
Keys: TypeAlias = list[tuple[Any, ...]]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")


@dataclass(frozen=True, kw_only=True, slots=True)
class Parent:
    """A parent table the derived rows depend on, when no foreign key says so.

    ``columns`` are the derived table's columns, ``parent_columns`` the
    parent's matching (unique) columns, in the same order.
    """

    table: str
    columns: tuple[str, ...]
    parent_columns: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", _names(self.columns, "parents.columns"))
        object.__setattr__(
            self, "parent_columns", _names(self.parent_columns, "parents.parent_columns")
        )
        if len(self.columns) != len(self.parent_columns) or not self.columns:
            raise ConfigError(
                f"parents: {self.table!r} needs as many parent_columns as columns, got "
                f"{self.columns} and {self.parent_columns}"
            )


def _names(value: str | Sequence[str] | None, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    out = tuple(value)
    if not all(isinstance(v, str) and v for v in out):
        raise ConfigError(f"{field}: expected column names, got {value!r}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """Fields every job has. Use a subclass: :class:`RecomputeJob`,
    :class:`QueueJob` or :class:`TaskJob`."""

    kind: ClassVar[str] = "job"

    name: str
    #: jobs of one group never run at the same time (one advisory lock per group);
    #: defaults to the target table, or to the job's name when it has none
    group: str | None = None
    #: the interval between runs; ``None`` with ``cron`` set
    every: Duration | None = "60s"
    #: a crontab expression ("*/5 * * * *") instead of ``every``
    cron: str | None = None
    #: ``conn -> bool``, asked before the lock is taken; ``None`` means "always"
    has_work: Callable[[Connection], bool] | None = None
    #: wait after a failure, persisted so that every replica honours it
    backoff: Backoff | Duration = "1h"
    #: ``SET LOCAL lock_timeout`` for the job's transaction
    lock_timeout: Duration = "5s"
    #: ``SET LOCAL statement_timeout`` for the job's transaction (0: none)
    statement_timeout: Duration = "30m"
    #: a periodic job that found its group busy may retry this soon
    busy_retry: Duration | None = "5s"
    #: ``SET LOCAL synchronous_commit`` for the job's transaction: whether its
    #: commit waits for the WAL to reach disk (see :class:`_DiffJob` for why
    #: recompute and queue jobs don't)
    synchronous_commit: bool = True
    enabled: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        where = f"{type(self).__name__} {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"{type(self).__name__}.name: expected letters, digits, '_', '-', '.', ':', got "
                f"{self.name!r}"
            )
        group = self.group if self.group is not None else self._default_group()
        if not isinstance(group, str) or not _NAME.fullmatch(group):
            raise ConfigError(f"{where}: group: expected a name, got {self.group!r}")
        object.__setattr__(self, "group", group)
        if self.every is None and self.cron is None:
            raise ConfigError(f"{where}: every or cron is required")
        if self.every is not None and self.cron is not None:
            raise ConfigError(f"{where}: give every or cron, not both")
        if self.every is not None:
            every = parse_duration(self.every, field=f"{where}: every")
            if every <= timedelta(0):
                raise ConfigError(f"{where}: every: must be positive, got {self.every!r}")
            object.__setattr__(self, "every", every)
        if self.cron is not None and (
            not isinstance(self.cron, str) or len(self.cron.split()) != 5
        ):
            raise ConfigError(f"{where}: cron: expected 5 crontab fields, got {self.cron!r}")
        object.__setattr__(self, "backoff", Backoff.coerce(self.backoff, field=f"{where}: backoff"))
        for name in ("lock_timeout", "statement_timeout"):
            object.__setattr__(
                self, name, parse_duration(getattr(self, name), field=f"{where}: {name}")
            )
        if self.busy_retry is not None:
            object.__setattr__(
                self, "busy_retry", parse_duration(self.busy_retry, field=f"{where}: busy_retry")
            )
        if not isinstance(self.synchronous_commit, bool):
            raise ConfigError(
                f"{where}: synchronous_commit: expected true or false, got "
                f"{self.synchronous_commit!r}"
            )
        if self.has_work is not None and not callable(self.has_work):
            raise ConfigError(f"{where}: has_work: expected a callable, got {self.has_work!r}")

    def _default_group(self) -> str:
        return self.name

    # -- typed views of the normalized fields -------------------------------
    @property
    def interval(self) -> timedelta | None:
        """``every`` as a timedelta (``None`` for cron jobs)."""
        return self.every if isinstance(self.every, timedelta) or self.every is None else None

    @property
    def backoff_policy(self) -> Backoff:
        assert isinstance(self.backoff, Backoff)
        return self.backoff

    @property
    def schedule(self) -> str:
        """Human-readable schedule: ``every 60s`` or ``cron */5 * * * *``."""
        from .durations import format_duration

        if self.interval is not None:
            return f"every {format_duration(self.interval)}"
        return f"cron {self.cron}"

    def replace(self, **changes: Any) -> Job:
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    # -- what the runner calls -----------------------------------------------
    def check_work(self, conn: Connection, ctx: RunContext) -> bool:
        """Step 2 of the run protocol, in a short read-only transaction."""
        return True if self.has_work is None else bool(self.has_work(conn))

    def prefetch(self, raw: psycopg.Connection[Any], ctx: RunContext) -> None:
        """Step 3: send what the job's body will need first, in the round trip
        that takes the group lock (inside that pipeline; results are read in
        :meth:`execute`, through ``ctx.extra``). Nothing by default."""

    def work_query(self, ctx: RunContext) -> tuple[sql.Composed, Sequence[Any]] | None:
        """Step 2 as one statement answering one boolean, when it is one: the
        runner sends it in the round trip that reads the job's state (and
        commits). ``None``: :meth:`check_work` is called instead."""
        return None

    def execute(self, conn: Connection, ctx: RunContext) -> Execution:
        """Step 4: the job's body, inside the job transaction, lock held."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskJob(Job):
    """A job whose body is a function of your own: ``run(conn)`` may return
    :class:`DiffStats` or ``None``. It gets the whole run protocol."""

    kind: ClassVar[str] = "task"

    run: Callable[[Connection], DiffStats | None]

    def __post_init__(self) -> None:
        Job.__post_init__(self)
        if not callable(self.run):
            raise ConfigError(f"TaskJob {self.name!r}: run: expected a callable, got {self.run!r}")

    def execute(self, conn: Connection, ctx: RunContext) -> Execution:
        stats = self.run(conn)
        return Execution(stats=stats if isinstance(stats, DiffStats) else DiffStats())


@dataclass(frozen=True, kw_only=True, slots=True)
class _DiffJob(Job):
    #: the derived table ("table" or "schema.table")
    target: str = ""
    #: the diff key; the target's primary key when ``None``
    key: tuple[str, ...] | None = None
    #: parents the target's foreign keys don't declare
    parents: tuple[Parent, ...] = ()
    #: Off: the commit returns before its WAL is flushed (PostgreSQL's
    #: asynchronous commit). A crash can then lose the last job transactions,
    #: never part of one, and only together with everything that makes them
    #: run again: the queue entries they deleted, the job state they
    #: advanced. Derived rows are recomputed from their sources, so nothing
    #: is lost but the work; and any later synchronous commit (a user's)
    #: flushes the WAL before it, job transactions included. A recompute
    #: that rewrote many rows otherwise waits for megabytes of WAL at commit
    #: (15-20 ms of a 0.16 s run at 50k rows / 2 % changed, measured here).
    synchronous_commit: bool = False

    def __post_init__(self) -> None:
        Job.__post_init__(self)
        where = f"{type(self).__name__} {self.name!r}"
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError(f"{where}: target: expected a table name, got {self.target!r}")
        if self.key is not None:
            object.__setattr__(self, "key", _names(self.key, f"{where}: key"))
        parents = tuple(self.parents or ())
        if not all(isinstance(p, Parent) for p in parents):
            raise ConfigError(
                f"{where}: parents: expected pgjobs.Parent values, got {self.parents!r}"
            )
        object.__setattr__(self, "parents", parents)

    def _default_group(self) -> str:
        return self.target or self.name

    def prefetch(self, raw: psycopg.Connection[Any], ctx: RunContext) -> None:
        # the reflection cache's catalog check (see reflect_target)
        from .target import send_fingerprint

        ctx.extra["fingerprint"] = send_fingerprint(raw, self.target, self.parents)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputeJob(_DiffJob):
    """A periodic full recompute of ``target``.

    ``compute(conn)`` returns the complete new contents of the target as SQL
    text, a SQLAlchemy selectable or an iterable of rows (tuples in the
    target's column order, or mappings). It runs into an ``ON COMMIT DROP``
    temp table holding no row locks; then only the difference is written.

    ``chunk_parents``: write in chunks of that many parents, committing
    after each, so that no user transaction waits on more than one chunk
    (off by default; see :func:`pgjobs.diff.write_diff`). It needs one
    server session across those commits: behind a transaction pooler
    (``$PGJOBS_TRANSACTION_POOLING``) the job writes in one transaction.
    """

    kind: ClassVar[str] = "recompute"

    compute: Callable[[Connection], Source] | str = ""
    chunk_parents: int | None = None

    def __post_init__(self) -> None:
        _DiffJob.__post_init__(self)
        where = f"RecomputeJob {self.name!r}"
        if not (callable(self.compute) or (isinstance(self.compute, str) and self.compute.strip())):
            raise ConfigError(
                f"{where}: compute: expected a callable or SQL text, got {self.compute!r}"
            )
        if self.chunk_parents is not None and (
            not isinstance(self.chunk_parents, int) or self.chunk_parents < 1
        ):
            raise ConfigError(
                f"{where}: chunk_parents: expected a positive integer, got {self.chunk_parents!r}"
            )

    def execute(self, conn: Connection, ctx: RunContext) -> Execution:
        from .diff import run_recompute

        return run_recompute(conn, self, ctx)


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueJob(_DiffJob):
    """A worker for the items of a queue.

    Items are ``scope`` values (one column or several) put in the built-in
    queue with :func:`pgjobs.enqueue`. Each tick claims up to ``batch_size``
    due items, calls ``compute(conn, keys)`` once for the batch (SQL may bind
    ``:keys``), writes one diff scoped to those items, then calls
    ``after(conn, keys, stats)``. A failing item is isolated and retried
    after ``item_backoff``, and parked as dead after ``max_attempts``.

    A plugin with a queue table of its own gives ``claim``, ``finish`` and
    ``has_work`` instead: ``claim(conn, limit)`` locks up to ``limit`` due
    items of its table (``FOR UPDATE SKIP LOCKED``: never wait) and returns
    their scope values as tuples; after the batch, ``finish(conn, done,
    failed)`` gets the keys to take off the queue (processed, or their
    parent is gone) and ``{key: exception}`` of the items that failed, to
    retry or park as it sees fit. Keys in neither (a parent a user holds)
    stay queued. Everything else (parents locked first, one scoped diff,
    ``after``, per-item isolation) is the same.
    """

    kind: ClassVar[str] = "queue"

    every: Duration | None = "30s"
    scope: tuple[str, ...] = ()
    compute: Callable[[Connection, Keys], Source] | str = ""
    after: Callable[[Connection, Keys, DiffStats], None] | None = None
    batch_size: int = 100
    max_attempts: int = 5
    item_backoff: Backoff | Duration = "30s"
    #: a queue of the plugin's own: ``(conn, limit) -> keys``, items locked
    claim: Callable[[Connection, int], Keys] | None = None
    #: ... and ``(conn, done keys, {failed key: exception})`` after the batch
    finish: Callable[[Connection, Keys, dict[tuple[Any, ...], BaseException]], None] | None = None

    def __post_init__(self) -> None:
        _DiffJob.__post_init__(self)
        where = f"QueueJob {self.name!r}"
        for name in ("claim", "finish"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{where}: {name}: expected a callable, got {value!r}")
        if self.claim is not None and (self.finish is None or self.has_work is None):
            raise ConfigError(
                f"{where}: claim (a queue of your own) needs finish (to take processed "
                f"items off it) and has_work (to tell when it holds due items)"
            )
        if self.finish is not None and self.claim is None:
            raise ConfigError(f"{where}: finish is for a queue of your own: give claim too")
        object.__setattr__(self, "scope", _names(self.scope, f"{where}: scope"))
        if not self.scope:
            raise ConfigError(f"{where}: scope: name the column(s) that tie an item to its rows")
        if not (callable(self.compute) or (isinstance(self.compute, str) and self.compute.strip())):
            raise ConfigError(
                f"{where}: compute: expected a callable or SQL text, got {self.compute!r}"
            )
        if self.after is not None and not callable(self.after):
            raise ConfigError(f"{where}: after: expected a callable, got {self.after!r}")
        for name in ("batch_size", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {name}: expected a positive integer, got {value!r}")
        object.__setattr__(
            self, "item_backoff", Backoff.coerce(self.item_backoff, field=f"{where}: item_backoff")
        )

    def check_work(self, conn: Connection, ctx: RunContext) -> bool:
        if self.has_work is not None:
            return bool(self.has_work(conn))
        from .queue import has_pending

        return has_pending(conn, self, ctx)

    def work_query(self, ctx: RunContext) -> tuple[sql.Composed, Sequence[Any]] | None:
        if self.has_work is not None:
            return None
        from .queue import pending_query

        return pending_query(self, ctx)

    def execute(self, conn: Connection, ctx: RunContext) -> Execution:
        from .queue import run_queue

        return run_queue(conn, self, ctx)
