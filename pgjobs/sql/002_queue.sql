-- pgjobs-migration: additive
-- The built-in queue of QueueJob items. {schema} is composed with psycopg.sql.Identifier.

create table {schema}.queue (
    job          text not null,
    -- the item's scope values as a JSON array in the job's scope order: [42] or [7, "b"]
    key          jsonb not null,
    -- the first enqueue since the item was last processed (the queue's age)
    enqueued_at  timestamptz not null default now(),
    -- failed attempts so far; the item is parked (dead_at) after the job's max_attempts
    attempts     integer not null default 0,
    not_before   timestamptz not null default now(),
    last_error   text,
    -- parked items stay here, visible in queue_stats, until enqueued again
    dead_at      timestamptz,
    primary key (job, key)
);

-- has_pending: one index probe per job for a due, live item, however many
-- items wait for a retry. The claim reads due items in key order through the
-- primary key (job, key) once the table has statistics.
create index queue_due_idx on {schema}.queue (job, not_before) where dead_at is null;

-- The one definition of "enqueue", used by pgjobs.enqueue() and by the trigger.
-- An item already pending is locked by the caller's transaction (ON CONFLICT DO
-- UPDATE locks the row even when its WHERE is false, without writing a new
-- version): a worker claims with SKIP LOCKED, so it cannot consume the entry
-- while the caller's change is uncommitted. DO NOTHING would take no lock, and
-- the worker could read the old data and delete the entry: a lost update.
-- A parked (dead) item is revived: the data it depends on has changed.
-- Keys are inserted in key order, so two transactions enqueueing overlapping
-- sets lock them in the same order.
create function {schema}.enqueue(p_job text, p_keys jsonb) returns integer
language sql volatile as $$
    with added as (
        insert into {schema}.queue as q (job, key)
        select p_job, k
        from (select distinct e.k from jsonb_array_elements(p_keys) as e(k)) as d
        order by k
        on conflict (job, key) do update
            set attempts = 0, not_before = excluded.not_before, last_error = null,
                dead_at = null, enqueued_at = excluded.enqueued_at
            where q.dead_at is not null
        returning 1
    )
    select count(*)::integer from added
$$;

-- Statement-level trigger function installed by pgjobs.install_enqueue_trigger():
-- tg_argv[0] is the job, tg_argv[1..] the table's columns that form the key.
-- Rows whose key has a null are skipped (a null key names no item).
create function {schema}.enqueue_trigger() returns trigger
language plpgsql as $$
declare
    cols text[] := tg_argv[1:tg_nargs - 1];
    found_keys jsonb := '[]';
begin
    if tg_op in ('INSERT', 'UPDATE') then
        select found_keys || coalesce(jsonb_agg(s.k), '[]') into found_keys
        from (
            select (select jsonb_agg(to_jsonb(r) -> u.c order by u.o)
                    from unnest(cols) with ordinality as u(c, o)) as k
            from new_rows as r
        ) as s
        where not s.k @> '[null]';
    end if;
    if tg_op in ('DELETE', 'UPDATE') then
        select found_keys || coalesce(jsonb_agg(s.k), '[]') into found_keys
        from (
            select (select jsonb_agg(to_jsonb(r) -> u.c order by u.o)
                    from unnest(cols) with ordinality as u(c, o)) as k
            from old_rows as r
        ) as s
        where not s.k @> '[null]';
    end if;
    if jsonb_array_length(found_keys) > 0 then
        perform {schema}.enqueue(tg_argv[0], found_keys);
    end if;
    return null;
end
$$;
