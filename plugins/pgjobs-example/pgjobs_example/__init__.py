"""pgjobs-example: a first-party pgjobs plugin.

It registers ``example-expire-sessions``, a :class:`pgjobs.TaskJob` that
deletes expired rows of ``example_session``, and a derived table kept two
ways, as pgjobs is meant to be used: ``example_user_sessions`` (sessions per
user) maintained by a queue worker (:data:`COUNT_WORKER`, fed by an enqueue
trigger on ``example_session``) and recomputed now and then
(:data:`RECOUNT`). The plugin's tests assert with
:func:`pgjobs.testing.assert_no_drift` that both paths agree.

The expiry job:

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


# -- a derived table, kept by a queue worker and by a recompute --------------------------
COUNTS_DDL = (
    "create table if not exists example_user_sessions ("
    " user_name text primary key,"
    " sessions integer not null,"
    " last_expires_at timestamptz not null)",
    # when the worker last rewrote each user's row (its ``after`` callback)
    "create table if not exists example_user_refresh ("
    " user_name text primary key,"
    " refreshed_at timestamptz not null)",
)

#: the full computation (the recompute's), and the same for some users (the worker's)
COUNTS = (
    "select user_name, count(*)::int as sessions, max(expires_at) as last_expires_at"
    " from example_session group by user_name"
)
COUNTS_FOR_USERS = (
    "select user_name, count(*)::int as sessions, max(expires_at) as last_expires_at"
    " from example_session where user_name = any(:keys) group by user_name"
)

_MARK_REFRESHED = text(
    "insert into example_user_refresh (user_name, refreshed_at)"
    " select user_name, now() from unnest(cast(:users as text[])) as u(user_name)"
    " on conflict (user_name) do update set refreshed_at = excluded.refreshed_at"
)


def mark_refreshed(conn: Connection, keys: list[tuple[str]], stats: pgjobs.DiffStats) -> None:
    """The worker's ``after``: in the batch's transaction, once its rows are
    written, record when each user's row was rewritten.

    ``keys`` holds one tuple per item, the scope's values: ``[("u1",),
    ("u2",)]``. Bind the user names, not the tuples (a list of tuples is
    bound as records, which a ``text`` column refuses); sorted, so that
    batches upsert in one order."""
    users = sorted(user_name for (user_name,) in keys)
    conn.execute(_MARK_REFRESHED, {"users": users})


COUNT_WORKER = pgjobs.QueueJob(
    name="example-user-sessions",
    group="example-user-sessions",
    target="example_user_sessions",
    scope=("user_name",),
    compute=COUNTS_FOR_USERS,
    after=mark_refreshed,
    every="30s",
    description="Sessions per user, for the users whose sessions changed.",
)

RECOUNT = pgjobs.RecomputeJob(
    name="example-user-sessions-recount",
    group="example-user-sessions",
    target="example_user_sessions",
    compute=COUNTS,
    every="1h",
    verify_every="10m",
    description="Sessions per user, recomputed; checked for drift every 10 minutes.",
)


def install_counts(conn: Connection) -> None:
    """Create ``example_user_sessions`` and the trigger that enqueues the
    users whose sessions change (pgjobs' tables must be installed:
    :func:`pgjobs.install`)."""
    for statement in COUNTS_DDL:
        conn.execute(text(statement))
    pgjobs.install_enqueue_trigger(
        conn, table="example_session", job=COUNT_WORKER, columns=("user_name",)
    )


@pgjobs.hookimpl
def pgjobs_register_jobs(register: Callable[[pgjobs.Job], None]) -> None:
    """Register :data:`JOB`, :data:`COUNT_WORKER` and :data:`RECOUNT` with pgjobs."""
    register(JOB)
    register(COUNT_WORKER)
    register(RECOUNT)
