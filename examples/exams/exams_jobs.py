"""The exams scenario as a pgjobs plugin: the jobs ``pgjobs demo`` runs.

Tables (``schema.sql``): ``exam`` (the parents), ``submission`` (the source
data), ``exam_score`` (the derived rows: a foreign key to ``exam``, on
delete cascade) and ``exam_status`` (one row per exam).

Two jobs rewrite ``exam_score``. They share the lock group ``exams`` (pgjobs
refuses two jobs writing one table from different groups), so they never run
at the same time, and neither ever waits for the other:

* ``exam-worker``, a :class:`pgjobs.QueueJob`: every second, the exams the
  application enqueued (see :func:`change_weight`) get their scores rewritten
  — only the rows that differ — and then their status row upserted.
* ``exam-scores``, a :class:`pgjobs.RecomputeJob`: every 15 minutes, every
  score is computed again from scratch, holding no row lock while it
  computes, and only the difference is written.

pgjobs finds this module through ``plugins = ["exams_jobs"]`` in the
``pgjobs.toml`` next to it; a packaged plugin declares an entry point in the
``pgjobs`` group instead (see ``plugins/`` in the repository).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

import pgjobs

#: Every exam's scores, from scratch. The columns are exam_score's.
SCORES = """
    select s.exam_id, s.student_id, s.points * e.weight as score
    from submission s
    join exam e on e.id = s.exam_id
"""


#: The scores of one batch of queued exams: pgjobs binds ``:keys`` to the
#: batch's exam ids (the values of the job's one ``scope`` column).
SCORES_FOR_BATCH = SCORES + " where s.exam_id = any(:keys)"


def upsert_status(conn: Connection, keys: list[tuple[Any, ...]], stats: pgjobs.DiffStats) -> None:
    """The queue job's ``after``: the status rows, written last.

    pgjobs has already locked the batch's exams (``FOR KEY SHARE``) and
    written their scores, so the order is the same as a user's cascading
    delete — parent, derived rows, status — and the two cannot deadlock.
    """
    conn.execute(
        text(
            """
            insert into exam_status (exam_id, students, scored_at)
            select e.id, count(sc.student_id), now()
            from exam e left join exam_score sc on sc.exam_id = e.id
            where e.id = any(:ids)
            group by e.id
            on conflict (exam_id) do update
                set students = excluded.students, scored_at = excluded.scored_at
            """
        ),
        {"ids": [exam_id for (exam_id,) in keys]},
    )


@pgjobs.hookimpl
def pgjobs_register_jobs(register: Any) -> None:
    """Register the scenario's two jobs."""
    register(
        pgjobs.QueueJob(
            name="exam-worker",
            group="exams",
            target="exam_score",
            scope=("exam_id",),  # a queue item is an exam: its rows are those with its exam_id
            compute=SCORES_FOR_BATCH,
            after=upsert_status,
            every="1s",
            batch_size=100,
            description="rewrite the scores of the exams the application changed",
        )
    )
    register(
        pgjobs.RecomputeJob(
            name="exam-scores",
            group="exams",
            target="exam_score",
            compute=SCORES,
            every="15m",
            backoff="1h",  # a failing recompute must not monopolize the lock
            description="recompute every score from scratch, write the difference",
        )
    )


def change_weight(conn: Connection, exam_id: int, weight: int) -> None:
    """Application code: change an exam and enqueue it in the same
    transaction, so that the worker sees the change or the item not at all.

    >>> with engine.begin() as conn:
    ...     change_weight(conn, 42, 3)
    """
    conn.execute(text("update exam set weight = :w where id = :id"), {"w": weight, "id": exam_id})
    pgjobs.enqueue(conn, "exam-worker", [exam_id])
