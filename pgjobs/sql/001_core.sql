-- pgjobs-migration: additive
-- pgjobs' own tables. {schema} is composed with psycopg.sql.Identifier.

create table {schema}.job_state (
    job              text primary key,
    -- the earliest time the job may run again: one interval after its last
    -- run, or now() + backoff after a failure. Every replica honours it.
    next_attempt_at  timestamptz,
    failures         integer not null default 0,
    last_started_at  timestamptz,
    last_success_at  timestamptz,
    last_failure_at  timestamptz,
    last_error       text,
    last_sqlstate    text,
    updated_at       timestamptz not null default now()
);

create table {schema}.run (
    id                      bigserial primary key,
    job                     text not null,
    outcome                 text not null
        check (outcome in ('ran', 'idle', 'busy', 'backing_off', 'not_due', 'failed')),
    started_at              timestamptz not null,
    finished_at             timestamptz not null,
    compute_ms              double precision,
    write_ms                double precision,
    lock_ms                 double precision,
    inserted                bigint not null default 0,
    updated                 bigint not null default 0,
    deleted                 bigint not null default 0,
    skipped_missing_parent  bigint not null default 0,
    unchanged               bigint not null default 0,
    items                   integer not null default 0,
    failed_items            integer not null default 0,
    error                   text,
    sqlstate                text,
    worker                  text
);

create index run_job_started_idx on {schema}.run (job, started_at desc);
create index run_started_idx on {schema}.run (started_at);
