-- pgjobs-migration: additive
-- Wake on enqueue (docs/DESIGN.md, "The queue and its worker"): an enqueue
-- that adds or revives an entry notifies the job's channel in the caller's
-- transaction. PostgreSQL delivers it at commit (an enqueue that rolls back
-- wakes nobody), once per channel and transaction however many enqueues it
-- made. Schedulers LISTEN on the channels of their queue jobs.
--
-- The channel: "pgjobs_" and 20 hex digits of md5(<schema length>:<schema>
-- <job>), so that it is an identifier of any job's name, within 63 bytes,
-- and distinct per schema. pgjobs.queue.channel() computes the same name.
create function {schema}.channel(p_job text) returns text
language sql immutable as $$
    select 'pgjobs_' || left(md5(length({schema_name})::text || ':' || {schema_name} || p_job), 20)
$$;

create or replace function {schema}.enqueue(p_job text, p_keys jsonb) returns integer
language plpgsql volatile as $$
declare
    n integer;
begin
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
    select count(*)::integer into n from added;
    -- an entry that was pending already wakes nobody: it is on its way
    if n > 0 then
        perform pg_notify({schema}.channel(p_job), '');
    end if;
    return n;
end
$$;
