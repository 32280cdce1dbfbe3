"""Job definitions: frozen value objects that validate on construction.

* :class:`RecomputeJob` — a periodic full recompute of a derived table,
  written as a difference (see :mod:`pgjobs.diff`).
* :class:`QueueJob` — a worker that rewrites the derived rows of the items
  in a queue, batch by batch (see :mod:`pgjobs.queue` and :mod:`pgjobs.worker`).
* :class:`TaskJob` — any other body, run under the same protocol (lock
  group, check-before-lock, backoff, run log).

Also :class:`RunContext`, what a job's body gets besides its connection,
and :class:`Body`, how the runner runs one kind. These are the model: they
say what a job is, not how it runs. The runner
(:mod:`pgjobs.runner`) runs each kind through its body (:mod:`pgjobs.recompute`,
:mod:`pgjobs.worker`); a kind of your own (a :class:`Job` subclass) is its
own body, through the methods under "what the runner calls".
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, TypeVar

from psycopg import sql

from ._pg import Later, later
from .backoff import Backoff
from .cron import check_cron, check_text, check_timezone
from .durations import Duration, format_duration, parse_duration, parse_timeout
from .errors import ConfigError
from .results import DiffStats, Execution

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: What a ``compute`` callable may return: SQL text, a SQLAlchemy selectable, or rows.
Computed: TypeAlias = Any
Keys: TypeAlias = list[tuple[Any, ...]]

#: ``progress(phase, done, total)``: phases are "compute", "diff", "write", ...
Progress = Callable[[str, int | None, int | None], None]
#: a statement and its parameters
Statement = tuple[sql.Composed, Any]


class Checkpoint(Protocol):
    """``ctx.checkpoint(rest=0.0)``: commit, rest ``rest`` seconds outside
    any transaction (cut short by a shutdown), go on in a new transaction."""

    def __call__(self, *, rest: float = 0.0) -> None: ...


@dataclass(kw_only=True)
class RunContext:
    """What a job's body may use besides its connection."""

    job: Job
    #: the advisory-lock namespace
    namespace: str
    #: the schema of pgjobs' own tables (job state, run log, the queue)
    schema: str
    now: datetime
    progress: Progress | None = None
    #: the process running the tick (the runner's ``worker``: host:pid)
    worker: str = ""
    #: commit what is written so far and continue in a new transaction, the
    #: group still locked; only for jobs that write in chunks
    checkpoint: Checkpoint | None = None
    #: statements (with parameters) the runner sends right before the job's
    #: COMMIT, in the same round trip: writes whose results nobody waits for
    before_commit: list[Statement] = field(default_factory=list)
    #: called once the job's transaction has committed, on its connection
    #: (outside any transaction); an error there is logged, and the run's
    #: outcome stays what it was
    after_commit: list[Callable[[Connection], None]] = field(default_factory=list)
    #: called once the job's transaction has ended without a commit (rolled
    #: back, failed, cut off); an error there is logged
    after_rollback: list[Callable[[], None]] = field(default_factory=list)
    #: where each queue job's claims start (internal: one per runner, so
    #: per database; ``None``: a claim reads from the start of the queue)
    queue_cursors: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def report(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    def later(self, conn: Connection, statement: sql.Composed | str, params: Any = None) -> Later:
        """Queue ``statement`` (one SQL command) to go out, in order, with the
        next round trip pgjobs sends on ``conn`` (in :meth:`Job.prefetch`: the
        lock's); the returned handle's ``result`` (``rowcount``, ``rows``)
        is there once it was sent."""
        return later(conn, statement, params)


class Locks(Enum):
    """Which of its group's advisory locks a tick takes in step 3
    (``docs/DESIGN.md``, "Flow"); the runner turns it into the statement."""

    #: the group's write lock, exclusively, tried (never waited for)
    WRITE = "write"
    #: the write lock, shared with the group's other flow workers, waited for
    #: briefly: a recompute holds it exclusively one chunk at a time, and a
    #: worker that queues gets in between two chunks
    SHARED_WRITE = "shared write"
    #: the group's recompute lock only, tried: a recompute with flow, which
    #: takes the write lock for an instant per chunk itself
    RECOMPUTE = "recompute"
    #: the recompute lock and the write lock, exclusively, tried, to the commit
    RECOMPUTE_AND_WRITE = "recompute and write"
    #: the recompute lock shared, tried: the processes of a sliced run share
    #: it (each slice takes the write lock itself), and an unsliced
    #: recompute of the group, which takes it exclusively, waits its turn
    RECOMPUTE_SHARED = "recompute shared"


def next_due_after_success(job: Job, started: datetime, scheduled: datetime | None) -> datetime:
    """When ``job`` is next due after a run that started at ``started``
    succeeded: one interval later, or the scheduler's next fire time for a
    cron job (``scheduled``), else at once."""
    if job.interval is not None:
        return started + job.interval
    return scheduled if scheduled is not None else started


P = TypeVar("P")


class Body(Protocol[P]):
    """How the runner runs one kind of job: steps 2 (work?), 3 (the locks,
    what to send with them) and 4 (the run) of the protocol, and when the
    job is next due. ``P`` is what :meth:`prefetch` hands :meth:`execute`."""

    def work_query(self, job: Any, ctx: RunContext) -> tuple[sql.Composed, Sequence[Any]] | None:
        """Step 2 as one statement answering one boolean, or ``None``."""

    def work_answer(self, job: Any, ctx: RunContext, row: Sequence[Any] | None) -> bool:
        """Whether :meth:`work_query`'s row (its first column) says there is work."""

    def check_work(self, conn: Connection, job: Any, ctx: RunContext) -> bool:
        """Step 2, in a short read-only transaction."""

    def locks(self, job: Any, ctx: RunContext) -> Locks:
        """Step 3: which of the group's locks the tick takes (after step 2,
        which may have decided it)."""

    def chunked(self, job: Any, ctx: RunContext) -> bool:
        """Whether the body may commit in the middle of its run
        (``ctx.checkpoint``); the runner still says no behind a
        transaction pooler."""

    def prefetch(self, conn: Connection, job: Any, ctx: RunContext) -> P:
        """Step 3: queue (:meth:`RunContext.later`) what the body will need
        first, to go out in the round trip that takes the lock; what it
        returns (the handles) is passed to :meth:`execute`. It goes out
        right after the savepoint :data:`RUN_SAVEPOINT` (which the body may
        roll back to, never release)."""

    def execute(self, conn: Connection, job: Any, ctx: RunContext, prefetched: P) -> Execution:
        """Step 4: the job's body, inside the job transaction, lock held."""

    def next_due(self, job: Any, started: datetime, scheduled: datetime | None) -> datetime:
        """When the job is next due after a success (``scheduled``: the
        scheduler's next fire time of a cron job)."""


#: the savepoint under which the runner runs a body (taken in the lock's
#: round trip, just before what the body prefetches): a failing body is
#: rolled back to it and recorded in the same transaction, its lock held
RUN_SAVEPOINT = "pgjobs_run"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")

#: the largest ``batch_size`` and ``chunk_parents``: a queue batch is one
#: transaction holding its items' entries and their parents' key-share locks
#: until it commits, and its keys travel as one array; a chunk bounds how long
#: a user's delete may wait. Past this, a batch is a recompute in disguise.
MAX_BATCH = 100_000
#: rows of the difference a recompute writes per transaction, by default: a
#: user's delete of a parent waits for at most one such chunk (10,000 rows:
#: about 70 ms of row locks here; 1.5 M rows at once held them 20 s)
DEFAULT_CHUNK_ROWS = 10_000
MAX_CHUNK_ROWS = 10_000_000
#: the time a slice of a sliced recompute aims at, by default (seconds): long
#: enough that a slice's fixed costs (its snapshot, staging, the keys' diff)
#: are a small part of it, short enough that no snapshot is held for long
DEFAULT_SLICE_SECONDS = 2
MAX_SLICE_SECONDS = timedelta(minutes=10)
#: after each slice, a sliced recompute rests this share of the slice's time,
#: outside any transaction, by default: the cores it leaves to the
#: application meanwhile (``docs/slices.md``, "Its share of the machine")
DEFAULT_SLICE_PAUSE = 0.0
MAX_SLICE_PAUSE = 10.0
#: the largest ``max_attempts``: an item that failed this often is parked
MAX_ATTEMPTS = 1_000
#: concurrent workers of one queue job in one process
MAX_WORKERS = 64
#: workers x batch_size, when workers > 1 (each holds an advisory lock per item it claims)
MAX_WORKER_ITEMS = 2_000


def check_name(value: object, field: str) -> str:
    """A job name or group: letters, digits, ``_``, ``-``, ``.``, ``:``."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"{field}: expected letters, digits, '_', '-', '.', ':', got {value!r}")
    return value


def check_table(value: object, field: str) -> str:
    """``"table"`` or ``"schema.table"``."""
    text = check_text(value, field, what="a table name")
    parts = text.split(".")
    if len(parts) > 2 or not all(p.strip() for p in parts):
        raise ConfigError(
            f"{field}: expected a table name, 'table' or 'schema.table', got {value!r}"
        )
    return text


def check_count(value: object, field: str, maximum: int) -> int:
    """An integer from 1 to ``maximum``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
        raise ConfigError(
            f"{field}: expected a positive integer, at most {maximum:,}, got {value!r}"
        )
    return value


def check_pause(value: object, field: str) -> float:
    """A share of a slice's time, from 0 to :data:`MAX_SLICE_PAUSE`."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 <= value <= MAX_SLICE_PAUSE
    ):
        raise ConfigError(
            f"{field}: expected a number from 0 to {MAX_SLICE_PAUSE:g} (a share of each"
            f" slice's time), got {value!r}"
        )
    return float(value)


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
        check_table(self.table, "parents.table")
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
    if not isinstance(value, Sequence):
        raise ConfigError(f"{field}: expected column names, got {value!r}")
    out = tuple(value)
    if not all(isinstance(v, str) and v for v in out):
        raise ConfigError(f"{field}: expected column names, got {value!r}")
    if any("\x00" in v for v in out):
        raise ConfigError(f"{field}: a column name must not contain a NUL byte, got {value!r}")
    return out


def _arity(compute: Callable[..., Any]) -> int:
    """How many positional arguments ``compute`` takes (2 or more: keyed)."""
    try:
        signature = inspect.signature(compute)
    except (TypeError, ValueError):
        return 1
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _check_compute(compute: object, where: str) -> None:
    if callable(compute):
        return
    if not isinstance(compute, str) or not compute.strip():
        raise ConfigError(f"{where}: compute: expected a callable or SQL text, got {compute!r}")
    if "\x00" in compute:
        raise ConfigError(
            f"{where}: compute: SQL text must not contain a NUL byte, got {compute!r}"
        )


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
    #: the IANA time zone ``cron`` is read in ("Europe/Paris"); ``None``: the
    #: scheduler's (``timezone`` in ``pgjobs.toml``, UTC by default)
    timezone: str | None = None
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
    #: commit waits for the WAL to reach disk (``local``; never for a
    #: synchronous standby, see docs/failover.md; :class:`_DiffJob` says why
    #: recompute and queue jobs don't wait at all: ``off``)
    synchronous_commit: bool = True
    enabled: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        where = f"{type(self).__name__} {self.name!r}"
        check_name(self.name, f"{type(self).__name__}.name")
        group = self.group if self.group is not None else self._default_group()
        if not isinstance(group, str) or not _NAME.fullmatch(group):
            if self.group is None:
                raise ConfigError(
                    f"{where}: group: defaults to the target, {group!r}, which is not a lock "
                    "group name (letters, digits, '_', '-', '.', ':'): give a group"
                )
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
        if self.cron is not None:
            object.__setattr__(self, "cron", check_cron(self.cron, f"{where}: cron"))
        if self.timezone is not None:
            object.__setattr__(
                self, "timezone", check_timezone(self.timezone, f"{where}: timezone")
            )
        object.__setattr__(self, "backoff", Backoff.coerce(self.backoff, field=f"{where}: backoff"))
        for name in ("lock_timeout", "statement_timeout"):
            object.__setattr__(
                self, name, parse_timeout(getattr(self, name), field=f"{where}: {name}")
            )
        if self.busy_retry is not None:
            retry = parse_duration(self.busy_retry, field=f"{where}: busy_retry")
            # 0 is "no retry", not "retry at once": that would spin on a busy lock
            object.__setattr__(self, "busy_retry", retry or None)
        for name in ("synchronous_commit", "enabled"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{where}: {name}: expected true or false, got {getattr(self, name)!r}"
                )
        if not isinstance(self.description, str) or "\x00" in self.description:
            raise ConfigError(
                f"{where}: description: expected text without NUL bytes, got {self.description!r}"
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
        if self.interval is not None:
            return f"every {format_duration(self.interval)}"
        return f"cron {self.cron}" + (f" ({self.timezone})" if self.timezone else "")

    def replace(self, **changes: Any) -> Job:
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    # -- what the runner calls (for a kind of your own; the built-in kinds'
    # bodies are in pgjobs.recompute and pgjobs.worker) ----------------------
    def check_work(self, conn: Connection, ctx: RunContext) -> bool:
        """Step 2 of the run protocol, in a short read-only transaction."""
        return True if self.has_work is None else bool(self.has_work(conn))

    def prefetch(self, conn: Connection, ctx: RunContext) -> None:
        """Step 3: queue what the job's body will need first with
        :meth:`RunContext.later`, to go out in the round trip that takes the
        group lock; read the results in :meth:`execute` (keep the handles in
        ``ctx.extra``). Nothing by default."""

    def locks(self, ctx: RunContext) -> Locks:
        """Step 3: which of the group's locks the tick takes: by default the
        write lock, exclusively, tried (:class:`Locks`)."""
        return Locks.WRITE

    def chunked(self, ctx: RunContext) -> bool:
        """Whether :meth:`execute` may commit part-way (``ctx.checkpoint``,
        the group still locked). No by default."""
        return False

    def next_due(self, started: datetime, scheduled: datetime | None) -> datetime:
        """When the job is next due after a success: by default one interval
        after the run started (a cron job: its next fire time)."""
        return next_due_after_success(self, started, scheduled)

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
    #: the target columns the job maintains, when not all of them: its new
    #: rows must give these (and the key and parent columns); the target's
    #: other columns keep their values. ``None``: every writable column, and
    #: new rows that leave one out are an error naming it.
    columns: tuple[str, ...] | None = None
    #: Flow (``docs/DESIGN.md``, "Flow"): a recompute holds the group's write
    #: lock only at its start and while it writes, and leaves out the keys a
    #: queue worker rewrote meanwhile; workers share the write lock. Off: the
    #: protocol before it (a recompute holds the lock from start to commit),
    #: for a target something pgjobs does not see writes to as well.
    flow: bool = True
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
        where = f"{type(self).__name__} {self.name!r}"
        check_table(self.target, f"{where}: target")  # before the group it defaults
        Job.__post_init__(self)
        if self.key is not None:
            object.__setattr__(self, "key", _names(self.key, f"{where}: key"))
            if not self.key:
                raise ConfigError(f"{where}: key: expected column names, got {self.key!r}")
        parents = tuple(self.parents or ())
        if not all(isinstance(p, Parent) for p in parents):
            raise ConfigError(
                f"{where}: parents: expected pgjobs.Parent values, got {self.parents!r}"
            )
        object.__setattr__(self, "parents", parents)
        if self.columns is not None:
            object.__setattr__(self, "columns", _names(self.columns, f"{where}: columns"))
            if not self.columns:
                raise ConfigError(f"{where}: columns: expected column names, got ()")
        if not isinstance(self.flow, bool):
            raise ConfigError(f"{where}: flow: expected true or false, got {self.flow!r}")

    def _default_group(self) -> str:
        return self.target or self.name


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputeJob(_DiffJob):
    """A periodic full recompute of ``target``.

    ``compute(conn)`` returns the complete new contents of the target as SQL
    text, a SQLAlchemy selectable or an iterable of rows (tuples in the
    target's column order, or mappings). It runs into an ``ON COMMIT DROP``
    temp table holding no row locks; then only the difference is written.

    A large difference is written in chunks, each committed on its own, so
    that no user transaction waits on more than one chunk: ``chunk_rows``
    rows of the difference a chunk (whole parents: all rows of a parent are
    in one chunk), in parent-key order; a difference of at most
    ``chunk_rows`` rows is written in one transaction. The price: readers
    may see a half-written table, and a failure leaves the chunks before it
    committed (the next run finishes the work). ``atomic=True`` writes any
    difference in one transaction; ``chunk_parents=N`` makes chunks of N
    parents each instead, whatever the difference's size. A target that
    references itself is always written at once. Chunks need one server
    session across their commits: behind a transaction pooler
    (``$PGJOBS_TRANSACTION_POOLING``) the job writes in one transaction.

    With a ``scope`` (the column(s) that tie the target's rows to their
    sources, as a :class:`QueueJob`'s), a run goes in slices of the scope's
    keys, each its own short transaction of about ``slice_seconds``:
    resumed after a crash, shared by every process that ticks the job
    (``docs/slices.md``). The compute is then SQL text (restricted by pgjobs
    to each slice), SQL binding ``:keys``, or ``compute(conn, keys)``.
    """

    kind: ClassVar[str] = "recompute"

    compute: Callable[..., Computed] | str = ""
    chunk_parents: int | None = None
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    atomic: bool = False
    #: the scope of the group's queue workers on this target as this
    #: process knows them: set by the registry when every queue job of the
    #: group on this target registered beside it has flow on and one scope.
    #: Each run also reads the workers' own records (``docs/flow.md``):
    #: flow needs them to agree with this, and runs without it when
    #: ``None`` and no worker recorded itself.
    worker_scope: tuple[str, ...] | None = None
    #: check the target on this schedule (:func:`pgjobs.check`: what a
    #: recompute would write, nothing written) and record it in the run log
    #: as ``checked``; ``None`` (or 0): never
    verify_every: Duration | None = None
    #: the column(s) of the target that tie its rows to their sources, as a
    #: :class:`QueueJob`'s: the rows of a key depend only on that key's
    #: sources. With it the run goes in slices of the scope's keys, each its
    #: own short transaction (``docs/slices.md``); ``()``: one snapshot
    scope: tuple[str, ...] = ()
    #: with a ``scope``, run in slices (off: one snapshot, as without a scope)
    sliced: bool = True
    #: the time a slice aims at: slices grow or shrink to take about this long
    slice_seconds: Duration = DEFAULT_SLICE_SECONDS
    #: after each slice, rest this share of its time (0.25: a quarter),
    #: outside any transaction: the machine's share the run leaves to others
    slice_pause: float = DEFAULT_SLICE_PAUSE

    def __post_init__(self) -> None:
        _DiffJob.__post_init__(self)
        where = f"RecomputeJob {self.name!r}"
        object.__setattr__(self, "scope", _names(self.scope, f"{where}: scope"))
        if not isinstance(self.sliced, bool):
            raise ConfigError(f"{where}: sliced: expected true or false, got {self.sliced!r}")
        seconds = parse_duration(self.slice_seconds, field=f"{where}: slice_seconds")
        if not timedelta(0) < seconds <= MAX_SLICE_SECONDS:
            raise ConfigError(
                f"{where}: slice_seconds: expected more than 0 and at most"
                f" {format_duration(MAX_SLICE_SECONDS)}, got {self.slice_seconds!r}"
            )
        object.__setattr__(self, "slice_seconds", seconds)
        pause = check_pause(self.slice_pause, f"{where}: slice_pause")
        object.__setattr__(self, "slice_pause", pause)
        if self.slices:
            if self.atomic:
                raise ConfigError(
                    f"{where}: atomic: a sliced run (scope {self.scope}) commits slice by"
                    " slice; set sliced = false to write it in one transaction"
                )
            if callable(self.compute) and _arity(self.compute) < 2:
                raise ConfigError(
                    f"{where}: compute: a Python compute(conn) gives every key's rows and"
                    f" cannot be cut into slices of the scope {self.scope}: give SQL text"
                    " (pgjobs restricts it to each slice), a compute(conn, keys) that gives"
                    " the rows of the keys it is handed, or sliced = false"
                )
        elif callable(self.compute) and _arity(self.compute) >= 2:
            raise ConfigError(
                f"{where}: compute: compute(conn, keys) is for a sliced run; give scope"
                " (and leave sliced on), or a compute(conn)"
            )
        if self.verify_every is not None:
            verify = parse_duration(self.verify_every, field=f"{where}: verify_every")
            if verify < timedelta(0):
                raise ConfigError(f"{where}: verify_every: must not be negative, got {verify}")
            object.__setattr__(self, "verify_every", verify or None)
        _check_compute(self.compute, where)
        if self.chunk_parents is not None:
            check_count(self.chunk_parents, f"{where}: chunk_parents", MAX_BATCH)
        check_count(self.chunk_rows, f"{where}: chunk_rows", MAX_CHUNK_ROWS)
        if not isinstance(self.atomic, bool):
            raise ConfigError(f"{where}: atomic: expected true or false, got {self.atomic!r}")
        if self.worker_scope is not None:
            scope = _names(self.worker_scope, f"{where}: worker_scope")
            if not scope:
                raise ConfigError(f"{where}: worker_scope: expected column names, got ()")
            object.__setattr__(self, "worker_scope", scope)

    @property
    def slices(self) -> bool:
        """Whether a run goes in slices: a ``scope``, and ``sliced`` on."""
        return bool(self.scope) and self.sliced

    @property
    def slice_target(self) -> float:
        """``slice_seconds`` in seconds."""
        v = self.slice_seconds
        return v.total_seconds() if isinstance(v, timedelta) else float(DEFAULT_SLICE_SECONDS)

    @property
    def verify_interval(self) -> timedelta | None:
        """``verify_every`` as a timedelta (``None``: no scheduled check)."""
        v = self.verify_every
        return v if isinstance(v, timedelta) else None

    @property
    def flows(self) -> bool:
        """Flow on, and its process knows its workers' scope (whether a run
        has flow is decided by the workers' records too: ``docs/flow.md``)."""
        return self.flow and self.worker_scope is not None


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
    compute: Callable[[Connection, Keys], Computed] | str = ""
    after: Callable[[Connection, Keys, DiffStats], None] | None = None
    batch_size: int = 100
    #: how many ticks of this job a scheduler runs at once (each claims its own batch)
    workers: int = 1
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
        _check_compute(self.compute, where)
        if self.after is not None and not callable(self.after):
            raise ConfigError(f"{where}: after: expected a callable, got {self.after!r}")
        check_count(self.batch_size, f"{where}: batch_size", MAX_BATCH)
        check_count(self.workers, f"{where}: workers", MAX_WORKERS)
        if self.workers > 1 and self.workers * self.batch_size > MAX_WORKER_ITEMS:
            raise ConfigError(
                f"{where}: workers: {self.workers} workers of batch_size {self.batch_size}"
                f" would hold {self.workers * self.batch_size:,} item locks at once; at most"
                f" {MAX_WORKER_ITEMS:,} (PostgreSQL's lock table holds max_locks_per_transaction"
                " x max_connections, 6,400 by default): fewer workers or a smaller batch_size"
            )
        if self.workers > 1 and not self.flow:
            raise ConfigError(
                f"{where}: workers: {self.workers} workers share the group's write lock, which"
                " needs flow (without it each tick takes the lock alone); set flow = true or"
                " workers = 1"
            )
        check_count(self.max_attempts, f"{where}: max_attempts", MAX_ATTEMPTS)
        object.__setattr__(
            self, "item_backoff", Backoff.coerce(self.item_backoff, field=f"{where}: item_backoff")
        )


__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_SLICE_PAUSE",
    "DEFAULT_SLICE_SECONDS",
    "MAX_ATTEMPTS",
    "MAX_BATCH",
    "MAX_CHUNK_ROWS",
    "MAX_SLICE_PAUSE",
    "MAX_SLICE_SECONDS",
    "MAX_WORKERS",
    "MAX_WORKER_ITEMS",
    "RUN_SAVEPOINT",
    "Body",
    "Checkpoint",
    "Computed",
    "Job",
    "Keys",
    "Locks",
    "P",
    "Parent",
    "Progress",
    "QueueJob",
    "RecomputeJob",
    "RunContext",
    "Statement",
    "TaskJob",
    "check_count",
    "check_name",
    "check_pause",
    "check_table",
    "next_due_after_success",
]
