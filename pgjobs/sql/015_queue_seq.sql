-- pgjobs-migration: additive
-- The queue when vacuum is held back (docs/DESIGN.md, "The queue under a
-- held horizon"; docs/long-transactions.md).
--
-- A processed entry is deleted, but while any snapshot older than the
-- delete is open (a report, pg_dump, an idle transaction) its index entries
-- stay, and every scan that starts at the low end of an index walks them
-- all: the claim in key order, the work check in not_before order. After
-- 120 s of a held horizon at 800 keys/s they cost 36-68 ms a tick instead of
-- 0.1-0.2 ms, and a 600 s hold stalled the worker.
--
-- Each pending entry gets a number from one sequence when it becomes
-- pending (enqueued, or revived); a worker claims in that order from a
-- cursor that it keeps, past which every entry it already dealt with lies
-- behind it: its scans start where the live entries are, whatever the dead
-- ones below (pgjobs/worker/cursor.py says when the cursor may move on).
-- Entries waiting for a retry after a failure leave that order (attempts >
-- 0) and are found by the retry index, which holds only those.
--
-- Older code runs on beside it: it claims in key order through the primary
-- key and checks for work without queue_due_idx (slower, the same results);
-- entries it enqueues get their number from the enqueue function below.
-- An entry an older `pgjobs revive` makes due keeps its old number: newer
-- workers find it at their next full pass (at most QUEUE_RESCAN apart).
create sequence {schema}.queue_seq as bigint;

alter table {schema}.queue add column seq bigint;

-- The entries already queued, numbered in key order (the order they were
-- claimed in until now).
update {schema}.queue as q set seq = n.seq
from (select job, key, row_number() over (order by job, key) as seq from {schema}.queue) as n
where q.job = n.job and q.key = n.key;
select setval(format('%I.queue_seq', {schema_name})::regclass, count(*) + 1, false)
from {schema}.queue;

-- A number is always drawn by a transaction that has its xid already, so
-- that a worker can tell, from two snapshots, that every transaction which
-- drew a number up to some value has ended (pgjobs/worker/cursor.py).
create function {schema}.queue_seq() returns bigint
language plpgsql volatile as $$
begin
    perform pg_catalog.pg_current_xact_id();
    return pg_catalog.nextval(pg_catalog.format('%I.queue_seq', {schema_name})::regclass);
end
$$;

alter table {schema}.queue alter column seq set default {schema}.queue_seq();
alter table {schema}.queue alter column seq set not null;

-- The claim and the work check of entries not failed yet, in number order.
create index queue_seq_idx on {schema}.queue (job, seq) where dead_at is null and attempts = 0;
-- Entries waiting for a retry after a failure (few, whatever the horizon).
create index queue_retry_idx on {schema}.queue (job, not_before)
    where dead_at is null and attempts > 0;

-- The key order's indexes: every processed entry stayed in them while the
-- horizon was held. Older code finds its entries through the primary key.
drop index {schema}.queue_claim_idx;
drop index {schema}.queue_due_idx;

-- The enqueue of 008, with its number: the caller's xid first (see
-- queue_seq), then one nextval per key, in key order. A revived (dead)
-- entry gets a new number; a pending one keeps its own (it is locked, not
-- written: the lock is what keeps a worker off it until the commit).
create or replace function {schema}.enqueue(p_job text, p_keys jsonb) returns integer
language plpgsql volatile as $$
declare
    n integer;
    numbers regclass := pg_catalog.format('%I.queue_seq', {schema_name})::regclass;
begin
    perform pg_catalog.pg_current_xact_id();
    with added as (
        insert into {schema}.queue as q (job, key, seq)
        select p_job, k, nextval(numbers)
        from (select distinct e.k from jsonb_array_elements(p_keys) as e(k) order by 1) as d
        on conflict (job, key) do update
            set attempts = 0, not_before = excluded.not_before, last_error = null,
                dead_at = null, enqueued_at = excluded.enqueued_at, seq = excluded.seq
            where q.dead_at is not null
        returning 1
    )
    select count(*)::integer into n from added;
    -- an entry that was pending already wakes nobody: it is on its way
    if n > 0 then
        perform pg_notify({schema}.channel(p_job), '');
    end if;
    return n;
end
$$;
