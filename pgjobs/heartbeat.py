"""Each running scheduler's heartbeat, in ``pgjobs.scheduler`` (migration 011).

A :class:`~pgjobs.Scheduler` records itself (host, pid, pgjobs' version,
its jobs, when it started) and then, every ``heartbeat_every`` (5 s by
default), its ``last_seen``: one upsert a beat, from a thread of its own
(not the job threads, which a long run may all hold), with a statement
timeout. The same statement deletes the rows of schedulers quiet for more
than :data:`PRUNE_AFTER`; a clean shutdown deletes its own row. The same
round trip reads the database's xmin horizon (:mod:`pgjobs.horizon`).

:func:`schedulers_query` is what ``pgjobs status`` and the metrics read: a
scheduler not seen for :data:`QUIET_BEATS` of its own heartbeats is "gone
quiet" (killed, frozen, or cut off from the database).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from importlib import metadata
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from . import logs
from ._pg import first_line, send, set_local
from .durations import Duration, parse_duration
from .errors import ConfigError
from .horizon import HorizonWatch, horizon_of, horizon_query

log = logging.getLogger(__name__)

#: a scheduler not seen for this many of its heartbeats is gone quiet
QUIET_BEATS = 3
#: rows of schedulers quiet for longer than this are deleted
PRUNE_AFTER = timedelta(hours=1)
#: bounded; and no wait for the WAL's flush: a heartbeat lost in a crash is
#: harmless (the next one comes in seconds)
_SETTINGS = {"statement_timeout": "2000ms", "lock_timeout": "1000ms", "synchronous_commit": "off"}


def version() -> str:
    """pgjobs' installed version (its distribution is ``pgjobs-derived``)."""
    try:
        return metadata.version("pgjobs-derived")
    except metadata.PackageNotFoundError:
        return "unknown"


class Heartbeat:
    """A scheduler's heartbeat: :meth:`start` records it and beats every
    ``every``; :meth:`stop` ends it and deletes the row."""

    def __init__(
        self,
        connect: Callable[[], AbstractContextManager[Connection]],
        schema: str,
        jobs: Sequence[str],
        every: Duration,
        *,
        watch: HorizonWatch | None = None,
    ) -> None:
        #: a connection whose round trips have a deadline (:meth:`pgjobs.Runner.connect`)
        self.connect = connect
        self.every = parse_duration(every, field="heartbeat_every")
        if self.every <= timedelta(0):
            raise ConfigError(f"heartbeat_every: must be positive, got {every!r}")
        self.table = sql.Identifier(schema, "scheduler")
        self.id = uuid.uuid4().hex
        self.params: dict[str, Any] = {
            "id": self.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": version(),
            "jobs": list(jobs),
            "ms": max(1, int(self.every.total_seconds() * 1000)),
            "prune": PRUNE_AFTER,
        }
        #: the horizon, read in each beat's round trip (one line when held, one when not)
        self.watch = watch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        """The first beat now (a database that cannot take it, away or a
        standby, is the scheduler's to say), then one every ``every``."""
        self._stop.clear()
        self._try_beat()
        self._thread = threading.Thread(target=self._loop, name="pgjobs-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, *, delete: bool = True) -> None:
        """End the beats and delete this scheduler's row (bounded: a database
        that does not answer leaves it, to be pruned). ``delete=False``
        leaves it at once (a shutdown past its deadline, its ticks stuck:
        the database is likely away, and the row shows the scheduler gone
        quiet until it is pruned)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)
        logs.SUMMARY.flush(force=True)  # the queue jobs' last lines
        if not delete:
            return
        try:
            with self.connect() as conn, conn.begin():
                send(
                    conn,
                    set_local(_SETTINGS),
                    (sql.SQL("delete from {} where id = %s").format(self.table), (self.id,)),
                )
        except Exception as exc:
            log.debug("pgjobs: could not delete this scheduler's heartbeat: %s", first_line(exc))

    def beat(self) -> None:
        """One upsert of ``last_seen`` (and the pruning of long-quiet rows);
        and the read of the horizon, in the same round trip."""
        query = sql.SQL(
            "with gone as (delete from {t} where id <> %(id)s and last_seen < now() - %(prune)s)"
            " insert into {t} (id, host, pid, version, jobs, heartbeat_ms, started_at, last_seen)"
            " values (%(id)s, %(host)s, %(pid)s, %(version)s, %(jobs)s, %(ms)s, now(), now())"
            " on conflict (id) do update set last_seen = excluded.last_seen"
        ).format(t=self.table)
        with self.connect() as conn, conn.begin():
            if self.watch is None:
                send(conn, set_local(_SETTINGS), (query, self.params))
                return
            *_, oldest = send(
                conn, set_local(_SETTINGS), (query, self.params), (horizon_query(), None)
            )
            horizon = horizon_of(oldest.all())
        self.watch.observe(horizon)

    def _loop(self) -> None:
        while not self._stop.wait(self.every.total_seconds()):
            self._try_beat()

    def _try_beat(self) -> None:
        """One beat; the first that fails says so at WARNING (a missing
        table, a permission, a statement timeout are not the database being
        away, which the scheduler says too), the next ones at DEBUG, and the
        first that gets through again says so."""
        # the queue jobs' summary lines of a minute that ended quiet
        logs.SUMMARY.flush()
        try:
            self.beat()
        except Exception as exc:
            if not self._failing:
                log.warning(
                    "pgjobs: heartbeat not recorded (%s); other schedulers and `pgjobs status`"
                    " will see this one as gone quiet until it is",
                    first_line(exc),
                )
            else:
                log.debug("pgjobs: heartbeat not recorded again (%s)", first_line(exc))
            self._failing = True
        else:
            if self._failing:
                log.warning("pgjobs: heartbeat recorded again")
            self._failing = False


def schedulers_query(schema: str) -> tuple[sql.Composed, tuple[int]]:
    """The schedulers' rows, newest first, each with ``live`` (seen within
    :data:`QUIET_BEATS` of its heartbeats) and ``quiet_seconds`` (the table
    must exist): what the read model reads (:mod:`pgjobs.readmodel`)."""
    return (
        sql.SQL(
            "select id, host, pid, version, jobs, heartbeat_ms, started_at, last_seen,"
            " now() - last_seen <= make_interval(secs => %s * heartbeat_ms / 1000.0) as live,"
            " extract(epoch from now() - last_seen)::float8 as quiet_seconds"
            " from {} order by started_at desc, id"
        ).format(sql.Identifier(schema, "scheduler")),
        (QUIET_BEATS,),
    )


__all__ = [
    "PRUNE_AFTER",
    "QUIET_BEATS",
    "Heartbeat",
    "schedulers_query",
    "version",
]
