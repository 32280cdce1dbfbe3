"""``pgjobs check`` on a large target: time and peak memory beside a recompute's.

For each size (default 200k and 1M rows: 20k / 100k parents of ten rows),
one database with a parent table, a source table and the derived target,
filled by a first recompute. Then, in rounds, drift is injected (``--drift``,
a share of the rows given a wrong value) and one child process runs the
check, another the recompute that repairs it (drift injected again before
each, so both see the same difference), in alternating order: A/B
interleaved, each in a fresh process so that its peak RSS
(``ru_maxrss``) is its own. A third child only imports pgjobs and connects:
the baseline RSS.

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        python benchmarks/check_bench.py [--rows 200000,1000000] [--rounds 3]

Prints the machine reference (``_machine.py``) and the load average beside
the figures. Results are printed, never committed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from sqlalchemy import create_engine

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PER_PARENT = 10

SCHEMA = """
create table parent (id int primary key);
create table src (parent_id int not null, k int not null, v int not null);
create table derived (
    parent_id int not null references parent (id) on delete cascade,
    k int not null,
    v int not null,
    primary key (parent_id, k));
insert into parent select g from generate_series(1, {parents}) g;
insert into src select p, k, p * 31 + k from generate_series(1, {parents}) p,
    generate_series(1, {per}) k;
analyze parent; analyze src;
"""
COMPUTE = "select parent_id, k, v from src"


def job() -> Any:
    import pgjobs

    return pgjobs.RecomputeJob(
        name="bench", target="derived", compute=COMPUTE, every="1h", statement_timeout="0"
    )


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def child(kind: str, url: str) -> None:
    import pgjobs

    started = time.perf_counter()
    out: dict[str, Any] = {}
    if kind == "check":
        result = pgjobs.check(job(), url, sample=5)
        out = {
            "compute_s": result.compute_seconds,
            "diff_s": result.diff_seconds,
            "changed": result.stats.changed,
        }
    elif kind == "recompute":
        ran = pgjobs.run_once(job(), url, force=True)
        assert ran.outcome is pgjobs.Outcome.RAN, ran.error
        out = {
            "compute_s": ran.compute_seconds,
            "diff_s": float(ran.detail.get("diff_seconds", 0.0)),
            "write_s": ran.write_seconds,
            "changed": ran.stats.changed,
        }
    else:  # baseline: pgjobs imported, one connection
        engine = create_engine(url)
        with engine.connect() as conn:
            conn.exec_driver_sql("select 1")
        engine.dispose()
    out.update(kind=kind, seconds=time.perf_counter() - started, rss_mb=rss_mb())
    print(json.dumps(out))


def run_child(kind: str, url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--url", url],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def inject(url: str, share: float) -> int:
    import psycopg

    with psycopg.connect(url.replace("+psycopg", "")) as pg:
        cur = pg.execute(
            "update derived set v = v + 1 where (hashint4(parent_id * 7 + k) & 1023) < %s",
            (int(share * 1024),),
        )
        return cur.rowcount


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r.get(key, 0.0)) for r in rows)


def bench_size(server: str, rows: int, rounds: int, share: float) -> None:
    import pgjobs
    from pgjobs.testing import fresh_database, run_sql

    parents = rows // PER_PARENT
    with fresh_database(server, prefix="pgjobs_check_bench") as url:
        engine = create_engine(url)
        run_sql(engine, SCHEMA.format(parents=parents, per=PER_PARENT))
        first = pgjobs.run_once(job(), engine, force=True)
        assert first.outcome is pgjobs.Outcome.RAN, first.error
        import psycopg

        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as pg:
            pg.execute("vacuum analyze derived")
        engine.dispose()
        results: dict[str, list[dict[str, Any]]] = {"check": [], "recompute": [], "baseline": []}
        for n in range(rounds):
            order = ["check", "recompute"] if n % 2 == 0 else ["recompute", "check"]
            for kind in order:
                drifted = inject(url, share)
                got = run_child(kind, url)
                got["drifted"] = drifted
                results[kind].append(got)
            results["baseline"].append(run_child("baseline", url))
    check, rec, base = results["check"], results["recompute"], results["baseline"]
    assert all(c["changed"] == c["drifted"] for c in check), check
    print(
        f"\n{rows:,} rows ({parents:,} parents x {PER_PARENT}), drift {check[0]['drifted']:,}"
        f" rows a round, {rounds} rounds (medians; each run in a fresh process):"
    )
    print(f"  {'':<12}{'wall s':>9}{'compute s':>11}{'diff s':>9}{'write s':>9}{'peak RSS MB':>13}")
    for name, got in (("check", check), ("recompute", rec), ("baseline", base)):
        write = f"{median(got, 'write_s'):>9.2f}" if name == "recompute" else f"{'-':>9}"
        print(
            f"  {name:<12}{median(got, 'seconds'):>9.2f}{median(got, 'compute_s'):>11.2f}"
            f"{median(got, 'diff_s'):>9.2f}{write}{median(got, 'rss_mb'):>13.1f}"
        )
    print(f"  every round: {json.dumps(results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="200000,1000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drift", type=float, default=0.01, help="share of rows made wrong")
    parser.add_argument("--child", default=None)
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.url)
        return
    from _machine import describe, reference

    from pgjobs.database import normalize_url

    dsn = os.environ.get("PGJOBS_TEST_DSN")
    if not dsn:
        raise SystemExit("set PGJOBS_TEST_DSN to a server the benchmark may create databases on")
    print(describe(reference(dsn)))
    print(f"load average before (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for rows in (int(r) for r in args.rows.split(",")):
        bench_size(normalize_url(dsn), rows, args.rounds, args.drift)
    print(f"\nload average after (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
