-- pgjobs-migration: additive
-- Derived tables declared once ([derived.NAME], pgjobs.derived): the
-- statement-level triggers pgjobs puts on every source call this function.
--
-- tg_argv[0]: the queue job; tg_argv[1]: the search_path the declaration's
-- SQL is read under (fixed at install: pg_catalog first, pg_temp last);
-- tg_argv[2]: a statement, composed by pgjobs.derived at install, that
-- reads the statement's transition tables (new_rows, old_rows; bound to the
-- source's name for a mapping SQL) and answers one jsonb array of keys.
-- The keys go to <schema>.enqueue, the one function every enqueue uses:
-- one upsert per statement, in the writer's transaction.
--
-- SECURITY DEFINER, so that an application role with privileges on its own
-- tables only (no USAGE on this schema, no right on the queue) can still
-- write to every source. No role gains anything else through it: its
-- search_path is pinned; a trigger function cannot be called directly; and
-- EXECUTE is revoked from PUBLIC, and CREATE TRIGGER is where PostgreSQL
-- checks it, so only its owner can attach it to a table with a statement of
-- their choosing.
create function {schema}.derived_trigger() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    found_keys jsonb;
begin
    perform pg_catalog.set_config('search_path', tg_argv[1], true);
    execute tg_argv[2] into found_keys;
    perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    if found_keys is null or pg_catalog.jsonb_array_length(found_keys) = 0 then
        return null;
    end if;
    if {schema}.enqueue(tg_argv[0], found_keys) = 0 then
        -- Every key was pending already, so enqueue notified nobody. But a
        -- worker may have claimed while this transaction held one of those
        -- entries (the upsert locks it) and skipped it: wake the workers at
        -- this commit, or the entry waits for the next wake-up (5 to 20 s
        -- under derived_bench's users). Notifications of one transaction to
        -- one channel are sent once.
        perform pg_catalog.pg_notify({schema}.channel(tg_argv[0]), '');
    end if;
    return null;
end
$$;

revoke all on function {schema}.derived_trigger() from public;
