-- pgjobs-migration: additive
-- Ticks that change nothing (idle, busy, not due, backing off) are counted
-- here instead of each writing a row to the run log: with wake-ups reaching
-- every replica, each enqueue would otherwise log one such row per replica.
-- The counts are cumulative; last_quiet_* say what the latest such tick was.
alter table {schema}.job_state
    add column idle_ticks         bigint not null default 0,
    add column busy_ticks         bigint not null default 0,
    add column not_due_ticks      bigint not null default 0,
    add column backing_off_ticks  bigint not null default 0,
    add column last_quiet_at      timestamptz,
    add column last_quiet_outcome text;
