-- pgjobs-migration: additive
-- Sliced recomputes (docs/DESIGN.md, "Slices"; pgjobs/slices/): the run in
-- progress of each sliced job, and its pieces of the scope's key space.
-- A run is cut into pieces when it starts (along the keys of the scope's
-- parent table, or of the target); each slice, one short transaction, takes
-- a few consecutive pieces (FOR UPDATE SKIP LOCKED: several processes share
-- the run, none takes a piece twice), writes their keys' rows and marks the
-- pieces done in the same commit. A run cut off resumes from its pieces
-- still to do; the slice that does the last piece deletes the run's rows in
-- the commit that records the run. Older code neither reads nor writes them.
create table {schema}.slice_run (
    job          text primary key,          -- one sliced run per job at a time
    id           bigint generated always as identity,
    grp          text not null,             -- the job's group
    scope        text[] not null,           -- the scope columns the pieces cut
    pieces       integer not null,          -- how many pieces the run has
    done         integer not null default 0, -- pieces done
    slices       integer not null default 0, -- slices (transactions) that did them
    started_at   timestamptz not null,
    touched_at   timestamptz not null,      -- the last slice's commit (server clock)
    resumed      boolean not null default false, -- picked up after a tick gave it up
    inserted     bigint not null default 0,
    updated      bigint not null default 0,
    deleted      bigint not null default 0,
    skipped      bigint not null default 0, -- rows of parents gone
    unchanged    bigint not null default 0,
    excluded     bigint not null default 0, -- rows a queue worker rewrote (flow)
    deferred     bigint not null default 0, -- rows of busy parents, left to the next run
    compute_seconds double precision not null default 0,
    write_seconds   double precision not null default 0,
    lock_seconds    double precision not null default 0
);
create table {schema}.slice (
    job        text not null,
    run        bigint not null,               -- slice_run.id
    n          integer not null,              -- the piece's place in key order
    low        text[],                        -- first key (as text), null: open
    high       text[],                        -- key after the last, null: open
    state      text not null default 'todo' check (state in ('todo', 'done')),
    taken_by   text,                          -- host:pid of the process that did it
    done_at    timestamptz,
    rows       bigint,                        -- new rows computed for its keys
    seconds    double precision,              -- its share of its slice's time
    primary key (job, run, n)
);
