"""What a one-item queue tick costs the client: statements, round trips and
CPU, and where the CPU goes (cProfile), through ``Runner.tick`` on the same
workload as ``queue_bench.py`` (5 derived rows and a status row an item)::

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python benchmarks/tick_profile.py [--ticks 300] [--profile]

Statements and round trips are counted by wrapping pgjobs' round trips
(``pgjobs._wire.round_trip``: one, its statements counted one by one) and
the driver (each ``execute`` outside a pipeline is one round trip, each
psycopg pipeline one).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import _machine
import psycopg
from sqlalchemy import create_engine

sys.path.insert(0, str(Path(__file__).parent))
import queue_bench

import pgjobs
from pgjobs import _wire
from pgjobs.queue import enqueue
from pgjobs.testing import find_server_url, fresh_database


class Count:
    shown: list[str] | None = None
    statements = 0
    round_trips = 0
    in_pipeline = 0


def _wrap() -> None:
    execute = psycopg.Connection.execute
    pipeline = psycopg.Connection.pipeline

    def counted_execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        Count.statements += 1
        if Count.shown is not None:
            query = args[0] if args else kwargs.get("query")
            text = query.as_string(None) if hasattr(query, "as_string") else str(query)
            Count.shown.append(("  " if Count.in_pipeline else "* ") + " ".join(text.split())[:150])
        if not Count.in_pipeline:
            Count.round_trips += 1
        return execute(self, *args, **kwargs)

    class _Pipe:
        def __init__(self, conn) -> None:  # type: ignore[no-untyped-def]
            self.inner = pipeline(conn)

        def __enter__(self):  # type: ignore[no-untyped-def]
            Count.in_pipeline += 1
            if Count.in_pipeline == 1:
                Count.round_trips += 1
            return self.inner.__enter__()

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            Count.in_pipeline -= 1
            return self.inner.__exit__(*exc)

    psycopg.Connection.execute = counted_execute  # type: ignore[method-assign]
    psycopg.Connection.pipeline = lambda self: _Pipe(self)  # type: ignore[method-assign,assignment,return-value]

    # pgjobs' own round trips (pgjobs._wire): one round trip, its statements
    round_trip = _wire.round_trip

    def counted_round_trip(raw, statements, **kwargs):  # type: ignore[no-untyped-def]
        Count.round_trips += 1
        for n, (query, _) in enumerate(statements):
            Count.statements += 1
            if Count.shown is not None:
                text = query.as_string(None) if hasattr(query, "as_string") else str(query)
                Count.shown.append(("* " if n == 0 else "  ") + " ".join(text.split())[:150])
        if kwargs.get("commit"):
            Count.statements += 1
            if Count.shown is not None:
                Count.shown.append("  commit")
        return round_trip(raw, statements, **kwargs)

    _wire.round_trip = counted_round_trip  # type: ignore[assignment]


#: where a function's own CPU time is counted, by the file it is in
_AREAS = (
    ("psycopg.sql (composing SQL)", "psycopg/sql.py"),
    ("psycopg (queries, adapters, pipeline, results)", "psycopg/"),
    ("SQLAlchemy", "sqlalchemy/"),
    ("pgjobs.diff", "pgjobs/diff/"),
    ("pgjobs.staging", "pgjobs/staging/"),
    ("pgjobs.worker", "pgjobs/worker/"),
    ("pgjobs (runner, store, _pg, target...)", "pgjobs/"),
)


def _by_area(stats: pstats.Stats, ticks: int) -> None:
    """Each function's own CPU time, summed by area, per tick."""
    totals: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = next((name for name, part in _AREAS if part in filename), "other (stdlib, builtins)")
        totals[area] = totals.get(area, 0.0) + own
    whole = sum(totals.values())
    print(f"client CPU under cProfile, {1000 * whole / ticks:.2f} ms a tick, by area:")
    for area, own in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {100 * own / whole:5.1f} %  {1000 * own / ticks:6.2f} ms  {area}")


def switch_point(url: str, batches: list[int], ticks: int) -> None:
    """Per batch size, ticks of that many items through each write path
    (the small path and the session tables', ``SMALL_KEYS`` set for each),
    interleaved tick by tick: wall and client CPU per item (medians), update
    passes (every item's rows change: ``factor`` bumped before each tick)."""
    import pgjobs.worker.small as small

    engine = create_engine(url)
    top = max(batches)
    queue_bench.setup(engine, top)
    print(f"{'batch':>6} {'path':>8} {'wall ms/item':>13} {'CPU ms/item':>12} {'round trips':>12}")
    with pgjobs.Runner(engine) as runner:
        for batch in batches:
            job = queue_bench.make_job(batch, name=f"switch-{batch}")
            got: dict[str, list[tuple[float, float, int]]] = {"small": [], "general": []}
            for n in range(ticks + 2):
                for path in ("small", "general"):
                    small.SMALL_KEYS = 10**6 if path == "small" else 0
                    with engine.begin() as conn:
                        conn.exec_driver_sql(
                            f"update parent set factor = factor + 1 where id <= {batch}"
                        )
                        enqueue(conn, job, range(1, batch + 1))
                    r0 = Count.round_trips
                    w0, c0 = time.perf_counter(), time.process_time()
                    result = runner.tick(job, force=True)
                    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                    assert result.items == batch, result
                    if n >= 2:  # the first two warm the path
                        got[path].append((wall, cpu, Count.round_trips - r0))
            for path, samples in got.items():
                print(
                    f"{batch:>6} {path:>8} {1000 * statistics.median(w for w, _, _ in samples) / batch:>13.3f}"
                    f" {1000 * statistics.median(c for _, c, _ in samples) / batch:>12.3f}"
                    f" {statistics.median(r for _, _, r in samples):>12}"
                )
    engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--show", action="store_true", help="print the last tick's statements (* = new round trip)"
    )
    parser.add_argument(
        "--polled",
        action="store_true",
        help="ticks as a poll runs them (with the work check before the lock), not as the"
        " Scheduler runs a tick an enqueue woke (Runner.tick(woken=True))",
    )
    parser.add_argument(
        "--paths",
        type=int,
        nargs="*",
        default=None,
        metavar="BATCH",
        help="measure the switch point instead: both write paths at these batch sizes",
    )
    args = parser.parse_args(argv)
    _wrap()
    if args.paths:
        with (
            find_server_url(args.dsn) as server,
            fresh_database(server, prefix="pgjobs_prof") as url,
        ):
            print(_machine.describe(_machine.reference(server.replace("+psycopg", ""))))
            print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
            switch_point(url, args.paths, args.ticks)
            print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        return 0
    with find_server_url(args.dsn) as server, fresh_database(server, prefix="pgjobs_prof") as url:
        print(_machine.describe(_machine.reference(server.replace("+psycopg", ""))))
        print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        engine = create_engine(url)
        queue_bench.setup(engine, args.ticks + 10)
        job = queue_bench.make_job(1, name="prof")
        with pgjobs.Runner(engine) as runner:
            for warm in range(1, 6):  # warm: reflection, keys table, session tables
                with engine.begin() as conn:
                    enqueue(conn, job, [warm])
                runner.tick(job, force=True)
            profile = cProfile.Profile(time.process_time)  # CPU, not waits
            walls, cpus, stmts, trips = [], [], [], []
            for item in range(6, args.ticks + 6):
                with engine.begin() as conn:
                    enqueue(conn, job, [item])
                Count.shown = [] if args.show else None
                s0, r0 = Count.statements, Count.round_trips
                w0, c0 = time.perf_counter(), time.process_time()
                if args.profile:
                    profile.enable()
                result = runner.tick(job, force=True, woken=not args.polled)
                if args.profile:
                    profile.disable()
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
                stmts.append(Count.statements - s0)
                trips.append(Count.round_trips - r0)
                assert result.outcome == "ran" and result.items == 1, result
        engine.dispose()
    print(
        f"one-item tick ({'polled' if args.polled else 'woken'}, {args.ticks} ticks): statements {statistics.median(stmts)},"
        f" round trips {statistics.median(trips)},"
        f" wall p50 {1000 * statistics.median(walls):.2f} ms,"
        f" client CPU p50 {1000 * statistics.median(cpus):.2f} ms"
        f" (mean {1000 * statistics.fmean(cpus):.2f} ms)"
    )
    if Count.shown:
        print("\n".join(Count.shown))
    if args.profile:
        stats = pstats.Stats(profile)
        _by_area(stats, len(walls))
        stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
