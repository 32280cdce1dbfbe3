"""A sliced recompute SIGKILLed half-way, as a user runs it: ``pgjobs once
JOB -c pgjobs.toml`` in a process of its own, killed (no shutdown at all)
when its first slice has committed and its second is inside the compute;
then the next run resumes, does only the pieces left, and the target equals
a from-scratch derivation.

Scripted, not timed: the compute passes a gate (an advisory lock the test
holds) for every key past the first piece, so the run stops there, its
first slice committed and the second waiting, until the test kills it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Engine
from test_slices import DERIVE, PARENTS, SCHEMA, wrong_rows

import pgjobs
from pgjobs import RecomputeJob
from pgjobs.config import load_config

WAIT = 30.0
GATE = 4233  # the advisory lock the compute waits on past the first piece

GATED = (
    "select p.id as parent_id, g as n, md5(p.v::text || '/' || g) as h"
    " from parent p cross join generate_series(1, 3) g where gate(p.id)"
)
GATE_FUNCTION = f"""
create function gate(id int) returns boolean language plpgsql as $$
begin
  if id > 1000 then perform pg_advisory_xact_lock_shared({GATE}); end if;
  return true;
end $$;
"""
CONFIG = f"""
[jobs.sliced]
kind = "recompute"
target = "derived"
sql = "{GATED}"
scope = ["parent_id"]
every = "1h"
slice_seconds = "0.05s"
"""


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT:.0f} s"
        time.sleep(0.02)


def scalar(engine: Engine, sql: str, **params: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one() or 0)


def test_a_sliced_run_sigkilled_half_way_resumes_with_only_the_pieces_left(
    engine: Engine, db_url: str, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        conn.execute(text(SCHEMA + GATE_FUNCTION))
    pgjobs.install(engine)
    path = tmp_path / "pgjobs.toml"
    path.write_text(CONFIG)
    (job,) = load_config(path).jobs
    assert isinstance(job, RecomputeJob) and job.slices

    log = tmp_path / "once.log"
    with engine.connect() as gate, log.open("w") as out:
        gate.execute(text("select pg_advisory_lock(:g)"), {"g": GATE})
        gate.commit()
        proc = subprocess.Popen(
            [*pgjobs_command(), "once", "sliced", "-c", str(path), "--database", db_url],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            # half-way: the first piece committed, the next slice in its compute
            until(
                lambda: (
                    proc.poll() is not None
                    or (
                        scalar(engine, "select max(done) from pgjobs.slice_run") >= 1
                        and scalar(
                            engine,
                            "select count(*) from pg_locks where locktype = 'advisory'"
                            " and objid = :g and not granted",
                            g=GATE,
                        )
                        == 1
                    )
                ),
                "the run's first slice committed and its second waiting at the gate",
            )
            assert proc.poll() is None, log.read_text()
            proc.send_signal(signal.SIGKILL)
            proc.wait(WAIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)
        # the server has not noticed yet (its backend waits at the gate): as
        # it would once TCP keepalive told it, end the dead process's sessions
        mine = f"%({proc.pid}@%"
        with engine.connect() as conn:
            conn.execute(
                text(
                    "select pg_terminate_backend(pid) from pg_stat_activity"
                    " where application_name like :mine"
                ),
                {"mine": mine},
            )
        until(
            lambda: (
                scalar(
                    engine,
                    "select count(*) from pg_stat_activity where application_name like :mine",
                    mine=mine,
                )
                == 0
            ),
            "the killed process's sessions ended",
        )
        gate.execute(text("select pg_advisory_unlock(:g)"), {"g": GATE})
        gate.commit()

    assert proc.returncode == -signal.SIGKILL
    with engine.connect() as conn:
        cut = conn.execute(text("select done, pieces, slices from pgjobs.slice_run")).one()
    assert cut.pieces == 3 and cut.done == 1, cut
    half = scalar(engine, "select count(*) from derived")
    assert 0 < half < 3 * PARENTS  # the first slice's rows stayed, committed
    with engine.connect() as conn:
        # (its writes, in chunks of about WRITE_ROWS rows, a transaction each)
        first_slice = list(conn.execute(text("select distinct xmin::text from derived")).scalars())

    resumed = pgjobs.run_once(job, engine, force=True)
    assert resumed.outcome == "ran", resumed.error
    assert resumed.resumed
    sliced = resumed.detail["sliced"]
    assert sliced["pieces"] == 3
    # only the pieces left: what this run did is what the killed one had not
    assert sliced["slices_here"] == sliced["slices"] - cut.slices >= 1
    # and did not redo the killed run's piece: its rows are still those it wrote
    written_then = "select count(*) from derived where xmin::text = any(:x)"
    assert scalar(engine, written_then, x=first_slice) == half
    # one record of the run: the sums over both processes' slices
    assert resumed.stats.inserted == 3 * PARENTS
    assert wrong_rows(engine, DERIVE) == (0, 0)
