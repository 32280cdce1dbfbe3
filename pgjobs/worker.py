"""The body of a :class:`~pgjobs.QueueJob`: one tick claims a batch of
items, computes their new rows once, writes one diff scoped to them, calls
``after``, and takes them off the queue with the commit.

1. *Claim*, in one statement: the due items in key order; their parents
   ``FOR KEY SHARE SKIP LOCKED``; then the entries of the items whose
   parents are locked (or gone) ``FOR UPDATE SKIP LOCKED``. Nothing waits.
2. Load the batch's keys into ``pgjobs_keys`` and call ``compute(conn, keys)``.
3. Write one scoped diff (:func:`pgjobs.diff.write_diff`), then ``after``.
4. Delete the processed entries in the commit's round trip.

A failing batch is retried in halves under savepoints until the failing
items are found; the others commit. The queue table's API is
:mod:`pgjobs.queue`; the reasons behind each step are in ``docs/DESIGN.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import Connection

from ._pg import analyze, driver, later, send, sqlstate_of
from .diff import Scope, write_diff
from .errors import ConfigError
from .jobs import Keys, QueueJob, RunContext
from .queue import key_json, queue_table, vacuum_queue
from .results import DiffStats, Execution
from .staging import stage
from .target import Target, prefetch_fingerprint, reflect_target

log = logging.getLogger(__name__)

#: the temp table holding the current batch's scope values (compute SQL may join it)
KEYS_TABLE = "pgjobs_keys"

#: savepoints one tick may take to isolate failing items (PostgreSQL caches 64
#: subtransactions per transaction; beyond that, snapshots slow down)
_MAX_SAVEPOINTS = 48

#: batches with more keys than this get their keys table analyzed
_ANALYZE_KEYS = 1000

#: the queue is vacuumed after this many entries were taken off it (see vacuum_queue)
VACUUM_EVERY = 1000
_deleted_lock = threading.Lock()
#: entries this process took off each schema's queue since it last vacuumed it
_deleted: dict[str, int] = {}

# SQLSTATEs that say nothing about an item: the run fails and is retried as a whole.
_RUN_LEVEL_CLASSES = ("08", "40", "53", "57", "58", "XX")
_RUN_LEVEL_STATES = ("55P03",)


def _count_deleted(ctx: RunContext, n: int) -> None:
    """Count ``n`` entries taken off the queue; at :data:`VACUUM_EVERY`, vacuum
    it once this tick has committed."""
    schema = ctx.schema
    with _deleted_lock:
        total = _deleted.get(schema, 0) + n
        due = total >= VACUUM_EVERY
        _deleted[schema] = 0 if due else total
    if due:
        ctx.after_commit.append(lambda conn: vacuum_queue(conn, schema=schema))


def pending_query(job: QueueJob, ctx: RunContext) -> tuple[sql.Composed, tuple[str]]:
    """Is a live item of ``job`` due? One index probe, taken before any lock."""
    return (
        sql.SQL(
            "select exists (select from {} where job = %s and dead_at is null and not_before <= now())"
        ).format(queue_table(ctx.schema)),
        (job.name,),
    )


def has_pending(conn: Connection, job: QueueJob, ctx: RunContext) -> bool:
    """:func:`pending_query`'s answer."""
    row = driver(conn).execute(*pending_query(job, ctx)).fetchone()
    return bool(row and row[0])


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


def _is_run_level(exc: BaseException) -> bool:
    """An error no item caused: fail the run instead of blaming items."""
    if isinstance(exc, ConfigError):  # the job's definition is wrong, not an item
        return True
    state = sqlstate_of(exc)
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(_RUN_LEVEL_CLASSES) or state in _RUN_LEVEL_STATES


def _error_text(exc: BaseException) -> str:
    message = f"{type(exc).__name__}: {exc}".strip()
    return message if len(message) <= 2000 else message[:1997] + "..."


class _Worker:
    """One tick of one queue job, inside the job's transaction."""

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

    # -- the tick -------------------------------------------------------------------
    def run(self) -> Execution:
        if self.job.claim is not None:
            items, gone, deferred, unreadable = self._claim_own()
        else:
            items, gone, deferred, unreadable = self._claim()
        self.ctx.report("claim", len(items), None)
        for item, exc in unreadable.items():
            self.batch.failed[item] = exc
        if gone:
            self.dropped.extend(gone)
            log.info(
                "pgjobs: %s: dropped %d item(s) whose parent is gone", self.job.name, len(gone)
            )
        if items:
            self._process(items)
        dead = 0
        if self.own is not None:
            self._finish_own()
        else:
            self._delete([*self.dropped, *self.batch.done])
            if self.batch.failed:
                dead = self._record_failures()
        b = self.batch
        return Execution(
            stats=b.stats,
            compute_seconds=b.compute_seconds,
            write_seconds=b.write_seconds,
            lock_seconds=b.lock_seconds,
            items=len(b.done),
            failed_items=len(b.failed),
            detail={
                "claimed": len(items) + len(gone) + len(unreadable),
                "parent_gone": len(gone),
                "deferred": len(deferred),
                "kept": len(b.kept),
                "rows_deferred": b.rows_deferred,
                "dead": dead,
            },
        )

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

    # -- 1 + 2: claim, then the items' parents without waiting ------------------------
    def _claim(self) -> tuple[list[str], list[str], list[str], dict[str, BaseException]]:
        """Returns (items to process, items whose parent is gone, items left for
        later because a user holds their parent, items whose key doesn't fit)."""
        if not self.item_parents:
            # Nothing to lock first: keys that don't fit fail in _process.
            self._ensure_keys_table()
            return self._claim_rows(None), [], [], {}
        sp = self._next_savepoint()
        try:
            # One round trip: the keys table's shape, a savepoint and the
            # claim (which reads the keys table's row type). When the table
            # is missing or has another shape, the claim's effects (locks
            # included) are rolled back, the table made, and the claim redone.
            shape = later(self.conn, self._KEYS_SHAPE)
            try:
                _, rows = send(
                    self.conn,
                    (sql.SQL("savepoint {}").format(sp), None),
                    (self._claim_sql(), {"job": self.job.name, "n": self.job.batch_size}),
                )
                fits = self._keys_table_fits(shape.result.one() if shape.result else None)
                result = rows.all() if fits else []
            except psycopg.DatabaseError as exc:
                if _is_run_level(exc) or shape.result is None:
                    raise
                if self._keys_table_fits(shape.result.one()):
                    raise
                fits = False
            if not fits:
                self._rollback_to(sp)
                self._create_keys_table()
                sp = self._savepoint()
                result = self.raw.execute(
                    self._claim_sql(), {"job": self.job.name, "n": self.job.batch_size}
                ).fetchall()
        except psycopg.DataError:
            # A key that does not convert to the scope's types: claim plainly
            # and find it one by one (rare, so this path may hold the entries
            # of deferred items until commit; it still waits for nothing).
            self._rollback_to(sp)
            return self._lock_readable(self._claim_rows(None))
        # The savepoint stays open (the commit releases it): a round trip saved.
        ok: list[str] = []
        gone: list[str] = []
        deferred: list[str] = []
        # Items neither listed as claimed nor deferred have an entry that a
        # user's transaction holds (an uncommitted enqueue): skipped.
        for item, attempts, is_gone, claimed in result:
            if claimed:
                self.batch.attempts_of[item] = attempts
                (gone if is_gone else ok).append(item)
            else:
                deferred.append(item)
        return sorted(ok), sorted(gone), sorted(deferred), {}

    def _classify_ctes(self, keys: sql.Composable) -> sql.Composed:
        """CTEs ``k`` (the jsonb ``item`` of ``keys``, typed), ``p<n>`` (the item
        parents, locked ``FOR KEY SHARE SKIP LOCKED``) and ``s`` (item, locked,
        present): an item is locked when all its parents are, gone when one of
        them does not exist. Membership tests are ``IN (subquery)``, which
        PostgreSQL hashes: a join between CTEs (no statistics) would be a
        nested loop, quadratic in the batch size."""
        ctes = [
            sql.SQL("k as materialized (select i.item, t.* from {} as i, lateral {} as t)").format(
                keys, self.typed
            )
        ]
        locked, present = [], []
        for n, parent in enumerate(self.item_parents):
            alias = sql.Identifier(f"p{n}")
            pcols = sql.SQL(", ").join(sql.Identifier("p", c) for c in parent.parent_columns)
            ccols = sql.SQL(", ").join(sql.Identifier("k", c) for c in parent.columns)
            ctes.append(
                sql.SQL(
                    "{alias} as materialized (select {pcols} from {table} as p"
                    " where ({pcols}) in (select {ccols} from k) for key share of p skip locked)"
                ).format(alias=alias, pcols=pcols, table=parent.table, ccols=ccols)
            )
            is_locked = sql.SQL("({}) in (select * from {})").format(ccols, alias)
            locked.append(is_locked)
            match = sql.SQL(" and ").join(
                sql.SQL("{} = {}").format(sql.Identifier("x", pc), sql.Identifier("k", c))
                for c, pc in zip(parent.columns, parent.parent_columns, strict=True)
            )
            present.append(
                sql.SQL("({} or exists (select from {} as x where {}))").format(
                    is_locked, parent.table, match
                )
            )
        ctes.append(
            sql.SQL("s as materialized (select k.item, {} as locked, {} as present from k)").format(
                sql.SQL(" and ").join(locked), sql.SQL(" and ").join(present)
            )
        )
        return sql.SQL(", ").join(ctes)

    def _claim_sql(self) -> sql.Composed:
        """One statement: the due items (no lock), their parents ``FOR KEY
        SHARE SKIP LOCKED``, then the entries of the items whose parents are
        locked or gone ``FOR UPDATE SKIP LOCKED``. Parents before entries, the
        order of a user who changes a parent and then enqueues it, and neither
        lock ever waited for: an item whose parent a user holds is not claimed
        at all, so that user's enqueue never waits for the worker.

        Rows: (item, attempts, gone, claimed) for claimed entries, then
        (item, null, false, false) for deferred items."""
        return sql.SQL(
            "with due as materialized (select key as item from {q} where job = %(job)s"
            " and dead_at is null and not_before <= now() order by key limit %(n)s), {classify},"
            # One primary-key probe per item (a lateral subquery, so that no
            # plan can turn it into a scan of the job's whole queue). No need
            # to test dead_at and not_before again: only a worker of the job's
            # group changes them, and this one holds the group lock.
            " c as materialized (select e.key, e.attempts from s, lateral"
            " (select q.key, q.attempts from {q} as q where q.job = %(job)s and q.key = s.item"
            " for update of q skip locked) as e where s.locked or not s.present)"
            " select c.key::text, c.attempts, c.key in (select item from s where not present),"
            " true from c"
            " union all select s.item::text, null, false, false from s"
            " where s.present and not s.locked"
        ).format(q=self.queue, classify=self._classify_ctes(sql.SQL("due")))

    def _claim_rows(self, wanted: list[str] | None) -> list[str]:
        if wanted is None:
            query = sql.SQL(
                "select key::text, attempts from {} where job = %s and dead_at is null"
                " and not_before <= now() order by key limit %s for update skip locked"
            ).format(self.queue)
            params: tuple[Any, ...] = (self.job.name, self.job.batch_size)
        else:
            query = sql.SQL(
                "select key::text, attempts from {} where job = %s"
                " and key = any(%s::text[]::jsonb[]) and dead_at is null and not_before <= now()"
                " order by key for update skip locked"
            ).format(self.queue)
            params = (self.job.name, wanted)
        rows = self.raw.execute(query, params).fetchall()
        for item, attempts in rows:
            self.batch.attempts_of[item] = attempts
        return [r[0] for r in rows]

    def _claim_own(self) -> tuple[list[str], list[str], list[str], dict[str, BaseException]]:
        """:meth:`_claim` for a queue of the plugin's own: ``job.claim`` takes
        and locks the items, then their parents are locked here, never
        waiting. Returns the same four sets."""
        assert self.job.claim is not None
        width = len(self.job.scope)
        self.own = {}
        for key in self.job.claim(self.conn, self.job.batch_size):
            values = tuple(key) if isinstance(key, tuple | list) else (key,)
            self.own.setdefault(key_json(values, width), values)
        items = list(self.own)
        if not items:
            return [], [], [], {}
        self._ensure_keys_table()
        if not self.item_parents:
            return sorted(items), [], [], {}
        sp = self._savepoint()
        try:
            ok, gone, deferred = self._lock_parents(items)
        except psycopg.DataError:
            self._rollback_to(sp)
            return self._lock_readable(items)
        return ok, gone, deferred, {}

    def _finish_own(self) -> None:
        """Hand the plugin its done and failed keys (a queue of its own)."""
        assert self.own is not None and self.job.finish is not None
        own = self.own
        done = [own[i] for i in (*self.dropped, *self.batch.done)]
        failed = {own[i]: exc for i, exc in sorted(self.batch.failed.items())}
        for key, exc in failed.items():
            log.warning("pgjobs: %s: item %s failed: %s", self.job.name, key, _error_text(exc))
        self.job.finish(self.conn, done, failed)

    def _lock_readable(
        self, items: list[str]
    ) -> tuple[list[str], list[str], list[str], dict[str, BaseException]]:
        """After a key failed to convert to the scope's types: find such keys
        one by one, then lock the others' parents. The four sets of _claim."""
        unreadable = self._unreadable(items)
        ok, gone, deferred = self._lock_parents([i for i in items if i not in unreadable])
        return ok, gone, deferred, unreadable

    def _unreadable(self, items: list[str]) -> dict[str, BaseException]:
        """Keys that don't convert to the scope's column types, one by one."""
        probe = sql.SQL("select {} from unnest(%s::text[]) as i(item)").format(self.typed)
        bad: dict[str, BaseException] = {}
        for item in items:
            sp = self._savepoint()
            try:
                self.raw.execute(probe, ([item],))
            except psycopg.DatabaseError as exc:
                if _is_run_level(exc):
                    raise
                self._rollback_to(sp)
                bad[item] = exc
            else:
                self._release(sp)
        return bad

    def _lock_parents(self, items: list[str]) -> tuple[list[str], list[str], list[str]]:
        """For claimed ``items``: (parents locked, a parent gone, a parent busy)."""
        if not items:
            return [], [], []
        # Each item comes back as it was given (text), not as jsonb prints it.
        query = sql.SQL(
            "with given as (select g.item::jsonb as item, g.item as given"
            " from unnest(%s::text[]) as g(item)), {}"
            " select given.given, locked, present from s join given using (item)"
        ).format(self._classify_ctes(sql.SQL("given")))
        ok, gone, deferred = [], [], []
        for item, is_locked, is_present in self.raw.execute(query, (items,)).fetchall():
            if not is_present:
                gone.append(item)
            elif is_locked:
                ok.append(item)
            else:
                deferred.append(item)
        return sorted(ok), sorted(gone), sorted(deferred)

    # -- 3 + 4 + 5, with per-item isolation ----------------------------------------------
    def _process(self, items: list[str]) -> None:
        sp = self._next_savepoint()
        try:
            self._write(items, sp)
        except Exception as exc:
            if _is_run_level(exc):
                raise
            self._rollback_to(sp)
            if len(items) == 1:
                self.batch.failed[items[0]] = exc
                return
            if self._savepoints >= _MAX_SAVEPOINTS:
                # Past some 64 subtransactions in one transaction, every
                # snapshot in the database gets slower: leave the rest queued,
                # untouched, for the next tick (the items found failing so far
                # back off meanwhile).
                log.warning(
                    "pgjobs: %s: %d item(s) left for the next tick: too many failures to isolate",
                    self.job.name,
                    len(items),
                )
                self.batch.kept.extend(items)
                return
            log.info(
                "pgjobs: %s: a batch of %d items failed (%s); isolating the failing items",
                self.job.name,
                len(items),
                type(exc).__name__,
            )
            half = len(items) // 2
            self._process(items[:half])
            self._process(items[half:])

    def _load_keys(self, items: list[str], savepoint: sql.Identifier) -> Keys:
        # The savepoint and the load in one round trip. The delete empties
        # what an earlier sub-batch (or anything earlier in this transaction)
        # left; it does not see the rows inserted beside it.
        _, loaded = send(
            self.conn,
            (sql.SQL("savepoint {}").format(savepoint), None),
            (
                sql.SQL(
                    "with gone as (delete from pg_temp.{t}),"
                    " ins as (insert into pg_temp.{t} ({cols}) select distinct t.* from"
                    " unnest(%s::text[]) as i(item), lateral {typed} as t returning {cols})"
                    " select {cols} from ins order by {cols}"
                ).format(t=self.keys_table, cols=self.scope, typed=self.typed),
                (items,),
            ),
        )
        return [tuple(r) for r in loaded.all()]

    def _params(self, keys: Keys) -> dict[str, Any]:
        params: dict[str, Any] = {"keys": [k[0] for k in keys]}
        for n, column in enumerate(self.job.scope):
            params[f"keys_{column}"] = [k[n] for k in keys]
        return params

    def _write(self, items: list[str], savepoint: sql.Identifier) -> None:
        """Process ``items`` under ``savepoint`` (taken here; released by the
        commit, or rolled back to by the caller when this raises)."""
        b = self.batch
        keys = self._load_keys(items, savepoint)
        if len(keys) > _ANALYZE_KEYS:
            # Up to this size, the planner's estimate from the table's current
            # size serves joins as well as statistics would, for less.
            self.raw.execute(analyze(sql.Identifier("pg_temp", KEYS_TABLE)))
        started = time.perf_counter()
        compute = self.job.compute
        source = compute if isinstance(compute, str) else compute(self.conn, keys)
        staged = stage(self.conn, self.target, source, params=self._params(keys), session=True)
        b.compute_seconds += time.perf_counter() - started
        self.ctx.report("write", len(keys), None)
        # wait_busy=False: this transaction holds queue entries, and a user may
        # lock a parent FOR UPDATE and then enqueue one of our items (a delete
        # cascading to a table with an enqueue trigger); waiting for that
        # parent would deadlock. Its rows are deferred, the items stay queued.
        result = write_diff(
            self.conn,
            self.target,
            staged,
            # The claim locked every item's item parents FOR KEY SHARE (in
            # its savepoint, which no isolation rolls back): not again.
            scope=Scope(
                columns=self.job.scope,
                keys=self.keys_table,
                rows=len(keys),
                parents_locked=True,
            ),
            wait_busy=False,
        )
        b.write_seconds += result.write_seconds
        b.lock_seconds += result.lock_seconds
        b.stats = b.stats + result.stats
        if result.deferred:
            # Some rows wait for a parent a user holds: what was written stays,
            # the items stay queued, and the next tick finishes them.
            b.kept.extend(items)
            b.rows_deferred += result.deferred
            self._release(savepoint)
            return
        if self.job.after is not None:
            self.job.after(self.conn, keys, result.stats)
        # The savepoint stays open (the commit releases it): a round trip
        # saved. Should a later sub-batch fail, it is rolled back to its own.
        b.done.extend(items)

    def _delete(self, items: list[str]) -> None:
        """Take ``items`` (processed, or their parent gone) off the queue, with
        the commit: the statement goes out in the runner's last round trip,
        before the run record and COMMIT. Their entries stay locked by this
        transaction until then."""
        if not items:
            return
        # One primary-key probe per entry, then a TID scan: "key = any(...)"
        # may be planned as a scan of the job's whole queue (stale statistics
        # on a table that churns). The entries are locked by this transaction,
        # so their ctid cannot change between the probe and the delete.
        delete = sql.SQL(
            "delete from {q} where ctid = any(array(select e.ctid"
            " from unnest(%s::text[]) as i(item), lateral (select q.ctid from {q} as q"
            " where q.job = %s and q.key = i.item::jsonb limit 1) as e))"
        ).format(q=self.queue)
        later(self.conn, delete, (items, self.job.name))
        _count_deleted(self.ctx, len(items))

    def _record_failures(self) -> int:
        job = self.job
        policy = job.item_backoff
        assert not isinstance(policy, str | int | float | timedelta)
        names, delays, texts, dead = [], [], [], 0
        for item, exc in sorted(self.batch.failed.items()):
            attempts = self.batch.attempts_of.get(item, 0) + 1
            names.append(item)
            delays.append(policy.delay(attempts).total_seconds())
            texts.append(_error_text(exc))
            if attempts >= job.max_attempts:
                dead += 1
                log.error(
                    "pgjobs: %s: item %s failed %d times and is parked: %s",
                    job.name,
                    item,
                    attempts,
                    texts[-1],
                )
            else:
                log.warning(
                    "pgjobs: %s: item %s failed (attempt %d of %d), retrying in %.0fs: %s",
                    job.name,
                    item,
                    attempts,
                    job.max_attempts,
                    delays[-1],
                    texts[-1],
                )
        self.raw.execute(
            sql.SQL(
                "update {} as q set attempts = q.attempts + 1, last_error = f.err,"
                " not_before = now() + make_interval(secs => f.delay),"
                " dead_at = case when q.attempts + 1 >= %s then now() end"
                " from unnest(%s::text[], %s::float8[], %s::text[]) as f(item, delay, err)"
                " where q.job = %s and q.key = f.item::jsonb"
            ).format(self.queue),
            (job.max_attempts, names, delays, texts, job.name),
        )
        return dead


def _item_parents(target: Target, scope: tuple[str, ...]) -> list[_ItemParent]:
    """The target's parents whose columns are all scope columns: every item has
    exactly one row in each (or none, when it is gone)."""
    return [
        _ItemParent(parent.ident, parent.columns, parent.parent_columns)
        for parent in target.parents
        if parent.columns and set(parent.columns) <= set(scope) and not parent.self_reference
    ]


def run_queue(conn: Connection, job: QueueJob, ctx: RunContext) -> Execution:
    """One tick of ``job``: claim a batch, compute it once, write one scoped
    diff, call ``after``; inside the job's transaction, the group lock held."""
    return _Worker(conn, job, ctx).run()


class QueueBody:
    """How the runner runs a :class:`~pgjobs.QueueJob`."""

    def work_query(
        self, job: QueueJob, ctx: RunContext
    ) -> tuple[sql.Composed, Sequence[Any]] | None:
        return None if job.has_work is not None else pending_query(job, ctx)

    def check_work(self, conn: Connection, job: QueueJob, ctx: RunContext) -> bool:
        if job.has_work is not None:
            return bool(job.has_work(conn))
        return has_pending(conn, job, ctx)

    def prefetch(self, conn: Connection, job: QueueJob, ctx: RunContext) -> None:
        # the reflection cache's catalog check (see reflect_target)
        ctx.extra["fingerprint"] = prefetch_fingerprint(conn, job.target, job.parents)

    def execute(self, conn: Connection, job: QueueJob, ctx: RunContext) -> Execution:
        return run_queue(conn, job, ctx)


BODY = QueueBody()
