"""What every step of a queue worker's tick shares: the job, its target,
the batch so far, savepoints, and the ``pgjobs_keys`` table the batch's
keys are loaded into. :mod:`.claim` and :mod:`.tick` build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import driver, sqlstate_of
from ..errors import ConfigError
from ..jobs import QueueJob, RunContext
from ..queue import queue_table
from ..results import DiffStats
from ..target import Target, reflect_target

#: the temp table holding the current batch's scope values (compute SQL may join it)
KEYS_TABLE = "pgjobs_keys"

#: savepoints one tick may take to isolate failing items (PostgreSQL caches 64
#: subtransactions per transaction; beyond that, snapshots slow down)
_MAX_SAVEPOINTS = 48

#: batches with more keys than this get their keys table analyzed
_ANALYZE_KEYS = 1000

# SQLSTATEs that say nothing about an item: the run fails and is retried as a whole.
_RUN_LEVEL_CLASSES = ("08", "40", "53", "57", "58", "XX")
_RUN_LEVEL_STATES = ("55P03",)


@dataclass(frozen=True, slots=True)
class _ItemParent:
    """A parent every item has: its columns are all scope columns."""

    table: sql.Composable
    columns: tuple[str, ...]  # in the target (= scope columns)
    parent_columns: tuple[str, ...]


@dataclass(kw_only=True)
class _Batch:
    """What one tick did, accumulated across the isolation's sub-batches."""

    stats: DiffStats = field(default_factory=DiffStats)
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
    lock_seconds: float = 0.0
    done: list[str] = field(default_factory=list)
    #: written, but rows were deferred by the writer: left in the queue
    kept: list[str] = field(default_factory=list)
    rows_deferred: int = 0
    failed: dict[str, BaseException] = field(default_factory=dict)
    attempts_of: dict[str, int] = field(default_factory=dict)
    #: seconds since each claimed item's enqueue, at the claim (database clock)
    age_of: dict[str, float] = field(default_factory=dict)
    claimed_at: float = 0.0  #: time.perf_counter() at the claim


def _is_run_level(exc: BaseException) -> bool:
    """An error no item caused: fail the run instead of blaming items."""
    if isinstance(exc, ConfigError):  # the job's definition is wrong, not an item
        return True
    state = sqlstate_of(exc)
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(_RUN_LEVEL_CLASSES) or state in _RUN_LEVEL_STATES


def _error_text(exc: BaseException) -> str:
    """What an item's ``last_error`` says: the driver's error (not
    SQLAlchemy's wrapper, which repeats the SQL and adds a link), with its
    SQLSTATE when the database gave one."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    state = sqlstate_of(exc)
    message = f"{type(exc).__name__}: {str(exc).strip()}" + (
        f" (SQLSTATE {state})" if state else ""
    )
    return message if len(message) <= 2000 else message[:1997] + "..."


def _item_parents(target: Target, scope: tuple[str, ...]) -> list[_ItemParent]:
    """The target's parents whose columns are all scope columns: every item has
    exactly one row in each (or none, when it is gone)."""
    return [
        _ItemParent(parent.ident, parent.columns, parent.parent_columns)
        for parent in target.parents
        if parent.columns and set(parent.columns) <= set(scope) and not parent.self_reference
    ]


class Base:
    """One tick of one queue job, inside the job's transaction: its state."""

    def __init__(self, conn: Connection, job: QueueJob, ctx: RunContext) -> None:
        self.conn = conn
        self.raw = driver(conn)
        self.job = job
        self.ctx = ctx
        self.queue = queue_table(ctx.schema)
        self.target = reflect_target(
            conn,
            job.target,
            key=job.key,
            parents=job.parents,
            prefetched=ctx.extra.pop("fingerprint", None),
        )
        missing = [c for c in job.scope if c not in self.target.types]
        if missing:
            raise ConfigError(
                f"QueueJob {job.name!r}: scope: {self.target.label} has no writable column(s) "
                f"{', '.join(missing)}"
            )
        self.item_parents = _item_parents(self.target, job.scope)
        self.scope = sql.SQL(", ").join(sql.Identifier(c) for c in job.scope)
        self.keys_table = sql.Identifier(KEYS_TABLE)
        # One typed row per queue key: jsonb array -> the keys table's row type.
        self.typed = sql.SQL(
            "jsonb_populate_record(null::pg_temp.{}, jsonb_build_object({}))"
        ).format(
            self.keys_table,
            sql.SQL(", ").join(
                sql.SQL("{}, i.item::jsonb -> {}").format(sql.Literal(c), sql.Literal(n))
                for n, c in enumerate(job.scope)
            ),
        )
        self.batch = _Batch()
        self._savepoints = 0
        #: a queue of the plugin's own (job.claim): item text -> its key as claimed
        self.own: dict[str, tuple[Any, ...]] | None = None
        #: the items dropped because their parent is gone
        self.dropped: list[str] = []
        #: the claim loaded the keys table with its items' keys, and took the
        #: savepoint of their processing: (that savepoint, the keys)
        self.preloaded: tuple[sql.Identifier, list[tuple[Any, ...]]] | None = None

    # -- savepoints -------------------------------------------------------------
    def _savepoint(self) -> sql.Identifier:
        name = self._next_savepoint()
        self.raw.execute(sql.SQL("savepoint {}").format(name))
        return name

    def _next_savepoint(self) -> sql.Identifier:
        self._savepoints += 1
        return sql.Identifier(f"pgjobs_q{self._savepoints}")

    def _release(self, name: sql.Identifier) -> None:
        self.raw.execute(sql.SQL("release savepoint {}").format(name))

    def _rollback_to(self, name: sql.Identifier) -> None:
        self.raw.execute(sql.SQL("rollback to savepoint {n}; release savepoint {n}").format(n=name))

    _KEYS_SHAPE = (
        "select array_agg(attname || ':' || atttypid order by attnum) from pg_attribute"
        " where attrelid = to_regclass('pg_temp.pgjobs_keys') and attnum > 0"
        " and not attisdropped"
    )

    def _keys_table_fits(self, row: tuple[Any, ...] | None) -> bool:
        want = [f"{c}:{self.target.types[c].type_oid}" for c in self.job.scope]
        return row is not None and row[0] == want

    def _ensure_keys_table(self) -> None:
        """``pgjobs_keys`` lives as long as the session (``ON COMMIT DELETE
        ROWS``): creating a temp table per tick costs more catalog writes than
        the rest of a small batch. It is recreated when its columns or their
        types don't match this job's scope."""
        if not self._keys_table_fits(self.raw.execute(self._KEYS_SHAPE).fetchone()):
            self._create_keys_table()

    def _create_keys_table(self) -> None:
        self.raw.execute(
            sql.SQL(
                "drop table if exists pg_temp.{t}; create temp table {t} on commit delete rows as"
                " select {cols} from {target} with no data"
            ).format(t=self.keys_table, cols=self.scope, target=self.target.ident)
        )
