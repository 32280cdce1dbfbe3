"""The statements a queue job runs tick after tick, composed once per job
and target (:func:`statements_for`), not per tick.

Composing SQL with :mod:`psycopg.sql` and rendering it to text cost a
one-item tick about half its client CPU on main (``docs/queue-performance.md``).
Here each statement is composed once and kept as rendered text
(:func:`frozen`): psycopg then only encodes it, and finds its conversion
to PostgreSQL's placeholders in its own cache. The cache is keyed by the
job, pgjobs' schema and the reflected target (a new reflection, after DDL,
is a new target: the statements are composed again).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from .._pg import frozen, replanned
from ..jobs import QueueJob
from ..queue import queue_table
from ..target import Target
from .cursor import SAMPLE, sample_sql

#: the temp table holding the current batch's scope values (compute SQL may join it)
KEYS_TABLE = "pgjobs_keys"
#: the claim's rows: (item, attempts, gone, claimed, age, seq, path, read,
#: ctid, server, running), then (the keyed claim) the item's typed scope
#: values from this column on. The first row is the cursor's sample
#: (path ``SAMPLE``: seq, server and running; pgjobs/worker/cursor.py)
SEQ_AT = 5
KEYED_AT = 11
#: what the claim's CTEs carry along from ``due`` for each item: no join
#: between CTEs (a generic plan, which takes each CTE for one row, made
#: them nested loops: 1,000 x 1,000 jsonb comparisons, 380 ms a claim)
_CARRY = ("pgjobs_seq", "pgjobs_path", "pgjobs_ctid")


@dataclass(frozen=True, slots=True)
class ItemParent:
    """A parent every item has: its columns are all scope columns."""

    table: sql.Composable
    columns: tuple[str, ...]  # in the target (= scope columns)
    parent_columns: tuple[str, ...]


def item_parents(target: Target, scope: tuple[str, ...]) -> list[ItemParent]:
    """The target's parents whose columns are all scope columns: every item has
    exactly one row in each (or none, when it is gone)."""
    return [
        ItemParent(parent.ident, parent.columns, parent.parent_columns)
        for parent in target.parents
        if parent.columns and set(parent.columns) <= set(scope) and not parent.self_reference
    ]


class Statements:
    """One job's statements for one target (see the module docstring)."""

    def __init__(self, job: QueueJob, schema: str, target: Target) -> None:
        self.job = job
        self.target = target
        self.item_parents = item_parents(target, job.scope)
        self.queue = queue_table(schema)
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
        self.create_keys = frozen(
            sql.SQL(
                "drop table if exists pg_temp.{t}; create temp table {t} on commit delete rows as"
                " select {cols} from {target} with no data"
            ).format(t=self.keys_table, cols=self.scope, target=target.ident)
        )
        self._compose_claims(schema)
        self._compose_writes(schema)
        #: the small path's statement per compute text (see :mod:`.small`)
        self.small: dict[str, Any] = {}
        #: compute texts whose small-path keys go as parameters (see :mod:`.small`)
        self.small_as_parameters: set[str] = set()
        #: the small path's statement per compute text as the job gives it,
        #: where it takes no parameter: found without compiling the text
        #: again, and sent ahead with the claim (see :mod:`.claim`)
        self.small_ready: dict[str, Any] = {}
        #: how many keys this job's last claim took (the claim sends the
        #: small write ahead when the last one took few enough)
        self.last_claimed = 0

    def _compose_claims(self, schema: str) -> None:
        """The claim's statements (:mod:`.claim`)."""
        self.claim = frozen(self._claim_sql(schema, load=False))
        self.claim_loading = frozen(self._claim_sql(schema, load=True))
        #: the claim that loads the keys table and returns each claimed
        #: item's typed key too (when the keys table is known to fit)
        self.claim_keyed = frozen(self._claim_sql(schema, load=True, keyed=True))
        self.loaded_keys = frozen(
            sql.SQL("select {c} from pg_temp.{t} order by {c}").format(
                c=self.scope, t=self.keys_table
            )
        )
        self.lock_parents = frozen(
            sql.SQL(
                "with given as (select g.item::jsonb as item, g.item as given"
                " from unnest(%s::text[]) as g(item)), {}"
                " select given.given, locked, present from s join given using (item)"
            ).format(self._classify_ctes(sql.SQL("given")))
        )
        self.unreadable_probe = frozen(
            sql.SQL("select {} from unnest(%s::text[]) as i(item)").format(self.typed)
        )
        # Without item parents: the entries of the due items, locked
        # FOR UPDATE SKIP LOCKED, and a row with no item for each entry read
        # but not taken (the cursor's, pgjobs/worker/cursor.py).
        self.claim_all = frozen(
            sql.SQL(
                "with {due}, c as materialized (select e.key, e.attempts, e.enqueued_at, e.ctid,"
                " due.pgjobs_seq, due.pgjobs_path from due, lateral ({lock}) as e where e.dead_at is null"
                " and e.not_before <= now()) {sample}"
                " union all select c.key::text, c.attempts,"
                " extract(epoch from clock_timestamp() - c.enqueued_at)::float8, c.pgjobs_seq,"
                " c.pgjobs_path, {read}, c.ctid::text, null, null from c"
                " union all select null, null, null, d.pgjobs_seq, d.pgjobs_path, {read}, null,"
                " null, null from {unread} as d where d.item not in (select key from c)"
            ).format(
                due=self._due_sql(),
                lock=self._lock_sql("due.pgjobs_ctid", "due.item"),
                sample=self._sample_sql(schema, before=3),
                read=self._read_sql(),
                unread=self._unread_sql(),
            )
        )

    def _compose_writes(self, schema: str) -> None:
        """The statements of the processing and of the finish (:mod:`.tick`)."""
        job, target = self.job, self.target
        # The delete empties what an earlier sub-batch (or anything earlier in
        # this transaction) left; it does not see the rows inserted beside it.
        self.load_keys = frozen(
            sql.SQL(
                "with gone as (delete from pg_temp.{t}),"
                " ins as (insert into pg_temp.{t} ({cols}) select distinct t.* from"
                " unnest(%s::text[]) as i(item), lateral {typed} as t returning {cols})"
                " select {cols} from ins order by {cols}"
            ).format(t=self.keys_table, cols=self.scope, typed=self.typed)
        )
        self.mark = frozen(
            sql.SQL(
                "insert into {marks} (target, key, xid) select %s, jsonb_build_array({cols}),"
                " pg_current_xact_id() from pg_temp.{keys} as k order by 2"
                " on conflict (target, key) do update set xid = excluded.xid"
            ).format(
                marks=sql.Identifier(schema, "mark"),
                cols=sql.SQL(", ").join(sql.Identifier("k", c) for c in job.scope),
                keys=self.keys_table,
            )
        )
        #: the flow marks as a data-modifying CTE of the small path's
        #: statement (over its keys ``k``), composed, not rendered
        self.mark_small = sql.SQL(
            "insert into {marks} (target, key, xid) select {label}, jsonb_build_array({cols}),"
            " pg_current_xact_id() from k order by 2"
            " on conflict (target, key) do update set xid = excluded.xid returning 1"
        ).format(
            marks=sql.Identifier(schema, "mark"),
            label=sql.Literal(target.label),
            cols=sql.SQL(", ").join(sql.Identifier("k", c) for c in job.scope),
        )
        # By the ctid the claim locked (a TID scan: no probe of the primary
        # key, which walks every version of a key that a held horizon
        # keeps). The entries are locked by this transaction, so their ctid
        # cannot change between the claim and the delete, and the ctid alone
        # names them: with a condition on ``job`` too, the plan PostgreSQL
        # kept was a walk of the job's whole primary key with the ctids as a
        # filter (10 ms a tick after 100 s of a held horizon). Planned at
        # each run: a plan kept from a queue that fit a page scans it whole.
        self.delete = replanned(
            sql.SQL("delete from {} where ctid = any(%s::tid[])").format(self.queue)
        )
        self.record_failures = frozen(
            sql.SQL(
                "update {} as q set attempts = q.attempts + 1, last_error = f.err,"
                " not_before = now() + make_interval(secs => f.delay),"
                " dead_at = case when q.attempts + 1 >= %s then now() end"
                " from unnest(%s::text[], %s::float8[], %s::text[]) as f(item, delay, err)"
                " where q.job = %s and q.key = f.item::jsonb"
            ).format(self.queue)
        )

    def _classify_ctes(self, keys: sql.Composable, carry: tuple[str, ...] = ()) -> sql.Composed:
        """CTEs ``k`` (the jsonb ``item`` of ``keys``, typed), ``p<n>`` (the item
        parents, locked ``FOR KEY SHARE SKIP LOCKED``) and ``s`` (item, locked,
        present): an item is locked when all its parents are, gone when one of
        them does not exist. Membership tests are ``IN (subquery)``, which
        PostgreSQL hashes: a join between CTEs (no statistics) would be a
        nested loop, quadratic in the batch size."""
        ctes = [
            sql.SQL(
                "k as materialized (select i.item{}, t.* from {} as i, lateral {} as t)"
            ).format(
                sql.SQL("").join(sql.SQL(", ") + sql.Identifier("i", c) for c in carry),
                keys,
                self.typed,
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
                    " where ({pcols}) in (select {ccols} from k) order by {pcols}"
                    " for key share of p skip locked)"
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
            sql.SQL(
                "s as materialized (select k.item{}, {} as locked, {} as present from k)"
            ).format(
                sql.SQL("").join(sql.SQL(", ") + sql.Identifier("k", c) for c in carry),
                sql.SQL(" and ").join(locked),
                sql.SQL(" and ").join(present),
            )
        )
        return sql.SQL(", ").join(ctes)

    def _sample_sql(
        self, schema: str, *, before: int, nulls: sql.Composable | None = None
    ) -> sql.Composed:
        """The claim's first row: the cursor's sample (pgjobs/worker/cursor.py),
        in the claim's own statement, a statement saved on each tick: nulls
        for the ``before`` columns before ``seq``, then the sequence's value
        as ``seq``, :data:`SAMPLE` as ``path``, nulls for the read count and
        the ``ctid``, then the server's start and the xids running (nulls
        there in the other rows)."""
        last, running = sample_sql(schema)
        return sql.SQL(
            "select {gap}l.v, {path}, null, null, l.server, {running}{nulls} from {last}"
        ).format(
            gap=sql.SQL("null, " * before),
            path=sql.Literal(SAMPLE),
            running=running,
            nulls=nulls or sql.SQL(""),
            last=last,
        )

    def _claim_sql(self, schema: str, *, load: bool, keyed: bool = False) -> sql.Composed:
        """One statement: the due items (no lock), their parents ``FOR KEY
        SHARE SKIP LOCKED``, then the entries of the items whose parents are
        locked or gone ``FOR UPDATE SKIP LOCKED``. Parents before entries, the
        order of a user who changes a parent and then enqueues it, and neither
        lock ever waited for: an item whose parent a user holds is not claimed
        at all, so that user's enqueue never waits for the worker.

        Rows: the cursor's sample first (:meth:`_sample_sql`), then (item,
        attempts, gone, claimed, seconds since its enqueue) for claimed
        entries, then (item, null, false, false, null) for deferred items;
        ``keyed``: each with the item's typed scope values after them (nulls
        for deferred items), claimed items first in key order (the sample's
        ``claimed`` is null: first in that order too)."""
        nulls = sql.SQL(", (null::pg_temp.{}).*").format(self.keys_table) if keyed else sql.SQL("")
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
            " c as materialized (select e.key, e.attempts, e.enqueued_at, e.ctid, s.pgjobs_seq,"
            " s.pgjobs_path from s, lateral ({lock}) as e"
            " where (s.locked or not s.present) and e.dead_at is null"
            " and e.not_before <= now()){load} {sample}"
            " union all select c.key::text, c.attempts,"
            " c.key in (select item from s where not present),"
            " true, extract(epoch from clock_timestamp() - c.enqueued_at)::float8,"
            " c.pgjobs_seq, c.pgjobs_path, {read}, c.ctid::text, null, null{keyed} from c{typed}"
            " union all select s.item::text, null, false, false, null, s.pgjobs_seq, s.pgjobs_path,"
            " {read}, null, null, null{nulls} from s"
            " where s.present and not s.locked"
            # entries read but not taken: held by another transaction (or
            # failed by a worker beside this one since "due" read them), and,
            # with workers > 1, the candidates whose item lock another has
            " union all select null, null, false, false, null, d.pgjobs_seq, d.pgjobs_path,"
            " {read}, null, null, null{nulls} from {unread} as d"
            " where d.item not in (select key from c)"
            " and d.item not in (select item from s where s.present and not s.locked){order}"
        ).format(
            sample=self._sample_sql(schema, before=SEQ_AT, nulls=nulls),
            due=self._due_sql(),
            lock=self._lock_sql("s.pgjobs_ctid", "s.item"),
            classify=self._classify_ctes(sql.SQL("due"), _CARRY),
            load=self._load_sql() if load else sql.SQL(""),
            read=self._read_sql(),
            unread=self._unread_sql(),
            # keyed: each claimed item's key as the keys table types it, the
            # rows in the keys table's order (what the keys' select returned)
            keyed=sql.SQL(", t.*") if keyed else sql.SQL(""),
            typed=sql.SQL(", lateral {} as t").format(self._typed_of("c.key"))
            if keyed
            else sql.SQL(""),
            nulls=nulls,
            order=sql.SQL(" order by 4 desc, {}").format(
                sql.SQL(", ").join(
                    sql.SQL(str(KEYED_AT + 1 + n)) for n in range(len(self.job.scope))
                )
            )
            if keyed
            else sql.SQL(""),
        )

    def _typed_of(self, item: str) -> sql.Composed:
        """:attr:`typed` of the jsonb expression ``item`` instead of ``i.item``."""
        return sql.SQL("jsonb_populate_record(null::pg_temp.{}, jsonb_build_object({}))").format(
            self.keys_table,
            sql.SQL(", ").join(
                sql.SQL("{}, ({})::jsonb -> {}").format(
                    sql.Literal(c), sql.SQL(item), sql.Literal(n)
                )
                for n, c in enumerate(self.job.scope)
            ),
        )

    def _due_sql(self) -> sql.Composed:
        """The CTE ``due``: up to ``batch_size`` due items (``item``, and
        the entry's ``pgjobs_seq`` and ``pgjobs_path``), read without a lock, from
        three places (pgjobs/worker/cursor.py): entries waiting for a retry
        whose time has come (``pgjobs_path`` 1, their own index); entries read
        before and not taken, by their number (2, ``%(recheck)s``: one probe
        a number, driven from the array by a subquery behind ``OFFSET 0``,
        which the planner may not pull up. ``seq = any(...)``, and then a
        plain join with the array, were both kept, in a generic plan, as a
        walk of the job's whole index, however short the array: 10-20 ms a
        claim after 100 s of a held horizon); then
        entries numbered past the cursor (0, ``%(low)s``), in number order.

        A job with several workers takes different items in each: of the
        first 4 x batch_size entries, the first batch_size whose item
        advisory lock (two ints: apart from the group locks' bigints) this
        transaction gets without waiting; the scan stops at the last one
        taken. A row lock could not do it: ``FOR NO KEY UPDATE`` would make
        a user's enqueue wait, and ``FOR KEY SHARE`` keeps another worker's
        ``FOR UPDATE SKIP LOCKED`` off the rows while its own is kept off
        the same way (both claimed nothing). One lock per item, so only
        with ``workers`` > 1 (``workers x batch_size`` is bounded for it)."""
        read = sql.SQL(
            "select item, pgjobs_seq, pgjobs_path, pgjobs_ctid from ("
            "(select key as item, seq as pgjobs_seq, 1 as pgjobs_path, ctid as pgjobs_ctid from {q}"
            " where job = %(job)s and dead_at is null and attempts > 0 and not_before <= now()"
            " order by not_before limit %(n)s)"
            " union all (select e.key, e.seq, 2, e.ctid from unnest(%(recheck)s::bigint[]) as r(seq),"
            " lateral (select key, seq, ctid from {q} where job = %(job)s and seq = r.seq"
            " and dead_at is null and attempts = 0 offset 0) as e)"
            " union all (select key, seq, 0, ctid from {q} where job = %(job)s"
            " and dead_at is null and attempts = 0 and seq > %(low)s"
            " and seq <> all(%(recheck)s::bigint[]) order by seq limit {limit})) as u"
            " limit {limit}"
        )
        if self.job.workers == 1:
            return sql.SQL("due as materialized ({})").format(
                read.format(q=self.queue, limit=sql.SQL("%(n)s"))
            )
        return sql.SQL(
            "candidates as materialized ({}),"
            " due as materialized (select item, pgjobs_seq, pgjobs_path, pgjobs_ctid from candidates"
            " where pg_try_advisory_xact_lock(hashtext(%(job)s), hashtext(item::text))"
            " limit %(n)s)"
        ).format(read.format(q=self.queue, limit=sql.SQL("4 * %(n)s")))

    def _lock_sql(self, ctid: str, item: str) -> sql.Composed:
        """The entry a due item's row was read from, locked ``FOR UPDATE SKIP
        LOCKED``: by its ``ctid`` (a TID scan: that one version, where a
        probe of the primary key walks every version of the key that a held
        horizon keeps, 0.066 ms an item after 130 s at 800 keys/s, most of
        the claim's time). An entry changed since "due" read it (failed by
        a worker beside this one, revived) is followed to its new version
        by the lock, which no longer has that ``ctid``: not taken, read
        again by the cursor. ``dead_at`` and ``not_before`` are tested on
        the row locked, outside (behind OFFSET 0)."""
        return sql.SQL(
            "select q.key, q.attempts, q.enqueued_at, q.dead_at, q.not_before, q.ctid"
            " from {q} as q where q.ctid = {ctid} and q.job = %(job)s and q.key = {item}"
            " offset 0 for update of q skip locked"
        ).format(q=self.queue, ctid=sql.SQL(ctid), item=sql.SQL(item))

    def _read_sql(self) -> sql.Composable:
        """How many entries the claim read (``due``, or its ``candidates``
        with workers > 1): fewer than it could take, and it read them all."""
        if self.job.workers == 1:
            return sql.SQL("(select count(*) from due)")
        # (all the candidates were tried only when fewer than n were taken)
        return sql.SQL(
            "(select case when count(*) < %(n)s then (select count(*) from candidates)"
            " else 4 * %(n)s end from due)"
        )

    def _unread_sql(self) -> sql.Composable:
        """The entries read, as rows of ``due``'s shape: ``due``, and with
        workers > 1 the candidates whose item lock was tried and taken by
        another (those past the last one taken were not tried)."""
        if self.job.workers == 1:
            return sql.SQL("due")
        return sql.SQL(
            "(select * from due union all select * from candidates"
            " where item not in (select item from due) and ((select count(*) from due) < %(n)s"
            " or pgjobs_seq < (select max(pgjobs_seq) from due where pgjobs_path = 0) or pgjobs_path <> 0))"
        )

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


_cache_lock = threading.Lock()
#: (id(job), schema, id(target)) -> (job, target, statements): the job and
#: target kept, so that their ids cannot be reused while cached
_cache: dict[tuple[int, str, int], tuple[QueueJob, Target, Statements]] = {}
_CACHE_SIZE = 256


def statements_for(job: QueueJob, schema: str, target: Target) -> Statements:
    """``job``'s statements for ``target`` (reflected), composed on first use."""
    key = (id(job), schema, id(target))
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None and hit[0] is job and hit[1] is target:
        return hit[2]
    made = Statements(job, schema, target)
    with _cache_lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[key] = (job, target, made)
    return made


__all__ = [
    "KEYED_AT",
    "KEYS_TABLE",
    "SEQ_AT",
    "ItemParent",
    "Statements",
    "frozen",
    "item_parents",
    "statements_for",
]
