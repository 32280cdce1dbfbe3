"""Where a queue job's claims start reading: a cursor over the numbers
entries get when they become pending (``seq``, migration 015).

Why: a processed entry is deleted, and while another session holds the
database's xmin horizon (a long report, ``pg_dump``, a transaction left
idle) its index entries stay; a scan from the low end of an index walks all
of them, a claim in key order 36-68 ms after two minutes at 800 keys/s, and
a hold of ten minutes stalled the worker (docs/DESIGN.md, "The queue under
a held horizon"). A claim that reads ``seq > low`` starts past them.

When ``low`` may move on. Numbers are drawn in one order, but an entry
becomes visible at its transaction's commit, in another: a transaction that
drew 41 may commit after one that drew 42 was claimed. ``low`` moves past a
number only when both hold:

* *read*: every entry numbered up to it that this worker could see was read
  by one of its claims (each claim reads up to ``batch_size`` entries in
  number order; one that read fewer read all there were);
* *safe*: every transaction that drew a number up to it has ended, so that
  what it committed was there to read. The enqueue takes its transaction's
  xid before it draws a number (``<schema>.enqueue``, ``queue_seq()``). A
  *sample*, a row of each claim's statement (and a column of each work
  check's), reads the sequence's last value and then the xids of the
  transactions running at that moment: every transaction that drew a
  number up to that value is among them or has ended. Once no xid of a
  sample runs any more (a later sample says), its value is safe. A claim
  moves ``low`` only up to what was safe when it was *sent*: the sample
  read in its own statement comes after its snapshot, and so does one
  that another worker of the job read while it ran.

An entry read but not claimed (a user's transaction holds it, or a parent
of its item: the claim skips both, never waiting) is kept by number in
``recheck`` and read again by its number at the next claims, until it is
claimed or gone: ``low`` does not wait for it. So is what a tick claimed
when the tick does not commit (rolled back, failed, cut off), and what it
claimed and left queued when it does (kept for a lock someone holds).

When the server is another (a failover, a restart: the sample reads its
start) or a tick was cut off by the database going away, the cursor goes
back to the start: a commit it saw may not have reached the new primary,
whose numbers may also be lower than some the old one handed out.

Entries waiting for a retry after a failure are found apart (their own
index, ``attempts > 0``). A long transaction *with an xid* (one that wrote,
or a transaction prepared for two-phase commit) keeps the samples from
being safe while it runs: claims then read from an older ``low``, and walk
the entries processed since (as every claim did before). What nothing
above covers (an entry an older release's ``pgjobs revive`` made due
again with its old number; a database restored under a running process)
is found by a full pass, a claim from the start, every
:data:`FULL_PASS_SECONDS` and at the first claim of a process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

#: a claim from the start of the queue every so often (see the module docstring)
FULL_PASS_SECONDS = 300.0
#: entries kept to be read again by their number, at most; past it, ``low``
#: stays below the lowest of them (claims then read from there)
RECHECK_MAX = 1000

#: the rows' ``path``: where a claim found the entry (``SAMPLE``: the
#: claim's row of its sample, not an entry)
FRESH, RETRY, RECHECK, SAMPLE = 0, 1, 2, 3


def sample_sql(schema: str) -> tuple[sql.Composable, sql.Composable]:
    """The sample (see the module docstring) as a FROM item ``l`` (the
    sequence's last value, ``l.v``) and a column of that row: the xids of
    the transactions running in this database, this session's left out, and
    of those prepared for two-phase commit; a subquery of ``l``'s row, so
    read after it.

    A session reads the activity of the others once a transaction, then
    answers from that copy: a second sample in the same transaction (a
    claim redone after a rollback to a savepoint) would pair a fresh value
    with the xids running at the first, missing those that drew a number
    between the two. ``pg_stat_clear_snapshot()``, read with the value,
    throws that copy away (a volatile function: kept in the plan)."""
    numbers = sql.Identifier(schema, "queue_seq")
    last = sql.SQL(
        "(select case when is_called then last_value else 0 end as v,"
        " extract(epoch from pg_postmaster_start_time())::float8 as server,"
        " pg_stat_clear_snapshot() as fresh from {} offset 0) as l"
    ).format(numbers)
    running = sql.SQL(
        "(select array_agg(x) from (select a.backend_xid::text::bigint as x"
        " from pg_stat_get_activity(null) as a where a.backend_xid is not null"
        " and a.pid <> pg_backend_pid() and a.datid ="
        " (select oid from pg_database where datname = current_database()) and l.v is not null"
        " union all select p.transaction::text::bigint from pg_prepared_xacts as p"
        " where p.database = current_database() and l.v is not null) as r)"
    )
    return last, running


@dataclass(slots=True)
class Read:
    """What one claim read, for :meth:`Cursor.advance`."""

    #: the ``low`` and ``recheck`` it was sent with
    low: int
    recheck: tuple[int, ...]
    #: how many entries it could read (the job's batch size; 4 x with workers > 1)
    limit: int
    #: what was safe when it was sent: how far ``low`` may move after it
    safe: int = 0
    #: how many it read: fewer than ``limit``, and it read all there were
    count: int = 0
    #: (seq, path, claimed) of every entry it read
    rows: list[tuple[int, int, bool]] = field(default_factory=list)
    #: whether it was a full pass (sent with ``low`` 0)
    full: bool = False
    #: the cursor's generation when it was sent (see :meth:`Cursor.advance`)
    generation: int = 0


class Cursor:
    """One queue job's cursor in one runner (thread-safe: a job's workers share it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.low = 0
        self.recheck: dict[int, None] = {}
        #: samples not yet safe: (the sequence's value, the xids running then)
        self._samples: list[tuple[int, frozenset[int]]] = []
        #: the highest number every drawer of which has ended
        self.safe = 0
        #: when the next full pass is due (the first claim is one)
        self._full_at = 0.0
        #: what ticks not yet ended claimed (by number), to be read again if
        #: they do not commit
        self._held: dict[int, tuple[int, list[int]]] = {}
        self._next_tick = 0
        #: how many times the cursor was reset (a read from before is ignored)
        self._generation = 0
        #: the start of the server the last sample came from
        self._server: float | None = None

    def _now(self) -> float:
        return self._clock()

    def params(self) -> Read:
        """``low`` and ``recheck`` for the next claim (``low`` 0 for a full pass)."""
        with self._lock:
            full = self._now() >= self._full_at
            if full:
                self._full_at = self._now() + FULL_PASS_SECONDS
            low = 0 if full else self.low
            return Read(
                low=low,
                recheck=tuple(self.recheck),
                safe=self.safe,
                limit=0,
                full=full,
                generation=self._generation,
            )

    def peek(self) -> tuple[int, bool, tuple[int, int, bool]]:
        """Where a work check reads from (0 when a full pass is due),
        whether entries wait to be read again, and what :meth:`nothing_past`
        needs: what is safe now, the cursor's generation, and whether the
        check is a full pass."""
        with self._lock:
            full = self._now() >= self._full_at
            low = 0 if full else self.low
            return low, bool(self.recheck), (self.safe, self._generation, full)

    def nothing_past(self, sent: tuple[int, int, bool]) -> None:
        """A work check found no entry past ``low``: every entry numbered
        up to what was safe when it was sent is gone (and, from the start,
        that was a full pass)."""
        safe, generation, full = sent
        with self._lock:
            if generation == self._generation:
                self.low = max(self.low, safe)
                if full:
                    self._full_at = self._now() + FULL_PASS_SECONDS

    def sample(self, last: int | None, server: float | None, running: Iterable[int] | None) -> None:
        """What the sample sent with a claim read: the sequence's last value,
        the server's start, then the xids running (this session's own left
        out)."""
        now_running = frozenset(running or ())
        value = last or 0
        with self._lock:
            if server != self._server:
                # Another server than the last sample's (a failover, a restart):
                # a commit this cursor saw may not be there (replicated
                # asynchronously), its numbers may have gone back. From the start.
                if self._server is not None:
                    self._reset()
                self._server = server
            if value < self.low or value < self.safe:
                # the sequence is behind what this cursor has seen: another
                # database under the same name, or the schema made again
                self._reset()
            still = []
            for seen, xids in self._samples:
                if xids & now_running:
                    still.append((seen, xids))
                else:
                    self.safe = max(self.safe, seen)
            if now_running:
                still.append((value, now_running))
            else:
                self.safe = max(self.safe, value)
            # the oldest kept: a long transaction keeps them all unsafe
            self._samples = still[-64:] if len(still) > 64 else still

    def reset(self) -> None:
        """Back to the start: the next claim or work check is a full pass."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._generation += 1
        self.low = 0
        self.safe = 0
        self.recheck.clear()
        self._samples.clear()
        self._held.clear()
        self._full_at = 0.0

    def advance(self, read: Read) -> int:
        """Move on after ``read`` (a claim's rows): ``low``, ``recheck``.
        Returns a tick token for :meth:`ended`, which reads again by number
        what the tick claimed if it does not commit (a rollback leaves it
        queued), and what it left queued if it does."""
        fresh = [seq for seq, path, _ in read.rows if path == FRESH]
        complete = read.count < read.limit
        with self._lock:
            self._next_tick += 1
            if read.generation != self._generation:
                return self._next_tick  # read before a reset: tells nothing now
            # past what it read (all of it, when it read fewer than it could)
            # and not past what was safe when it was sent (see the module
            # docstring: a later sample may have come after its snapshot)
            bound = read.safe if complete else min(read.safe, max(fresh, default=0))
            new_low = max(read.low, bound)
            self.low = new_low if read.full else max(self.low, new_low)
            # what it read again: kept while not claimed, dropped when claimed,
            # or gone (not read, when it read all there was: the batch may
            # have been full before it came to them)
            returned = {seq for seq, _, _ in read.rows}
            for seq in read.recheck:
                if seq in returned or complete:
                    self.recheck.pop(seq, None)
            for seq, path, claimed in read.rows:
                if not claimed and path != RETRY and seq <= self.low:
                    self.recheck[seq] = None
            if len(self.recheck) > RECHECK_MAX:
                kept = sorted(self.recheck)
                self.recheck = dict.fromkeys(kept[:RECHECK_MAX])
                self.low = min(self.low, kept[RECHECK_MAX] - 1)
            taken = [seq for seq, path, claimed in read.rows if claimed and path != RETRY]
            if taken:
                self._held[self._next_tick] = (self._generation, taken)
            return self._next_tick

    def ended(self, token: int, *, committed: bool, left: Iterable[int] = ()) -> None:
        """The tick of ``token`` ended: committed (its entries are gone, but
        those ``left`` queued, read again by their number) or not (what it
        claimed is queued still: read again)."""
        with self._lock:
            generation, taken = self._held.pop(token, (self._generation, []))
            if generation != self._generation:
                return
            for seq in taken if not committed else left:
                if seq <= self.low:
                    self.recheck[seq] = None


class Cursors:
    """A runner's cursors, one per queue job (each runner talks to one database)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cursors: dict[tuple[str, str], Cursor] = {}

    def reset(self) -> None:
        """Every cursor back to the start (a full pass next): after a tick
        cut off by the database going away, which may come back as another
        server (a failover), whose numbers may have gone back."""
        with self._lock:
            cursors = list(self._cursors.values())
        for cursor in cursors:
            cursor.reset()

    def of(self, schema: str, job: str) -> Cursor:
        with self._lock:
            cursor = self._cursors.get((schema, job))
            if cursor is None:
                cursor = self._cursors[(schema, job)] = Cursor()
            return cursor


def split_sample(
    rows: list[tuple[Any, ...]], seq_at: int
) -> tuple[list[tuple[Any, ...]], tuple[Any, ...] | None]:
    """A claim's rows without the row of its sample (``path`` :data:`SAMPLE`,
    first as the claim orders them), and the sample for :meth:`Cursor.sample`:
    the sequence's value (at ``seq_at``), the server's start and the xids
    running (the two columns after the entry's ``ctid``)."""
    path = seq_at + 1
    at = 0 if rows and rows[0][path] == SAMPLE else None
    if at is None:  # (not first: looked for)
        at = next((n for n, row in enumerate(rows) if row[path] == SAMPLE), None)
    if at is None:
        return rows, None
    row = rows[at]
    return rows[:at] + rows[at + 1 :], (row[seq_at], row[seq_at + 4], row[seq_at + 5])


def rows_read(read: Read, rows: Sequence[Sequence[Any]], seq_at: int, claimed_at: int) -> Read:
    """``read`` with a claim's rows: their ``seq``, ``path`` and ``read``
    columns from ``seq_at`` on, whether the entry was claimed at ``claimed_at``."""
    read.rows = [(int(r[seq_at]), int(r[seq_at + 1]), bool(r[claimed_at])) for r in rows]
    read.count = int(rows[0][seq_at + 2]) if rows else 0
    return read


__all__ = [
    "FRESH",
    "FULL_PASS_SECONDS",
    "RECHECK",
    "RECHECK_MAX",
    "RETRY",
    "SAMPLE",
    "Cursor",
    "Cursors",
    "Read",
    "rows_read",
    "sample_sql",
    "split_sample",
]
