"""Derived tables declared once, on the field report's schema, driven as users do.

exam, submission, answer -> exam_score -> exam_rank, declared in a
``pgjobs.toml`` alone (the issue's form). Two parts:

1. **The writers' cost.** A user's statement on a source, with pgjobs'
   triggers and without (a twin schema with the same tables and data, no
   triggers), A/B interleaved statement by statement: an INSERT and an
   UPDATE of 1 and of 1,000 rows, on ``submission`` (a source given as
   columns: the row carries the key) and on ``answer`` (a source given as an
   SQL text that maps the row through a join), and on ``exam_score`` (a
   derived table read by another: what a worker's write costs). Each
   statement in a transaction of its own, timed from the client to its
   COMMIT; the median of ``--reps`` each.
2. **Users under ``pgjobs run``.** ``pgjobs run`` in a child process, as a
   user starts it; ``--users`` threads insert, update and delete answers,
   submissions and exams through plain SQL (no enqueue anywhere) for
   ``--seconds``; a probe thread, on exams of its own, commits an answer
   that makes a new student first of an exam and waits for that rank in
   ``exam_rank``: the latency from a user's commit to the rank's update
   (p50 / p95). Then the users stop, the queues drain, and both levels are
   compared with a from-scratch derivation, with no extra recompute.

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        python benchmarks/derived_bench.py [--seconds 60] [--users 4] [--reps 30]

Prints the machine reference (``_machine.py``) and the load average beside
the figures. The machine is shared: read the A/B ratios, not the absolute
times. Results are printed, never committed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _machine import describe, reference  # noqa: E402

SCHEMA = """
create table exam (exam_id bigint primary key, title text not null default '');
create table submission (
    submission_id bigint primary key,
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null);
create index on submission (exam_id);
create table answer (
    answer_id bigint primary key,
    submission_id bigint not null references submission on delete cascade,
    points int not null);
create index on answer (submission_id);
create table exam_score (
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null, score bigint not null,
    primary key (exam_id, student_id));
create table exam_rank (
    exam_id bigint not null references exam on delete cascade,
    student_id bigint not null, rank bigint not null,
    primary key (exam_id, student_id));
"""
FILL = """
insert into exam select g from generate_series(1, {exams}) g;
insert into submission select e * 100 + s, e, s from generate_series(1, {exams}) e,
    generate_series(1, {students}) s;
insert into answer select (e * 100 + s) * 10 + q, e * 100 + s, (e * 7 + s * 3 + q) %% 10
    from generate_series(1, {exams}) e, generate_series(1, {students}) s,
    generate_series(1, {questions}) q;
analyze;
"""
SCORE_SQL = (
    "select s.exam_id, s.student_id, sum(a.points) as score from submission s"
    " join answer a on a.submission_id = s.submission_id group by 1, 2"
)
RANK_SQL = (
    "select exam_id, student_id, rank() over (partition by exam_id order by score desc) as rank"
    " from exam_score"
)
TOML = f"""
database = "{{url}}"

[derived.exam_score]
target = "exam_score"
scope = ["exam_id"]
sql = "{SCORE_SQL}"
every = "1h"

[derived.exam_score.sources]
submission = ["exam_id"]
answer = "select s.exam_id from submission s where s.submission_id = answer.submission_id"

[derived.exam_rank]
target = "exam_rank"
scope = ["exam_id"]
sql = "{RANK_SQL}"

[derived.exam_rank.sources]
exam_score = ["exam_id"]
"""


def fresh(server: str, name: str) -> str:
    with psycopg.connect(server, autocommit=True) as pg:
        pg.execute(f'drop database if exists "{name}"')
        pg.execute(f'create database "{name}"')
    base, _, _ = server.rpartition("/")
    return f"{base}/{name}"


def drop(server: str, name: str) -> None:
    with psycopg.connect(server, autocommit=True) as pg:
        pg.execute(f'drop database if exists "{name}" with (force)')


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


# -- part 1: the writers' cost -------------------------------------------------------------
STATEMENTS = {
    # (source shape, rows): (the statement, how to undo it)
    ("submission (columns)", "insert"): (
        "insert into {s}.submission select 9000000 + g, 1 + g %% {exams}, 9000 + g"
        " from generate_series(1, {n}) g",
        "delete from {s}.submission where submission_id > 9000000",
    ),
    ("submission (columns)", "update"): (
        "update {s}.submission set student_id = student_id + 0"
        " where submission_id in (select submission_id from {s}.submission order by"
        " submission_id limit {n})",
        None,
    ),
    ("answer (mapping SQL)", "insert"): (
        "insert into {s}.answer select 90000000 + g, 101 + (g %% {students}), 1"
        " from generate_series(1, {n}) g",
        "delete from {s}.answer where answer_id > 90000000",
    ),
    ("answer (mapping SQL)", "update"): (
        "update {s}.answer set points = points + 0 where answer_id in"
        " (select answer_id from {s}.answer order by answer_id limit {n})",
        None,
    ),
    ("exam_score (chain)", "update"): (
        "update {s}.exam_score set score = score + 0 where (exam_id, student_id) in"
        " (select exam_id, student_id from {s}.exam_score order by 1, 2 limit {n})",
        None,
    ),
}


def writers_cost(url: str, args: argparse.Namespace) -> None:
    from sqlalchemy import create_engine

    import pgjobs
    from pgjobs.derived import Derived

    print("\n== the writers' cost: a statement with the triggers (A) and without (B) ==")
    sizes = {"exams": 200, "students": 20, "questions": 5}
    with psycopg.connect(url, autocommit=True) as pg:
        for schema in ("with_triggers", "without"):
            pg.execute(f"create schema {schema}")
            pg.execute(f"set search_path = {schema}")
            pg.execute(SCHEMA)
            pg.execute(FILL.replace("%%", "%").format(**sizes))
            pg.execute(f"insert into {schema}.exam_score {SCORE_SQL}")
    engine = create_engine(url, connect_args={"options": "-c search_path=with_triggers"})
    config = pgjobs.load_config(_write_toml(url))
    declared: list[Derived] = list(config.derived)
    pgjobs.install(engine, derived=declared)
    engine.dispose()
    print(
        f"{sizes['exams']} exams x {sizes['students']} students x {sizes['questions']} answers;"
        f" {args.reps} statements each way, interleaved; median ms per statement, to its commit"
    )
    print(
        "ms: from the client, to the commit (A with the triggers, B without, A-B); on the"
        " server (EXPLAIN ANALYZE, rolled back): B's execution, A's trigger alone"
    )
    print(
        f"{'source shape':24} {'statement':10} {'rows':>6} {'A trig':>8} {'B none':>8} {'A-B':>8}"
        f"   {'B exec':>8} {'trigger':>8}"
    )
    with psycopg.connect(url, autocommit=True) as pg:
        for (shape, verb), (text, undo) in STATEMENTS.items():
            for rows in (1, 1000):
                times: dict[str, list[float]] = {"with_triggers": [], "without": []}
                for rep in range(args.reps):
                    order = (
                        ("with_triggers", "without")
                        if rep % 2 == 0
                        else ("without", "with_triggers")
                    )
                    for schema in order:
                        statement = text.replace("%%", "%").format(s=schema, n=rows, **sizes)
                        started = time.perf_counter()
                        with pg.transaction():
                            pg.execute(statement)
                        times[schema].append(1000 * (time.perf_counter() - started))
                        if undo:
                            pg.execute(undo.format(s=schema))
                        pg.execute("delete from pgjobs.queue")
                a = statistics.median(times["with_triggers"])
                b = statistics.median(times["without"])
                server = _server_side(pg, text, rows, sizes, args.reps)
                print(
                    f"{shape:24} {verb:10} {rows:>6} {a:8.2f} {b:8.2f} {a - b:8.2f}"
                    f"   {server[0]:8.2f} {server[1]:8.2f}"
                )


def _server_side(
    pg: psycopg.Connection[Any], text: str, rows: int, sizes: dict[str, int], reps: int
) -> tuple[float, float]:
    """The server's own times, under less noise than a client's round trip
    and commit: the statement's execution without triggers, and pgjobs'
    trigger's time with them (``EXPLAIN ANALYZE``'s ``Trigger`` line, which
    counts a statement-level trigger too), medians, each rolled back."""
    plain: list[float] = []
    trigger: list[float] = []
    for _ in range(reps):
        for schema in ("without", "with_triggers"):
            statement = text.replace("%%", "%").format(s=schema, n=rows, **sizes)
            with pg.transaction(force_rollback=True):
                row = pg.execute("explain (analyze, format json) " + statement).fetchone()
            assert row is not None
            plan = row[0][0]
            if schema == "without":
                plain.append(float(plan["Execution Time"]))
            else:
                trigger.append(
                    sum(
                        float(t["Time"])
                        for t in plan.get("Triggers", ())
                        if t["Trigger Name"].startswith("pgjobs_")
                    )
                )
    return statistics.median(plain), statistics.median(trigger)


def _write_toml(url: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="derived-bench-"))
    path = folder / "pgjobs.toml"
    path.write_text(TOML.format(url=url), encoding="utf-8")
    return path


# -- part 2: users under pgjobs run -----------------------------------------------------------
class Users:
    def __init__(self, url: str, exams: int, probe_exams: range, seed: int) -> None:
        self.url = url
        self.exams = exams
        self.probe_exams = probe_exams
        self.stop = threading.Event()
        self.statements = 0
        self.errors: dict[str, int] = {}
        self.latency: list[float] = []
        #: (ms, wall clock at the rank's update, exam), for the slowest's story
        self.slowest: list[tuple[float, float, int]] = []
        self.lock = threading.Lock()
        self.seed = seed
        self.next_id = 50_000_000

    def new_id(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id

    def user(self, index: int) -> None:
        rnd = random.Random(self.seed * 100 + index)
        with psycopg.connect(self.url, autocommit=True) as pg:
            while not self.stop.is_set():
                exam = rnd.randint(1, self.exams)
                action = rnd.random()
                try:
                    if action < 0.35:  # a student answers
                        pg.execute(
                            "insert into answer select %s, submission_id, %s from submission"
                            " where exam_id = %s order by random() limit 1",
                            (self.new_id(), rnd.randint(0, 10), exam),
                        )
                    elif action < 0.65:  # a grader changes points
                        pg.execute(
                            "update answer set points = %s where answer_id = (select a.answer_id"
                            " from answer a join submission s using (submission_id)"
                            " where s.exam_id = %s limit 1)",
                            (rnd.randint(0, 10), exam),
                        )
                    elif action < 0.8:  # an answer withdrawn
                        pg.execute(
                            "delete from answer where answer_id = (select a.answer_id from answer a"
                            " join submission s using (submission_id) where s.exam_id = %s"
                            " order by a.answer_id desc limit 1)",
                            (exam,),
                        )
                    elif action < 0.9:  # a new submission with one answer
                        sub = self.new_id()
                        with pg.transaction():
                            pg.execute(
                                "insert into submission values (%s, %s, %s)",
                                (sub, exam, rnd.randint(1, 1000)),
                            )
                            pg.execute(
                                "insert into answer values (%s, %s, %s)", (self.new_id(), sub, 5)
                            )
                    elif action < 0.97:  # a submission moved to another exam
                        pg.execute(
                            "update submission set exam_id = %s where submission_id ="
                            " (select submission_id from submission where exam_id = %s limit 1)",
                            (rnd.randint(1, self.exams), exam),
                        )
                    else:  # an exam deleted and created again
                        with pg.transaction():
                            pg.execute("delete from exam where exam_id = %s", (exam,))
                            pg.execute("insert into exam values (%s)", (exam,))
                    with self.lock:
                        self.statements += 1
                except psycopg.Error as exc:
                    name = type(exc).__name__
                    with self.lock:
                        self.errors[name] = self.errors.get(name, 0) + 1

    def probe(self) -> None:
        """Commit an answer that makes a new student first of a probe exam;
        wait for that rank in exam_rank."""
        with psycopg.connect(self.url, autocommit=True) as pg:
            while not self.stop.is_set():
                for exam in self.probe_exams:
                    if self.stop.is_set():
                        return
                    sub, student = self.new_id(), self.new_id()
                    with pg.transaction():
                        pg.execute(
                            "insert into submission values (%s, %s, %s)", (sub, exam, student)
                        )
                        pg.execute(
                            "insert into answer values (%s, %s, %s)",
                            (self.new_id(), sub, 10**6 + sub),
                        )
                    committed = time.perf_counter()
                    deadline = committed + 30
                    while time.perf_counter() < deadline:
                        row = pg.execute(
                            "select rank from exam_rank where exam_id = %s and student_id = %s",
                            (exam, student),
                        ).fetchone()
                        if row is not None and row[0] == 1:
                            self.latency.append(1000 * (time.perf_counter() - committed))
                            self.slowest.append((self.latency[-1], time.time(), exam))
                            break
                        time.sleep(0.002)
                    time.sleep(0.05)


def users_under_run(url: str, args: argparse.Namespace) -> None:
    print(
        f"\n== {args.users} users through plain SQL under `pgjobs run` for {args.seconds:.0f} s =="
    )
    exams, probes = 1000, 20
    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(SCHEMA)
        pg.execute(FILL.replace("%%", "%").format(exams=exams + probes, students=10, questions=5))
    path = _write_toml(url)
    env = {**os.environ, "PGJOBS_LOAD_PLUGINS": "", "PGJOBS_CONFIG": str(path)}
    subprocess.run(
        [sys.executable, "-m", "pgjobs.cli", "migrate"], env=env, check=True, capture_output=True
    )
    log = path.parent / "run.log"  # a file: an unread pipe fills up and stops the process
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "pgjobs.cli", "run"], env=env, stdout=out, stderr=out
        )
    try:
        with psycopg.connect(url, autocommit=True) as pg:
            for _ in range(600):  # the first fill: both recomputes ran once
                ran = pg.execute(
                    "select count(*) from pgjobs.job_state where job in ('exam_score', 'exam_rank')"
                    " and last_success_at is not null"
                ).fetchone()
                if ran and ran[0] == 2:
                    break
                time.sleep(0.1)
            else:
                raise SystemExit("the first recomputes did not run in 60 s")
        users = Users(url, exams, range(exams + 1, exams + probes + 1), args.seed)
        threads = [threading.Thread(target=users.user, args=(i,)) for i in range(args.users)]
        threads.append(threading.Thread(target=users.probe))
        started = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        users.stop.set()
        for t in threads:
            t.join()
        with psycopg.connect(url, autocommit=True) as pg:
            drained_at = None
            for _ in range(1200):
                left = pg.execute(
                    "select count(*) from pgjobs.queue where dead_at is null"
                ).fetchone()
                if left and left[0] == 0:
                    drained_at = time.perf_counter()
                    break
                time.sleep(0.05)
            dead = pg.execute(
                "select count(*) from pgjobs.queue where dead_at is not null"
            ).fetchone()
            runs = pg.execute(
                "select job, count(*) filter (where outcome = 'ran'), count(*) filter"
                " (where outcome = 'failed') from pgjobs.run group by job order by job"
            ).fetchall()
            wrong_score = pg.execute(
                f"select count(*) from ((select * from exam_score except all select * from ({SCORE_SQL}) q)"
                f" union all (select * from ({SCORE_SQL}) q except all select * from exam_score)) d"
            ).fetchone()
            wrong_rank = pg.execute(
                f"select count(*) from ((select * from exam_rank except all select * from ({RANK_SQL.replace('exam_score', f'({SCORE_SQL}) s')}) q)"
                f" union all (select * from ({RANK_SQL.replace('exam_score', f'({SCORE_SQL}) s')}) q except all select * from exam_rank)) d"
            ).fetchone()
            rows = pg.execute(
                "select (select count(*) from exam_score), (select count(*) from exam_rank)"
            ).fetchone()
    finally:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
    elapsed = time.perf_counter() - started
    print(
        f"user statements: {users.statements:,} ({users.statements / args.seconds:.0f}/s);"
        f" errors: {users.errors or 'none'}"
    )
    print(
        f"commit -> rank updated (probe, {len(users.latency)} commits): p50"
        f" {pct(users.latency, 0.5):.0f} ms, p95 {pct(users.latency, 0.95):.0f} ms,"
        f" max {max(users.latency, default=float('nan')):.0f} ms"
    )
    for ms, at, exam in sorted(users.slowest, reverse=True)[:3]:
        print(
            f"  slow: {ms:.0f} ms, exam {exam}, rank seen at {time.strftime('%H:%M:%S', time.gmtime(at))}.{int(at % 1 * 1000):03d} UTC"
        )
    drained = (
        "did not drain"
        if drained_at is None
        else f"drained {drained_at - started - args.seconds:.1f} s after the users stopped"
    )
    print(f"queues {drained}; dead items: {dead[0] if dead else '?'}; elapsed {elapsed:.0f} s")
    print("runs (ran, failed): " + ", ".join(f"{j} {r}/{f}" for j, r, f in runs))
    print(f"(pgjobs run's log: {log})")
    assert rows is not None and wrong_score is not None and wrong_rank is not None
    print(
        f"after draining, no extra recompute: exam_score {rows[0]:,} rows, {wrong_score[0]} differ"
        f" from a from-scratch derivation; exam_rank {rows[1]:,} rows, {wrong_rank[0]} differ"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-users", action="store_true")
    args = parser.parse_args()
    server = os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    print(describe(reference(server)) + f"; load average {os.getloadavg()[0]:.2f}")
    if not args.skip_cost:
        url = fresh(server, "pgjobs_derived_bench_cost")
        try:
            writers_cost(url, args)
        finally:
            drop(server, "pgjobs_derived_bench_cost")
    if not args.skip_users:
        url = fresh(server, "pgjobs_derived_bench_users")
        try:
            users_under_run(url, args)
        finally:
            drop(server, "pgjobs_derived_bench_users")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
