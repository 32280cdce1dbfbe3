-- pgjobs-migration: additive
-- What a job kind reports beyond DiffStats (rows deferred because a user held
-- their parent, queue items dropped because their parent is gone, ...).
alter table {schema}.run add column detail jsonb;
