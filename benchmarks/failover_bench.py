"""Failover, measured: a pg_auto_failover formation on this machine (a monitor
and two nodes, tests/ha.py), ``pgjobs run`` with one queue job and users
changing and enqueueing about 20 items a second (tests/ha_scenario.py), through
``--runs`` planned switchovers and crashes of the primary (SIGKILL of its
postmaster) each, interleaved with the same switchover with the users alone
(no ``pgjobs run``): the baseline that shows whether pgjobs slows the
failover down.

Per run: the time from the switchover's (or crash's) start to the first
write a new primary committed, the switchover command's own length, the
first item pgjobs processed after that write, latency p50/p95 of the changes
made after recovery (from 2 s after the first item), items lost (derived
rows that differ from a from-scratch derivation after the drain; changes
users saw commit that the new primary lacks), a traceback in pgjobs run's
output or not, how long SIGTERM took to stop it, its lines about failures
and backoffs, and its stacks (faulthandler) when the queue did not drain.

    python benchmarks/failover_bench.py                 # 5 of each, about 10 minutes
    python benchmarks/failover_bench.py --runs 1 --url-form libpq

Targets (issue 21): every run recovers: nothing lost, the first item within
15 s of the new primary accepting writes, p50 under 100 ms, no traceback,
SIGTERM within 10 s; with pgjobs run, the switchover takes no longer than
with the users alone. Runs as root (the formation runs as ``postgres``).
Not a test: pytest never runs it (tests/test_failover.py runs one of each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _machine
from ha import Formation
from ha_scenario import Outcome, describe, scenario

KINDS = {
    "switchover": ("switchover", True),
    "baseline": ("switchover", False),
    "crash": ("crash", True),
}


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, {platform.python_version()}, load {load}"


def recovered(out: Outcome) -> bool:
    """Did this run meet every target of the issue?"""
    if not out.with_pgjobs:  # nothing derives: only what users committed counts
        return out.acked_lost == 0 and out.failover.command_error is None
    return (
        out.drained
        and out.wrong == 0
        and out.acked_lost == 0
        and out.first_item_s is not None
        and out.first_item_s <= 15.0
        and out.p50_ms is not None
        and out.p50_ms < 100.0
        and out.alive
        and not out.traceback
        and out.exit_code == 0
        and out.stop_s is not None
        and out.stop_s <= 10.0
    )


def one(f: Formation, name: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    kind, with_pgjobs = KINDS[name]
    load = os.getloadavg()[0]
    try:
        out = scenario(f, kind, workdir, with_pgjobs=with_pgjobs, url_form=args.url_form)
    except Exception as exc:  # a run that broke is a figure too
        print(f"{name:10} BROKE: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        return {"name": name, "broke": f"{type(exc).__name__}: {exc}", "load": load}
    ok = recovered(out)
    print(f"{name:10} {'ok  ' if ok else 'FAIL'} load {load:.1f}  {describe(out)}", flush=True)
    for line in out.notable if (args.verbose or not ok) else []:
        print(f"           | {line}", flush=True)
    if out.failover.phases:
        print(f"           states reached (s): {out.failover.phase_text()}", flush=True)
    for line in out.failover.events if not ok else []:
        print(f"           monitor {line}", flush=True)
    for line in out.failover.waiting:
        print(f"           ~ {line}", flush=True)
    for line in out.stacks:
        print(f"           ! {line}", flush=True)
    return {"name": name, "ok": ok, "load": load, **asdict(out)}


def summary(results: list[dict[str, Any]]) -> None:
    print("\nsummary (medians over the runs that did not break):")
    for name in KINDS:
        runs = [r for r in results if r["name"] == name]
        done = [r for r in runs if "broke" not in r]
        writable = [r["failover"]["writable_at"] - r["failover"]["started"] for r in done]
        command = [r["failover"]["done_s"] for r in done if name != "crash"]
        line = f"  {name:10} {sum(r.get('ok', False) for r in runs)}/{len(runs)} recovered"
        if writable:
            line += f"  writable {statistics.median(writable):.2f} s (max {max(writable):.2f})"
        if command:
            line += f"  command {statistics.median(command):.2f} s (max {max(command):.2f})"
        demoted = [
            at
            for r in done
            for at, port, state in r["failover"].get("phases", [])
            if state == "demoted" and port == r["failover"]["old"]
        ]
        if demoted:  # the old primary's shutdown: what pgjobs' sessions could slow down
            line += (
                f"  old primary demoted {statistics.median(demoted):.2f} s (max {max(demoted):.2f})"
            )
        firsts = [r["first_item_s"] for r in done if r.get("first_item_s") is not None]
        p50s = [r["p50_ms"] for r in done if r.get("p50_ms") is not None]
        if firsts:
            line += f"  first item {statistics.median(firsts):.2f} s (max {max(firsts):.2f})"
        if p50s:
            line += f"  p50 {statistics.median(p50s):.0f} ms (max {max(p50s):.0f})"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--url-form", choices=("sqlalchemy", "libpq"), default="libpq")
    parser.add_argument("-v", "--verbose", action="store_true", help="pgjobs run's lines always")
    parser.add_argument("--summary-of", metavar="JSON", help="print the summary of a past run")
    args = parser.parse_args()
    if args.summary_of:
        summary(json.loads(Path(args.summary_of).read_text()))
        return
    print(f"machine: {machine()}", flush=True)
    results: list[dict[str, Any]] = []
    f = Formation()
    try:
        started = time.monotonic()
        f.start()
        print(f"formation up in {time.monotonic() - started:.1f} s", flush=True)
        print(_machine.describe(_machine.reference(f.conninfo())), flush=True)
        with tempfile.TemporaryDirectory(prefix="failover-bench-") as workdir:
            for n in range(args.runs):
                print(f"-- round {n + 1}/{args.runs}", flush=True)
                for name in args.kinds:  # interleaved: the load moves for all alike
                    results.append(one(f, name, Path(workdir), args))
    finally:
        f.remove()
    summary(results)
    print(f"machine: {machine()}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"failover_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
