"""One round trip straight through libpq's pipeline: how :func:`pgjobs._pg.send`
sends statements with parameters, and a COMMIT with them.

psycopg's cursors cost the client 0.1-0.2 ms a statement in a pipeline (a
cursor object, the pipeline's queues, a read of the socket after each
statement, a sync of its own at the pipeline's exit): about half of a
one-item queue tick's client time. Here the round trip's statements are
handed to libpq one after the other, then one Sync, and read back in one
wait; what psycopg does per statement that matters is kept:

* each statement's text and parameters go through psycopg's own converter
  (:class:`psycopg._queries.PostgresQuery`: ``%s`` and ``%(name)s``
  placeholders, its cache of converted texts) and its adapters;
* a statement is prepared the second time a session runs it (:data:`PREPARE_AT`;
  or at psycopg's ``prepare_threshold``, if lower), named ``pgjobs_<n>``,
  and PostgreSQL keeps its plan; never where psycopg prepares nothing
  (``prepare_threshold = None``: behind a transaction pooler). At most
  :data:`MAX_PREPARED` per server session, none dropped: past it,
  statements go unprepared. psycopg deallocates every statement of the
  session (``DEALLOCATE ALL``) when it rolls back, or sees a DROP or an
  ALTER, while it has prepared statements of its own (an ``after``
  callback's, say): pgjobs' go with them, and are prepared again, told by
  the connection (:class:`pgjobs.deadline.BoundedConnection`);
* BEGIN is psycopg's own (its isolation level, read-only and deferrable
  settings), sent first when the transaction has yet to begin;
* the wait is the connection's own ``wait`` (bounded: :mod:`pgjobs.deadline`).

A statement that fails leaves the results of those before it; the ones
after it are skipped by the server (``PIPELINE_ABORTED``), COMMIT too.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors, pq, sql
from psycopg.adapt import Transformer
from psycopg.waiting import Ready, Wait

from .deadline import BoundedConnection, abandon_connection

log = logging.getLogger(__name__)

#: set (not "0"): pgjobs sends its round trips through psycopg's cursors, as
#: it must where psycopg no longer has ``_queries.PostgresQuery`` (read at
#: import; a way back should a psycopg release change what this module takes
#: from it, and how the tests run that path: tests/test_wire.py, .ci/lowest)
FALLBACK_ENV = "PGJOBS_WIRE_FALLBACK"

_PostgresQuery: Any = None
if os.environ.get(FALLBACK_ENV, "") in ("", "0"):
    try:  # psycopg's converter of placeholders (what its cursors use): private
        from psycopg._queries import PostgresQuery as _PostgresQuery
    except ImportError:  # psycopg moved it: its cursors' way then (usable() says no)
        log.warning(
            "pgjobs: psycopg %s has no _queries.PostgresQuery; pgjobs' round trips"
            " go through psycopg's cursors (slower, the same answers)",
            psycopg.__version__,
        )

#: a statement is prepared at this run on a session (psycopg's default is
#: the sixth: pgjobs' statements are those of jobs that run again and again)
PREPARE_AT = 2
#: statements prepared per server session, at most
MAX_PREPARED = 256
#: distinct statements counted per server session before the counts start over
MAX_COUNTED = 4096

#: libpq (as psycopg loaded it) has pipelines
_PIPELINES = psycopg.Pipeline.is_supported()

_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_ANSWERED = (_TUPLES_OK, _COMMAND_OK)
_FATAL = pq.ExecStatus.FATAL_ERROR
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_IDLE = pq.TransactionStatus.IDLE
_TEXT = pq.Format.TEXT


class Replanned(sql.SQL):
    """A statement never prepared: PostgreSQL plans it at each run, for its
    tables as they are then. For a statement whose best plan changes with a
    table's size, where a plan kept from when the table was small turns
    into a walk of everything a held horizon keeps in it (the queue's
    delete by ctid: a sequential scan while the queue fits a page, a TID
    scan after)."""


class Result:
    """What one statement of a round trip returned: its row count and, for a
    statement that returns rows, the rows and their columns' names (read
    off the server's answer when asked: few callers ask)."""

    __slots__ = ("_columns", "_source", "rowcount", "rows")

    def __init__(
        self,
        rowcount: int = -1,
        rows: list[tuple[Any, ...]] | None = None,
        columns: tuple[str, ...] | None = None,
        *,
        source: tuple[Any, str] | None = None,
    ) -> None:
        self.rowcount = rowcount
        self.rows = rows
        self._columns = columns
        #: (the result, the connection's encoding) the names are read from
        self._source = source

    @property
    def columns(self) -> tuple[str, ...] | None:
        """The names of the columns it returns (``None``: it returns no rows)."""
        if self._columns is None and self._source is not None:
            result, encoding = self._source
            self._columns = tuple(
                (result.fname(i) or b"").decode(encoding) for i in range(result.nfields)
            )
            self._source = None
        return self._columns

    def one(self) -> tuple[Any, ...] | None:
        """The first row, or ``None``."""
        return self.rows[0] if self.rows else None

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows or []

    def scalar(self) -> Any:
        """The first column of the first row, or ``None``."""
        row = self.one()
        return row[0] if row else None


@dataclass(slots=True)
class _Session:
    """What one connection's server session has prepared, and counted."""

    backend: int
    #: the connection's count of psycopg's DEALLOCATE ALL when this began
    deallocations: int
    #: how many names were handed out (a prepare that failed used one too)
    names: int = 0
    counts: dict[tuple[bytes, tuple[int, ...]], int] = field(default_factory=dict)
    prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = field(default_factory=dict)


_sessions: weakref.WeakKeyDictionary[psycopg.Connection[Any], _Session] = (
    weakref.WeakKeyDictionary()
)


def usable(raw: psycopg.Connection[Any]) -> bool:
    """Can :func:`round_trip` run on ``raw`` (psycopg offers what it takes,
    libpq has pipelines, no psycopg pipeline or COPY is under way, and the
    connection counts psycopg's DEALLOCATE ALL, which takes pgjobs'
    statements too: :class:`pgjobs.deadline.BoundedConnection`)?"""
    return (
        _PostgresQuery is not None
        and isinstance(raw, BoundedConnection)
        and _PIPELINES
        and not raw.autocommit
        and getattr(raw, "_pipeline", None) is None
        and hasattr(raw, "_get_tx_start_command")
        and raw.pgconn.pipeline_status == pq.PipelineStatus.OFF
    )


def forget(raw: psycopg.Connection[Any]) -> None:
    """Forget what ``raw``'s session prepared (its statements are gone:
    ``DISCARD ALL``, ``DEALLOCATE ALL``, SQLSTATE 26000)."""
    _sessions.pop(raw, None)


def round_trip(
    raw: psycopg.Connection[Any],
    statements: Sequence[tuple[sql.Composable | str, Sequence[Any] | Mapping[str, Any] | None]],
    *,
    commit: bool = False,
) -> tuple[list[Result | None], psycopg.Error | None]:
    """Send ``statements`` (and COMMIT) in one round trip on ``raw``; their
    outcomes (``None`` for those the server skipped after a failure) and
    the first error, if one failed. Raises what the connection raises
    (lost, past its deadline), and what converting a statement or its
    parameters raises (then before anything is sent)."""
    session = _session_of(raw)
    tx = Transformer(raw)
    queries = []  # every statement converted first: a failure here sends nothing
    for statement, params in statements:
        query = _PostgresQuery(tx)
        query.convert(statement, params)
        queries.append(query)
    threshold = raw.prepare_threshold
    if threshold is not None:
        threshold = min(threshold, PREPARE_AT - 1)
    # what each group of results answers: "begin", "commit", a statement's
    # index, or the (key, name) of a statement prepared on the way
    expected: list[object] = []
    pgconn = raw.pgconn
    with raw.lock:
        pgconn.enter_pipeline_mode()
        try:
            if pgconn.transaction_status == _IDLE:
                pgconn.send_query_params(raw._get_tx_start_command(), None)
                expected.append("begin")
            for index, query in enumerate(queries):
                key = (query.query, tuple(query.types))
                name = session.prepared.get(key)
                replanned = isinstance(statements[index][0], Replanned)
                if name is None and threshold is not None and not replanned:
                    name = _to_prepare(session, key, threshold)
                    if name is not None:
                        pgconn.send_prepare(name, query.query, param_types=query.types)
                        expected.append((key, name))
                if name is not None:
                    pgconn.send_query_prepared(
                        name, query.params, param_formats=query.formats, result_format=_TEXT
                    )
                else:
                    pgconn.send_query_params(
                        query.query,
                        query.params,
                        param_types=query.types,
                        param_formats=query.formats,
                        result_format=_TEXT,
                    )
                expected.append(index)
            if commit:
                pgconn.send_query_params(b"COMMIT", None)
                expected.append("commit")
            pgconn.pipeline_sync()
            groups = raw.wait(_exchange(pgconn, len(expected)))
            pgconn.exit_pipeline_mode()
        except BaseException:
            # what is half sent or unread cannot be taken back: the
            # connection is given up (its pool then drops it)
            abandon_connection(raw, owner=True)
            raise
    outcomes: list[Result | None] = [None] * len(statements)
    first: psycopg.Error | None = None
    for what, results in zip(expected, groups, strict=True):
        if isinstance(what, tuple) and results and results[-1].status == _COMMAND_OK:
            session.prepared[what[0]] = what[1]
        failed = next((r for r in results if r.status == _FATAL), None)
        if failed is not None:
            if first is None:
                first = errors.error_from_result(failed, encoding=raw.info.encoding)
                if first.sqlstate == "26000":  # a statement of ours is gone
                    forget(raw)
        elif isinstance(what, int) and results and results[-1].status in _ANSWERED:
            outcomes[what] = _outcome(tx, results[-1], raw.info.encoding)
    return outcomes, first


def _session_of(raw: psycopg.Connection[Any]) -> _Session:
    """What ``raw``'s server session has prepared: nothing, when the session
    is another than last time, or psycopg deallocated everything since."""
    backend = raw.info.backend_pid
    deallocations = getattr(raw, "pgjobs_deallocations", 0)
    session = _sessions.get(raw)
    if session is None or session.backend != backend or session.deallocations != deallocations:
        session = _sessions[raw] = _Session(backend, deallocations)
    return session


def _to_prepare(
    session: _Session, key: tuple[bytes, tuple[int, ...]], threshold: int
) -> bytes | None:
    """The name to prepare ``key`` under now, or ``None`` (not yet, or no room)."""
    if len(session.prepared) >= MAX_PREPARED:
        return None
    if len(session.counts) >= MAX_COUNTED:
        session.counts.clear()
    count = session.counts.get(key, 0) + 1
    session.counts[key] = count
    if count <= threshold:
        return None
    del session.counts[key]
    session.names += 1
    return f"pgjobs_{session.names}".encode()


def _exchange(pgconn: pq.abc.PGconn, groups: int) -> Generator[Wait, Ready | int, list[list[Any]]]:
    """Flush what is queued, then read ``groups`` result groups and the
    Sync's: the groups (a list of results each)."""
    while pgconn.flush() != 0:
        ready = yield Wait.RW
        if ready & Ready.R:
            pgconn.consume_input()
    out: list[list[Any]] = []
    current: list[Any] = []
    while True:
        while pgconn.is_busy():
            yield Wait.R
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            if pgconn.status == pq.ConnStatus.BAD or len(out) > groups:
                raise psycopg.OperationalError(
                    f"pgjobs: the connection was lost during a round trip: {_message(pgconn)}"
                )
            out.append(current)
            current = []
            continue
        if result.status == _SYNC:
            break
        current.append(result)
    if len(out) != groups:
        raise psycopg.OperationalError(
            f"pgjobs: a round trip got {len(out)} answers for {groups} statements"
        )
    return out


def _message(pgconn: pq.abc.PGconn) -> str:
    return (pgconn.error_message or b"").decode(errors="replace").strip() or "no message"


def _outcome(tx: Any, result: Any, encoding: str) -> Result:
    if result.status != _TUPLES_OK:
        tuples = result.command_tuples
        return Result(-1 if tuples is None else tuples)
    tx.set_pgresult(result)
    n = result.ntuples
    return Result(n, tx.load_rows(0, n, tuple), source=(result, encoding))


__all__ = ["FALLBACK_ENV", "MAX_PREPARED", "PREPARE_AT", "Result", "forget", "round_trip", "usable"]
