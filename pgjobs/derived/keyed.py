"""The queue job's keyed compute, derived from the declaration's one SQL text.

The text gives the whole table; the queue job needs the rows of a batch's
keys. The text is wrapped, never rewritten: ``select * from (<sql>) q
where q.<scope> = any(:keys)`` (a scope of several columns: the batch's
keys table, ``pg_temp.pgjobs_keys``). PostgreSQL pushes the condition
down into the query, through its GROUP BY and into a window's PARTITION
BY, when the scope columns are among their keys.
"""

from __future__ import annotations

from psycopg import sql

#: the wrapped query's alias
_ALIAS = "pgjobs_derived"


def keyed_sql(query: str, scope: tuple[str, ...]) -> str:
    """``query`` restricted to a batch's keys, as SQL text for a
    :class:`~pgjobs.QueueJob`'s compute (``:keys`` for one scope column;
    the keys table for several)."""
    inner = sql.SQL(query)
    if len(scope) == 1:
        statement = sql.SQL("select * from ({}) as {} where {} = any(:keys)").format(
            inner, sql.Identifier(_ALIAS), sql.Identifier(_ALIAS, scope[0])
        )
    else:
        statement = sql.SQL("select * from ({}) as {} where ({}) in (select {} from {})").format(
            inner,
            sql.Identifier(_ALIAS),
            sql.SQL(", ").join(sql.Identifier(_ALIAS, c) for c in scope),
            sql.SQL(", ").join(sql.Identifier(c) for c in scope),
            sql.Identifier("pg_temp", "pgjobs_keys"),
        )
    return statement.as_string(None)


__all__ = ["keyed_sql"]
