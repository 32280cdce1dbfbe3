"""The demo's scenario, shared by every design: options, schema, seed data, SQL.

Exams (parents), their submissions (source data), the derived ``exam_score``
rows (a foreign key to ``exam``, ``on delete cascade``, ``students`` per
exam) and one ``exam_status`` row per exam. Each design gets a schema of its
own built by :func:`build`; its engine resolves these unqualified names there
(:func:`schema_engine`). The SQL is the same for every design: what differs
is how the jobs run it (``naive.py``, ``pgjobs_design.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import sql
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine

import pgjobs
from pgjobs._pg import sqlstate_of

DEADLOCK = "40P01"
FK_VIOLATION = "23503"

GROUP = "exams"
WORKER = "exam-worker"
RECOMPUTE = "exam-scores"

# -- the scenario's SQL (run with search_path set to the design's schema) -----

TABLES = (
    "create table exam (id bigint primary key, title text not null, weight integer not null)",
    "create table submission (exam_id bigint not null references exam on delete cascade,"
    " student_id integer not null, points integer not null, primary key (exam_id, student_id))",
    # The derived table: what both jobs rewrite.
    "create table exam_score (exam_id bigint not null references exam on delete cascade,"
    " student_id integer not null, score integer not null, primary key (exam_id, student_id))",
    "create table exam_status (exam_id bigint primary key references exam on delete cascade,"
    " students integer not null, scored_at timestamptz not null)",
    # The naive design's queue (pgjobs brings its own).
    "create table naive_queue (exam_id bigint primary key)",
)

#: The derived rows, computed from scratch.
COMPUTE_SQL = (
    "select s.exam_id, s.student_id, s.points * e.weight as score"
    " from submission s join exam e on e.id = s.exam_id"
)

SEED = (
    "insert into exam (id, title, weight)"
    " select g, 'exam ' || g, 1 + g % 3 from generate_series(1, :exams) g",
    "insert into submission (exam_id, student_id, points)"
    " select e, s, (e * 37 + s * 11) % 101"
    " from generate_series(1, :exams) e, generate_series(1, :students) s",
    "insert into exam_score (exam_id, student_id, score) " + COMPUTE_SQL,
    "insert into exam_status (exam_id, students, scored_at) select id, :students, now() from exam",
    # Grading rules changed overnight for one exam in twenty: the first
    # recompute has real work to do.
    "update exam set weight = weight + 1 where id % 20 = 0",
    "analyze",
)

UPSERT_STATUS = (
    "insert into exam_status (exam_id, students, scored_at)"
    " select e.id, count(sc.student_id), now() from exam e"
    " left join exam_score sc on sc.exam_id = e.id"
    " where e.id = any(:ids) group by e.id"
    " on conflict (exam_id) do update"
    " set students = excluded.students, scored_at = excluded.scored_at"
)

#: Scores (keys) whose row differs from a from-scratch computation: wrong,
#: missing or left over.
DRIFT = (
    "select count(distinct (exam_id, student_id)) from ("
    " (select exam_id, student_id, score from exam_score except all " + COMPUTE_SQL + ")"
    " union all"
    " (" + COMPUTE_SQL + " except all select exam_id, student_id, score from exam_score)"
    ") d"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    """The knobs of :func:`pgjobs.demo.run_demo` (``pgjobs demo --help``)."""

    #: length of each design's timed run
    seconds: float = 30.0
    #: also run the naive design, first, on a copy of the same data
    naive: bool = False
    exams: int = 10_000
    #: derived rows per exam
    students: int = 5
    #: the recompute's simulated expensive computation (``pg_sleep``)
    compute_seconds: float = 2.0
    recompute_every: float = 5.0
    worker_every: float = 1.0
    #: threads deleting and merging exams, each every ``user_pause`` seconds
    users: int = 2
    user_pause: float = 0.1
    #: the share of those operations that are merges
    merge_share: float = 0.3
    #: a thread changing one exam (and enqueuing it) every ``change_pause`` seconds
    change_pause: float = 0.1
    seed: int = 1
    #: a progress line on stderr every this many seconds (0: none)
    progress_every: float = 5.0

    def __post_init__(self) -> None:
        positive = (
            "seconds",
            "compute_seconds",
            "recompute_every",
            "worker_every",
            "user_pause",
            "change_pause",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise pgjobs.ConfigError(f"demo: {name}: expected a positive number, got {value!r}")
        if not isinstance(self.exams, int) or self.exams < 20:
            raise pgjobs.ConfigError(f"demo: exams: expected an integer >= 20, got {self.exams!r}")
        if not isinstance(self.students, int) or self.students < 1:
            raise pgjobs.ConfigError(
                f"demo: students: expected a positive integer, got {self.students!r}"
            )
        if not isinstance(self.users, int) or self.users < 0:
            raise pgjobs.ConfigError(f"demo: users: expected an integer >= 0, got {self.users!r}")
        if not 0 <= self.merge_share <= 1:
            raise pgjobs.ConfigError(f"demo: merge_share: expected 0..1, got {self.merge_share!r}")
        if self.progress_every < 0:
            raise pgjobs.ConfigError(
                f"demo: progress_every: expected >= 0, got {self.progress_every!r}"
            )


def sqlstate(exc: BaseException) -> str:
    """The SQLSTATE of the database error in ``exc``'s chain, else the
    exception's class name (what the tallies count failures by)."""
    return sqlstate_of(exc) or type(exc).__name__


# -- databases and schemas -------------------------------------------------------


def schema_engine(url: str, schema: str, *, pool_size: int = 12) -> Engine:
    """An engine whose connections resolve the scenario's unqualified table
    names in ``schema``."""
    engine = create_engine(url, pool_size=pool_size, max_overflow=8, pool_pre_ping=True)
    statement = sql.SQL("set search_path to {}").format(sql.Identifier(schema))

    @event.listens_for(engine, "connect")
    def _search_path(dbapi_connection: Any, _record: Any) -> None:
        # A session setting: committed so that the pool's reset (a rollback)
        # does not undo it.
        dbapi_connection.execute(statement)
        dbapi_connection.execute("set application_name to 'pgjobs demo'")
        dbapi_connection.commit()

    return engine


def admin(engine: Engine, statement: sql.Composable) -> None:
    """Run ``statement`` outside a transaction (``create`` / ``drop schema``)."""
    with engine.connect() as conn:
        raw: Any = conn.connection.driver_connection
        raw.autocommit = True
        try:
            raw.execute(statement)
        finally:
            raw.autocommit = False


def build(admin_engine: Engine, engine: Engine, schema: str, opts: DemoOptions) -> None:
    """Create ``schema`` with the scenario's tables and seed data (``engine``'s
    connections have ``schema`` as their search_path)."""
    admin(admin_engine, sql.SQL("create schema {}").format(sql.Identifier(schema)))
    with engine.connect() as conn, conn.begin():
        for ddl in TABLES:
            conn.execute(text(ddl))
        for statement in SEED:
            conn.execute(text(statement), {"exams": opts.exams, "students": opts.students})


def live_exams(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [int(r[0]) for r in conn.execute(text("select id from exam order by id"))]


def drift(engine: Engine) -> int:
    """Scores that differ from a from-scratch computation."""
    with engine.connect() as conn:
        return int(conn.execute(text(DRIFT)).scalar_one())


__all__ = [
    "COMPUTE_SQL",
    "DEADLOCK",
    "DRIFT",
    "FK_VIOLATION",
    "GROUP",
    "RECOMPUTE",
    "SEED",
    "TABLES",
    "UPSERT_STATUS",
    "WORKER",
    "DemoOptions",
    "admin",
    "build",
    "drift",
    "live_exams",
    "schema_engine",
    "sqlstate",
]
