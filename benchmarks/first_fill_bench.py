"""A recompute's first fill of a large derived table, run as users run it
(``pgjobs once JOB`` with a ``pgjobs.toml``), while a user deletes a random
parent every 50 ms: how long do those deletes wait for the recompute's row
locks?

Two configurations of the same job, interleaved round by round:

  default    the job as declared, nothing else set: a large difference is
             written in chunks of about 10,000 rows (``chunk_rows``)
  atomic     ``atomic = true``: the whole difference in one transaction

``--rows`` derived rows (5 per parent, ``ON DELETE CASCADE`` from
``parent``), the derived table empty before each run. After each run the
table is compared with the query (minus the deleted parents' rows).

    python benchmarks/first_fill_bench.py                    # 1.5 M rows, 2 rounds
    python benchmarks/first_fill_bench.py --rows 200000 --rounds 1

Target (issue "Faults and bad input"): with the default settings, the
longest delete <= 250 ms, and the table exact. Not a test: pytest never runs it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _machine
import psycopg
from sqlalchemy import create_engine, text

from pgjobs.testing import fresh_database

QUERY = "select s.parent_id, s.bucket, sum(s.val) as total from source s group by 1, 2"

SCHEMA = """
create table parent (id int primary key);
create table source (parent_id int not null references parent on delete cascade,
                     bucket int not null, val int not null);
create index on source (parent_id);
create table derived (parent_id int not null references parent on delete cascade,
                      bucket int not null, total bigint not null,
                      primary key (parent_id, bucket));
insert into parent select generate_series(1, %(parents)s);
insert into source select p, b, p + b from generate_series(1, %(parents)s) p,
                                           generate_series(1, 5) b;
analyze parent; analyze source;
"""


class Deleter(threading.Thread):
    """A user deleting a random live parent every 50 ms, timing each delete."""

    def __init__(self, dsn: str, parents: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.parents = dsn, parents
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            alive = [r[0] for r in conn.execute("select id from parent")]
            self.rng.shuffle(alive)
            while not self.stop.wait(0.05) and alive:
                victim = alive.pop()
                started = time.perf_counter()
                try:
                    conn.execute("delete from parent where id = %s", (victim,))
                except psycopg.Error as exc:
                    self.errors.append(exc.sqlstate or type(exc).__name__)
                self.latencies.append(time.perf_counter() - started)


def run_once(url: str, dsn: str, parents: int, atomic: bool, seed: int) -> dict[str, object]:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("truncate derived"))
        conn.execute(text("delete from pgjobs.job_state"))
    engine.dispose()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pgjobs.toml"
        config.write_text(
            "[jobs.fill]\nkind = 'recompute'\ntarget = 'derived'\n"
            f"sql = {QUERY!r}\n" + ("atomic = true\n" if atomic else "")
        )
        deleter = Deleter(dsn, parents, seed)
        deleter.start()
        time.sleep(0.2)  # a few deletes before the run, as a baseline
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pgjobs.cli", "once", "fill", "-c", str(config), "--json"],
            env={**os.environ, "PGJOBS_DATABASE_URL": url},
            capture_output=True,
            text=True,
            check=False,
        )
        seconds = time.perf_counter() - started
        deleter.stop.set()
        deleter.join()
    if done.returncode != 0:
        raise SystemExit(f"pgjobs once failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    import json

    result = json.loads(done.stdout)
    engine = create_engine(url)
    with engine.connect() as conn:
        wrong = conn.execute(
            text(
                f"select count(*) from ((select * from derived except ({QUERY}))"
                f" union all (({QUERY}) except select * from derived)) as x"
            )
        ).scalar_one()
    engine.dispose()
    lat = sorted(deleter.latencies)
    return {
        "mode": "atomic" if atomic else "default",
        "seconds": seconds,
        "chunks": result["detail"].get("chunks"),
        "lock_s": result["lock_seconds"],
        "max_chunk_lock_s": result["detail"].get("max_chunk_lock_seconds"),
        "inserted": result["stats"]["inserted"],
        "deletes": len(lat),
        "p50_ms": 1000 * statistics.median(lat) if lat else None,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
        "max_ms": 1000 * lat[-1] if lat else None,
        "errors": deleter.errors,
        "wrong": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGJOBS_BENCH_DSN")
        or os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    parser.add_argument("--rows", type=int, default=1_500_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    parents = args.rows // 5
    ref = _machine.reference(args.dsn)
    with fresh_database(args.dsn, prefix="pgjobs_fill") as url:
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA.replace("%(parents)s", str(parents)))
        subprocess.run(
            [sys.executable, "-c", "import sys, pgjobs; pgjobs.install(sys.argv[1])", url],
            check=True,
        )
        rows = []
        for n in range(args.rounds):
            for atomic in (False, True):
                # a seed of its own: a parent deleted by an earlier run deletes nothing
                rows.append(run_once(url, dsn, parents, atomic, seed=2 * n + atomic))
                r = rows[-1]
                print(
                    f"{r['mode']:>8}  {r['seconds']:6.1f} s  chunks {r['chunks']!s:>4}"
                    f"  row locks {r['lock_s']:6.2f} s (longest chunk {r['max_chunk_lock_s']:.3f} s)"
                    f"  deletes {r['deletes']:4}  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:8.1f}"
                    f" ms  max {r['max_ms']:8.1f} ms  errors {len(r['errors'])}  wrong {r['wrong']}",
                    flush=True,
                )
    print(f"{args.rows:,} derived rows, first fill; {_machine.describe(ref)}")


if __name__ == "__main__":
    main()
