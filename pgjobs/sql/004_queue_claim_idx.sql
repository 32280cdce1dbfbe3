-- pgjobs-migration: additive
-- The claim reads up to batch_size due items in key order. Through
-- queue_due_idx that means reading and sorting every due entry of the job;
-- this index serves the key order, so the claim stops after batch_size
-- entries (not-yet-due entries are filtered on the way). With no statistics
-- (a queue that filled since the last ANALYZE), both indexes look equally
-- cheap and the planner takes the one that needs no sort: this one.
create index queue_claim_idx on {schema}.queue (job, key) where dead_at is null;
