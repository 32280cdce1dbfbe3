"""Replicas as processes: ``--replicas`` schedulers (8), each a process of its
own as ``pgjobs run`` is, each with the queue job (``QueueJob(workers=4)``)
and the recompute of the same group; users changing and enqueueing items
in this process, as in benchmarks/flow_soak.py (whose schema, jobs, drift
and users this reuses).

What it proves, from the database (no registry, no callback is shared
across processes):

* **no overlapping runs**: the recompute's runs (pgjobs.run, outcome 'ran',
  from every replica) never overlap one another; and no item is processed
  by two worker transactions at once: each worker transaction logs, from its
  ``after`` hook, the items it processed with its start (``now()``) and the
  time it reached ``after`` (``clock_timestamp()``); per item those intervals
  never overlap;
* **every recompute interval kept**: between two recompute starts at least
  ``--recompute-every`` less the runner's slack (10 %, at most 1 s), and at
  most the interval plus the compute and a margin (``--interval-margin``):
  no replica ran it early, and it was not missed;
* **exact at the end**: after the users stop and the queue drains (no extra
  recompute), every item's derived rows equal a from-scratch derivation;
* the queue lag (an enqueue's commit, as the users saw it return, to the
  first worker transaction that processed the item after it) and errors
  (failed runs by SQLSTATE, from pgjobs.run); each replica stops on SIGTERM.

    python benchmarks/replica_soak.py                      # 8 x 4, 10k items, 90 s
    python benchmarks/replica_soak.py --replicas 2 --seconds 30

It starts a private PostgreSQL (tests/cluster.py, max_connections 300)
unless ``--dsn`` is given: 8 replicas hold about 60 connections, too many to
share a server with others. Not a test: pytest never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _machine
import flow_soak
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection

import pgjobs
from pgjobs.testing import fresh_database

WORK_LOG = """
create table work_log (item int not null, xact_start timestamptz not null,
                       at_after timestamptz not null, pid int not null);
"""
OVERLAPS = """
select count(*) from (
  select xact_start, lag(at_after) over (partition by item order by xact_start) as before
  from work_log
) as x where before > xact_start
"""


def log_work(conn: Connection, keys: list[tuple[Any, ...]], stats: Any) -> None:
    """The queue job's ``after``: the items this worker transaction processed."""
    conn.execute(
        text(
            "insert into work_log select unnest(cast(:items as int[])), now(),"
            " clock_timestamp(), pg_backend_pid()"
        ),
        {"items": [int(k[0]) for k in keys]},
    )


# -- one replica (a child process) ------------------------------------------------------
def replica(url: str, args: argparse.Namespace) -> None:
    """A scheduler with both jobs until SIGTERM, as ``pgjobs run`` is."""
    engine = create_engine(url, pool_size=args.job_workers + 3)
    worker, recompute = flow_soak.make_jobs(
        args, compute=lambda conn: flow_soak.drift_and_wait(engine, conn, args), after=log_work
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    scheduler = pgjobs.Scheduler([recompute, worker], engine, keep_runs=None)
    scheduler.start()
    print("ready", flush=True)
    stop.wait()
    scheduler.shutdown(wait=True)
    engine.dispose()


# -- the soak ------------------------------------------------------------------------------
class ReplicaSoak(flow_soak.Soak):
    """flow_soak's users and drain, with the schedulers in processes."""

    def spawn(self) -> list[subprocess.Popen[str]]:
        passed = [
            f"--{name.replace('_', '-')}={value}"
            for name, value in vars(self.args).items()
            if name in ("drift", "compute_seconds", "recompute_every", "flow", "job_workers")
        ]
        children = [
            subprocess.Popen(
                [sys.executable, __file__, f"--replica-url={self.url}", *passed],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(self.args.replicas)
        ]
        for child in children:  # each has started its scheduler (bounded: readline of a pipe)
            assert child.stdout is not None
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a replica did not start: {line!r}")
        return children

    def run(self) -> dict[str, Any]:
        pgjobs.install(self.engine)
        self.worker = flow_soak.make_jobs(self.args, compute=flow_soak.DERIVE, after=log_work)[0]
        children = self.spawn()
        users = [
            threading.Thread(target=self._user, args=(0.2, self._delete_or_insert, 1)),
            threading.Thread(target=self._user, args=(0.1, self._change, 2)),
        ]
        for user in users:
            user.start()
        self.stop.wait(self.args.seconds)  # the soak's length, not an ordering
        self.stop.set()
        for user in users:
            user.join()
        stops = []
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            started = time.monotonic()
            code = child.wait(120)
            stops.append((time.monotonic() - started, code))
        with pgjobs.Runner(self.engine) as runner:  # drain: no recompute
            while runner.tick(self.worker, force=True).outcome == "ran":
                pass
        figures = self.analyse()
        self.engine.dispose()
        return {**figures, "stops": stops}

    def analyse(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            strict = conn.execute(text(flow_soak.WRONG_ITEMS.format(schema="pgjobs"))).scalar_one()
            recomputes = conn.execute(
                text(
                    "select started_at, finished_at from pgjobs.run where job = 'r'"
                    " and outcome = 'ran' order by started_at"
                )
            ).all()
            outcomes: dict[str, int] = dict(
                conn.execute(text("select outcome, count(*) from pgjobs.run group by 1")).all()
            )
            errors: dict[str, int] = dict(
                conn.execute(
                    text(
                        "select job || ':' || coalesce(sqlstate, 'error'), count(*)"
                        " from pgjobs.run where outcome = 'failed' group by 1"
                    )
                ).all()
            )
            item_overlaps = conn.execute(text(OVERLAPS)).scalar_one()
            work = conn.execute(
                text(
                    "select item, extract(epoch from at_after)::float8 from work_log"
                    " order by at_after"
                )
            ).all()
            pids = conn.execute(text("select count(distinct pid) from work_log")).scalar_one()
        return {
            "strict": strict,
            "recomputes": len(recomputes),
            "recompute_overlaps": sum(
                b.started_at < a.finished_at for a, b in pairwise(recomputes)
            ),
            "gaps": [(b.started_at - a.started_at) for a, b in pairwise(recomputes)],
            "outcomes": outcomes,
            "errors": errors,
            "item_overlaps": item_overlaps,
            "work_backends": pids,
            "lags": self.lags(work),
        }

    def lags(self, work: Any) -> list[float]:
        """Each enqueue to the first worker transaction after it that processed its item."""
        by_item: dict[int, list[float]] = {}
        for item, at in work:
            by_item.setdefault(item, []).append(at)
        lags = []
        for item, enqueued in self.enqueued_at:
            after = [at for at in by_item.get(item, []) if at >= enqueued]
            if after:
                lags.append(after[0] - enqueued)
        return sorted(lags)


def report(args: argparse.Namespace, r: dict[str, Any]) -> bool:
    every = timedelta(seconds=args.recompute_every)
    slack = min(every / 10, timedelta(seconds=1))
    most = every + timedelta(seconds=args.compute_seconds + args.interval_margin)
    gaps = r["gaps"]
    kept = bool(gaps) and min(gaps) >= every - slack and max(gaps) <= most
    lags = r["lags"]
    q = lambda p: lags[min(len(lags) - 1, int(p * len(lags)))] if lags else float("nan")  # noqa: E731
    slowest_stop = max(s for s, _ in r["stops"])
    ok = (
        r["recompute_overlaps"] == 0
        and r["item_overlaps"] == 0
        and kept
        and r["strict"] == 0
        and all(code == 0 for _, code in r["stops"])
    )
    gap_text = (
        f"{min(gaps).total_seconds():.2f}-{max(gaps).total_seconds():.2f} s" if gaps else "none"
    )
    print(
        f"{args.replicas} replicas x {args.job_workers} workers, {args.items:,} items,"
        f" {args.seconds:.0f} s, drift {args.drift:.0%}, recompute every {args.recompute_every:.0f} s"
        f" (compute {args.compute_seconds:.0f} s): {'ok' if ok else 'FAIL'}\n"
        f"  recomputes {r['recomputes']}, overlapping {r['recompute_overlaps']},"
        f" gaps between starts {gap_text} (allowed {(every - slack).total_seconds():.1f}"
        f"-{most.total_seconds():.1f} s): {'kept' if kept else 'NOT kept'}\n"
        f"  items processed by two transactions at once: {r['item_overlaps']}"
        f" (worker backends seen {r['work_backends']})\n"
        f"  queue lag p50 {q(0.5):.3f} s p95 {q(0.95):.3f} s max {lags[-1] if lags else float('nan'):.3f} s"
        f" ({len(lags):,} enqueues)\n"
        f"  outcomes {r['outcomes']}  failed {r['errors'] or 0}\n"
        f"  strict wrong {r['strict']}  SIGTERM stops: slowest {slowest_stop:.2f} s,"
        f" exit codes {sorted({c for _, c in r['stops']})}",
        flush=True,
    )
    return ok


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from cluster import Cluster  # type: ignore[import-not-found]  # tests/, on sys.path

    cluster = Cluster()
    try:
        (cluster.data / "postgresql.auto.conf").write_text("max_connections = 300\n")
        cluster.start()
        yield cluster.url
    finally:
        cluster.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=None, help="a server of your own (default: a private one)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--job-workers", type=int, default=4)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--drift", type=float, default=0.02)
    parser.add_argument("--compute-seconds", type=float, default=4.0)
    parser.add_argument("--recompute-every", type=float, default=10.0)
    parser.add_argument("--interval-margin", type=float, default=3.0)
    parser.add_argument("--flow", choices=("on", "off"), default="on")
    parser.add_argument("--replica-url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica_url:
        replica(args.replica_url, args)
        return
    with server(args.dsn) as dsn:
        ref = _machine.reference(dsn)
        with fresh_database(dsn, prefix="pgjobs_replicas") as url:
            engine = create_engine(url)
            with engine.begin() as conn:
                conn.exec_driver_sql(flow_soak.SCHEMA.format(items=args.items) + WORK_LOG)
            engine.dispose()
            ok = report(args, ReplicaSoak(url, args).run())
        print(_machine.describe(ref))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
