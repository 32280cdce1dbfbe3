"""pgjobs-example: a first-party pgjobs plugin.

It registers ``example-expire-sessions``, a :class:`pgjobs.TaskJob` that
deletes expired rows of ``example_session``:

* ``has_work`` asks whether any row has expired, before any lock is taken,
  so an empty pass never makes another job lose its group lock;
* the delete takes rows ``FOR UPDATE SKIP LOCKED``: a session a user's
  transaction holds is left for the next run instead of waited on;
* at most :data:`BATCH` rows per run, so that no run holds many row locks
  for long; the next tick (has_work still true) takes the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import Connection

import pgjobs

#: rows deleted per run at most
BATCH = 10_000

#: the table the job cleans; create it with :func:`install` or a migration of yours
DDL = (
    "create table if not exists example_session ("
    " id bigint generated always as identity primary key,"
    " user_name text not null,"
    " expires_at timestamptz not null)",
    "create index if not exists example_session_expires_at_idx on example_session (expires_at)",
)

_HAS_EXPIRED = text("select exists (select from example_session where expires_at < now())")
_DELETE_EXPIRED = text(
    "delete from example_session where id in ("
    " select id from example_session where expires_at < now()"
    " order by id limit :batch for update skip locked)"
)


def install(conn: Connection) -> None:
    """Create ``example_session`` (inside the caller's transaction)."""
    for statement in DDL:
        conn.execute(text(statement))


def has_expired(conn: Connection) -> bool:
    """Is there anything to delete? Asked before the group lock is taken."""
    return bool(conn.execute(_HAS_EXPIRED).scalar())


def expire_sessions(conn: Connection) -> pgjobs.DiffStats:
    """Delete up to :data:`BATCH` expired sessions nobody holds locked."""
    deleted = conn.execute(_DELETE_EXPIRED, {"batch": BATCH}).rowcount
    return pgjobs.DiffStats(deleted=deleted)


JOB = pgjobs.TaskJob(
    name="example-expire-sessions",
    group="example-session",
    every="5m",
    has_work=has_expired,
    run=expire_sessions,
    backoff="10m",
    lock_timeout="2s",
    description="Delete expired rows of example_session, skipping rows that are locked.",
)


@pgjobs.hookimpl
def pgjobs_register_jobs(register: Callable[[pgjobs.Job], None]) -> None:
    """Register :data:`JOB` with pgjobs."""
    register(JOB)
