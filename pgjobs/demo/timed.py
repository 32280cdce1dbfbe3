"""A design's timed run: users and jobs together for ``seconds``, then a drain.

:func:`timed_run` starts the design's jobs and the simulated users, prints a
progress line every ``progress_every`` seconds, stops everything, drains the
queue and turns the tallies into a :class:`~pgjobs.demo.report.PhaseReport`
(with the drift against a from-scratch computation and the queue lag).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TextIO

from .design import Design
from .report import JobTally, PhaseReport, fmt_s
from .scenario import DEADLOCK, FK_VIOLATION, DemoOptions, drift, live_exams
from .users import Exams, Users


def _progress_line(design: Design, users: Users, elapsed: float, total: float) -> str:
    def job(t: JobTally, label: str) -> str:
        with t.lock:
            parts = [
                f"{n} {o}" for o, n in sorted(t.outcomes.items()) if o in ("ran", "failed", "busy")
            ]
        return f"{label}: {', '.join(parts) or 'no run yet'}"

    with users.tally.lock:
        ops = users.tally.ops["delete"] + users.tally.ops["merge"]
        worst = max(users.tally.latencies, default=0.0)
        errors = Counter(users.tally.errors)
    for t in (design.worker, design.recompute):
        with t.lock:
            errors.update(t.errors)
    return (
        f"[{design.name:<6} {elapsed:4.0f}/{total:.0f} s] {job(design.recompute, 'recompute')} · "
        f"{job(design.worker, 'worker')} · users: {ops} deletes/merges (slowest {fmt_s(worst)}) · "
        f"40P01: {errors[DEADLOCK]} · 23503: {errors[FK_VIOLATION]}"
    )


def _run(
    design: Design, users: Users, stop: threading.Event, opts: DemoOptions, err: TextIO | None
) -> float:
    """Jobs and users for ``opts.seconds``, until ``stop``; return the seconds it took."""
    threads = users.threads()
    started = time.monotonic()
    design.start_jobs(stop)
    for t in threads:
        t.start()
    try:
        end = started + opts.seconds
        step = opts.progress_every if opts.progress_every > 0 else opts.seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(step, left))
            if err is not None and opts.progress_every > 0 and end - time.monotonic() > 0.5:
                print(
                    _progress_line(design, users, time.monotonic() - started, opts.seconds),
                    file=err,
                    flush=True,
                )
    finally:
        stop.set()
        for t in threads:
            t.join()
        design.stop_jobs()
    return time.monotonic() - started


def timed_run(design: Design, opts: DemoOptions, err: TextIO | None) -> PhaseReport:
    """Run ``design`` under the simulated users and report what happened."""
    # The figures are the timed run's own (the scripted interleaving is reported apart).
    design.fresh_tallies()
    stop = threading.Event()
    users = Users(design, Exams(live_exams(design.engine)), opts, stop)
    elapsed = _run(design, users, stop, opts, err)
    if err is not None:
        print(
            _progress_line(design, users, elapsed, opts.seconds) + " · stopped, draining the queue",
            file=err,
            flush=True,
        )
    design.drain()
    with users.tally.lock:
        ops = Counter(users.tally.ops)
        latencies = list(users.tally.latencies)
        user_errors = dict(users.tally.errors)
    live = live_exams(design.engine)
    lag = design.lag.figures(set(live))
    return PhaseReport(
        design=design.name,
        seconds=elapsed,
        jobs={"worker": design.worker.report(), "recompute": design.recompute.report()},
        deletes=ops["delete"],
        merges=ops["merge"],
        changes=ops["change"],
        delete_latencies=latencies,
        user_errors=user_errors,
        drift=drift(design.engine),
        exams_left=len(live),
        queue_lags=lag.lags,
        unprocessed=lag.unprocessed,
    )


__all__ = [
    "timed_run",
]
