"""Queue jobs as users run them: drain speed and enqueue-to-processed latency.

Five derived rows and a status row per item, on a database of its own::

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python benchmarks/queue_bench.py [--items 5000] [--repeat 3]

**Drain**, at batch sizes 1, 100 and 1,000: a backlog enqueued in one
transaction, timed from its commit to the last item processed, two ways,
interleaved round by round: ``scheduler`` (a started :class:`pgjobs.Scheduler`
with the default ``every = "30s"``, woken by the enqueue, draining batch
after batch: what ``pgjobs run`` does) and ``loop`` (``Runner.tick`` in a
hand-written loop until idle: what only a benchmark would write, the floor).
"insert" passes write new rows (the tables emptied before each), "update"
passes change every row of each item.

**Trickle**: enqueues at a steady rate (10 and 100 a second,
``--trickle-rates``), each its own transaction on a plain psycopg
connection, into a running Scheduler (listening, ``every = "30s"``) and
into the floor (``_floor.py``: a plain psycopg worker, LISTEN, one
transaction an item), interleaved round by round; latency from the
enqueue's commit to the worker's ``after`` hook for that item (inside its
transaction, just before its commit; the floor's equivalent): p50, p95,
max; and this process's CPU per item.

**Workers**: the same backlog (batch 100, update passes) drained by a
Scheduler whose job has ``workers`` = 1, 2, 4; and four workers draining
without pause beside a recompute of their group every 5 s (flow): the
longest gap between the recompute's starts says whether the workers starve it.

Also the median cost of an idle tick, and the CPU an idle Scheduler spends
waiting (a second). Prints a table with the machine's
reference timings and writes JSON to ``benchmarks/results/queue_bench.json``.
Targets (each printed as "target ...: met" or "NOT met"): drain at batch
100 >= 5,000 items/s and within 1.2x of the loop; batch 1 >= 357 items/s
(3x the 119 of the issue's machine); trickle, at each rate, p50 <= 1.5x the
floor's, p95 <= 2x and CPU per item <= 2x (no target on max); two workers
drain >= 1.5x as fast as one; the recompute beside four workers starts
within two of its intervals of the one before.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import _ab
import _floor
import _machine
import psycopg
from sqlalchemy import create_engine, text

import pgjobs
from pgjobs.queue import enqueue
from pgjobs.testing import find_server_url, fresh_database

SCHEMA = """
create table parent (id int primary key, factor int not null default 1);
create table source (
    id bigserial primary key,
    parent_id int not null references parent (id) on delete cascade,
    val int not null
);
create index on source (parent_id);
create table derived (
    parent_id int not null references parent (id) on delete cascade,
    bucket int not null,
    total bigint not null,
    n int not null,
    primary key (parent_id, bucket)
);
create table status (
    parent_id int primary key references parent (id) on delete cascade,
    rows int not null,
    computed_at timestamptz not null default now()
);
"""

COMPUTE = """
select s.parent_id, s.val % 5 as bucket, sum(s.val) * p.factor as total, count(*)::int as n
from source s join parent p on p.id = s.parent_id
where s.parent_id = any(:keys)
group by s.parent_id, s.val % 5, p.factor
"""

STATUS = text(
    "insert into status (parent_id, rows) select k.parent_id, 5 from pgjobs_keys k"
    " on conflict (parent_id) do update set rows = excluded.rows, computed_at = now()"
)


def upsert_status(conn, keys, stats):
    conn.execute(STATUS)
    _Clock.stamp(keys)


class _Clock:
    """When each item reached the worker's ``after`` hook (trickle latency)."""

    lock = threading.Lock()
    seen: dict[int, float] = {}

    @classmethod
    def stamp(cls, keys) -> None:
        now = time.perf_counter()
        with cls.lock:
            for (key,) in keys:
                cls.seen.setdefault(key, now)

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.seen = {}


def setup(engine, parents: int) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
        conn.execute(text("insert into parent (id) select generate_series(1, :n)"), {"n": parents})
        conn.execute(
            text(
                "insert into source (parent_id, val) select p, v"
                " from generate_series(1, :n) p, generate_series(1, 10) v"
            ),
            {"n": parents},
        )
        conn.exec_driver_sql("analyze")
    pgjobs.Runner(engine).install()


def drain(runner, job) -> tuple[int, float, int, int]:
    """Tick until idle: (items, seconds, ticks, rows written)."""
    items = ticks = rows = 0
    started = time.perf_counter()
    while True:
        result = runner.tick(job, force=True)
        if result.outcome != "ran":
            if result.outcome != "idle":
                raise SystemExit(f"unexpected outcome {result.outcome}: {result.error}")
            break
        if result.failed_items:
            raise SystemExit(f"items failed: {result}")
        items += result.items
        rows += result.stats.changed
        ticks += 1
    return items, time.perf_counter() - started, ticks, rows


def make_job(batch: int, **changes) -> pgjobs.QueueJob:
    fields = dict(
        name=f"bench-{batch}",
        target="derived",
        scope=("parent_id",),
        compute=COMPUTE,
        after=upsert_status,
        batch_size=batch,
    )
    fields.update(changes)
    return pgjobs.QueueJob(**fields)


class Counting:
    """A Scheduler's on_result: items processed, and when the last one was."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items = self.ticks = self.rows = 0
        self.last = 0.0
        self.done = threading.Event()
        self.wanted = 0
        self.failed: list = []

    def expect(self, n: int) -> None:
        with self.lock:
            self.items = self.ticks = self.rows = 0
            self.wanted = n
            self.done.clear()

    def __call__(self, result) -> None:
        with self.lock:
            if result.outcome == "failed" or result.failed_items:
                self.failed.append(result)
            if result.outcome != "ran":
                return
            self.items += result.items
            self.rows += result.stats.changed
            self.ticks += 1
            self.last = time.perf_counter()
            if self.wanted and self.items >= self.wanted:
                self.done.set()


def _prepare(engine, job, mode: str, items: int) -> None:
    with engine.begin() as conn:
        if mode == "insert":
            conn.execute(text("truncate derived, status"))  # every insert pass writes new rows
        else:
            conn.execute(text("update parent set factor = factor + 1"))


def bench(server: str, batch: int, items: int, repeat: int) -> list[dict]:
    out = []
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url)
        try:
            setup(engine, items)
            job = make_job(batch)
            # the loop's own job: the running scheduler is not woken by its enqueues
            loop_job = make_job(batch, name=f"bench-{batch}-loop")
            counting = Counting()
            scheduler = pgjobs.Scheduler([job], engine, on_result=counting, keep_runs=None)
            with pgjobs.Runner(engine) as runner:
                for mode in ("insert", "update"):
                    for r in range(repeat):
                        for how in ("scheduler", "loop"):
                            _prepare(engine, job, mode, items)
                            if how == "loop":
                                with engine.begin() as conn:
                                    enqueue(conn, loop_job, range(1, items + 1))
                                n, seconds, ticks, rows = drain(runner, loop_job)
                            else:
                                if not scheduler.running:
                                    scheduler.start()
                                    assert scheduler.listener is not None
                                    scheduler.listener.listening.wait(10)
                                counting.expect(items)
                                with engine.begin() as conn:
                                    enqueue(conn, job, range(1, items + 1))
                                started = time.perf_counter()
                                if not counting.done.wait(600):
                                    raise SystemExit(
                                        f"scheduler drained {counting.items} of {items}"
                                    )
                                n, ticks, rows = counting.items, counting.ticks, counting.rows
                                seconds = counting.last - started
                            if counting.failed:
                                raise SystemExit(f"items failed: {counting.failed[0]}")
                            assert n == items, (n, items)
                            assert rows == 5 * items, (rows, items)
                            out.append(
                                {
                                    "batch_size": batch,
                                    "mode": mode,
                                    "how": how,
                                    "round": r,
                                    "items": n,
                                    "seconds": seconds,
                                    "ticks": ticks,
                                    "items_per_s": n / seconds,
                                    "ms_per_tick": 1000 * seconds / ticks,
                                }
                            )
            scheduler.shutdown()
        finally:
            engine.dispose()
    return out


def trickle(
    server: str, seconds: float, rates: list[float], repeat: int, parents: int | None = None
) -> list[dict]:
    """Enqueues at each rate into a running Scheduler (listening, ``every =
    "30s"``) and into the floor (``_floor.py``), interleaved round by round;
    the enqueuing application uses a plain psycopg connection for both.
    Latency from the enqueue's commit to the item's hook inside its
    transaction (``after``; the floor's equivalent); client CPU per item:
    this process's ``time.process_time()`` over the pass (application,
    worker and everything else), divided by the items."""
    out = []
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url)
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        try:
            needed = sum(int(seconds * rate) for rate in rates) * 2 * repeat
            setup(engine, max(needed, parents or 0))
            _floor.install(dsn)
            key = 0
            for r in range(repeat):
                for rate in rates:
                    for system in ("pgjobs", "floor"):
                        n = int(seconds * rate)
                        keys = list(range(key + 1, key + n + 1))
                        key += n
                        lat, cpu = _trickle_pass(engine, dsn, system, rate, keys, r)
                        out.append(
                            {
                                "system": system,
                                "rate": rate,
                                "round": r,
                                "items": n,
                                "p50_ms": lat[len(lat) // 2],
                                "p95_ms": lat[int(0.95 * (len(lat) - 1))],
                                "max_ms": lat[-1],
                                "cpu_ms_per_item": 1000 * cpu / n,
                                "load": os.getloadavg()[0],
                            }
                        )
        finally:
            engine.dispose()
    return out


def _trickle_pass(
    engine, dsn: str, system: str, rate: float, keys: list[int], r: int
) -> tuple[list[float], float]:
    """One pass: (sorted latencies in ms, process CPU seconds)."""
    _Clock.reset()
    committed: dict[int, float] = {}
    if system == "pgjobs":
        job = make_job(100, name=f"trickle-{int(rate)}-{r}", every="30s")
        running = pgjobs.Scheduler([job], engine, keep_runs=None)
        put = lambda pg, key: enqueue(pg, job, [key])  # noqa: E731
    else:
        running = _floor.FloorWorker(dsn, lambda key: _Clock.stamp([(key,)]))
        put = _floor.enqueue
    with running, psycopg.connect(dsn) as pg:
        listener = getattr(running, "listener", None)
        if listener is not None:
            listener.listening.wait(10)
        time.sleep(1.5)  # past the first (idle) tick
        cpu = time.process_time()
        begin = time.perf_counter()
        for i, key in enumerate(keys):
            with pg.transaction():
                put(pg, key)
            committed[key] = time.perf_counter()
            pause = begin + (i + 1) / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        deadline = time.monotonic() + 30
        while len(_Clock.seen) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu = time.process_time() - cpu
    lat = sorted(1000 * (_Clock.seen[k] - t) for k, t in committed.items() if k in _Clock.seen)
    if len(lat) != len(keys):
        raise SystemExit(f"trickle {system} at {rate}/s: {len(lat)} of {len(keys)} items processed")
    return lat, cpu


def workers_drain(server: str, items: int, counts: list[int], repeat: int) -> list[dict]:
    """A backlog drained by a Scheduler whose job has ``workers = n``, at batch
    100 (update passes), for each n, interleaved round by round."""
    out = []
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url, pool_size=max(counts) + 5)
        try:
            setup(engine, items)
            for r in range(repeat):
                for n in counts:
                    job = make_job(100, name=f"workers-{n}-{r}", workers=n)
                    counting = Counting()
                    with pgjobs.Scheduler([job], engine, on_result=counting, keep_runs=None) as s:
                        assert s.listener is not None
                        s.listener.listening.wait(10)
                        _prepare(engine, job, "update", items)
                        counting.expect(items)
                        with engine.begin() as conn:
                            enqueue(conn, job, range(1, items + 1))
                        started = time.perf_counter()
                        if not counting.done.wait(600):
                            raise SystemExit(f"workers {n}: {counting.items} of {items}")
                        seconds = counting.last - started
                    out.append({"workers": n, "round": r, "items_per_s": items / seconds})
        finally:
            engine.dispose()
    return out


def starvation(server: str, seconds: float, every: float) -> dict:
    """Four workers draining without pause (a backlog topped up all along)
    and a recompute of the same group and target every ``every`` s, with
    flow: does every due recompute run within its interval?"""
    parents = 20_000
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url, pool_size=12)
        try:
            setup(engine, parents)
            worker = make_job(100, name="starve-w", group="g", workers=4)
            recompute = pgjobs.RecomputeJob(
                name="starve-r",
                group="g",
                target="derived",
                compute=COMPUTE.replace("where s.parent_id = any(:keys)", ""),
                every=f"{every}s",
                lock_timeout="30s",
            )
            starts: list[float] = []
            runs: list[tuple[float, float, float]] = []
            counting = Counting()

            def on_result(result) -> None:
                if result.job == "starve-r" and result.outcome == "ran":
                    starts.append(result.started_at.timestamp())
                    took = (result.finished_at - result.started_at).total_seconds()
                    runs.append((took, result.compute_seconds, result.write_seconds))
                elif result.job == "starve-w":
                    counting(result)

            stop = threading.Event()

            def top_up() -> None:
                key = 0
                with engine.connect() as conn:
                    while not stop.is_set():
                        with conn.begin():
                            enqueue(conn, worker, [(key + i) % parents + 1 for i in range(200)])
                        key += 200
                        time.sleep(0.02)

            registry = pgjobs.Registry.from_jobs([worker, recompute])
            with pgjobs.Scheduler(registry, engine, on_result=on_result, keep_runs=None):
                filler = threading.Thread(target=top_up)
                filler.start()
                time.sleep(seconds)
                stop.set()
                filler.join()
        finally:
            engine.dispose()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    return {
        "seconds": seconds,
        "every": every,
        "recomputes": len(starts),
        "max_gap": max(gaps, default=float("nan")),
        "worker_items": counting.items,
        "longest_run": max(runs, default=(float("nan"),) * 3),
    }


def idle_tick(server: str, samples: int) -> dict:
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url)
        try:
            setup(engine, 10)
            job = pgjobs.QueueJob(
                name="bench-idle", target="derived", scope=("parent_id",), compute=COMPUTE
            )
            with pgjobs.Runner(engine) as runner:
                for _ in range(20):  # warm the pool and the plans
                    runner.tick(job, force=True)
                times = []
                for _ in range(samples):
                    started = time.perf_counter()
                    result = runner.tick(job, force=True)
                    times.append(time.perf_counter() - started)
                    assert result.outcome == "idle", result
        finally:
            engine.dispose()
    times.sort()
    return {
        "samples": samples,
        "median_ms": 1000 * statistics.median(times),
        "p95_ms": 1000 * times[int(0.95 * (len(times) - 1))],
    }


def idle_scheduler(server: str, seconds: float = 10.0) -> float:
    """CPU (ms a second) of this process while a started Scheduler with one
    listening queue job waits, nothing enqueued: what the trickle's CPU per
    item carries at 10/s (divided by 10)."""
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url)
        try:
            setup(engine, 10)
            job = make_job(100, name="idle-scheduler", every="30s")
            with pgjobs.Scheduler([job], engine, keep_runs=None) as running:
                assert running.listener is not None and running.listener.listening.wait(10)
                time.sleep(1.5)  # past the first (idle) tick
                cpu, began = time.process_time(), time.perf_counter()
                time.sleep(seconds)
                return 1000 * (time.process_time() - cpu) / (time.perf_counter() - began)
        finally:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=None, help="server URL (default: $PGJOBS_TEST_DSN)")
    parser.add_argument("--items", type=int, default=5000, help="items per pass (batch >= 100)")
    parser.add_argument("--items-batch1", type=int, default=500, help="items per pass at batch 1")
    parser.add_argument("--repeat", type=int, default=3, help="passes of each kind per batch size")
    parser.add_argument(
        "--batches", type=int, nargs="*", default=[1, 100, 1000], help="batch sizes to measure"
    )
    parser.add_argument("--idle-samples", type=int, default=300)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument(
        "--starve-every", type=float, default=5.0, help="the recompute's interval there"
    )
    parser.add_argument(
        "--starve-seconds", type=float, default=30.0, help="four workers beside a recompute (0: no)"
    )
    parser.add_argument(
        "--trickle-seconds", type=float, default=30.0, help="length of a trickle pass (0: none)"
    )
    parser.add_argument(
        "--trickle-rates", type=float, nargs="*", default=[10.0, 100.0], help="enqueues a second"
    )
    parser.add_argument(
        "--trickle-parents",
        type=int,
        default=None,
        help="parent rows of the trickle's tables, at least (default: the items it enqueues;"
        " 19,800 with the defaults): the planner's choices depend on it",
    )
    parser.add_argument(
        "--drain-only",
        action="store_true",
        help="only the drain passes, printed as JSON (what --ab runs on each side)",
    )
    parser.add_argument(
        "--ab",
        metavar="CHECKOUT",
        default=None,
        help="drain A/B against another checkout of pgjobs (e.g. /work/main), interleaved",
    )
    parser.add_argument("--ab-rounds", type=int, default=3)
    parser.add_argument(
        "--ab-this", metavar="CHECKOUT", default=None, help="this side of --ab from a checkout too"
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "queue_bench.json")
    )
    args = parser.parse_args(argv)

    if args.drain_only:
        with find_server_url(args.dsn) as server:
            drained = []
            for batch in args.batches:
                n = args.items_batch1 if batch == 1 else max(args.items, batch)
                drained.extend(bench(server, batch, n, args.repeat))
        print(json.dumps(drained))
        return 0
    if args.ab:
        return _ab.drain_ab(args, __file__)

    rows: list[dict] = []
    with find_server_url(args.dsn) as server:
        machine = _machine.reference(server.replace("postgresql+psycopg://", "postgresql://"))
        for batch in args.batches:
            n = args.items_batch1 if batch == 1 else max(args.items, batch)
            rows.extend(bench(server, batch, n, args.repeat))
        lat = (
            trickle(
                server, args.trickle_seconds, args.trickle_rates, args.repeat, args.trickle_parents
            )
            if args.trickle_seconds
            else []
        )
        by_workers = (
            workers_drain(server, args.items, args.workers, args.repeat) if args.workers else []
        )
        starving = (
            starvation(server, args.starve_seconds, args.starve_every)
            if args.starve_seconds
            else None
        )
        idle = idle_tick(server, args.idle_samples)
        waiting = idle_scheduler(server)

    summary = []
    for batch in args.batches:
        for mode in ("insert", "update"):
            line = {"batch_size": batch, "mode": mode}
            for how in ("scheduler", "loop"):
                runs = [
                    r for r in rows if (r["batch_size"], r["mode"], r["how"]) == (batch, mode, how)
                ]
                line["items"] = runs[0]["items"]
                line[f"{how}_items_per_s"] = statistics.median(r["items_per_s"] for r in runs)
                line[f"{how}_ms_per_tick"] = statistics.median(r["ms_per_tick"] for r in runs)
            summary.append(line)
    print("drain: a backlog enqueued in one transaction, commit -> last item processed (medians)")
    print(
        f"{'batch':>6} {'mode':>7} {'items':>7} {'scheduler/s':>12} {'loop/s':>9}"
        f" {'ratio':>6} {'ms/tick':>8}"
    )
    for x in summary:
        ratio = x["loop_items_per_s"] / x["scheduler_items_per_s"]
        print(
            f"{x['batch_size']:>6} {x['mode']:>7} {x['items']:>7} {x['scheduler_items_per_s']:>12.0f}"
            f" {x['loop_items_per_s']:>9.0f} {ratio:>6.2f} {x['scheduler_ms_per_tick']:>8.2f}"
        )
    trickle_summary = _ab.trickle_table(lat) if lat else {}
    workers_summary = {
        n: statistics.median(r["items_per_s"] for r in by_workers if r["workers"] == n)
        for n in args.workers
    }
    if workers_summary:
        print("drain by workers (QueueJob(workers=n), batch 100, update passes, Scheduler):")
        print("  " + ", ".join(f"{n}: {v:.0f} items/s" for n, v in workers_summary.items()))
    if starving:
        print(
            f"four workers draining for {starving['seconds']:.0f} s beside a recompute every"
            f" {starving['every']:.0f} s: {starving['recomputes']} recomputes, longest gap between"
            f" their starts {starving['max_gap']:.2f} s, {starving['worker_items']:,} items;"
            " longest recompute {:.2f} s (compute {:.2f} s, write {:.2f} s)".format(
                *starving["longest_run"]
            )
        )
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(_machine.describe(machine))
    print(f"idle tick: median {idle['median_ms']:.2f} ms, p95 {idle['p95_ms']:.2f} ms")
    print(f"an idle Scheduler (one listening queue job): {waiting:.2f} ms of CPU a second")
    checks = []
    for x in summary:
        if x["batch_size"] == 100:
            checks.append(
                (f"batch 100 {x['mode']}: >= 5000 items/s", x["scheduler_items_per_s"] >= 5000)
            )
            checks.append(
                (
                    f"batch 100 {x['mode']}: within 1.2x of the loop",
                    x["loop_items_per_s"] <= 1.2 * x["scheduler_items_per_s"],
                )
            )
        if x["batch_size"] == 1:
            checks.append(
                (f"batch 1 {x['mode']}: >= 357 items/s (3x 119)", x["scheduler_items_per_s"] >= 357)
            )
    for rate, ratios in trickle_summary.items():
        checks.append((f"trickle {rate:g}/s p50 <= 1.5x the floor", ratios["p50_ms"] <= 1.5))
        checks.append((f"trickle {rate:g}/s p95 <= 2x the floor", ratios["p95_ms"] <= 2))
        checks.append(
            (f"trickle {rate:g}/s CPU/item <= 2x the floor", ratios["cpu_ms_per_item"] <= 2)
        )
    if 1 in workers_summary and 2 in workers_summary:
        checks.append(
            ("two workers drain >= 1.5x one", workers_summary[2] >= 1.5 * workers_summary[1])
        )
    if starving:
        checks.append(
            (
                "every due recompute runs within its interval beside four workers",
                starving["max_gap"] <= 2 * starving["every"],
            )
        )
    for what, ok in checks:
        print(f"target {what}: {'met' if ok else 'NOT met'}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "queue",
                "at": datetime.now(UTC).isoformat(),
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "machine_reference": machine,
                "derived_rows_per_item": 5,
                "summary": summary,
                "runs": rows,
                "trickle": lat,
                "workers": by_workers,
                "starvation": starving,
                "trickle_summary": trickle_summary,
                "idle_tick": idle,
                "idle_scheduler_cpu_ms_per_s": waiting,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
