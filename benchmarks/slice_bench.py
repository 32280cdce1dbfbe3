"""A sliced recompute against an unsliced one on a large target (issue #33).

One database: ``parent`` (``--parents``, default 2,000,000) and ``derived``
(``--per`` = 5 rows a parent, an md5 per row: 10 M rows by default), filled
by SQL. Then, in ``--rounds`` rounds, ``--changed`` (2 %) of the parents
change and one recompute repairs them, through :func:`pgjobs.run_once` in a
child process of its own (its peak RSS is its own): unsliced and sliced,
their order alternating round by round (A/B interleaved in one run), then
the sliced run by two processes at once. Throughout each run a user
commits a small change every 50 ms (a parent deleted and inserted again in
one transaction: its derived rows go by the cascade; the wait of that
delete is timed), and a sampler reads ``pg_stat_activity`` every 50 ms for
the longest transaction of the recompute's backends. Exact: after each
run the target is compared with a from-scratch derivation, leaving out the
keys the user changed during the run (which the next run repairs).

Side by side: ``REFRESH MATERIALIZED VIEW CONCURRENTLY`` of a uniquely
indexed materialized view over the same SQL (``--mv``), under the same user
and sampler. And the resume: a sliced run SIGKILLed half-way (by its
progress rows), then the next run's time against a full run's (``--kill``).

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        python benchmarks/slice_bench.py --parents 200000      # small first
    ... python benchmarks/slice_bench.py                        # 2 M parents, 10 M rows

The machine is shared (2 cores, other sessions' tests running): read the
ratios, which A/B interleaving in one run keeps fair, more than the times.
Prints the machine reference (``_machine.py``) and the load average.
Results are printed, never committed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DB = "pgjobs_slice_bench"
APP = "pgjobs_slice_bench_job"
DERIVE = (
    "select p.id as parent_id, g as n, md5(p.v::text || '/' || g) as h"
    " from parent p cross join generate_series(1, {per}) g"
)


def with_db(dsn: str, name: str, app: str | None = None) -> str:
    parts = urlsplit(dsn)
    query = f"application_name={app}" if app else parts.query
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, query, ""))


def job(args: Any, sliced: bool) -> Any:
    import pgjobs

    return pgjobs.RecomputeJob(
        name="bench_sliced" if sliced else "bench_whole",
        group="bench",
        target="derived",
        compute=DERIVE.format(per=args.per),
        scope=("parent_id",),
        sliced=sliced,
        every="1h",
        statement_timeout="0",
        slice_seconds=args.slice_seconds,
    )


# -- the child: one tick ----------------------------------------------------------------
def child(args: Any) -> None:
    import pgjobs

    url = with_db(args.dsn, DB, APP).replace("postgresql://", "postgresql+psycopg://", 1)
    started = time.perf_counter()
    result = pgjobs.run_once(job(args, args.mode == "sliced"), url, force=True)
    print(
        json.dumps(
            {
                "outcome": str(result.outcome),
                "error": result.error,
                "seconds": time.perf_counter() - started,
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "updated": result.stats.updated,
                "inserted": result.stats.inserted,
                "deleted": result.stats.deleted,
                "slices": result.slices,
                "processes": result.processes,
                "resumed": result.resumed,
                "slices_here": (result.detail.get("sliced") or {}).get("slices_here"),
                "pieces": (result.detail.get("sliced") or {}).get("pieces"),
            }
        )
    )


def spawn(args: Any, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--dsn",
            args.dsn,
            "--per",
            str(args.per),
            "--slice-seconds",
            args.slice_seconds,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def collect(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"outcome": f"exit {proc.returncode}"}


# -- the user and the sampler ----------------------------------------------------------
class Load:
    """The user's change every 50 ms and the sampler of the job's transactions."""

    def __init__(self, url: str, parents: int, apps: tuple[str, ...] = (APP,)) -> None:
        self.url, self.parents, self.apps = url, parents, apps
        self.stop = threading.Event()
        self.touched: list[int] = []
        self.waits: list[float] = []
        self.longest = 0.0
        self.threads = [
            threading.Thread(target=self._user, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _user(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            n = 0
            while not self.stop.wait(0.05):
                key = 1 + (n * 7919) % self.parents
                n += 1
                started = time.perf_counter()
                with conn.transaction():
                    row = conn.execute(
                        "delete from parent where id = %s returning v", [key]
                    ).fetchone()
                    if row is not None:
                        conn.execute("insert into parent values (%s, %s)", [key, row[0] + 1])
                self.waits.append(time.perf_counter() - started)
                self.touched.append(key)

    def _sample(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.wait(0.05):
                row = conn.execute(
                    "select coalesce(max(extract(epoch from clock_timestamp() - xact_start)), 0)"
                    " from pg_stat_activity where application_name = any(%s)"
                    " and xact_start is not null and pid <> pg_backend_pid()",
                    [list(self.apps)],
                ).fetchone()
                self.longest = max(self.longest, float(row[0]) if row else 0.0)


def wrong(url: str, per: int, touched: list[int]) -> tuple[int, int]:
    """Rows missing from / too many in the target, the user's keys left out."""
    derive = DERIVE.format(per=per)
    with psycopg.connect(url) as conn:
        conn.execute("set local statement_timeout = 0")
        conn.execute("create temp table touched (id int primary key)")
        with conn.cursor().copy("copy touched from stdin") as copy:
            for key in sorted(set(touched)):
                copy.write_row((key,))
        missing, extra = conn.execute(
            f"select (select count(*) from (({derive}) except table derived) x"
            "   where not exists (select from touched t where t.id = x.parent_id)),"
            f" (select count(*) from (table derived except ({derive})) x"
            "   where not exists (select from touched t where t.id = x.parent_id))"
        ).fetchone()
        return int(missing), int(extra)


def change(url: str, share: float, round_no: int) -> int:
    every = max(1, round(1 / share))
    with psycopg.connect(url, autocommit=True) as conn:
        done = conn.execute(
            "update parent set v = v + 1 where id %% %s = %s", [every, round_no % every]
        ).rowcount
        conn.execute("vacuum analyze parent")
        return done


def setup(args: Any) -> str:
    if args.reuse:  # the database of an earlier run, its progress rows dropped
        url = with_db(args.dsn, DB)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("delete from pgjobs.slice; delete from pgjobs.slice_run")
            conn.execute("drop materialized view if exists mv")
            (parents,) = conn.execute("select count(*) from parent").fetchone() or (0,)
        print(f"reused: {parents:,} parents")
        return url
    admin = with_db(args.dsn, urlsplit(args.dsn).path.lstrip("/") or "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"drop database if exists {DB} with (force)")
        conn.execute(f"create database {DB}")
    url = with_db(args.dsn, DB)
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("set maintenance_work_mem = '256MB'")
        conn.execute("create table parent (id int primary key, v int not null)")
        conn.execute(
            "create table derived (parent_id int not null references parent on delete cascade,"
            " n int not null, h text not null, primary key (parent_id, n))"
        )
        conn.execute("insert into parent select g, g from generate_series(1, %s) g", [args.parents])
        conn.execute(f"insert into derived {DERIVE.format(per=args.per)}")
        conn.execute("vacuum analyze parent")
        conn.execute("vacuum analyze derived")
    print(
        f"setup: {args.parents:,} parents, {args.parents * args.per:,} rows in {time.perf_counter() - started:.0f} s"
    )
    return url


def one(args: Any, url: str, modes: list[str], label: str) -> dict[str, Any]:
    """``modes`` started at once (two "sliced": two processes), under the load."""
    with Load(url, args.parents) as load:
        started = time.perf_counter()
        procs = [spawn(args, m) for m in modes]
        results = [collect(p) for p in procs]
        wall = time.perf_counter() - started
    exact = wrong(url, args.per, load.touched) if args.exact else None
    row = {
        "run": label,
        "wall_s": round(wall, 2),
        "longest_xact_s": round(load.longest, 2),
        "user_wait_max_ms": round(1000 * max(load.waits, default=0), 1),
        "user_wait_p50_ms": round(1000 * statistics.median(load.waits), 1) if load.waits else None,
        "rss_mb": [round(r.get("rss_mb", 0), 1) for r in results],
        "outcomes": [r.get("outcome") for r in results],
        "updated": sum(r.get("updated") or 0 for r in results),
        "slices": [r.get("slices") for r in results],
        "exact (missing, extra)": exact,
    }
    errors = [r.get("error") for r in results if r.get("error")]
    if errors:
        row["errors"] = errors
    print(json.dumps(row))
    return row


def refresh_mv(args: Any, url: str, first: bool) -> dict[str, Any]:
    mv_app = APP + "_mv"
    with psycopg.connect(url, autocommit=True) as conn:
        if first:
            started = time.perf_counter()
            conn.execute(f"create materialized view mv as {DERIVE.format(per=args.per)}")
            conn.execute("create unique index on mv (parent_id, n)")
            print(f"mv: created in {time.perf_counter() - started:.0f} s")
    with Load(url, args.parents, apps=(mv_app,)) as load:
        started = time.perf_counter()
        with psycopg.connect(with_db(args.dsn, DB, mv_app), autocommit=True) as conn:
            conn.execute("set statement_timeout = 0")
            conn.execute("refresh materialized view concurrently mv")
        wall = time.perf_counter() - started
    row = {
        "run": "REFRESH MATERIALIZED VIEW CONCURRENTLY",
        "wall_s": round(wall, 2),
        "longest_xact_s": round(load.longest, 2),
        "user_wait_max_ms": round(1000 * max(load.waits, default=0), 1),
        "user_wait_p50_ms": round(1000 * statistics.median(load.waits), 1) if load.waits else None,
    }
    print(json.dumps(row))
    return row


def kill_and_resume(args: Any, url: str) -> dict[str, Any]:
    with Load(url, args.parents) as load:
        proc = spawn(args, "sliced")
        started = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            while proc.poll() is None:
                row = conn.execute(
                    "select done, pieces from pgjobs.slice_run where job = 'bench_sliced'"
                ).fetchone()
                if row and row[0] * 2 >= row[1]:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
        proc.wait()
        killed_at = time.perf_counter() - started
        resume_started = time.perf_counter()
        resumed = collect(spawn(args, "sliced"))
        resume = time.perf_counter() - resume_started
    exact = wrong(url, args.per, load.touched) if args.exact else None
    row = {
        "run": "sliced, SIGKILL half-way, then the next run",
        "killed_after_s": round(killed_at, 2),
        "resume_s": round(resume, 2),
        "resumed": resumed.get("resumed"),
        "outcome": resumed.get("outcome"),
        "slices_here": resumed.get("slices_here"),
        "slices": resumed.get("slices"),
        "pieces": resumed.get("pieces"),
        "exact (missing, extra)": exact,
    }
    print(json.dumps(row))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBS_TEST_DSN", ""))
    parser.add_argument("--parents", type=int, default=2_000_000)
    parser.add_argument("--per", type=int, default=5)
    parser.add_argument("--changed", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--slice-seconds", default="2s")
    parser.add_argument("--no-exact", dest="exact", action="store_false")
    parser.add_argument("--no-mv", dest="mv", action="store_false")
    parser.add_argument("--no-kill", dest="kill", action="store_false")
    parser.add_argument("--no-two", dest="two", action="store_false")
    parser.add_argument(
        "--reuse", action="store_true", help="the database of an earlier run, as it is"
    )
    parser.add_argument("--child", choices=("sliced", "whole"), dest="mode")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set PGJOBS_TEST_DSN")
    if args.mode:
        child(args)
        return 0
    import _machine

    print(_machine.describe(_machine.reference(args.dsn)))
    print(f"load average: {os.getloadavg()}; the machine is shared with other sessions")
    url = setup(args)
    if not args.reuse:
        # a first sliced run installs pgjobs' schema and finds nothing to change
        print("warm-up:", json.dumps(collect(spawn(args, "sliced"))))
    rows = []
    for r in range(args.rounds):
        order = ["whole", "sliced"] if r % 2 == 0 else ["sliced", "whole"]
        for mode in order:
            print(
                f"round {r + 1}: {change(url, args.changed, 2 * r + (mode == 'sliced'))} parents changed"
            )
            rows.append(one(args, url, [mode], f"{mode}, one process"))
        if args.two:
            print(f"round {r + 1}: {change(url, args.changed, 2 * r + 7)} parents changed")
            rows.append(one(args, url, ["sliced", "sliced"], "sliced, two processes"))
        if args.mv:
            rows.append(refresh_mv(args, url, first=r == 0))
    if args.kill:
        print(f"resume: {change(url, args.changed, 11)} parents changed")
        rows.append(kill_and_resume(args, url))
        print(f"full: {change(url, args.changed, 13)} parents changed")
        rows.append(one(args, url, ["sliced"], "sliced, a full run (for the resume)"))
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
