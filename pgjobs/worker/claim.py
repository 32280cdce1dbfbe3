"""Steps 1 and 2 of a queue worker's tick: claim due items and lock their
parents, never waiting.

One statement reads up to ``batch_size`` due items in key order (those
whose item advisory lock it gets: workers side by side take different
items), locks their parents ``FOR KEY SHARE SKIP LOCKED``, then takes the
entries of the items whose parents are locked (or gone) ``FOR UPDATE SKIP
LOCKED``: parents before entries, the order of a user who changes a parent
and then enqueues it. A queue of the plugin's own (``job.claim``) is claimed by the
plugin; its items' parents are then locked here the same way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg import sql

from .._pg import later, send
from ..queue import key_json
from .base import Base, _error_text, _is_run_level

log = logging.getLogger(__name__)

#: up to this batch size the claim also loads the keys table (a round trip saved)
PRELOAD_BATCH = 100


class Claiming(Base):
    """The claim of a tick (see the module docstring)."""

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
            # The claim also loads the claimed items' keys into the keys table;
            # the savepoint of their processing and the keys themselves come
            # back in the same round trip (see _process).
            shape = later(self.conn, self._KEYS_SHAPE)
            # Only for small batches, where the round trip is what counts: at
            # batch 1,000 loading inside the claim drained at 3,000 items/s
            # against 5,300 loaded apart.
            preload = self.job.batch_size <= PRELOAD_BATCH
            first = self._next_savepoint() if preload else None
            statements: list[tuple[sql.Composable, Any]] = [
                (sql.SQL("savepoint {}").format(sp), None),
                (self._claim_sql(load=preload), {"job": self.job.name, "n": self.job.batch_size}),
            ]
            if first is not None:  # after the claim: its savepoint, and the keys it loaded
                statements.append((sql.SQL("savepoint {}").format(first), None))
                statements.append(
                    (
                        sql.SQL("select {c} from pg_temp.{t} order by {c}").format(
                            c=self.scope, t=self.keys_table
                        ),
                        None,
                    )
                )
            try:
                _, rows, *loaded = send(self.conn, *statements)
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
            elif first is not None:
                self.preloaded = (first, [tuple(k) for k in loaded[-1].all()])
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
        self.batch.claimed_at = time.perf_counter()
        for item, attempts, is_gone, claimed, age in result:
            if claimed:
                self.batch.attempts_of[item] = attempts
                self.batch.age_of[item] = age
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

    def _claim_sql(self, *, load: bool = False) -> sql.Composed:
        """One statement: the due items (no lock), their parents ``FOR KEY
        SHARE SKIP LOCKED``, then the entries of the items whose parents are
        locked or gone ``FOR UPDATE SKIP LOCKED``. Parents before entries, the
        order of a user who changes a parent and then enqueues it, and neither
        lock ever waited for: an item whose parent a user holds is not claimed
        at all, so that user's enqueue never waits for the worker.

        Rows: (item, attempts, gone, claimed, seconds since its enqueue) for
        claimed entries, then (item, null, false, false, null) for deferred items."""
        return sql.SQL(
            "with {due}, {classify},"
            # One primary-key probe per item (a lateral subquery, so that no
            # plan can turn it into a scan of the job's whole queue), and the
            # due test again on the row it locked: a worker beside this one may
            # have failed the item (not_before later) since "due" read it. The
            # test stays outside the probe, behind OFFSET 0 (no push-down):
            # inside, it matched the partial index queue_due_idx, and each
            # probe scanned the job's due entries (a batch of 100 took 67 ms
            # instead of 34).
            " c as materialized (select e.key, e.attempts, e.enqueued_at from s, lateral"
            " (select q.key, q.attempts, q.enqueued_at, q.dead_at, q.not_before from {q} as q"
            " where q.job = %(job)s and q.key = s.item offset 0 for update of q skip locked) as e"
            " where (s.locked or not s.present) and e.dead_at is null"
            " and e.not_before <= now()){load}"
            " select c.key::text, c.attempts, c.key in (select item from s where not present),"
            " true, extract(epoch from clock_timestamp() - c.enqueued_at)::float8 from c"
            " union all select s.item::text, null, false, false, null from s"
            " where s.present and not s.locked"
        ).format(
            q=self.queue,
            due=self._due_sql(),
            classify=self._classify_ctes(sql.SQL("due")),
            load=self._load_sql() if load else sql.SQL(""),
        )

    def _due_sql(self) -> sql.Composed:
        """The CTE ``due``: up to ``batch_size`` due items in key order, read
        without a lock. A job with several workers takes different items in
        each: of the first 4 x batch_size due entries, the first batch_size
        whose item advisory lock (two ints: apart from the group locks'
        bigints) this transaction gets without waiting; the scan stops at the
        last one taken. A row lock could not do it: ``FOR NO KEY UPDATE``
        would make a user's enqueue wait, and ``FOR KEY SHARE`` keeps another
        worker's ``FOR UPDATE SKIP LOCKED`` off the rows while its own is kept
        off the same way (both claimed nothing). One lock per item, so only
        with ``workers`` > 1 (``workers x batch_size`` is bounded for it)."""
        if self.job.workers == 1:
            return sql.SQL(
                "due as materialized (select key as item from {q} where job = %(job)s"
                " and dead_at is null and not_before <= now() order by key limit %(n)s)"
            ).format(q=self.queue)
        return sql.SQL(
            "candidates as materialized (select key from {q} where job = %(job)s"
            " and dead_at is null and not_before <= now() order by key limit 4 * %(n)s),"
            " due as materialized (select key as item from candidates"
            " where pg_try_advisory_xact_lock(hashtext(%(job)s), hashtext(key::text))"
            " limit %(n)s)"
        ).format(q=self.queue)

    def _load_sql(self) -> sql.Composed:
        """CTEs of the claim that put the keys of the items it claims (and
        whose parents are there) into the keys table, emptied first: the
        delete does not see the rows inserted beside it."""
        return sql.SQL(
            ", emptied as (delete from pg_temp.{t}),"
            " loaded as (insert into pg_temp.{t} ({cols}) select distinct t.* from"
            " (select c.key as item from c where c.key in (select item from s where present))"
            " as i, lateral {typed} as t)"
        ).format(t=self.keys_table, cols=self.scope, typed=self.typed)

    def _claim_rows(self, wanted: list[str] | None) -> list[str]:
        # ORDER BY q.key, never a bare "key": that names the output column
        # key::text, and the text order no index serves (every due entry
        # read and sorted: 261 ms against 0.4 ms for 100 of 89k due entries,
        # tests/test_plans.py), nor is it the key order enqueues lock in.
        if wanted is None:
            query = sql.SQL(
                "select q.key::text, q.attempts,"
                " extract(epoch from clock_timestamp() - q.enqueued_at)::float8 from {} as q"
                " where q.job = %s and q.dead_at is null"
                " and q.not_before <= now() order by q.key limit %s for update skip locked"
            ).format(self.queue)
            params: tuple[Any, ...] = (self.job.name, self.job.batch_size)
        else:
            query = sql.SQL(
                "select q.key::text, q.attempts,"
                " extract(epoch from clock_timestamp() - q.enqueued_at)::float8 from {} as q"
                " where q.job = %s and q.key = any(%s::text[]::jsonb[]) and q.dead_at is null"
                " and q.not_before <= now() order by q.key for update skip locked"
            ).format(self.queue)
            params = (self.job.name, wanted)
        rows = self.raw.execute(query, params).fetchall()
        self.batch.claimed_at = time.perf_counter()
        for item, attempts, age in rows:
            self.batch.attempts_of[item] = attempts
            self.batch.age_of[item] = age
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
