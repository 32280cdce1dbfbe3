"""The group lock: a transaction-level advisory lock taken without waiting.

Every job of a group runs under
``pg_try_advisory_xact_lock(hashtextextended('<namespace>:<group>', 0))``.
The loser of a race does not queue behind the winner (that is how a
periodic recompute used to wait minutes, or deadlock); it returns ``busy``
at once and tries again at its next tick. The lock lives as long as the
job's transaction: commit, rollback or a dead client releases it.

Under flow (``docs/DESIGN.md``, "Flow") a group has a write lock that queue
workers share and a recompute takes exclusively for an instant and for
each chunk; the workers wait for it, at most a couple of seconds, before
they hold anything, so that they get in between two chunks.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

DEFAULT_NAMESPACE = "pgjobs"

#: the group lock for the job's transaction, on the driver connection (``%s``:
#: :func:`lock_name`), sent in the runner's pipeline; never waits
TRY_XACT_SQL = "select pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
#: the group's write lock, shared among queue workers (flow); never waits
TRY_XACT_SHARED_SQL = "select pg_try_advisory_xact_lock_shared(hashtextextended(%s, 0))"
#: ... and what a flow worker takes: waited for, briefly (FLOW_WAIT), behind a
#: recompute that writes a chunk, so that it gets in between two chunks
WAIT_XACT_SHARED_SQL = "select true from pg_advisory_xact_lock_shared(hashtextextended(%s, 0))"
#: ... with ``lock_timeout`` set first, in the same statement: a CASE evaluates
#: its WHEN before its THEN, and the lock's subquery only when THEN needs it
WAIT_XACT_SHARED_WITHIN_SQL = (
    "select case when set_config('lock_timeout', %s, true) is not null then"
    " (select true from pg_advisory_xact_lock_shared(hashtextextended(%s, 0))) end"
)
#: two locks, both or none (a recompute that does not flow: its own and the group's)
TRY_XACT_BOTH_SQL = (
    "select pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
    " and pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
)
#: a flow recompute's exclusive write lock: waited for, under lock_timeout
#: (workers step aside for it: a shared try-lock fails while it waits)
WAIT_XACT_SQL = "select pg_advisory_xact_lock(hashtextextended(%s, 0))"
WAIT_SESSION_SQL = "select pg_advisory_lock(hashtextextended(%s, 0))"
UNLOCK_SESSION_SQL = "select pg_advisory_unlock(hashtextextended(%s, 0))"
_TRY_SESSION = text(
    "select case when pg_try_advisory_lock(hashtextextended(:key, 0)) then pg_backend_pid() end"
)
_UNLOCK_SESSION = text("select pg_advisory_unlock(hashtextextended(:key, 0))")
_TRY_SESSION_SHARED = text(
    "select case when pg_try_advisory_lock_shared(hashtextextended(:key, 0))"
    " then pg_backend_pid() end"
)
_UNLOCK_SESSION_SHARED = text("select pg_advisory_unlock_shared(hashtextextended(:key, 0))")


def lock_name(namespace: str, group: str) -> str:
    """The text hashed into the lock key: ``'<namespace>:<group>'``."""
    return f"{namespace}:{group}"


def recompute_lock_name(namespace: str, group: str) -> str:
    """The lock recomputes of a group serialize on: ``'<namespace>:<group>:recompute'``."""
    return f"{namespace}:{group}:recompute"


def verify_lock_name(namespace: str, group: str) -> str:
    """The lock a scheduled verification (``verify_every``) of ``group``
    holds at session level while it checks: replicas take turns, never the
    full check at once."""
    return f"{lock_name(namespace, group)}:verify"


def try_session_lock(conn: Connection, name: str, *, shared: bool = False) -> int | None:
    """The lock ``name`` (see :func:`lock_name`) at session level, held across
    commits by chunked writes (``shared``: in share mode, a sliced run's):
    the server process holding it (``pg_backend_pid()``), or ``None`` when
    another session has it."""
    pid = conn.execute(_TRY_SESSION_SHARED if shared else _TRY_SESSION, {"key": name}).scalar_one()
    return None if pid is None else int(pid)


def release_session_lock(conn: Connection, name: str, *, shared: bool = False) -> None:
    conn.execute(_UNLOCK_SESSION_SHARED if shared else _UNLOCK_SESSION, {"key": name})


__all__ = [
    "DEFAULT_NAMESPACE",
    "TRY_XACT_BOTH_SQL",
    "TRY_XACT_SHARED_SQL",
    "TRY_XACT_SQL",
    "UNLOCK_SESSION_SQL",
    "WAIT_SESSION_SQL",
    "WAIT_XACT_SHARED_SQL",
    "WAIT_XACT_SHARED_WITHIN_SQL",
    "WAIT_XACT_SQL",
    "lock_name",
    "recompute_lock_name",
    "release_session_lock",
    "try_session_lock",
    "verify_lock_name",
]
