"""Enqueue rates as users enqueue: one key a transaction, and many keys a call.

Issue 39's migration 015 gives each entry a number as it becomes pending
(``<schema>.enqueue`` takes the caller's xid, then draws from a sequence).
This measures what that costs the application's side, A/B against another
checkout of pgjobs (before migration 015, e.g. a worktree at a607a2d),
each side in a process of its own on a database of its own, the sides'
order alternating round by round::

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        python benchmarks/enqueue_bench.py --ab /work/wt/old [--rounds 3] [--seconds 5]

Passes, each ``--seconds`` long, on a queue with no worker (emptied before
each pass):

* ``single``: ``pgjobs.enqueue(conn, job, [key])`` inside ``engine.begin()``
  with a new key each transaction (what an application's request does);
* ``again``: the same, a key already pending each time (the dedupe path:
  one entry per key);
* ``bulk``: ``pgjobs.enqueue(conn, job, keys)`` with ``--bulk`` (1,000) new
  keys a transaction: keys a second.

Prints transactions (or keys) a second for each side, the median of the
rounds with min-max, the ratio, the load average and the machine reference
(``_machine.py``). Target (issue 39): "unchanged": read the ratio against
the rounds' spread (these machines vary 20 % between runs). Not a test:
pytest never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import _machine
from sqlalchemy import create_engine, text

import pgjobs
from pgjobs.testing import find_server_url, fresh_database

JOB = "bench_enqueue"
PASSES = ("single", "again", "bulk")


def one_pass(engine: Any, kind: str, seconds: float, bulk: int) -> float:
    """Transactions a second (keys a second for ``bulk``) for ``seconds``."""
    with engine.begin() as conn:
        conn.execute(text("delete from pgjobs.queue"))
        if kind == "again":
            pgjobs.enqueue(conn, JOB, [0])
    key, done = 1, 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        with engine.begin() as conn:
            if kind == "single":
                pgjobs.enqueue(conn, JOB, [key])
                key += 1
            elif kind == "again":
                pgjobs.enqueue(conn, JOB, [0])
            else:
                pgjobs.enqueue(conn, JOB, range(key, key + bulk))
                key += bulk
        done += bulk if kind == "bulk" else 1
    return done / (time.perf_counter() - started)


def child(args: argparse.Namespace) -> None:
    """One side's passes, printed as JSON (the parent runs this per side and round)."""
    with find_server_url(args.dsn) as server, fresh_database(server, prefix="pgjobs_eq") as url:
        pgjobs.install(url)
        engine = create_engine(url)
        try:
            one_pass(engine, "single", 1.0, args.bulk)  # warm: connections, statements
            rates = {kind: one_pass(engine, kind, args.seconds, args.bulk) for kind in PASSES}
        finally:
            engine.dispose()
    print(json.dumps(rates))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBS_TEST_DSN"))
    parser.add_argument("--ab", metavar="CHECKOUT", help="the other checkout of pgjobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--bulk", type=int, default=1000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    common = ["--child", "--seconds", str(args.seconds), "--bulk", str(args.bulk)]
    if args.dsn:
        common += ["--dsn", args.dsn]
    here = os.path.dirname(os.path.abspath(__file__))
    sides = {"this": [sys.executable, __file__]}
    if args.ab:
        sides["ref"] = [sys.executable, os.path.join(here, "_ab.py"), args.ab, __file__]
    got: dict[tuple[str, str], list[float]] = {}
    loads = []
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            done = subprocess.run(
                [*sides[side], *common], capture_output=True, text=True, check=False
            )
            if done.returncode:
                raise SystemExit(f"{side}: {done.stderr[-2000:]}")
            for kind, rate in json.loads(done.stdout.strip().splitlines()[-1]).items():
                got.setdefault((side, kind), []).append(rate)
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} {side}: done", flush=True)
    unit = {"single": "tx/s", "again": "tx/s", "bulk": f"keys/s ({args.bulk} a tx)"}
    print(f"enqueue rates, {args.rounds} rounds of {args.seconds:g} s a pass (median, min-max)")
    for kind in PASSES:
        cells = []
        for side in sides:
            values = got[(side, kind)]
            cells.append(
                f"{side} {statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
            )
        line = f"{kind:>7} {unit[kind]:<22} " + "   ".join(cells)
        if args.ab:
            ratio = statistics.median(got[("this", kind)]) / statistics.median(got[("ref", kind)])
            line += f"   this/ref {ratio:.2f}"
        print(line)
    print(f"load average during the rounds: {min(loads):.1f}-{max(loads):.1f}")
    if args.dsn:
        print(_machine.describe(_machine.reference(args.dsn)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
