"""The group lock: a transaction-level advisory lock taken without waiting.

Every job of a group runs under
``pg_try_advisory_xact_lock(hashtextextended('<namespace>:<group>', 0))``.
The loser of a race does not queue behind the winner (that is how a
periodic recompute used to wait minutes, or deadlock); it returns ``busy``
at once and tries again at its next tick. The lock lives as long as the
job's transaction: commit, rollback or a dead client releases it.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

DEFAULT_NAMESPACE = "pgjobs"

#: the group lock for the job's transaction, on the driver connection (``%s``:
#: :func:`lock_name`), sent in the runner's pipeline; never waits
TRY_XACT_SQL = "select pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
_TRY_SESSION = text(
    "select case when pg_try_advisory_lock(hashtextextended(:key, 0)) then pg_backend_pid() end"
)
_UNLOCK_SESSION = text("select pg_advisory_unlock(hashtextextended(:key, 0))")


def lock_name(namespace: str, group: str) -> str:
    """The text hashed into the lock key: ``'<namespace>:<group>'``."""
    return f"{namespace}:{group}"


def try_session_lock(conn: Connection, namespace: str, group: str) -> int | None:
    """The same lock at session level, held across commits by chunked writes:
    the server process holding it (``pg_backend_pid()``), or ``None`` when
    another session has it."""
    pid = conn.execute(_TRY_SESSION, {"key": lock_name(namespace, group)}).scalar_one()
    return None if pid is None else int(pid)


def release_session_lock(conn: Connection, namespace: str, group: str) -> None:
    conn.execute(_UNLOCK_SESSION, {"key": lock_name(namespace, group)})
