"""The database's xmin horizon: which session or prepared transaction holds
it back, and for how long (docs/long-transactions.md).

Vacuum may remove a dead row version only once no snapshot can still see
it. One long statement, one transaction left idle, one forgotten prepared
transaction holds that horizon back for the whole database: every entry
a queue worker took off the queue meanwhile stays in the queue's table and
indexes, and the claims, work checks and enqueues step over them.

:func:`horizon_query` finds the holder: the backend of this database (or a
walsender: hot standby feedback) whose ``backend_xmin`` or ``backend_xid``
is the oldest, or a prepared transaction, older still. Its ``held`` is the
age of its transaction (the snapshot is at most that old). Another role's
sessions show no ``backend_xmin``, state or query to a role without
``pg_read_all_stats`` (``pg_monitor``): the holder may then go unseen.

The read model (:mod:`pgjobs.readmodel`) reads it with everything else:
``pgjobs status``, the status page and the metrics show it; a scheduler
reads it with each heartbeat and :class:`HorizonWatch` logs one line when
it passes ``horizon_warning`` and one when it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from . import logs
from .durations import format_duration

log = logging.getLogger(__name__)

#: the default of ``horizon_warning``: a horizon held longer is warned about
HORIZON_WARNING = timedelta(minutes=5)
#: how much of the holder's query is shown
QUERY_CHARS = 200

# One row at most: the oldest holder, by the age of its xid or snapshot (in
# transactions: which one vacuum waits for), its transaction's age as `held`.
# Autovacuum workers are left out: other vacuums ignore their snapshots.
_QUERY = (
    "select kind, pid, application_name, state, held, xid_age, query from ("
    " select 'session' as kind, pid, application_name, state,"
    " now() - coalesce(xact_start, query_start, backend_start) as held,"
    " greatest(age(backend_xid), age(backend_xmin)) as xid_age,"
    f" left(query, {QUERY_CHARS}) as query"
    " from pg_stat_activity"
    " where pid <> pg_backend_pid() and (backend_xid is not null or backend_xmin is not null)"
    " and (datname = current_database() or datname is null)"
    " and backend_type <> 'autovacuum worker'"
    " union all"
    " select 'prepared', null, gid, 'prepared', now() - prepared, age(transaction), null"
    " from pg_prepared_xacts where database = current_database()"
    ") h order by xid_age desc, held desc limit 1"
)


def horizon_query() -> str:
    """The statement that reads the oldest holder (no parameter; one row at
    most, in :class:`Horizon`'s order)."""
    return _QUERY


@dataclass(frozen=True, kw_only=True, slots=True)
class Horizon:
    """The oldest snapshot or transaction of the database: who holds the
    horizon back (``kind`` ``session``: a backend; ``prepared``: a
    prepared transaction, its ``gid`` as ``application_name``)."""

    kind: str
    #: how long its transaction has been open
    held: timedelta
    #: how many transactions began since its snapshot or xid
    xid_age: int
    pid: int | None = None
    application_name: str | None = None
    #: ``active``, ``idle in transaction``, ... (``prepared``)
    state: str | None = None
    #: the start of its query (the last one, when idle)
    query: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("session", "prepared"):
            raise ValueError(f"Horizon.kind: expected 'session' or 'prepared', got {self.kind!r}")

    def describe(self) -> str:
        """``pid 4242 (psql, idle in transaction) for 4m12s: select ...``"""
        held = format_duration(timedelta(seconds=int(self.held.total_seconds())))
        if self.kind == "prepared":
            return f"prepared transaction {self.application_name!r} for {held}"
        name = self.application_name or "no application_name"
        text = f"pid {self.pid} ({name}, {self.state or 'state unknown'}) for {held}"
        if self.query:
            query = " ".join(self.query.split())
            text += f": {query[:80]}" + ("..." if len(query) > 80 else "")
        return text

    def as_dict(self) -> dict[str, Any]:
        """For JSON output and log records (``held`` in seconds)."""
        return {
            "kind": self.kind,
            "pid": self.pid,
            "application_name": self.application_name,
            "state": self.state,
            "held_seconds": round(self.held.total_seconds(), 3),
            "xid_age": self.xid_age,
            "query": self.query,
        }


def horizon_of(rows: Sequence[Sequence[Any]]) -> Horizon | None:
    """The :class:`Horizon` of :func:`horizon_query`'s rows (none: nothing holds it)."""
    if not rows:
        return None
    kind, pid, name, state, held, xid_age, query = rows[0]
    return Horizon(
        kind=kind,
        held=held if held is not None else timedelta(0),
        xid_age=int(xid_age or 0),
        pid=pid,
        application_name=name or None,
        state=state,
        query=query,
    )


def horizon_line(horizon: Horizon) -> str:
    """What ``pgjobs status`` and the page say of a horizon held too long."""
    return (
        f"warning: the xmin horizon is held back by {horizon.describe()}"
        f" ({horizon.xid_age:,} transactions since): vacuum cannot remove dead rows,"
        " and the queue slows down until it ends (docs/long-transactions.md)"
    )


def held_past(horizon: Horizon | None, threshold: timedelta) -> bool:
    """Whether ``horizon`` has been held for ``threshold`` or longer."""
    return horizon is not None and horizon.held >= threshold


class HorizonWatch:
    """One line when the horizon has been held past ``threshold``, one when
    that ends (not one per read). :meth:`observe` each read; ``held`` is the
    holder while it is past the threshold, else ``None``; the queue jobs'
    summary lines name it meanwhile (:data:`pgjobs.logs.SUMMARY`)."""

    def __init__(self, threshold: timedelta = HORIZON_WARNING) -> None:
        if threshold <= timedelta(0):
            raise ValueError(f"horizon_warning: must be positive, got {threshold!r}")
        self.threshold = threshold
        self.held: Horizon | None = None

    def observe(self, horizon: Horizon | None) -> None:
        if held_past(horizon, self.threshold):
            assert horizon is not None
            if self.held is None or _holder(self.held) != _holder(horizon):
                log.warning(
                    "pgjobs: the database's xmin horizon is held back by %s: vacuum cannot"
                    " remove the queue's processed entries meanwhile (docs/long-transactions.md)",
                    horizon.describe(),
                    extra={logs.FIELDS: {"event": "horizon_held", "horizon": horizon.as_dict()}},
                )
            self.held = horizon
            logs.SUMMARY.set_horizon(horizon.describe(), horizon.as_dict())
        elif self.held is not None:
            log.info(
                "pgjobs: the xmin horizon is no longer held back (%s held it for at least %s)",
                _who(self.held),
                format_duration(timedelta(seconds=int(self.held.held.total_seconds()))),
                extra={logs.FIELDS: {"event": "horizon_released", "horizon": self.held.as_dict()}},
            )
            self.held = None
            logs.SUMMARY.set_horizon(None)


def _holder(horizon: Horizon) -> tuple[str, int | None, str | None]:
    return (horizon.kind, horizon.pid, horizon.application_name if horizon.pid is None else None)


def _who(horizon: Horizon) -> str:
    if horizon.kind == "prepared":
        return f"prepared transaction {horizon.application_name!r}"
    return f"pid {horizon.pid}"


__all__ = [
    "HORIZON_WARNING",
    "QUERY_CHARS",
    "Horizon",
    "HorizonWatch",
    "held_past",
    "horizon_line",
    "horizon_of",
    "horizon_query",
]
