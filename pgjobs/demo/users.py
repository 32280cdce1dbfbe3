"""Simulated users: threads that delete, merge and change exams, timed.

:class:`Users` runs during a design's timed run: deleters (each deleting or
merging an exam every ``user_pause`` seconds) and one changer (changing an
exam's grading weight, and enqueuing it, every ``change_pause`` seconds).
Every enqueue is recorded in the design's :class:`~pgjobs.demo.lag.LagTally`
once its commit returns. :class:`UserDelete` is the one delete a scripted
interleaving plays, in a thread of its own.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

import pgjobs

from .design import Design
from .lag import current_xid
from .report import UserTally
from .scenario import DemoOptions, sqlstate


class Exams:
    """The ids of live exams; a user takes the ones it deletes or merges, so
    that two simulated users never pick the same victim."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)
        self._lock = threading.Lock()

    def take(self, rng: random.Random) -> int | None:
        with self._lock:
            if len(self._ids) < 10:
                return None
            i = rng.randrange(len(self._ids))
            self._ids[i], self._ids[-1] = self._ids[-1], self._ids[i]
            return self._ids.pop()

    def give_back(self, exam: int) -> None:
        with self._lock:
            self._ids.append(exam)

    def peek(self, rng: random.Random) -> int | None:
        with self._lock:
            return rng.choice(self._ids) if self._ids else None


class UserDelete(threading.Thread):
    """A user deleting one exam in a transaction of its own, timed."""

    def __init__(self, engine: Engine, exam: int) -> None:
        super().__init__(name=f"user-delete-{exam}", daemon=True)
        self.engine = engine
        self.exam = exam
        self.sqlstate: str | None = None
        self.seconds = 0.0
        self.pid: int | None = None
        self._has_pid = threading.Event()

    def run(self) -> None:
        with self.engine.connect() as conn:
            self.pid = int(conn.execute(text("select pg_backend_pid()")).scalar_one())
            conn.commit()
            self._has_pid.set()
            started = time.perf_counter()
            try:
                with conn.begin():
                    conn.execute(text("delete from exam where id = :x"), {"x": self.exam})
            except DBAPIError as exc:
                self.sqlstate = sqlstate(exc)
            finally:
                self.seconds = time.perf_counter() - started

    def wait_until_blocked(self, timeout: float = 30.0) -> None:
        """Return once the delete waits for a lock (seen in pg_stat_activity)."""
        self._has_pid.wait(timeout)
        deadline = time.monotonic() + timeout
        with self.engine.connect() as conn:
            while time.monotonic() < deadline and self.is_alive():
                waiting = conn.execute(
                    text("select wait_event_type = 'Lock' from pg_stat_activity where pid = :pid"),
                    {"pid": self.pid},
                ).scalar()
                conn.rollback()
                if waiting:
                    return
                time.sleep(0.01)  # polling a state, not ordering steps
        raise pgjobs.PgJobsError(
            f"demo: the user's delete of exam {self.exam} never waited for a lock"
        )


class Users:
    """Threads that delete, merge and change exams, timed."""

    def __init__(
        self, design: Design, exams: Exams, opts: DemoOptions, stop: threading.Event
    ) -> None:
        self.design = design
        self.exams = exams
        self.opts = opts
        self.stop = stop
        self.tally = UserTally()

    def threads(self) -> list[threading.Thread]:
        out = [
            threading.Thread(target=self._deleter, args=(i,), name=f"user-{i}")
            for i in range(self.opts.users)
        ]
        out.append(threading.Thread(target=self._changer, name="user-changes"))
        return out

    def _deleter(self, i: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + i)
        while not self.stop.is_set():
            if rng.random() < self.opts.merge_share:
                self._merge(rng)
            else:
                self._delete(rng)
            self.stop.wait(self.opts.user_pause)

    def _delete(self, rng: random.Random) -> None:
        exam = self.exams.take(rng)
        if exam is None:
            return
        started = time.perf_counter()
        try:
            with self.design.engine.connect() as conn, conn.begin():
                conn.execute(text("delete from exam where id = :x"), {"x": exam})
        except DBAPIError as exc:
            self.tally.failed(sqlstate(exc), time.perf_counter() - started)
            self.exams.give_back(exam)
            return
        self.tally.done("delete", time.perf_counter() - started)

    def _merge(self, rng: random.Random) -> None:
        """Merge exam ``a`` into ``b``: lock both (key order), move a's
        submissions to b, delete a (cascading), enqueue b."""
        a, b = self.exams.take(rng), self.exams.take(rng)
        if a is None or b is None:
            for x in (a, b):
                if x is not None:
                    self.exams.give_back(x)
            return
        started = time.perf_counter()
        try:
            with self.design.engine.connect() as conn:
                with conn.begin():
                    conn.execute(
                        text("select id from exam where id = any(:ids) order by id for update"),
                        {"ids": [a, b]},
                    )
                    conn.execute(
                        text(
                            "insert into submission (exam_id, student_id, points)"
                            " select :b, student_id, points from submission where exam_id = :a"
                            " on conflict (exam_id, student_id)"
                            " do update set points = submission.points + excluded.points"
                        ),
                        {"a": a, "b": b},
                    )
                    conn.execute(text("delete from exam where id = :a"), {"a": a})
                    self.design.enqueue(conn, b)
                    xid = current_xid(conn)
                committed = time.monotonic()
        except DBAPIError as exc:
            self.tally.failed(sqlstate(exc), time.perf_counter() - started)
            self.exams.give_back(a)
            self.exams.give_back(b)
            return
        self.design.lag.enqueued(b, xid, committed)
        self.exams.give_back(b)
        self.tally.done("merge", time.perf_counter() - started)

    def _changer(self) -> None:
        """Change an exam's grading weight and enqueue it, atomically."""
        rng = random.Random(self.opts.seed * 1000 + 999)
        while not self.stop.is_set():
            exam = self.exams.peek(rng)
            if exam is not None:
                self._change(exam)
            self.stop.wait(self.opts.change_pause)

    def _change(self, exam: int) -> None:
        try:
            with self.design.engine.connect() as conn:
                with conn.begin():
                    conn.execute(
                        text("update exam set weight = weight % 5 + 1 where id = :x"), {"x": exam}
                    )
                    self.design.enqueue(conn, exam)
                    xid = current_xid(conn)
                committed = time.monotonic()
        except DBAPIError as exc:
            self.tally.failed(sqlstate(exc))
            return
        self.design.lag.enqueued(exam, xid, committed)
        self.tally.done("change")


__all__ = [
    "Exams",
    "UserDelete",
    "Users",
]
