"""Queue designs under a held xmin horizon, in plain SQL (issue 39's design
record): what a claim and a work check cost after N entries were processed
while another session holds a snapshot.

Not pgjobs: three bare queue tables on a database of their own, fed and
drained by this script in batches of ``--batch`` (enqueue a batch, commit;
claim a batch ``FOR UPDATE SKIP LOCKED``, delete it, commit), with a
REPEATABLE READ transaction of another connection left idle the whole time:

* ``key``: today's shape, one row per (job, key), the claim in key order
  through ``(job, key) where dead_at is null``, the work check through
  ``(job, not_before) where dead_at is null``;
* ``cursor``: the same table with an enqueue sequence ``seq``, the claim
  and the work check in ``seq`` order from a cursor (the last ``seq`` the
  worker took), brandur's shape;
* ``rotate``: two tables (PgQ's shape): enqueues go to the current one;
  the claim reads the other first, and a table found empty while it is not
  the current one is emptied by ``TRUNCATE`` and made current.

Printed: the claim's and the work check's time (median of 20, EXPLAIN
ANALYZE) and buffers at each checkpoint of entries processed.

Then the cursor's trap, and what closes it (``--trap``): a transaction
takes a lower ``seq`` and commits after one with a higher ``seq`` was
claimed; the cursor passes over its entry, unless the enqueue's
notification carries the lowest ``seq`` it added and the worker lowers its
cursor to it (LISTEN on a connection of its own).

    python benchmarks/horizon_designs.py --checkpoints 0,20000,60000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import psycopg

from pgjobs.testing import find_server_url, fresh_database

KEY = """
create table q (job text not null, key jsonb not null,
    not_before timestamptz not null default now(), dead_at timestamptz,
    seq bigserial, primary key (job, key));
create index q_claim on q (job, key) where dead_at is null;
create index q_due on q (job, not_before) where dead_at is null;
create index q_seq on q (job, seq) where dead_at is null;
create table r0 (job text not null, key jsonb not null,
    not_before timestamptz not null default now(), dead_at timestamptz, primary key (job, key));
create index r0_claim on r0 (job, key) where dead_at is null;
create table r1 (like r0 including all);
"""


def claim_sql(design: str, table: str = "q") -> str:
    if design == "key":
        return (
            f"select key::text from {table} where job = 'j' and dead_at is null"
            " and not_before <= now() order by key limit %(n)s for update skip locked"
        )
    return (
        "select key::text from q where job = 'j' and dead_at is null and seq > %(cursor)s"
        " and not_before <= now() order by seq limit %(n)s for update skip locked"
    )


def work_sql(design: str, table: str = "q") -> str:
    if design == "key":
        return (
            f"select (select 1 from {table} where job = 'j' and dead_at is null"
            " and not_before <= now() order by not_before limit 1) is not null"
        )
    return (
        "select (select 1 from q where job = 'j' and dead_at is null and seq > %(cursor)s"
        " and not_before <= now() order by seq limit 1) is not null"
    )


def explain(pg: psycopg.Connection, query: str, params: dict) -> tuple[float, int]:
    times, buffers = [], 0
    for _ in range(20):
        (plan,) = pg.execute("explain (analyze, buffers, format json) " + query, params).fetchone()
        times.append(plan[0]["Execution Time"])
        top = plan[0]["Plan"]
        buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
        pg.rollback()
    return statistics.median(times), buffers


def run(dsn: str, design: str, checkpoints: list[int], batch: int) -> list[dict]:
    out = []
    with psycopg.connect(dsn) as pg, psycopg.connect(dsn) as holder:
        pg.execute("truncate q, r0, r1")
        pg.execute("alter sequence q_seq_seq restart")
        pg.commit()
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute("select 1").fetchone()  # a snapshot, left idle
        processed, key, cursor = 0, 0, 0
        current = "r0"
        for mark in checkpoints:
            while processed < mark:
                keys = [json.dumps([key + i]) for i in range(batch)]
                key += batch
                table = current if design == "rotate" else "q"
                pg.execute(
                    f"insert into {table} (job, key) select 'j', k::jsonb from unnest(%s::text[]) k",
                    (keys,),
                )
                pg.commit()
                if design == "rotate":
                    other = "r1" if current == "r0" else "r0"
                    taken = pg.execute(claim_sql("key", other), {"n": batch}).fetchall()
                    if not taken:  # the other one is drained: empty it, make it current
                        pg.execute(f"truncate {other}")
                        pg.commit()
                        current, other = other, current
                        taken = pg.execute(claim_sql("key", other), {"n": batch}).fetchall()
                    pg.execute(
                        f"delete from {other} where job = 'j' and key = any(%s::text[]::jsonb[])",
                        ([t[0] for t in taken],),
                    )
                else:
                    taken = pg.execute(
                        claim_sql(design) + (" " if design == "key" else ""),
                        {"n": batch, "cursor": cursor},
                    ).fetchall()
                    if design == "cursor":
                        seqs = pg.execute(
                            "delete from q where job = 'j' and key = any(%s::text[]::jsonb[]) returning seq",
                            ([t[0] for t in taken],),
                        ).fetchall()
                        cursor = max([cursor, *(s[0] for s in seqs)])
                    else:
                        pg.execute(
                            "delete from q where job = 'j' and key = any(%s::text[]::jsonb[])",
                            ([t[0] for t in taken],),
                        )
                pg.commit()
                processed += len(taken)
            # a batch waits (enqueued, not yet claimed): what the next tick finds
            keys = [json.dumps([key + i]) for i in range(batch)]
            key += batch
            table = current if design == "rotate" else "q"
            pg.execute(
                f"insert into {table} (job, key) select 'j', k::jsonb from unnest(%s::text[]) k",
                (keys,),
            )
            pg.commit()
            if design == "rotate":
                other = "r1" if current == "r0" else "r0"
                c_ms, c_buf = explain(pg, claim_sql("key", other), {"n": batch})
                c2_ms, c2_buf = explain(pg, claim_sql("key", current), {"n": batch})
                w_ms, w_buf = explain(pg, work_sql("key", current), {})
                c_ms, c_buf = c_ms + c2_ms, c_buf + c2_buf
            else:
                params = {"n": batch, "cursor": cursor}
                c_ms, c_buf = explain(pg, claim_sql(design), params)
                w_ms, w_buf = explain(pg, work_sql(design), params)
            row = {
                "design": design,
                "processed": processed,
                "claim_ms": round(c_ms, 3),
                "claim_buffers": c_buf,
                "work_ms": round(w_ms, 3),
                "work_buffers": w_buf,
            }
            out.append(row)
            print(
                f"{design:>7} after {processed:>7,} processed: claim {c_ms:8.3f} ms"
                f" ({c_buf:,} buffers), work check {w_ms:8.3f} ms ({w_buf:,} buffers)",
                flush=True,
            )
            # drain what waits, so the next checkpoint starts clean
            if design == "rotate":
                for t in ("r0", "r1"):
                    n = pg.execute(f"delete from {t} where job = 'j'").rowcount
                    processed += n
            else:
                n = pg.execute("delete from q where job = 'j'").rowcount
                processed += n
                cursor = pg.execute("select coalesce(max(seq), 0) from q").fetchone()[0] or cursor
            pg.commit()
        holder.rollback()
    return out


def trap(dsn: str) -> dict[str, int]:
    """The late commit, with and without the notification's low-water mark."""
    with (
        psycopg.connect(dsn) as late,
        psycopg.connect(dsn) as early,
        psycopg.connect(dsn) as worker,
        psycopg.connect(dsn, autocommit=True) as listener,
    ):
        worker.execute("truncate q")
        worker.commit()
        listener.execute("listen q_added")

        def add(pg: psycopg.Connection, key: int) -> None:
            (seq,) = pg.execute(
                "insert into q (job, key) values ('j', %s) returning seq", (json.dumps([key]),)
            ).fetchone()
            pg.execute("select pg_notify('q_added', %s)", (str(seq),))

        add(late, 1)  # takes the lower seq, commits last
        add(early, 2)
        early.commit()
        cursor = 0
        taken = worker.execute(
            "select seq from q where job = 'j' and seq > %s order by seq for update skip locked",
            (cursor,),
        ).fetchall()
        cursor = max(s for (s,) in taken)
        worker.execute("delete from q where seq = any(%s)", ([s for (s,) in taken],))
        worker.commit()
        late.commit()
        missed = worker.execute(
            "select count(*) from q where job = 'j' and seq > %s", (cursor,)
        ).fetchone()[0]
        worker.rollback()
        lowest = min(int(n.payload) for n in listener.notifies(timeout=1.0, stop_after=2))
        found = worker.execute(
            "select count(*) from q where job = 'j' and seq > %s", (min(cursor, lowest - 1),)
        ).fetchone()[0]
        worker.rollback()
    out = {"first_claim": len(taken), "after_late_commit": missed, "with_notified_low": found}
    print(
        f"trap: the first claim took {len(taken)} (seq {cursor}); after the late commit, the"
        f" cursor finds {missed}; lowered to the notified seq {lowest}, it finds {found}"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBS_TEST_DSN"))
    parser.add_argument("--checkpoints", default="0,20000,60000")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--designs", default="key,cursor,rotate")
    parser.add_argument("--trap", action="store_true", help="only the cursor's trap")
    args = parser.parse_args()
    checkpoints = [int(x) for x in args.checkpoints.split(",")]
    with find_server_url(args.dsn) as server, fresh_database(server, prefix="pgjobs_hzd") as url:
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as pg:
            pg.execute(KEY)
        if args.trap:
            trap(dsn)
            return 0
        for design in args.designs.split(","):
            run(dsn, design, checkpoints, args.batch)
        trap(dsn)
    print(f"load {os.getloadavg()[0]:.1f} (2 cores, machine shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
