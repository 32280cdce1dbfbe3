-- pgjobs-migration: additive
-- The status read's "last check" (readmodel: each job's latest run with the
-- outcome 'checked', a drift check's record): one probe of this index a job.
-- Checks are rare among a job's runs, so without it the probe of
-- run_job_started_idx walks the job's run log back to its last check (at 2M
-- runs, seconds). Older code neither needs nor minds it. Built in the
-- migration's transaction (not concurrently): on a large run log it holds
-- the run table's SHARE lock (writes wait, reads do not) while it builds.
create index if not exists run_checked_idx on {schema}.run (job, started_at desc)
    where outcome = 'checked';
