-- pgjobs-migration: additive
-- The outcomes of this release beside those of 001: a run cut off because
-- its connection or server went away ('interrupted', not the job's failure),
-- a tick of a paused job ('paused'), a run cancelled by a shutdown deadline
-- ('cancelled'), and a verification that wrote nothing ('checked'). Older
-- code never writes them: it keeps working beside this change.
alter table {schema}.run drop constraint run_outcome_check;
alter table {schema}.run add constraint run_outcome_check check (outcome in (
    'ran', 'idle', 'busy', 'backing_off', 'not_due', 'failed',
    'interrupted', 'paused', 'cancelled', 'checked'
));
