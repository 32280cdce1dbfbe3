"""What a slice computes: the job's compute for the keys of one range.

Three forms (``docs/slices.md``):

* SQL text, the one full compute: restricted to the range by pgjobs
  (:func:`pgjobs.scoping.restrict`), its plan checked once per run;
* SQL text that binds ``:keys`` (and ``:keys_<column>``), as a
  :class:`~pgjobs.QueueJob`'s: run with the range's keys, read from the
  key table (:mod:`.cut`);
* ``compute(conn, keys)`` in Python: called with the range's keys, it
  returns SQL, a selectable or rows for those keys.

A ``compute(conn)`` is refused when the job is made
(:class:`~pgjobs.RecomputeJob`): it gives every key's rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from psycopg import sql
from sqlalchemy import text
from sqlalchemy.engine import Connection

from .._pg import execute
from ..errors import ConfigError
from ..jobs import Keys, RecomputeJob
from ..scoping import KeyRange, PlanReport, Restricted, check_plan, range_condition, restrict
from ..staging import Staged, stage, temp_name
from ..staging.query import plain_sql, stage_plain_temp, strip
from ..target import Target
from .cut import KeySource

#: a ``:keys`` or ``:keys_<column>`` bind in SQL text (not a ``::`` cast)
KEYS_BIND = re.compile(r"(?<![:\w\\]):keys(?:_\w+)?\b")


def keyed_text(query: str) -> bool:
    """Whether SQL text binds the keys it is computed for (``:keys``)."""
    return KEYS_BIND.search(query) is not None


class SliceCompute:
    """The job's compute for one range of keys at a time."""

    def __init__(self, conn: Connection, job: RecomputeJob, target: Target, source: KeySource):
        self.job, self.target, self.source = job, target, source
        self.scope = job.scope
        self.plain: str | None = None
        self.keyed = not isinstance(job.compute, str) or keyed_text(job.compute)
        if isinstance(job.compute, str):
            plain = plain_sql(conn, text(strip(job.compute)))
            if plain is None:
                raise ConfigError(
                    f"RecomputeJob {job.name!r}: compute: SQL text with typed or expanding binds"
                    " cannot run sliced; give plain SQL text, or set sliced = false"
                )
            self.plain = plain

    @property
    def form(self) -> str:
        if self.plain is None:
            return "python"
        return "keyed" if self.keyed else "restricted"

    def check(self, conn: Connection) -> PlanReport | None:
        """The plan check, once per run (:func:`pgjobs.scoping.check_plan`):
        of the restricted SQL, or of keyed SQL with its ``:keys`` binds. A
        Python compute is not checked."""
        if self.plain is None:
            return None
        if self.keyed:
            marks = frozenset({"keys", *(f"keys_{c}" for c in self.scope)})
            statement = sql.Composed([sql.SQL(self.plain)])
            restricted = Restricted(
                statement=statement, params={}, marks=marks, checked=statement, source=self.plain
            )
        else:
            bound = tuple(None for _ in self.scope)
            restricted = restrict(self.plain, self.scope, KeyRange(low=bound, high=bound))
        return check_plan(conn, restricted, job_name=self.job.name, scope=self.scope)

    def keys(self, conn: Connection, how: KeyRange) -> Keys:
        """The keys of the key table in the range, in key order (keyed forms)."""
        columns = [sql.Identifier(c) for c in self.source.columns]
        where, params = range_condition(columns, how)
        rows = execute(
            conn,
            sql.SQL("select distinct {cols} from {t} where {where} order by {cols}").format(
                cols=sql.SQL(", ").join(columns), t=self.source.table, where=where
            ),
            params,
        ).fetchall()
        return [tuple(r) for r in rows]

    def stage(
        self, conn: Connection, how: KeyRange, *, preserve: bool = False
    ) -> tuple[Staged, int | None]:
        """The new rows of the range's keys, staged (dropped at commit, or
        with ``preserve`` kept until dropped: a slice written in several
        transactions); and how many keys a keyed compute was given
        (``None``: restricted SQL)."""
        if self.plain is not None and not self.keyed:
            restricted = restrict(self.plain, self.scope, how)
            name = temp_name("stage")
            ident = sql.Identifier(name)
            columns, rows = stage_plain_temp(
                conn,
                self.target,
                restricted.statement.as_string(None),
                restricted.params,
                ident,
                preserve,
            )
            staged = Staged(table=ident, name=name, columns=columns, rows=rows, preserve=preserve)
            return staged, None
        keys = self.keys(conn, how)
        params = _keys_params(self.scope, keys)
        compute = self.job.compute
        if isinstance(compute, str):
            source: object = compute
        else:
            assert callable(compute)
            source = _call(compute, conn, keys)
        return stage(conn, self.target, source, params=params, preserve=preserve), len(keys)


def _call(compute: Callable[..., Any], conn: Connection, keys: Keys) -> Any:
    return compute(conn, keys)


def _keys_params(scope: tuple[str, ...], keys: Keys) -> dict[str, Any]:
    """``:keys`` (the first scope column's values) and ``:keys_<column>``, as
    a queue job's compute gets them."""
    params: dict[str, Any] = {"keys": [k[0] for k in keys]}
    for n, column in enumerate(scope):
        params[f"keys_{column}"] = [k[n] for k in keys]
    return params


__all__ = ["KEYS_BIND", "SliceCompute", "keyed_text"]
