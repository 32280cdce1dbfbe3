-- pgjobs-migration: additive
-- Flow (docs/DESIGN.md, "Flow"): a queue worker records, in its own
-- transaction, the transaction id under which it rewrote each scope key of
-- a target. A recompute that computed without the write lock drops from its
-- difference the keys whose mark is not visible in the snapshot it took at
-- its start, then prunes the marks that snapshot covers.
-- key: the scope values as jsonb_build_array of the typed values.
create table {schema}.mark (
    target  text not null,
    key     jsonb not null,
    xid     xid8 not null,
    primary key (target, key)
);
