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

And the queue beside it (``--queue-rate 400``, then only this): users
enqueue that many new keys a second to the group's queue job, which
``pgjobs run`` (a child process) works throughout, while a sliced
recompute runs, an unsliced one, none (``--queue-idle`` seconds), or a
``hog`` (no recompute: one backend counting on one core for
``--hog-seconds``, the machine's floor), in an order rotating round by
round. Each key's lag: from the commit of its enqueue (the user's clock
after the commit returned) to the compute that wrote its row
(``clock_timestamp()`` in the queue job's SQL, the same machine's clock);
p50 / p95 / p99 / max of the keys enqueued in each.

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
# not "pgjobs...": a tick renames a session whose name is pgjobs' own
# (pgjobs.database.names_itself), and the sampler would then find none
APP = "slice_bench_job"
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
        # "apart" ("whole-apart"): the same sliced (unsliced) run in a group
        # of its own, which never holds the queue's write lock, as a
        # recompute of another table is by default (its group is its
        # target): what the queue beside it feels of the machine's load and
        # of the snapshot the run holds
        group="bench_apart" if args.mode in ("apart", "whole-apart") else "bench",
        target="derived",
        compute=DERIVE.format(per=args.per),
        scope=("parent_id",),
        sliced=sliced,
        every="1h",
        statement_timeout="0",
        slice_seconds=args.slice_seconds,
        **({} if args.slice_pause is None else {"slice_pause": args.slice_pause}),
    )


# -- the child: one tick ----------------------------------------------------------------
def trace(path: str) -> None:
    """Where a slice's write phase holds the group's write lock: the time
    (``time.time()``, the users' clock) each write pass starts (its lock
    granted, or about to be: the lock is waited for in the same round trip)
    and each commit of the tick ends, appended to ``path`` as JSON lines."""
    from pgjobs import steps
    from pgjobs.diff import DiffWriter
    from pgjobs.slices.progress import Runs

    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def wrap(owner: Any, name: str, event: str, at_end: bool) -> None:
        inner = getattr(owner, name)

        def traced(*a: Any, **k: Any) -> Any:
            if not at_end:
                out.write(json.dumps({"e": event, "t": time.time()}) + "\n")
            value = inner(*a, **k)
            if at_end:
                out.write(json.dumps({"e": event, "t": time.time()}) + "\n")
            return value

        setattr(owner, name, traced)

    claim = Runs.claim

    def claimed(self: Any, run_id: int, count: int) -> Any:
        pieces = claim(self, run_id, count)
        out.write(json.dumps({"e": "claim", "t": time.time(), "n": len(pieces)}) + "\n")
        return pieces

    Runs.claim = claimed  # type: ignore[method-assign]
    wrap(DiffWriter, "write_chunk", "write", False)
    wrap(DiffWriter, "write_chunk", "written", True)
    wrap(steps.Tick, "_checkpoint", "commit", True)
    wrap(steps.Tick, "_commit", "commit", True)


def child(args: Any) -> None:
    import pgjobs

    if args.trace:
        trace(args.trace)
    if args.set:
        from pgjobs.slices import body

        for setting in args.set.split(";"):
            name, _, value = setting.partition("=")
            if name == "slice_pause":  # the job's setting
                args.slice_pause = float(value)
            else:
                setattr(body, name, type(getattr(body, name))(value))

    url = with_db(args.dsn, DB, APP).replace("postgresql://", "postgresql+psycopg://", 1)
    started = time.perf_counter()
    sliced = args.mode not in ("whole", "whole-apart")
    result = pgjobs.run_once(job(args, sliced), url, force=True)
    # beside the queue, the group's lock is the worker's at times: a tick then
    # ends busy, and a user's next tick (as the scheduler's busy_retry) gets it
    deadline = time.monotonic() + 120
    while args.retry_busy and str(result.outcome) == "busy" and time.monotonic() < deadline:
        time.sleep(0.05)
        result = pgjobs.run_once(job(args, sliced), url, force=True)
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


def spawn(
    args: Any, mode: str, *, retry_busy: bool = False, trace_to: str = ""
) -> subprocess.Popen[str]:
    # "sliced@WRITE_ROWS=200": a sliced run with that constant of
    # pgjobs.slices.body (';' between several), to compare; "apart@slice_pause=0"
    # with that job setting
    mode, _, settings = mode.partition("@")
    settings = settings or args.set
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
            *([] if args.slice_pause is None else ["--slice-pause", str(args.slice_pause)]),
            *(["--retry-busy"] if retry_busy else []),
            *(["--trace", trace_to] if trace_to else []),
            *(["--set", settings] if settings else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def collect(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"outcome": f"exit {proc.returncode}"}


# -- the queue beside it ----------------------------------------------------------------
QUEUE_JOB = "bench_queue"
#: the modes beside the queue that run no recompute (nothing to change first, nothing traced)
NO_RECOMPUTE = ("none", "hog")
QUEUE_CONFIG = f"""
[jobs.{QUEUE_JOB}]
kind = "queue"
group = "bench"
target = "qderived"
scope = ["item_id"]
sql = "select id as item_id, clock_timestamp() as written_at from item where id = any(:keys)"
every = "1h"
"""


def queue_setup(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("drop table if exists qderived, item")
        conn.execute("create table item (id bigint primary key)")
        conn.execute(
            "create table qderived (item_id bigint primary key references item,"
            " written_at timestamptz not null)"
        )


class Enqueuers:
    """Users inserting an item and enqueueing its key in one transaction,
    ``rate`` a second (paced on the clock, not slept per item); each key's
    commit time (time.time() after the commit returned)."""

    def __init__(self, url: str, rate: float, first_key: int) -> None:
        self.url, self.rate, self.key = url, rate, first_key
        self.stop = threading.Event()
        self.committed: dict[int, float] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Enqueuers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        started = time.perf_counter()
        n = 0
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                due = started + n / self.rate
                ahead = due - time.perf_counter()
                if ahead > 0 and self.stop.wait(ahead):
                    break
                key = self.key + n
                with conn.transaction():
                    conn.execute("insert into item values (%s)", [key])
                    conn.execute(
                        "select pgjobs.enqueue(%s, %s::jsonb)", [QUEUE_JOB, json.dumps([key])]
                    )
                self.committed[key] = time.time()
                n += 1


def queue_lags(url: str, committed: dict[int, float], timeout: float = 120.0) -> list[float]:
    """Each key's lag in ms, once the queue has written them all (bounded)."""
    keys = sorted(committed)
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "select item_id, extract(epoch from written_at)::float8 from qderived"
                " where item_id between %s and %s",
                [keys[0], keys[-1]],
            ).fetchall()
            if len(rows) >= len(keys) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return [1000 * (float(at) - committed[int(k)]) for k, at in rows if int(k) in committed]


def windows(path: str) -> list[tuple[float, float, float]]:
    """The write phases of a traced child (:func:`trace`): (start, end of the
    writes, commit), each from a write pass to the commit after it."""
    if not os.path.exists(path):
        return []
    out: list[tuple[float, float, float]] = []
    start = written = None
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            if event["e"] == "write" and start is None:
                start = event["t"]
            elif event["e"] == "written":
                written = event["t"]
            elif event["e"] == "commit" and start is not None:
                out.append((start, written or start, event["t"]))
                start = written = None
    return out


def beside_writes(
    held: list[tuple[float, float, float]], committed: dict[int, float], url: str
) -> dict[str, Any]:
    """Which keys were enqueued while a slice wrote (its write lock held,
    :func:`windows`), and their lag against the others'."""
    import bisect

    starts = [w[0] for w in held]
    with psycopg.connect(url, autocommit=True) as conn:
        keys = sorted(committed)
        got = dict(
            conn.execute(
                "select item_id, extract(epoch from written_at)::float8 from qderived"
                " where item_id between %s and %s",
                [keys[0], keys[-1]],
            ).fetchall()
        )
    inside: list[float] = []
    outside: list[float] = []
    for key, at in committed.items():
        if key not in got:
            continue
        lag = 1000 * (float(got[key]) - at)
        i = bisect.bisect_right(starts, at) - 1
        (inside if i >= 0 and at <= held[i][2] else outside).append(lag)
    holds = [1000 * (c - s) for s, _, c in held]
    writes = [1000 * (w - s) for s, w, _ in held]
    return {
        "write_phases": len(held),
        "write_phase_ms_p50": round(statistics.median(holds), 1),
        "write_phase_ms_max": round(max(holds), 1),
        "writes_ms_p50": round(statistics.median(writes), 1),
        "keys_during_writes": len(inside),
        "lag_p95_during_writes_ms": round(pct(inside, 0.95), 1),
        "lag_p95_other_keys_ms": round(pct(outside, 0.95), 1),
    }


def hog(url: str, seconds: float) -> dict[str, Any]:
    """The machine's floor: one backend kept busy on one core (counting a
    generated series, statement after statement) for ``seconds``, which is
    all a recompute that holds no lock and no snapshot of the queue's can
    cost it; no recompute."""
    deadline = time.perf_counter() + seconds
    with psycopg.connect(url, autocommit=True) as conn:
        while time.perf_counter() < deadline:
            conn.execute("select count(*) from generate_series(1, 5000000)")
    return {"outcome": "-"}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def queue_beside(args: Any, url: str) -> list[dict[str, Any]]:
    """The queue's lag with a sliced recompute, an unsliced one and none."""
    import tempfile

    queue_setup(url)
    config = os.path.join(tempfile.mkdtemp(prefix="slice-bench-"), "pgjobs.toml")
    with open(config, "w") as f:
        f.write(QUEUE_CONFIG)
    env = {**os.environ, "PGJOBS_DATABASE_URL": url, "PGJOBS_LOAD_PLUGINS": ""}
    script = os.path.join(os.path.dirname(sys.executable), "pgjobs")
    runner = subprocess.Popen(
        [script, "-c", config, "run"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows: list[dict[str, Any]] = []
    try:
        # warm: the worker is up and has drained a first few keys
        with Enqueuers(url, args.queue_rate, 1) as users:
            time.sleep(3)
        queue_lags(url, users.committed)
        first_key, span = 1_000_000, 10_000_000
        modes = args.queue_modes.split(",")
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                # (a mode that runs no recompute repairs nothing: the next run
                # would find twice as many)
                if mode not in NO_RECOMPUTE:
                    changed = change(url, args.changed, 20 + 3 * r + len(rows))
                    print(f"queue round {r + 1}: {changed} parents changed")
                with Enqueuers(url, args.queue_rate, first_key) as users:
                    started = time.perf_counter()
                    if mode == "none":
                        time.sleep(args.queue_idle)
                        result: dict[str, Any] = {"outcome": "-"}
                    elif mode == "hog":
                        result = hog(url, args.hog_seconds)
                    else:
                        trace_to = os.path.join(os.path.dirname(config), f"trace-{len(rows)}")
                        result = collect(spawn(args, mode, retry_busy=True, trace_to=trace_to))
                    wall = time.perf_counter() - started
                first_key += span
                lags = queue_lags(url, users.committed)
                held = windows(trace_to) if mode not in NO_RECOMPUTE else []
                row = {
                    "run": f"queue at {args.queue_rate:g}/s, recompute: {mode}",
                    "wall_s": round(wall, 2),
                    "outcome": result.get("outcome"),
                    "slices": result.get("slices"),
                    "enqueued": len(users.committed),
                    "written": len(lags),
                    "lag_p50_ms": round(pct(lags, 0.5), 1),
                    "lag_p95_ms": round(pct(lags, 0.95), 1),
                    "lag_p99_ms": round(pct(lags, 0.99), 1),
                    "lag_max_ms": round(max(lags, default=float("nan")), 1),
                }
                if held:
                    row.update(beside_writes(held, users.committed, url))
                print(json.dumps(row))
                rows.append(row)
    finally:
        runner.send_signal(signal.SIGTERM)
        try:
            runner.wait(30)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.wait(10)
    for mode in dict.fromkeys(m for m in modes if m != "none"):
        for q in ("p95", "p99"):
            mine = [r[f"lag_{q}_ms"] for r in rows if r["run"].endswith(": " + mode)]
            none = [r[f"lag_{q}_ms"] for r in rows if r["run"].endswith(": none")]
            if mine and none:
                ratio = statistics.median(mine) / statistics.median(none)
                print(f"queue lag {q}, recompute {mode} / none: {ratio:.2f}x (medians over rounds)")
    return rows


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
    parser.add_argument(
        "--slice-pause", type=float, default=None, help="the job's slice_pause (its default)"
    )
    parser.add_argument("--no-exact", dest="exact", action="store_false")
    parser.add_argument("--no-mv", dest="mv", action="store_false")
    parser.add_argument("--no-kill", dest="kill", action="store_false")
    parser.add_argument("--no-two", dest="two", action="store_false")
    parser.add_argument(
        "--reuse", action="store_true", help="the database of an earlier run, as it is"
    )
    parser.add_argument(
        "--queue-rate",
        type=float,
        default=0.0,
        help="only the queue beside a recompute: keys enqueued a second (e.g. 400)",
    )
    parser.add_argument(
        "--queue-idle", type=float, default=15.0, help="seconds of the queue alone, a round"
    )
    parser.add_argument(
        "--hog-seconds", type=float, default=30.0, help="seconds of the hog mode, a round"
    )
    parser.add_argument("--child", choices=("sliced", "whole", "apart", "whole-apart"), dest="mode")
    parser.add_argument(
        "--queue-modes",
        default="none,sliced,whole",
        help="beside the queue, in rotation: none, sliced, whole, apart (sliced in a group"
        " of its own: the machine's load without the group's lock), hog (no recompute: one"
        " backend counting on one core, --hog-seconds: the machine's floor), whole-apart (unsliced,"
        " in a group of its own: what the issue measured), sliced@NAME=VALUE (a constant"
        " of pgjobs.slices.body, or slice_pause)",
    )
    parser.add_argument("--retry-busy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--set",
        default="",
        help="constants of pgjobs.slices.body for the sliced runs, e.g. WRITE_ROWS=200,"
        " or the job's slice_pause"
        " (';' between several); a mode sliced@NAME=VALUE beside the queue sets them for it",
    )
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
    if args.queue_rate > 0:
        queue_beside(args, url)
        print(f"load average: {os.getloadavg()}")
        return 0
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
