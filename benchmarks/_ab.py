"""Side-by-side helpers of ``queue_bench.py``: the drain A/B against another
checkout of pgjobs, and the trickle's table against the floor.

Run as a script, it runs a benchmark against another checkout (the A/B
reference, e.g. a worktree of main)::

    python benchmarks/_ab.py /work/main benchmarks/queue_bench.py --drain-only ...

The reference's ``pgjobs`` is put first on ``sys.path``, and the editable
install's finder (which would find this checkout's ``pgjobs`` first) is
taken off ``sys.meta_path``: one venv serves both sides.
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import _machine


def drain_ab(args: Any, script: str) -> int:
    """Drain passes of this checkout and of ``args.ab``, one process per
    side and round, the sides' order alternating round by round."""
    common = [
        "--drain-only",
        "--batches",
        *map(str, args.batches),
        "--items",
        str(args.items),
        "--items-batch1",
        str(args.items_batch1),
        "--repeat",
        "1",
    ]
    if args.dsn:
        common += ["--dsn", args.dsn]
    this = [sys.executable, script]
    if args.ab_this:  # this side from a checkout too (a snapshot: edits meanwhile do not count)
        this = [sys.executable, __file__, args.ab_this, script]
    sides = {"this": this, "ref": [sys.executable, __file__, args.ab, script]}
    got: dict[tuple[str, int, str], list[float]] = {}
    loads = []
    for r in range(args.ab_rounds):
        for side in ("this", "ref") if r % 2 == 0 else ("ref", "this"):
            done = subprocess.run(
                [*sides[side], *common], capture_output=True, text=True, check=False
            )
            if done.returncode:
                raise SystemExit(f"{side}: {done.stderr[-2000:]}")
            for row in json.loads(done.stdout.strip().splitlines()[-1]):
                if row["how"] == "scheduler":
                    got.setdefault((side, row["batch_size"], row["mode"]), []).append(
                        row["items_per_s"]
                    )
            loads.append(os.getloadavg()[0])
    print(f"drain A/B: this checkout against {args.ab}, {args.ab_rounds} interleaved rounds")
    print(f"{'batch':>6} {'mode':>7} {'this/s (min-max)':>22} {'ref/s (min-max)':>22} {'ratio':>6}")
    for batch in args.batches:
        for mode in ("insert", "update"):
            this, ref = got[("this", batch, mode)], got[("ref", batch, mode)]
            print(
                f"{batch:>6} {mode:>7} {_spread(this):>22} {_spread(ref):>22}"
                f" {statistics.median(this) / statistics.median(ref):>6.2f}"
            )
    print(f"load average during the rounds: {min(loads):.1f}-{max(loads):.1f}")
    dsn = args.dsn or os.environ.get("PGJOBS_TEST_DSN", "")
    if dsn:
        print(_machine.describe(_machine.reference(dsn.replace("+psycopg", ""))))
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def trickle_table(lat: list[dict]) -> dict[float, dict[str, float]]:
    """Print the trickle's figures, pgjobs beside the floor of the same run
    (medians of rounds, min-max), and return pgjobs' ratios to the floor."""
    print(
        "trickle: enqueues at a steady rate, commit -> the item's hook inside its transaction"
        " (median of rounds, min-max); CPU: this process's per item"
    )
    print(
        f"{'rate':>5} {'system':>7} {'p50 ms':>16} {'p95 ms':>16} {'max ms':>8} {'CPU ms/item':>16}"
    )
    ratios: dict[float, dict[str, float]] = {}
    keys = ("p50_ms", "p95_ms", "cpu_ms_per_item")
    for rate in sorted({r["rate"] for r in lat}):
        med: dict[str, dict[str, float]] = {}
        for system in ("pgjobs", "floor"):
            runs = [r for r in lat if r["rate"] == rate and r["system"] == system]
            med[system] = {k: statistics.median(r[k] for r in runs) for k in (*keys, "max_ms")}
            cells = [
                f"{med[system][k]:.2f} ({min(r[k] for r in runs):.2f}-{max(r[k] for r in runs):.2f})"
                for k in keys
            ]
            print(
                f"{rate:>5.0f} {system:>7} {cells[0]:>16} {cells[1]:>16}"
                f" {med[system]['max_ms']:>8.1f} {cells[2]:>16}"
            )
        ratios[rate] = {k: med["pgjobs"][k] / med["floor"][k] for k in keys}
        print(
            f"{rate:>5.0f} {'ratio':>7} {ratios[rate]['p50_ms']:>16.2f}"
            f" {ratios[rate]['p95_ms']:>16.2f} {'':>8} {ratios[rate]['cpu_ms_per_item']:>16.2f}"
        )
    return ratios


if __name__ == "__main__":
    reference, target_script, *rest = sys.argv[1:]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, reference)
    sys.path.insert(1, str(Path(target_script).parent))
    sys.argv = [target_script, *rest]
    runpy.run_path(target_script, run_name="__main__")
