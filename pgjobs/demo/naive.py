"""The naive design: the field report's two jobs, as they were written.

The recompute locks every status row, deletes every score, computes (slowly)
and reinserts, holding those row locks and the reinsert's FK checks for the
whole computation. The worker rewrites one item per transaction, scores
first and status last: the opposite lock order. Its queue is a plain table
(``naive_queue``, ``on conflict do nothing``). Two scripted interleavings
show what follows: a deadlock (recompute vs a user's delete) and a
foreign-key violation (worker vs a user's delete). See ``design.py`` for the
interface, ``pgjobs_design.py`` for the same jobs through pgjobs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from .design import Design
from .lag import current_snapshot
from .report import Scripted
from .scenario import COMPUTE_SQL, UPSERT_STATUS, DemoOptions, sqlstate
from .users import UserDelete

_CLAIM = (
    "delete from naive_queue where exam_id = (select exam_id from naive_queue"
    " order by exam_id limit 1 for update skip locked) returning exam_id"
)
_EXISTS = "select 1 from exam where id = :x"
_INSERT_SCORES = (
    "insert into exam_score (exam_id, student_id, score)"
    " select * from unnest(cast(:e as bigint[]), cast(:s as integer[]), cast(:v as integer[]))"
)


@dataclass(frozen=True, slots=True)
class _ItemDone:
    inserted: int = 0
    deleted: int = 0
    compute: float = 0.0
    write: float = 0.0


class Naive(Design):
    """The field report's design, as it was."""

    name = "naive"
    schema_suffix = "naive"

    @staticmethod
    def wanted(opts: DemoOptions) -> bool:
        return opts.naive

    def enqueue(self, conn: Connection, exam: int) -> None:
        conn.execute(
            text("insert into naive_queue values (:x) on conflict do nothing"), {"x": exam}
        )

    def start_jobs(self, stop: threading.Event) -> None:
        self._threads = [
            threading.Thread(target=self._recompute_loop, args=(stop,), name="naive-recompute"),
            threading.Thread(target=self._worker_loop, args=(stop,), name="naive-worker"),
        ]
        for t in self._threads:
            t.start()

    def stop_jobs(self) -> None:
        for t in self._threads:
            t.join()

    # -- the recompute ---------------------------------------------------------

    # The recompute: lock the status rows, delete every derived row, compute
    # (slowly), reinsert. Every row lock is held for the whole computation,
    # and the reinsert's FK checks want KEY SHARE on parents that users are
    # deleting, while those deletes wait for the derived rows locked here.
    def _recompute_once(self, *, before_compute: Callable[[], None] | None = None) -> None:
        started = time.perf_counter()
        try:
            with self.engine.connect() as conn, conn.begin():
                locked_at = time.perf_counter()
                conn.execute(text("select exam_id from exam_status order by exam_id for update"))
                deleted = conn.execute(text("delete from exam_score")).rowcount
                if before_compute is not None:
                    before_compute()
                t0 = time.perf_counter()
                conn.execute(text("select pg_sleep(:s)"), {"s": self.opts.compute_seconds})
                conn.execute(text("create temp table fresh on commit drop as " + COMPUTE_SQL))
                t1 = time.perf_counter()
                inserted = conn.execute(
                    text("insert into exam_score (exam_id, student_id, score) select * from fresh")
                ).rowcount
                conn.execute(text("update exam_status set scored_at = now()"))
                t2 = time.perf_counter()
            self.recompute.add(
                "ran",
                inserted=inserted,
                deleted=deleted,
                compute=t1 - t0,
                write=t2 - t1,
                row_lock=time.perf_counter() - locked_at,
            )
        except DBAPIError as exc:
            self.recompute.add(
                "failed", error=sqlstate(exc), row_lock=time.perf_counter() - started
            )
            raise

    def _recompute_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(DBAPIError):
                self._recompute_once()
            stop.wait(max(0.0, self.opts.recompute_every - (time.monotonic() - started)))

    # -- the worker ------------------------------------------------------------

    # One item per transaction, its derived rows first, its status row last:
    # the opposite of the recompute's order.
    def _work_item(self, *, after_compute: Callable[[int], None] | None = None) -> _ItemDone | None:
        with self.engine.connect() as conn:
            with conn.begin():
                row = conn.execute(text(_CLAIM)).first()
                if row is None:
                    return None
                exam = int(row[0])
                # Taken before the compute: an enqueue it saw committed is one
                # the compute sees too (see lag.py).
                snapshot = current_snapshot(conn)
                if conn.execute(text(_EXISTS), {"x": exam}).first() is None:
                    return _ItemDone()  # deleted since it was queued: drop the item
                t0 = time.perf_counter()
                rows = conn.execute(text(COMPUTE_SQL + " where s.exam_id = :x"), {"x": exam}).all()
                if after_compute is not None:
                    after_compute(exam)
                t1 = time.perf_counter()
                deleted = conn.execute(
                    text("delete from exam_score where exam_id = :x"), {"x": exam}
                ).rowcount
                if rows:
                    conn.execute(
                        text(_INSERT_SCORES),
                        {
                            "e": [r[0] for r in rows],
                            "s": [r[1] for r in rows],
                            "v": [r[2] for r in rows],
                        },
                    )
                conn.execute(text(UPSERT_STATUS), {"ids": [exam]})
                t2 = time.perf_counter()
            self.lag.processed([exam], snapshot, time.monotonic())
        return _ItemDone(inserted=len(rows), deleted=deleted, compute=t1 - t0, write=t2 - t1)

    def _worker_pass(self, stop: threading.Event | None) -> None:
        """Work items one by one until the queue is empty (or an item fails:
        its claim is rolled back, so it stays queued for the next pass)."""
        done: list[_ItemDone] = []
        error: str | None = None
        while stop is None or not stop.is_set():
            try:
                item = self._work_item()
            except DBAPIError as exc:
                error = sqlstate(exc)
                break
            if item is None:
                break
            done.append(item)
        if not done and error is None:
            self.worker.add("idle")
            return
        self.worker.add(
            "failed" if error else "ran",
            error=error,
            inserted=sum(d.inserted for d in done),
            deleted=sum(d.deleted for d in done),
            items=len(done),
            compute=sum(d.compute for d in done),
            write=sum(d.write for d in done),
            # each item's locks are held for its own write only
            row_lock=max((d.write for d in done), default=0.0),
        )

    def _worker_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._worker_pass(stop)
            stop.wait(self.opts.worker_every)

    def drain(self) -> None:
        for _ in range(1000):
            with self.engine.connect() as conn:
                if conn.execute(text("select not exists (select from naive_queue)")).scalar_one():
                    return
            self._worker_pass(None)

    # -- the scripted interleavings ----------------------------------------------

    def scripted(self) -> list[Scripted]:
        return [self._scripted_recompute(1), self._scripted_worker(2)]

    def _scripted_recompute(self, exam: int) -> Scripted:
        """The recompute has deleted every score and is computing; a user
        deletes an exam (it waits); the recompute reinserts (its FK check
        waits for the user): a deadlock, every time."""
        holding = threading.Event()
        go = threading.Event()
        job_error: list[str | None] = [None]

        def recompute() -> None:
            def pause() -> None:
                holding.set()
                go.wait(60)

            try:
                self._recompute_once(before_compute=pause)
            except DBAPIError as exc:
                job_error[0] = sqlstate(exc)
            finally:
                holding.set()

        job = threading.Thread(target=recompute, name="naive-recompute-scripted")
        user = UserDelete(self.engine, exam)
        job.start()
        try:
            holding.wait(60)
            user.start()
            user.wait_until_blocked()  # on the rows the recompute holds
        finally:
            go.set()
            job.join()
            if user.ident is not None:
                user.join()
        return Scripted(
            design=self.name,
            job="recompute",
            exam=exam,
            job_sqlstate=job_error[0],
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=False,
        )

    def _scripted_worker(self, exam: int) -> Scripted:
        """The worker has computed an item's rows; the user deletes that exam
        (nothing blocks it); the worker writes: a foreign-key violation."""
        with self.engine.connect() as conn, conn.begin():
            self.enqueue(conn, exam)
        user = UserDelete(self.engine, exam)
        job_error: list[str | None] = [None]
        done_during: list[bool] = [False]

        def delete_now(_exam: int) -> None:
            user.start()
            user.join()
            done_during[0] = True

        try:
            self._work_item(after_compute=delete_now)
        except DBAPIError as exc:
            job_error[0] = sqlstate(exc)
        return Scripted(
            design=self.name,
            job="worker",
            exam=exam,
            job_sqlstate=job_error[0],
            user_sqlstate=user.sqlstate,
            user_seconds=user.seconds,
            user_done_during_job=done_during[0],
        )


__all__ = [
    "Naive",
]
