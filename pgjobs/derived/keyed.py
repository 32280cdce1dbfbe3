"""The queue job's keyed compute, derived from the declaration's one SQL text.

The text gives the whole table; the queue job needs the rows of a batch's
keys. The text is wrapped, never rewritten, by :func:`pgjobs.scoping.restrict`
(the sliced recompute's): ``select * from (<sql>) as pgjobs_q where
pgjobs_q.<scope> = any(array(select <scope> from pg_temp.pgjobs_keys))``,
the batch's keys read from the keys table the worker fills. PostgreSQL
pushes the condition down into the query, through its GROUP BY and a
window's PARTITION BY, when the scope columns are among their keys;
:func:`check_keyed` asks its plan (:func:`pgjobs.scoping.check_plan`) and
refuses a keyed compute that would compute every key.
"""

from __future__ import annotations

from psycopg import sql
from sqlalchemy.engine import Connection

from ..errors import ConfigError, ScopeError
from ..scoping import KeysTable, Restricted, check_plan, restrict

#: the table of a batch's keys (the worker's, ``pgjobs.worker``)
KEYS = KeysTable(table="pg_temp.pgjobs_keys")


def restricted(query: str, scope: tuple[str, ...]) -> Restricted:
    """``query`` restricted to the keys of a batch."""
    return restrict(query, scope, KEYS)


def keyed_sql(query: str, scope: tuple[str, ...]) -> str:
    """``query`` restricted to a batch's keys, as SQL text for a
    :class:`~pgjobs.QueueJob`'s compute."""
    statement: sql.Composed = restricted(query, scope).statement
    return statement.as_string(None)


def check_keyed(conn: Connection, query: str, scope: tuple[str, ...], *, where: str) -> None:
    """Refuse, naming ``where`` (the declaration's ``sql`` key), a keyed
    compute whose restriction does not reach the rows in its plan: each
    batch of a few keys would compute every key. Plans only, in the
    caller's transaction."""
    try:
        check_plan(conn, restricted(query, scope), job_name=where, scope=scope)
    except ScopeError as exc:
        raise ConfigError(
            f"{where}: the queue job's compute (this SQL restricted to a batch's keys) would"
            f" compute every key: {exc}"
        ) from None


__all__ = ["KEYS", "check_keyed", "keyed_sql", "restricted"]
