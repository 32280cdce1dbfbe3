-- pgjobs-migration: additive
-- Flow in any process layout (docs/flow.md): each queue job records here,
-- per server session, what a recompute of its target must know to run with
-- flow beside it: its group and lock namespace (whose write lock it takes),
-- its scope columns (what its marks are keyed by) and whether it has flow on
-- (marks at all). A scheduler records its queue jobs when it starts, and
-- renews them while it runs; a tick renews its job's record, in its own
-- transaction, when no record of the same kind is fresh. A recompute reads
-- the records at its start (in the statement that takes its snapshot S0)
-- and again before each chunk's writes (those whose xid S0 does not see),
-- and runs with flow only when every live record agrees with it.
-- One row per kind of worker and server session (backend): two sessions
-- never write one row, so that no tick waits for another's record.
-- Older code neither reads nor writes this table.
create table {schema}.flow_worker (
    target    text not null,     -- the target, schema.table (as in mark)
    job       text not null,     -- the queue job's name
    grp       text not null,     -- its group: the write lock is <namespace>:<grp>
    namespace text not null,     -- its advisory-lock namespace
    scope     text[] not null,   -- its scope columns, in order (its marks' key)
    flow      boolean not null,  -- it marks, and shares the write lock
    backend   integer not null,  -- pg_backend_pid() of the session that wrote the row
    worker    text not null,     -- host:pid of the process, for people reading
    seen_at   timestamptz not null,  -- last renewed (the server's clock)
    xid       xid8 not null,     -- the transaction that last renewed it
    primary key (target, job, grp, namespace, scope, flow, backend)
);
