-- pgjobs-migration: additive
-- A run rolled back by a lock timeout, a deadlock, a serialization failure,
-- an operator's cancel or a stale cached plan: 'transient', retried within
-- seconds without the job's backoff (docs/operate.md, "Transient failures").
-- Older code never writes it: it keeps working beside this change.
alter table {schema}.run drop constraint run_outcome_check;
alter table {schema}.run add constraint run_outcome_check check (outcome in (
    'ran', 'idle', 'busy', 'backing_off', 'not_due', 'failed',
    'interrupted', 'paused', 'cancelled', 'checked', 'transient'
));
