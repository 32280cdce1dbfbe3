"""The progress display of ``pgjobs once`` (:mod:`pgjobs.progress`).

On a terminal a stage's line is redrawn in place, never a newline within a
stage, and a clock keeps it moving through a long statement; elsewhere one
plain line per stage. The unit tests feed the display the calls a chunked
recompute makes, on a fake clock; the terminal test runs ``pgjobs once`` in a
pseudo-terminal on a recompute of 300,000 rows and reads what it drew.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import psycopg
from click.testing import CliRunner
from sqlalchemy import make_url

from pgjobs.cli import cli
from pgjobs.progress import Display

ERASE = "\r\x1b[K"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunked_recompute(display: Display, clock: FakeClock, chunks: int = 30) -> None:
    """The calls a chunked recompute of 300,000 rows makes, a tenth of a second apart."""

    def call(phase: str, done: int | None, total: int | None) -> None:
        display(phase, done, total)
        clock.now += 0.1

    call("compute", None, None)
    call("stage", None, None)
    call("stage", 300_000, 300_000)
    call("diff", None, None)
    call("diff", 300_000, None)
    for done in range(chunks):
        call("lock", done, chunks)
        call("rows", done, chunks)
        call("write", done + 1, chunks)
    display.close()


def test_on_a_terminal_each_stage_is_one_line_redrawn_in_place() -> None:
    clock, out = FakeClock(), io.StringIO()
    chunked_recompute(Display("scores", out, tty=True, clock=clock, refresh=False), clock)
    text = out.getvalue()
    # 30 chunks, 90 updates: four lines in all, one per stage (not 60)
    lines = text.split("\n")
    assert len(lines) == 5 and lines[-1] == ""
    for line, stage in zip(lines, ("compute", "stage", "diff", "write"), strict=False):
        redraws = line.split(ERASE)
        assert redraws[0] == ""  # every draw starts by going back to the line's start
        assert all(r.startswith(f"scores: {stage}") for r in redraws[1:]), line
    # The write line moves through every chunk, and says what it is doing.
    writes = lines[3].split(ERASE)[1:]
    counts = [int(m.group(1)) for r in writes if (m := re.search(r"write (\d+)/30 chunks", r))]
    assert counts == sorted(counts) and set(counts) == set(range(31))
    assert (
        "scores: write 0/30 chunks (0%) [--------------------] · locking parents · 0.0s" in writes
    )
    assert "scores: write 0/30 chunks (0%) [--------------------] · writing rows · 0.1s" in writes
    assert "scores: write 1/30 chunks (3%) [--------------------] · committing · 0.2s" in writes
    assert writes[-1] == "scores: write 30/30 chunks (100%) [####################] · 9.0s"
    assert lines[1].split(ERASE)[-1] == "scores: stage 300,000 rows · 0.2s"
    assert lines[2].split(ERASE)[-1] == "scores: diff 300,000 rows · 0.2s"


def test_elsewhere_each_stage_prints_one_plain_line_when_it_ends() -> None:
    clock, out = FakeClock(), io.StringIO()
    chunked_recompute(Display("scores", out, tty=False, clock=clock, refresh=False), clock)
    assert out.getvalue().splitlines() == [
        "scores: compute · 0.1s",
        "scores: stage 300,000 rows · 0.2s",
        "scores: diff 300,000 rows · 0.2s",
        "scores: write 30/30 chunks (100%) · 9.0s",
    ]


def test_a_sliced_run_shows_pieces_rows_and_an_eta() -> None:
    clock, out = FakeClock(), io.StringIO()
    display = Display("hashes", out, tty=False, clock=clock, refresh=False)
    display("slices", 10, 100)  # joined a run with 10 pieces done
    for done, rows in ((20, 500), (40, 1500)):
        clock.now += 1.5
        display("slice-rows", rows, None)
        display("slices", done, 100)
    assert display._text() == (
        "hashes: slices 40/100 pieces (40%), 1,500 rows written, ETA 6s · 3.0s"
    )  # 30 pieces in 3 s: 60 left, 6 s
    clock.now += 1
    display("slice-rows", 2500, None)
    display("slices", 100, 100)
    display.close()
    assert out.getvalue().splitlines() == [
        "hashes: slices 100/100 pieces (100%), 2,500 rows written · 4.0s"
    ]


def test_on_a_terminal_the_clock_moves_a_stage_that_reports_nothing() -> None:
    # One pass (no chunks): "writing rows" is one statement, and the line
    # still moves while it runs.
    clock, out = FakeClock(), io.StringIO()
    display = Display("big", out, tty=True, clock=clock, refresh=False)
    display("lock", 0, 1)
    display("rows", 0, 1)
    for _ in range(3):
        clock.now += 0.2
        display.refresh()
    display("write", 1, 1)
    display.close()
    assert out.getvalue() == (
        ERASE
        + "big: write · locking parents · 0.0s"
        + ERASE
        + "big: write · writing rows · 0.0s"
        + ERASE
        + "big: write · writing rows · 0.2s"
        + ERASE
        + "big: write · writing rows · 0.4s"
        + ERASE
        + "big: write · writing rows · 0.6s"
        + ERASE
        + "big: write · 0.6s"
        + ERASE
        + "big: write · 0.6s\n"
    )


def test_a_recompute_with_workers_waits_for_the_write_lock_on_the_write_line() -> None:
    clock, out = FakeClock(), io.StringIO()
    display = Display("r", out, tty=True, clock=clock, refresh=False)
    for done in range(2):
        display("write-lock", done, 2)
        display("lock", done, 2)
        display("rows", done, 2)
        display("write", done + 1, 2)
    display.close()
    draws = out.getvalue().split(ERASE)[1:]
    assert out.getvalue().count("\n") == 1  # all of it on the write line
    # (cut to the 80 columns a StringIO is taken to have)
    assert (
        draws[0]
        == (
            "r: write 0/2 chunks (0%) [--------------------] · waiting for the write lock · 0.0s"[
                :79
            ]
        )
    )
    assert [d.split(" · ")[1] for d in draws[:4]] == [
        "waiting for the write lock",
        "locking parents",
        "writing rows",
        "committing",
    ]


def test_elsewhere_a_long_stage_says_it_is_still_running() -> None:
    clock, out = FakeClock(), io.StringIO()
    display = Display("big", out, tty=False, clock=clock, refresh=False)
    display("rows", 0, 1)
    for step in (10.0, 25.0, 10.0, 20.0):  # at 10, 35, 45 and 65 s
        clock.now += step
        display.refresh()
    display("write", 1, 1)
    display.close()
    assert out.getvalue().splitlines() == [
        "big: write · writing rows · 35.0s (still running)",
        "big: write · writing rows · 65.0s (still running)",
        "big: write · 65.0s",
    ]


def test_queue_counts_and_unknown_counts() -> None:
    clock, out = FakeClock(), io.StringIO()
    display = Display("worker", out, tty=False, clock=clock, refresh=False)
    display("claim", 100, None)
    display("write", 100, None)
    display("write", -1, None)  # a driver that could not count: no figure
    display.close()
    assert out.getvalue().splitlines() == [
        "worker: claim 100 items · 0.0s",
        "worker: write · 0.0s",
    ]


def test_a_terminal_line_is_cut_to_the_terminal_width() -> None:
    # A StringIO has no terminal size: the fallback is 80 columns.
    out = io.StringIO()
    display = Display("j" * 200, out, tty=True, refresh=False)
    display("compute", None, None)
    display.close()
    draws = out.getvalue().rstrip("\n").split(ERASE)[1:]
    assert draws and all(len(d) == 79 for d in draws)


def test_the_clock_thread_redraws_until_closed() -> None:
    out = io.StringIO()
    display = Display("t", out, tty=True)
    display("rows", 0, 1)
    deadline = time.monotonic() + 10
    while out.getvalue().count(ERASE) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the thread's redraws, not timing them
    display.close()
    after = out.getvalue()
    assert after.count(ERASE) >= 3 and after.endswith("\n") and after.count("\n") == 1
    assert display._thread is None  # joined: nothing draws after close


# -- pgjobs once, for real ----------------------------------------------------------------
SCHEMA = """
create table parent (id int primary key);
create table source (parent_id int not null, n int not null);
create table derived_chunked (
    parent_id int not null references parent (id) on delete cascade,
    n int not null, v int not null, primary key (parent_id, n));
create table derived_whole (like derived_chunked including all);
alter table derived_whole add foreign key (parent_id) references parent (id) on delete cascade;
insert into parent select generate_series(1, {parents});
insert into source select p, n from generate_series(1, {parents}) p, generate_series(1, 100) n;
analyze;
"""

CONFIG = """
[jobs.chunked]
kind = "recompute"
target = "derived_chunked"
sql = "select parent_id, n, n * 2 as v from source"
every = "1h"
chunk_parents = {chunk_parents}

[jobs.whole]
kind = "recompute"
target = "derived_whole"
sql = "select parent_id, n, n * 2 as v from source"
every = "1h"
atomic = true
"""


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def setup_database(db_url: str, tmp_path: Path, *, parents: int = 3000) -> Path:
    """``parents`` parents of 100 rows each; the chunked job writes them in 30 chunks."""
    libpq = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(SCHEMA.format(parents=parents))  # type: ignore[arg-type]
    path = tmp_path / "pgjobs.toml"
    path.write_text(textwrap.dedent(CONFIG.format(chunk_parents=parents // 30)))
    return path


def once_in_a_terminal(job: str, config: Path, db_url: str) -> tuple[str, str, int]:
    """``pgjobs once JOB`` with its stderr on a pseudo-terminal of 160
    columns; returns what it drew there (the terminal's ``\\r\\n`` as
    ``\\n``), its stdout and its exit code."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {**os.environ, "PGJOBS_DATABASE_URL": db_url, "PGJOBS_LOAD_PLUGINS": ""}
    process = subprocess.Popen(
        [*pgjobs_command(), "once", job, "-c", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the process is gone and the terminal closed
            break
        if not data:
            break
        drawn += data
    os.close(master)
    stdout, _ = process.communicate(timeout=120)
    code = process.returncode
    return drawn.decode().replace("\r\n", "\n"), stdout.decode(), code


def stage_lines(drawn: str, job: str) -> dict[str, list[str]]:
    """Each stage's line, as the list of its redraws."""
    lines = drawn.split("\n")
    assert lines[-1] == "", repr(drawn[-200:])
    out: dict[str, list[str]] = {}
    for line in lines[:-1]:
        redraws = line.split(ERASE)
        assert redraws[0] == "", repr(line[:200])
        stage = redraws[1].removeprefix(f"{job}: ").split(" ")[0]
        assert stage not in out, f"two lines for {stage}"
        assert all(r.startswith(f"{job}: {stage}") for r in redraws[1:]), line[:300]
        out[stage] = redraws[1:]
    return out


def test_once_in_a_terminal_redraws_in_place_and_moves_during_the_write(
    db_url: str, tmp_path: Path
) -> None:
    config = setup_database(db_url, tmp_path)

    # 300,000 rows in 30 chunks of 100 parents, each committed.
    drawn, stdout, code = once_in_a_terminal("chunked", config, db_url)
    assert code == 0, stdout + drawn
    assert "chunked: ran" in stdout and "inserted 300,000" in stdout
    stages = stage_lines(drawn, "chunked")
    assert list(stages) == ["compute", "stage", "diff", "write"]  # one line each
    assert stages["stage"][-1].startswith("chunked: stage 300,000 rows · ")
    assert stages["diff"][-1].startswith("chunked: diff 300,000 rows · ")
    write = stages["write"]
    counts = [int(m.group(1)) for r in write if (m := re.search(r"write (\d+)/30 chunks", r))]
    assert counts == sorted(counts) and set(counts) == set(range(31)), counts
    steps = {step for r in write for step in ("locking parents", "writing rows") if step in r}
    assert steps == {"locking parents", "writing rows"}
    assert re.fullmatch(r"chunked: write 30/30 chunks \(100%\) \[#{20}\] · [0-9.]+s", write[-1])

    # The same rows in one pass (atomic): one insert of 300,000 rows, during which the
    # line keeps moving (the clock), "writing rows", with no newline.
    drawn, stdout, code = once_in_a_terminal("whole", config, db_url)
    assert code == 0, stdout + drawn
    assert "whole: ran" in stdout and "inserted 300,000" in stdout
    stages = stage_lines(drawn, "whole")
    assert list(stages) == ["compute", "stage", "diff", "write"]
    writing = [r for r in stages["write"] if "· writing rows ·" in r]
    clocks = [float(re.search(r"([0-9.]+)s$", r).group(1)) for r in writing]  # type: ignore[union-attr]
    assert len(set(clocks)) >= 2 and clocks == sorted(clocks), writing
    assert re.fullmatch(r"whole: write · [0-9.]+s", stages["write"][-1])


def test_once_elsewhere_prints_one_line_per_stage(env_db: str, tmp_path: Path) -> None:
    config = setup_database(env_db, tmp_path, parents=300)
    result = CliRunner().invoke(cli, ["once", "chunked", "-c", str(config)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert [line.split(" ")[1] for line in lines] == ["compute", "stage", "diff", "write"]
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    assert re.fullmatch(r"chunked: write 30/30 chunks \(100%\) · [0-9.]+s", lines[-1])
