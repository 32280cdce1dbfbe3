"""A sliced run's progress in the database (``slice_run``, ``slice``:
migration 014), written in the transactions of the run's slices.

* :meth:`Runs.join_or_start` finds the job's run in progress, or starts one
  (its pieces cut, :mod:`.cut`); a run whose last slice committed more
  than ``fresh_for`` ago is dropped and started over.
* :meth:`Runs.claim` takes the next free pieces (``FOR UPDATE SKIP LOCKED``:
  a piece another slice holds is skipped, never waited for), consecutive in
  key order, so that they make one range.
* :meth:`Runs.hold` keeps them across commits, for a slice written in
  several transactions: a mark naming the server process, which other
  claims skip while that process holds the group's recompute lock (every
  tick of a sliced run does, until it ends: a crash, a failure or the end
  of its tick frees its pieces).
* :meth:`Runs.done` marks them done and adds the slice's sums to the run,
  in the slice's own commit; the slice that does the last piece reads the
  sums (:meth:`Runs.finish`) and deletes the run's rows, in the commit that
  records the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection

from .._pg import execute, later, send
from .cut import Bound, KeySource, cut

#: the sums a run adds up over its slices (``slice_run``'s columns)
SUMS = (
    "inserted",
    "updated",
    "deleted",
    "skipped",
    "unchanged",
    "excluded",
    "deferred",
    "compute_seconds",
    "write_seconds",
    "lock_seconds",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SliceRun:
    """A sliced run in progress, as a tick found or started it."""

    id: int
    pieces: int
    done: int
    started_at: datetime
    #: picked up after the ticks that worked on it had stopped (a crash, a
    #: failure, a shutdown)
    resumed: bool
    #: this tick cut it
    created: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One piece of a run's key space: ``low`` (included) to ``high`` (excluded)."""

    n: int
    low: Bound | None
    high: Bound | None


class Runs:
    """The progress rows of one sliced job, on one connection."""

    def __init__(self, conn: Connection, schema: str, job: str, group: str, worker: str) -> None:
        self.conn, self.job, self.group, self.worker = conn, job, group, worker
        self.runs = sql.Identifier(schema, "slice_run")
        self.slices = sql.Identifier(schema, "slice")
        #: the group's recompute lock, which the run's ticks hold (join_or_start)
        self.lock = ""
        #: the server sessions working on the run as the last slice ended
        #: (those holding the recompute lock; :meth:`done`)
        self.processes = 1

    def join_or_start(
        self, source: KeySource, scope: tuple[str, ...], fresh_for: timedelta, lock: str
    ) -> SliceRun | None:
        """The job's run in progress (joined), or a new one. ``None``: another
        job of the group has a sliced run in progress (one at a time: they
        may write the same rows)."""
        self.lock = lock
        other = execute(
            self.conn,
            sql.SQL("select job from {} where grp = %s and job <> %s limit 1").format(self.runs),
            [self.group, self.job],
        ).fetchone()
        if other is not None:
            return None
        found = self._read(fresh_for, lock)
        if found is not None:
            return found
        bounds = cut(self.conn, source)
        pieces = [
            {"n": n, "low": low, "high": high}
            for n, (low, high) in enumerate(zip([None, *bounds], [*bounds, None], strict=True))
        ]
        (created,) = send(
            self.conn,
            (
                sql.SQL(
                    "insert into {} (job, grp, scope, pieces, started_at, touched_at)"
                    " values (%s, %s, %s, %s, clock_timestamp(), clock_timestamp())"
                    " on conflict (job) do nothing returning id, started_at"
                ).format(self.runs),
                (self.job, self.group, list(scope), len(pieces)),
            ),
        )
        row = created.one()
        if row is None:  # another process started it just now
            return self._read(fresh_for, lock)
        run_id, started_at = int(row[0]), row[1]
        send(
            self.conn,
            (
                sql.SQL(
                    "insert into {} (job, run, n, low, high)"
                    " select %s, %s, (p ->> 'n')::int,"
                    " case when jsonb_typeof(p -> 'low') = 'array' then"
                    "  array(select jsonb_array_elements_text(p -> 'low')) end,"
                    " case when jsonb_typeof(p -> 'high') = 'array' then"
                    "  array(select jsonb_array_elements_text(p -> 'high')) end"
                    " from jsonb_array_elements(%s::jsonb) as p"
                ).format(self.slices),
                (self.job, run_id, json.dumps(pieces)),
            ),
        )
        return SliceRun(
            id=run_id,
            pieces=len(pieces),
            done=0,
            started_at=started_at,
            resumed=False,
            created=True,
        )

    def _read(self, fresh_for: timedelta, lock: str) -> SliceRun | None:
        """The job's run if it is fresh (else it is deleted, with its pieces);
        marked resumed when it has pieces done and no other session holds
        the group's recompute lock ``lock`` (which every tick of a sliced
        run holds, shared, from its start to its end): the ticks that
        worked on it stopped (a crash, a failure, a shutdown), and this one
        takes it up."""
        row = execute(
            self.conn,
            sql.SQL(
                "select id, pieces, done, started_at, resumed,"
                " clock_timestamp() - touched_at > %s,"
                " done > 0 and not exists (select from pg_locks"
                "  where locktype = 'advisory' and objsubid = 1 and pid <> pg_backend_pid()"
                "  and classid = ((hashtextextended(%s, 0) >> 32) & 4294967295)::oid"
                "  and objid = (hashtextextended(%s, 0) & 4294967295)::oid)"
                " from {} where job = %s"
            ).format(self.runs),
            [fresh_for, lock, lock, self.job],
        ).fetchone()
        if row is None:
            return None
        run_id, pieces, done, started_at, resumed, stale, idle = row
        if stale:
            self.drop(int(run_id))
            return None
        if idle and not resumed:
            execute(
                self.conn,
                sql.SQL("update {} set resumed = true where job = %s and id = %s").format(
                    self.runs
                ),
                [self.job, run_id],
            )
            resumed = True
        return SliceRun(
            id=int(run_id),
            pieces=int(pieces),
            done=int(done),
            started_at=started_at,
            resumed=bool(resumed),
            created=False,
        )

    def drop(self, run_id: int) -> None:
        """Delete the run ``run_id`` and its pieces."""
        send(
            self.conn,
            (
                sql.SQL("delete from {} where job = %s and run = %s").format(self.slices),
                (self.job, run_id),
            ),
            (
                sql.SQL("delete from {} where job = %s and id = %s").format(self.runs),
                (self.job, run_id),
            ),
        )

    def claim(self, run_id: int, count: int) -> list[Piece]:
        """Up to ``count`` free pieces, consecutive in key order from the first
        free one, locked to this transaction's end. Empty: none is free (all
        done, or held by other slices)."""
        rows = execute(
            self.conn,
            sql.SQL(
                "select n, low, high from {} as s where job = %s and run = %s and state = 'todo'"
                " and (taken_by is null or not exists (select from pg_locks"
                "  where locktype = 'advisory' and objsubid = 1 and pid <> pg_backend_pid()"
                "  and pid = substring(s.taken_by from ' #([0-9]+)$')::int"
                "  and classid = ((hashtextextended(%s, 0) >> 32) & 4294967295)::oid"
                "  and objid = (hashtextextended(%s, 0) & 4294967295)::oid))"
                " order by n limit %s for update skip locked"
            ).format(self.slices),
            [self.job, run_id, self.lock, self.lock, count],
        ).fetchall()
        out: list[Piece] = []
        for n, low, high in rows:
            if out and n != out[-1].n + 1:
                break  # the next one is another slice's: the range ends here
            out.append(
                Piece(
                    n=int(n),
                    low=tuple(low) if low is not None else None,
                    high=tuple(high) if high is not None else None,
                )
            )
        return out

    def hold(self, run_id: int, pieces: list[Piece]) -> None:
        """Keep ``pieces`` (claimed in this transaction) this slice's across
        its commits: marked with this server process (``<worker> #<pid>``),
        which :meth:`claim` skips while that process holds the recompute
        lock. Queued for the next round trip (the commit's)."""
        later(
            self.conn,
            sql.SQL(
                "update {} set taken_by = %s || ' #' || pg_backend_pid()"
                " where job = %s and run = %s and n = any(%s)"
            ).format(self.slices),
            (self.worker, self.job, run_id, [p.n for p in pieces]),
        )

    def add(self, run_id: int, sums: dict[str, float]) -> None:
        """Add ``sums`` (some of :data:`SUMS`) to the run, with the next
        round trip: what a slice's chunks committed before the slice is done."""
        names = [name for name in SUMS if name in sums]
        adds = sql.SQL(", ").join(
            sql.SQL("{c} = {c} + %s").format(c=sql.Identifier(name)) for name in names
        )
        later(
            self.conn,
            sql.SQL("update {} set {} where job = %s and id = %s").format(self.runs, adds),
            (*(sums[name] for name in names), self.job, run_id),
        )

    def left(self, run_id: int) -> int:
        """Pieces not done (free or held by a slice under way)."""
        row = execute(
            self.conn,
            sql.SQL(
                "select count(*) from {} where job = %s and run = %s and state = 'todo'"
            ).format(self.slices),
            [self.job, run_id],
        ).fetchone()
        return int(row[0]) if row else 0

    def done(
        self, run_id: int, pieces: list[Piece], rows: int, seconds: float, sums: dict[str, float]
    ) -> tuple[int, int]:
        """Mark ``pieces`` done by this process and add a slice's ``sums``
        (:data:`SUMS`) to the run: queued for the slice's commit's round
        trip but the run's row, whose update (the last statement before the
        commit: it holds that row until then, serializing the slices' ends)
        says how many pieces are done of how many, and how many sessions
        hold the recompute lock (:attr:`processes`)."""
        later(
            self.conn,
            sql.SQL(
                "update {} set state = 'done', taken_by = %s, done_at = clock_timestamp(),"
                " rows = %s, seconds = %s where job = %s and run = %s and n = any(%s)"
            ).format(self.slices),
            (
                self.worker,
                rows,
                seconds / max(1, len(pieces)),
                self.job,
                run_id,
                [p.n for p in pieces],
            ),
        )
        adds = sql.SQL(", ").join(
            sql.SQL("{c} = {c} + %s").format(c=sql.Identifier(name)) for name in SUMS
        )
        (counted,) = send(
            self.conn,
            (
                sql.SQL(
                    "update {} set done = done + %s, slices = slices + 1,"
                    " touched_at = clock_timestamp(), {} where job = %s and id = %s"
                    " returning done, pieces, (select count(distinct pid) from pg_locks"
                    "  where locktype = 'advisory' and objsubid = 1 and granted"
                    "  and classid = ((hashtextextended(%s, 0) >> 32) & 4294967295)::oid"
                    "  and objid = (hashtextextended(%s, 0) & 4294967295)::oid)"
                ).format(self.runs, adds),
                (
                    len(pieces),
                    *(sums.get(name, 0) for name in SUMS),
                    self.job,
                    run_id,
                    self.lock,
                    self.lock,
                ),
            ),
        )
        row = counted.one()
        assert row is not None
        self.processes = max(1, int(row[2] or 0))
        return int(row[0]), int(row[1])

    def finish(self, run_id: int) -> dict[str, Any]:
        """The run's sums, its slices and the processes that took part; its
        rows deleted (with the caller's commit)."""
        names = sql.SQL(", ").join(map(sql.Identifier, SUMS))
        row = execute(
            self.conn,
            sql.SQL(
                "select pieces, slices, resumed, started_at, {names},"
                " (select array_agg(distinct taken_by order by taken_by) from {s}"
                "  where job = r.job and run = r.id)"
                " from {r} as r where job = %s and id = %s"
            ).format(names=names, s=self.slices, r=self.runs),
            [self.job, run_id],
        ).fetchone()
        assert row is not None
        pieces, slices, resumed, started_at, *sums, processes = row
        self.drop(run_id)
        return {
            "pieces": int(pieces),
            "slices": int(slices),
            "resumed": bool(resumed),
            "started_at": started_at,
            "processes": list(processes or []),
            **dict(zip(SUMS, sums, strict=True)),
        }


def in_progress(conn: Connection, schema: str) -> list[dict[str, Any]]:
    """Every sliced run in progress: job, pieces done of how many, rows
    written so far, when it started and last moved, the processes so far."""
    runs, slices = sql.Identifier(schema, "slice_run"), sql.Identifier(schema, "slice")
    rows = execute(
        conn,
        sql.SQL(
            "select r.job, r.done, r.pieces, r.slices, r.inserted + r.updated + r.deleted,"
            " r.started_at, r.touched_at, r.resumed,"
            " (select array_agg(distinct regexp_replace(taken_by, ' #[0-9]+$', '')) from {s}"
            "  where job = r.job and run = r.id and taken_by is not null)"
            " from {r} as r order by r.job"
        ).format(r=runs, s=slices),
    ).fetchall()
    return [
        {
            "job": job,
            "done": done,
            "pieces": pieces,
            "slices": n,
            "written": int(written),
            "started_at": started,
            "touched_at": touched,
            "resumed": resumed,
            "processes": list(processes or []),
        }
        for job, done, pieces, n, written, started, touched, resumed, processes in rows
    ]


__all__ = ["SUMS", "Piece", "Runs", "SliceRun", "in_progress"]
