-- pgjobs-migration: additive
-- Operating pgjobs from the command line (docs/operate.md).
--
-- A paused job: `pgjobs pause JOB` sets paused_at, `pgjobs resume JOB`
-- clears it. The runner reads these columns with the job's state, in the
-- statement it sends anyway (step 1), so a pause costs no round trip; every
-- scheduler on the database honours it from its next tick. paused_ticks
-- counts the ticks a pause skipped, like the other *_ticks columns (005).
alter table {schema}.job_state
    add column paused_at      timestamptz,
    add column paused_reason  text,
    add column paused_by      text,
    add column paused_ticks   bigint not null default 0;

-- Each running scheduler's heartbeat: one upsert every heartbeat_ms. A row
-- whose last_seen is older than a few heartbeats is a scheduler gone quiet
-- (killed, frozen, cut off); a clean shutdown deletes its own row, and a
-- live scheduler deletes rows quiet for an hour.
create table {schema}.scheduler (
    id            text primary key,
    host          text not null,
    pid           integer not null,
    version       text not null,
    jobs          text[] not null,
    heartbeat_ms  integer not null,
    started_at    timestamptz not null,
    last_seen     timestamptz not null
);
