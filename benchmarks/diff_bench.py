"""Side-by-side: pgjobs' diff writer against the usual ways of rewriting a derived table.

For each size (derived rows, about 5 per parent) and change rate (2 %, 100 %)
the same recompute (one SQL query over ``source``) is written into ``derived``
(FK to ``parent`` ON DELETE CASCADE) by:

  query      the recompute query alone into a temp table: the floor every
             method pays (writes nothing)
  pgjobs     RecomputeJob through pgjobs.Runner (stage, analyzed diff, parents
             FOR KEY SHARE, keyed delete/update/insert)
  pgjobs-chunked   the same with chunk_parents (largest size, 100 % only)
  naive      BEGIN; DELETE all; INSERT <query>; COMMIT
  recipe     the field report's recipe as literally described: compute into a
             temp table, anti-join DELETE, then WITH new_rows AS (anti-join),
             alive AS (... FOR KEY SHARE) INSERT ... JOIN alive
  upsert     INSERT ... ON CONFLICT DO UPDATE ... WHERE IS DISTINCT FROM, then
             an anti-join DELETE
  matview    REFRESH MATERIALIZED VIEW CONCURRENTLY over the same query

While each one runs, a user deletes a random parent every 50 ms (cascading to
``source`` and ``derived``); the latency of each delete is recorded. The data
is reset to the same starting point before every run.

Columns: total = wall time of the run; compute = computing the new rows into a
temp table (no row lock); write = everything after it; locks = from the first
row lock to the end of the writes. For naive and matview the phases cannot be
told apart (naive deletes before it computes).

    python benchmarks/diff_bench.py              # 50k and 500k rows
    python benchmarks/diff_bench.py --quick      # 10k rows, a smoke run
    python benchmarks/diff_bench.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Each (size, change rate) is measured ``--repeat`` times (3 by default), the
methods interleaved round by round, and the table shows for each method the
run whose total is the median, with the range of totals beside it: on a
shared 2-core machine one run of anything varies by up to 2x (a pure
Python loop does), and a single run decides nothing. The targets are
checked against those median runs.

Prints a table and writes JSON (every run, and the median ones) to
benchmarks/results/. Not a test: pytest never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import _machine
import psycopg
from psycopg import sql
from sqlalchemy import create_engine

import pgjobs
from pgjobs.testing import fresh_database

PER_PARENT = 5
DELETE_EVERY = 0.05

COMPUTE = (
    "select s.id, s.parent_id, s.v * 2 + case when s.id % 100 < g.pct then g.gen else 0 end as v,"
    " s.note from source s cross join bench_gen g"
)

SCHEMA = """
create table parent (id int primary key, name text not null);
create table source (id int primary key, parent_id int not null references parent on delete cascade,
                     v int not null, note text not null);
create index on source (parent_id);
create table derived (id int primary key,
                      parent_id int not null references parent on delete cascade,
                      v int not null, note text not null);
create index on derived (parent_id);
create table bench_gen (gen int not null, pct int not null);
insert into bench_gen values (0, 0);
create unlogged table parent_base (like parent);
create unlogged table source_base (like source);
create unlogged table derived_base (like derived);
"""


@dataclass
class Run:
    rows: int
    pct: int
    method: str
    ok: bool = True
    error: str | None = None
    total: float = 0.0
    compute: float | None = None
    write: float | None = None
    locks: float | None = None
    stats: dict[str, int] | None = None
    deletes: int = 0
    delete_p50_ms: float | None = None
    delete_p99_ms: float | None = None
    delete_max_ms: float | None = None
    delete_errors: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    #: min and max total over the rounds (set on the median run)
    total_range: tuple[float, float] | None = None


def plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


class Deleter:
    """A user deleting a random parent every 50 ms, each in its own transaction."""

    def __init__(self, dsn: str, parents: list[int]) -> None:
        self.dsn = dsn
        self.parents = parents
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Deleter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        rnd = random.Random(len(self.parents))
        victims = rnd.sample(self.parents, min(len(self.parents), 5000))
        with psycopg.connect(self.dsn, autocommit=True) as pg:
            pg.execute("set lock_timeout = '180s'")
            due = time.perf_counter()
            for victim in victims:
                if self._stop.is_set():
                    break
                started = time.perf_counter()
                try:
                    pg.execute("delete from parent where id = %s", (victim,))
                    self.latencies.append(time.perf_counter() - started)
                except psycopg.Error as exc:
                    key = exc.sqlstate or type(exc).__name__
                    self.errors[key] = self.errors.get(key, 0) + 1
                due += DELETE_EVERY
                self._stop.wait(max(0.0, due - time.perf_counter()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- setup and reset ---------------------------------------------------------------
def populate(dsn: str, rows: int) -> list[int]:
    parents = max(1, rows // PER_PARENT)
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute(SCHEMA)
        pg.execute(
            "insert into parent select i, 'parent ' || i from generate_series(1, %s) i", (parents,)
        )
        # a parent's rows are spread over the table, as they are in real ones
        pg.execute(
            "insert into source select i, 1 + (i - 1) %% %s, i %% 1000, 'note ' || i"
            " from generate_series(1, %s) i",
            (parents, rows),
        )
        pg.execute("insert into parent_base select * from parent")
        pg.execute("insert into source_base select * from source")
        pg.execute(f"insert into derived_base {COMPUTE}")
        pg.execute("create materialized view derived_mv as " + COMPUTE + " with no data")
        pg.execute("create unique index on derived_mv (id)")
    return list(range(1, parents + 1))


def reset(dsn: str, matview: bool = False) -> None:
    """Back to the starting point: every parent and source row, derived at gen 0."""
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute("update bench_gen set gen = 0, pct = 0")
        pg.execute("truncate derived")
        pg.execute(
            "insert into parent select * from parent_base b"
            " where not exists (select from parent p where p.id = b.id)"
        )
        pg.execute(
            "insert into source select * from source_base b"
            " where not exists (select from source s where s.id = b.id)"
        )
        pg.execute("insert into derived select * from derived_base")
        if matview:
            pg.execute("refresh materialized view derived_mv")
        for table in ("parent", "source", "derived", "derived_mv", "bench_gen"):
            pg.execute(sql.SQL("vacuum analyze {}").format(sql.Identifier(table)))
        pg.execute("checkpoint")


def set_generation(dsn: str, pct: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute("update bench_gen set gen = 1, pct = %s", (pct,))


# -- the methods -------------------------------------------------------------------------
def run_pgjobs(url: str, run: Run, chunk_parents: int | None = None) -> None:
    engine = create_engine(url)
    job = pgjobs.RecomputeJob(
        name=f"bench-{run.method}",
        target="derived",
        compute=COMPUTE,
        chunk_parents=chunk_parents,
        lock_timeout="180s",
        statement_timeout="30m",
    )
    try:
        with pgjobs.Runner(engine) as runner:
            runner.install()
            started = time.perf_counter()
            result = runner.tick(job, force=True)
            run.total = time.perf_counter() - started
    finally:
        engine.dispose()
    run.ok = result.outcome == "ran"
    run.error = None if run.ok else f"{result.sqlstate}: {result.error}"
    run.compute = result.compute_seconds
    run.write = result.write_seconds
    run.locks = result.lock_seconds
    run.stats = asdict(result.stats)
    run.detail = {
        k: result.detail.get(k)
        for k in ("diff_seconds", "chunks", "max_chunk_lock_seconds", "deferred", "parents_busy")
    }


def _sql_method(dsn: str, run: Run, body: Callable[[psycopg.Connection[Any], Run], None]) -> None:
    with psycopg.connect(dsn) as pg:
        pg.execute("set statement_timeout = '180s'")
        pg.execute("set lock_timeout = '180s'")
        pg.commit()
        started = time.perf_counter()
        try:
            body(pg, run)
            commit_started = time.perf_counter()
            pg.commit()
            if run.locks is not None:
                run.locks += time.perf_counter() - commit_started
        except psycopg.Error as exc:
            pg.rollback()
            run.ok = False
            run.error = f"{exc.sqlstate}: {str(exc).splitlines()[0]}"
        run.total = time.perf_counter() - started
        if run.compute is not None and run.ok:
            run.write = run.total - run.compute


def naive(pg: psycopg.Connection[Any], run: Run) -> None:
    # delete everything, recompute, reinsert: every row lock is held through
    # the compute.
    started = time.perf_counter()
    deleted = pg.execute("delete from derived").rowcount
    inserted = pg.execute(f"insert into derived {COMPUTE}").rowcount
    run.locks = time.perf_counter() - started
    run.stats = {"deleted": deleted, "inserted": inserted}


def compute_into_temp(pg: psycopg.Connection[Any], run: Run, analyze: bool) -> None:
    started = time.perf_counter()
    pg.execute(f"create temp table fresh on commit drop as {COMPUTE}")
    if analyze:
        pg.execute("analyze fresh")
    run.compute = time.perf_counter() - started


def recipe(pg: psycopg.Connection[Any], run: Run) -> None:
    compute_into_temp(pg, run, analyze=True)
    started = time.perf_counter()
    deleted = pg.execute(
        "delete from derived d where not exists (select from fresh f where f.id = d.id"
        " and f.parent_id = d.parent_id and f.v = d.v and f.note = d.note)"
    ).rowcount
    inserted = pg.execute(
        """
        with new_rows as (
            select f.* from fresh f where not exists (select from derived d where d.id = f.id)
        ), alive as (
            select p.id from parent p where p.id in (select parent_id from new_rows) for key share
        )
        insert into derived select n.* from new_rows n join alive a on a.id = n.parent_id
        """
    ).rowcount
    run.locks = time.perf_counter() - started
    run.stats = {"deleted": deleted, "inserted": inserted}


def upsert(pg: psycopg.Connection[Any], run: Run) -> None:
    compute_into_temp(pg, run, analyze=True)
    started = time.perf_counter()
    upserted = pg.execute(
        """
        insert into derived select * from fresh
        on conflict (id) do update set parent_id = excluded.parent_id, v = excluded.v,
            note = excluded.note
        where (derived.parent_id, derived.v, derived.note)
              is distinct from (excluded.parent_id, excluded.v, excluded.note)
        """
    ).rowcount
    deleted = pg.execute(
        "delete from derived d where not exists (select from fresh f where f.id = d.id)"
    ).rowcount
    run.locks = time.perf_counter() - started
    run.stats = {"upserted": upserted, "deleted": deleted}


def matview(pg: psycopg.Connection[Any], run: Run) -> None:
    pg.commit()  # REFRESH ... CONCURRENTLY runs in its own transaction here
    pg.autocommit = True
    try:
        pg.execute("refresh materialized view concurrently derived_mv")
    finally:
        pg.autocommit = False


def query(pg: psycopg.Connection[Any], run: Run) -> None:
    # the baseline every method pays: the recompute query alone, materialized
    compute_into_temp(pg, run, analyze=False)
    run.compute = None  # reported as its total
    pg.rollback()


SQL_METHODS: dict[str, Callable[[psycopg.Connection[Any], Run], None]] = {
    "query": query,
    "naive": naive,
    "recipe": recipe,
    "upsert": upsert,
    "matview": matview,
}


# -- driver ---------------------------------------------------------------------------------
def measure(
    url: str, parents: list[int], rows: int, pct: int, method: str, chunk_parents: int, rnd: int
) -> Run:
    dsn = plain(url)
    reset(dsn, matview=method == "matview")
    set_generation(dsn, pct)
    run = Run(rows=rows, pct=pct, method=method, round=rnd)
    with Deleter(dsn, parents) as deleter:
        if method == "pgjobs":
            run_pgjobs(url, run)
        elif method == "pgjobs-chunked":
            run_pgjobs(url, run, chunk_parents=chunk_parents)
            run.detail["chunk_parents"] = chunk_parents
        else:
            _sql_method(dsn, run, SQL_METHODS[method])
    lat = deleter.latencies
    run.deletes = len(lat)
    if lat:
        run.delete_p50_ms = statistics.median(lat) * 1000
        run.delete_p99_ms = percentile(lat, 0.99) * 1000
        run.delete_max_ms = max(lat) * 1000
    run.delete_errors = dict(deleter.errors)
    return run


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def medians(runs: list[Run]) -> list[Run]:
    """Per (size, change rate, method), the run whose total is the median of
    its rounds (the lower one of an even count), with the range of totals."""
    groups: dict[tuple[int, int, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.rows, r.pct, r.method), []).append(r)
    out = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r.total)
        median = ordered[(len(ordered) - 1) // 2]
        median.total_range = (ordered[0].total, ordered[-1].total)
        out.append(median)
    return out


def print_table(runs: list[Run], header: bool = True, file: Any = None) -> None:
    title = (
        f"{'rows':>7} {'chg':>4} {'method':<15} {'ok':<4} {'total s':>8} {'min-max':>13} "
        f"{'compute':>8} {'write':>8} {'locks':>8} {'dels':>5} {'p50 ms':>7} {'p99 ms':>8} "
        f"{'max ms':>8}  errors"
    )
    if header:
        print(title, file=file)
        print("-" * len(title), file=file)
    for r in runs:
        errors = ", ".join(
            [
                *([r.error.split(":")[0]] if r.error else []),
                *(f"user {k}x{v}" for k, v in r.delete_errors.items()),
            ]
        )
        spread = "-" if r.total_range is None else "{:.3f}-{:.3f}".format(*r.total_range)
        print(
            f"{r.rows:>7} {r.pct:>3}% {r.method:<15} {'yes' if r.ok else 'NO':<4} {fmt(r.total):>8} "
            f"{spread:>13} {fmt(r.compute):>8} {fmt(r.write):>8} {fmt(r.locks):>8} {r.deletes:>5} "
            f"{fmt(r.delete_p50_ms, digits=1):>7} {fmt(r.delete_p99_ms, digits=1):>8} "
            f"{fmt(r.delete_max_ms, digits=1):>8}  {errors}",
            file=file,
        )


def check_targets(runs: list[Run]) -> list[str]:
    """The issue's targets, checked against the median runs."""
    by = {(r.rows, r.pct, r.method): r for r in runs}
    lines = []

    def line(ok: bool, text: str) -> None:
        lines.append(f"[{'ok' if ok else 'MISS'}] {text}")

    for rows, reference in ((50_000, 0.02), (500_000, 0.24)):
        r = by.get((rows, 2, "pgjobs"))
        if r and r.locks is not None:
            line(
                r.locks <= reference,
                f"{rows} rows / 2 %: row-lock (write) phase {r.locks:.3f} s <= {reference} s",
            )
    p, m, q = (by.get((50_000, 2, k)) for k in ("pgjobs", "matview", "query"))
    if p and m and q:
        base = q.total
        ratio = (m.total - base) / (p.total - base) if p.total > base else float("inf")
        line(
            ratio >= 3,
            f"50000 rows / 2 %, net of the query both run ({base:.3f} s): matview "
            f"{m.total - base:.3f} s vs pgjobs {p.total - base:.3f} s = {ratio:.1f}x (>= 3x)",
        )
    if p and m:
        ratio = m.total / p.total if p.total else float("inf")
        w = p.total - (p.compute or 0)
        line(
            ratio >= 3,
            f"50000 rows / 2 %: matview {m.total:.3f} s vs pgjobs {p.total:.3f} s total = {ratio:.1f}x (>= 3x); pgjobs after compute {w:.3f} s",
        )
    for r in runs:
        if r.method == "pgjobs" and r.pct == 2 and r.delete_p99_ms is not None:
            line(
                r.delete_p99_ms <= 50,
                f"{r.rows} rows / 2 %: parent-delete p99 {r.delete_p99_ms:.1f} ms <= 50 ms",
            )
        if r.method == "pgjobs-chunked" and r.delete_max_ms is not None:
            line(
                r.delete_max_ms <= 250,
                f"{r.rows} rows / {r.pct} % chunked: parent-delete max {r.delete_max_ms:.1f} ms <= 250 ms",
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGJOBS_BENCH_DSN") or os.environ.get("PGJOBS_TEST_DSN"),
        help="a server where a scratch database may be created (default: $PGJOBS_BENCH_DSN, $PGJOBS_TEST_DSN)",
    )
    parser.add_argument("--quick", action="store_true", help="10k rows only: a smoke run")
    parser.add_argument(
        "--sizes", type=int, nargs="*", help="derived row counts (default 50000 500000)"
    )
    parser.add_argument(
        "--methods", nargs="*", default=["query", "pgjobs", "naive", "recipe", "upsert", "matview"]
    )
    parser.add_argument("--pcts", type=int, nargs="*", default=[2, 100], help="changed %% of rows")
    parser.add_argument(
        "--chunk-parents", type=int, default=1000, help="pgjobs-chunked: parents per chunk"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds per size and change rate (default 3)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("give --dsn or set $PGJOBS_BENCH_DSN")
    sizes = args.sizes or ([10_000] if args.quick else [50_000, 500_000])

    runs: list[Run] = []
    started = datetime.now(UTC)
    machine = _machine.reference(plain(args.dsn))
    for rows in sizes:
        with fresh_database(args.dsn) as url:
            parents = populate(plain(url), rows)
            with psycopg.connect(plain(url), autocommit=True) as pg:
                server = pg.execute("show server_version").fetchone()[0]
            for pct in args.pcts:
                methods = list(args.methods)
                if pct == 100 and rows == max(sizes) and "pgjobs" in methods:
                    methods.insert(methods.index("pgjobs") + 1, "pgjobs-chunked")
                for rnd in range(args.repeat):
                    for method in methods:
                        print(
                            f"... {rows} rows, {pct} %, {method}, round {rnd + 1}/{args.repeat}",
                            file=sys.stderr,
                            flush=True,
                        )
                        run = measure(url, parents, rows, pct, method, args.chunk_parents, rnd)
                        runs.append(run)
                        print_table([run], header=False, file=sys.stderr)
    summary = medians(runs)
    print()
    print(f"median of {args.repeat} round(s) per row; {_machine.describe(machine)}")
    print_table(summary)
    targets = check_targets(summary)
    if targets:
        print()
        print("\n".join(targets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"diff_bench-{started:%Y%m%d-%H%M%S}.json"
    path.write_text(
        json.dumps(
            {
                "started": started.isoformat(),
                "server_version": server,
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **machine},
                "delete_every_s": DELETE_EVERY,
                "repeat": args.repeat,
                "runs": [asdict(r) for r in runs],
                "medians": [asdict(r) for r in summary],
                "targets": targets,
            },
            indent=2,
        )
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
