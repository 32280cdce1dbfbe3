"""How fast this machine is right now, to read a benchmark's figures against.

The 2-core machines these benchmarks run on vary from day to day and hour to
hour: one session measured a pure-Python loop at 0.27 s, a later one at 0.40
to 0.53 s, and every figure moved with it. Both benchmarks print these two
reference timings (the median of five) beside their results.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg


def python_loop_ms() -> float:
    """3 million integer additions in a Python loop."""

    def once() -> float:
        started = time.perf_counter()
        total = 0
        for i in range(3_000_000):
            total += i
        return time.perf_counter() - started

    return 1000 * statistics.median(once() for _ in range(5))


def server_ms(dsn: str) -> float:
    """The server counting a million generated rows (JIT off)."""
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute("set jit = off")
        times = []
        for _ in range(5):
            started = time.perf_counter()
            pg.execute("select count(*) from generate_series(1, 1000000)").fetchone()
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def reference(dsn: str) -> dict[str, Any]:
    return {"python_loop_ms": python_loop_ms(), "server_count_1m_ms": server_ms(dsn)}


def describe(ref: dict[str, Any]) -> str:
    return (
        f"machine now: python loop {ref['python_loop_ms']:.0f} ms, server count of 1M rows "
        f"{ref['server_count_1m_ms']:.0f} ms (see benchmarks/_machine.py)"
    )
