"""One tick of a queue worker: claim, compute once, write one scoped diff,
``after``, take the processed items off the queue with the commit.

A failing batch is retried in halves under savepoints until the failing
items are found; the others commit. Errors no item caused (deadlock, lost
connection, timeouts, a ``ConfigError``) fail the whole run instead.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from psycopg import sql

from .._pg import analyze, later, send
from ..diff import Scope, write_diff
from ..jobs import Keys
from ..results import Execution
from ..staging import check_coverage, stage
from .base import _ANALYZE_KEYS, _MAX_SAVEPOINTS, KEYS_TABLE, _error_text, _is_run_level
from .claim import Claiming
from .vacuum import count_deleted

log = logging.getLogger(__name__)


class Worker(Claiming):
    """One tick of one queue job, inside the job's transaction."""

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
        if not (items or gone or deferred or unreadable):
            return Execution(idle=True)  # a worker beside this one took them
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
        since_claim = time.perf_counter() - b.claimed_at
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
            queue_lag=tuple(b.age_of[i] + since_claim for i in b.done if i in b.age_of),
        )

    # -- 3 + 4 + 5, with per-item isolation ----------------------------------------------
    def _process(self, items: list[str]) -> None:
        preloaded, self.preloaded = self.preloaded, None
        sp = preloaded[0] if preloaded else self._next_savepoint()
        try:
            self._write(items, sp, preloaded[1] if preloaded else None)
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

    def _write(self, items: list[str], savepoint: sql.Identifier, keys: Keys | None = None) -> None:
        """Process ``items`` under ``savepoint`` (taken here, unless the claim
        took it and loaded their ``keys``; released by the commit, or rolled
        back to by the caller when this raises)."""
        b = self.batch
        if keys is None:
            keys = self._load_keys(items, savepoint)
        if len(keys) > _ANALYZE_KEYS:
            # Up to this size, the planner's estimate from the table's current
            # size serves joins as well as statistics would, for less.
            self.raw.execute(analyze(sql.Identifier("pg_temp", KEYS_TABLE)))
        started = time.perf_counter()
        compute = self.job.compute
        source = compute if isinstance(compute, str) else compute(self.conn, keys)
        staged = stage(self.conn, self.target, source, params=self._params(keys), session=True)
        check_coverage(self.target, staged.columns, self.job.columns, "the new rows")
        if self.job.flow:
            self._mark()
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

    def _mark(self) -> None:
        """Flow: record, in this transaction, that its xid rewrote these keys
        (``docs/DESIGN.md``, "Flow"); a recompute that computed meanwhile
        leaves them out. Goes with the diff's first round trip, under the
        sub-batch's savepoint."""
        later(
            self.conn,
            sql.SQL(
                "insert into {marks} (target, key, xid) select %s, jsonb_build_array({cols}),"
                " pg_current_xact_id() from pg_temp.{keys} as k order by 2"
                " on conflict (target, key) do update set xid = excluded.xid"
            ).format(
                marks=sql.Identifier(self.ctx.schema, "mark"),
                cols=sql.SQL(", ").join(sql.Identifier("k", c) for c in self.job.scope),
                keys=self.keys_table,
            ),
            (self.target.label,),
        )

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
        count_deleted(self.ctx, len(items))

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
