"""Queue job throughput: items/s at batch sizes 1, 100 and 1,000 (five
derived rows per item), and the cost of an idle tick.

Every figure goes through the whole run protocol (``Runner.tick``: state
read, ``has_work``, group lock, claim, compute, scoped diff, ``after``,
run record, commit), on a database of its own::

    PGJOBS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python benchmarks/queue_bench.py [--items 5000] [--repeat 3]

Two kinds of pass per batch size, ``--repeat`` of each (the table shows
their medians): "insert" (the items' derived rows are new; the tables are
emptied before each) and "update" (every item's five rows change). Prints a table and writes JSON
to ``benchmarks/results/queue_bench.json``. Target: >= 5,000 items/s at
batch size 100.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import _machine
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


def bench(server: str, batch: int, items: int, repeat: int) -> list[dict]:
    out = []
    with fresh_database(server, prefix="pgjobs_bench") as url:
        engine = create_engine(url)
        try:
            setup(engine, items)
            job = pgjobs.QueueJob(
                name=f"bench-{batch}",
                target="derived",
                scope=("parent_id",),
                compute=COMPUTE,
                after=upsert_status,
                batch_size=batch,
            )
            with pgjobs.Runner(engine) as runner:
                for mode in ("insert", "update"):
                    for r in range(repeat):
                        with engine.begin() as conn:
                            if mode == "insert":
                                # every insert pass writes new rows
                                conn.execute(text("truncate derived, status"))
                            else:
                                conn.execute(text("update parent set factor = factor + 1"))
                            enqueue(conn, job, range(1, items + 1))
                        n, seconds, ticks, rows = drain(runner, job)
                        assert n == items, (n, items)
                        assert rows == 5 * items, (rows, items)
                        out.append(
                            {
                                "batch_size": batch,
                                "mode": mode,
                                "round": r,
                                "items": n,
                                "seconds": seconds,
                                "ticks": ticks,
                                "items_per_s": n / seconds,
                                "ms_per_tick": 1000 * seconds / ticks,
                            }
                        )
        finally:
            engine.dispose()
    return out


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
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "queue_bench.json")
    )
    args = parser.parse_args(argv)

    rows: list[dict] = []
    with find_server_url(args.dsn) as server:
        machine = _machine.reference(server.replace("postgresql+psycopg://", "postgresql://"))
        for batch in args.batches:
            n = args.items_batch1 if batch == 1 else max(args.items, batch)
            rows.extend(bench(server, batch, n, args.repeat))
        idle = idle_tick(server, args.idle_samples)

    summary = []
    for batch in args.batches:
        for mode in ("insert", "update"):
            runs = [r for r in rows if r["batch_size"] == batch and r["mode"] == mode]
            summary.append(
                {
                    "batch_size": batch,
                    "mode": mode,
                    "items": runs[0]["items"],
                    "items_per_s": statistics.median(r["items_per_s"] for r in runs),
                    "ms_per_tick": statistics.median(r["ms_per_tick"] for r in runs),
                }
            )
    print(f"{'batch':>6} {'mode':>7} {'items':>7} {'items/s':>9} {'ms/tick':>8}")
    for s in summary:
        print(
            f"{s['batch_size']:>6} {s['mode']:>7} {s['items']:>7} {s['items_per_s']:>9.0f}"
            f" {s['ms_per_tick']:>8.2f}"
        )
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(_machine.describe(machine))
    print(f"idle tick: median {idle['median_ms']:.2f} ms, p95 {idle['p95_ms']:.2f} ms")
    b100 = [s["items_per_s"] for s in summary if s["batch_size"] == 100]
    if b100:
        print(f"target >= 5000 items/s at batch 100: {'met' if min(b100) >= 5000 else 'NOT met'}")

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
                "idle_tick": idle,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
