"""The progress display of ``pgjobs once``: what ``progress(phase, done, total)``
calls (:data:`pgjobs.jobs.Progress`) look like to a person.

One line per stage of the tick: ``compute``, ``stage`` (the new rows, counted),
a sliced run's ``slices`` (pieces done of how many, rows written, an ETA at
this tick's pace),
``diff`` (the difference, no row lock, and its rows) and ``write`` (the diff writer's
"write-lock", "lock", "rows" and "write" calls: per chunk, waiting for the
group's write lock, locking its parents, writing its rows, committing), or a queue job's ``claim`` and ``write``.

* On a terminal the current stage's line is redrawn in place (``\\r`` and
  erase-line, never a newline within a stage), cut to the terminal's width,
  and a clock redraws it every :attr:`Display.interval` seconds, so that a
  long statement (one big insert) never leaves it standing still. A stage's
  line ends with a newline when the next stage starts, or at :meth:`close`.
* Elsewhere (a pipe, a log file) each stage prints one plain line when it
  ends, with its last figures and duration; a stage still running after
  :attr:`Display.heartbeat` seconds prints a line saying so, once per period.

Hand-written rather than ``rich`` or ``click.progressbar``: the stages and
their sub-steps come from the callback, not from an iterable, a stage's
figures change units (rows, chunks, items), and the non-terminal output is
a line per stage, which neither gives; what is left (a redraw, a clock
thread) is a few lines and no new dependency.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

#: phases shown as part of another stage's line
_STAGE_OF = {"write-lock": "write", "lock": "write", "rows": "write"}
#: the unit of a phase's count (``lock``/``write`` with a total: chunks of parents)
_UNITS = {"stage": "rows", "diff": "rows", "claim": "items"}

_ERASE = "\r\x1b[K"


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 80


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, AttributeError):
        return False


class Display:
    """A ``progress(phase, done, total)`` callback that draws the stages of
    one tick on ``stream`` (see the module docstring). Use it as a context
    manager, or call :meth:`close` at the end: it ends the last line and
    stops the clock."""

    #: seconds between redraws of a terminal line (the clock)
    interval = 0.2
    #: seconds after which a stage still running prints a line (not a terminal)
    heartbeat = 30.0

    def __init__(
        self,
        job: str,
        stream: TextIO,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh: bool = True,
    ) -> None:
        self.job = job
        self.stream = stream
        self.tty = _is_tty(stream) if tty is None else tty
        self.clock = clock
        self._lock = threading.Lock()
        self.stage: str | None = None
        self.step = ""
        self.figures = ""
        self.started = 0.0
        self._beats = 0
        self._drawn = ""
        #: a sliced run: the rows this tick's slices wrote, and the pieces
        #: done when its "slices" line began (the ETA is this tick's pace)
        self.slice_rows = 0
        self._first_done: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if refresh:
            self._thread = threading.Thread(target=self._run, name="pgjobs-progress", daemon=True)
            self._thread.start()

    # -- the callback ---------------------------------------------------------------
    def __call__(self, phase: str, done: int | None, total: int | None) -> None:
        if done is not None and done < 0:
            done = total = None  # a count the driver could not give (rowcount -1)
        if phase == "slice-rows":  # a figure of the "slices" line, said before it
            with self._lock:
                self.slice_rows = done or 0
            return
        stage = _STAGE_OF.get(phase, phase)
        with self._lock:
            if stage != self.stage:
                self._end_stage()
                self.stage, self.started, self._beats = stage, self.clock(), 0
                self._first_done = done
            self.figures = self._figures(phase, done, total)
            self.step = self._step(phase, done, total)
            if self.tty:
                self._draw()

    def _figures(self, phase: str, done: int | None, total: int | None) -> str:
        if done is None:
            return ""
        if total is None or phase == "stage":
            unit = _UNITS.get(phase)
            return f"{done:,}" + (f" {unit}" if unit else "")
        if phase in ("write-lock", "lock", "rows", "write"):
            if total == 1:
                return ""  # one pass: the step says where it is
            pct = 100 * done // total if total else 100
            bar = ""
            if self.tty:
                filled = 20 * done // total if total else 20
                bar = " [" + "#" * filled + "-" * (20 - filled) + "]"
            return f"{done:,}/{total:,} chunks ({pct}%){bar}"
        pct = 100 * done // total if total else 100
        if phase == "slices":
            return (
                f"{done:,}/{total:,} pieces ({pct}%), {self.slice_rows:,} rows written"
                + self._eta(done, total)
            )
        return f"{done:,}/{total:,} ({pct}%)"

    def _eta(self, done: int, total: int) -> str:
        """A sliced run's time left, at this tick's pace so far."""
        first = self._first_done or 0
        if done >= total or done <= first:
            return ""
        left = (self.clock() - self.started) / (done - first) * (total - done)
        return f", ETA {left:.0f}s"

    @staticmethod
    def _step(phase: str, done: int | None, total: int | None) -> str:
        """Per chunk a recompute with queue workers (flow) reports
        "write-lock" (the group's write lock next), then the diff writer
        "lock" (its parents next), "rows" (its rows next) and "write" (it is
        written; the recompute commits before the next one)."""
        if phase == "write-lock":
            return "waiting for the write lock"
        if phase == "lock":
            return "locking parents"
        if phase == "rows":
            return "writing rows"
        if phase == "write" and total is not None and done is not None and done < total:
            return "committing"
        return ""

    # -- drawing ------------------------------------------------------------------------
    def _text(self, *, final: bool = False) -> str:
        parts = [f"{self.job}: {self.stage}"]
        if self.figures:
            parts.append(f" {self.figures}")
        if self.step and not final:
            parts.append(f" · {self.step}")
        parts.append(f" · {self.clock() - self.started:.1f}s")
        return "".join(parts)

    def _draw(self) -> None:
        text = self._text()[: max(_width(self.stream) - 1, 20)]
        if text != self._drawn:
            self.stream.write(_ERASE + text)
            self.stream.flush()
            self._drawn = text

    def _end_stage(self) -> None:
        if self.stage is None:
            return
        text = self._text(final=True)
        if self.tty:
            self.stream.write(_ERASE + text[: max(_width(self.stream) - 1, 20)] + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._drawn = ""
        self.stage = None

    def refresh(self) -> None:
        """What the clock thread does every :attr:`interval`: redraw the
        terminal line; elsewhere, a line for a stage past its heartbeat."""
        with self._lock:
            if self.stage is None:
                return
            if self.tty:
                self._draw()
                return
            beats = int((self.clock() - self.started) // self.heartbeat)
            if beats > self._beats:
                self._beats = beats
                self.stream.write(self._text() + " (still running)\n")
                self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except (OSError, ValueError):
                return  # the stream is gone: nothing left to draw on

    # -- the end ----------------------------------------------------------------------
    def close(self) -> None:
        """End the last stage's line and stop the clock."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._end_stage()

    def __enter__(self) -> Display:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["Display"]
