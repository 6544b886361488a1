"""The logging rank's console: a live progress line, and every line it prints also in run.log.

What the progress shows, and where each number comes from:
  step k/N     the step this rank is in (1-based, as everywhere: step k is the k-th
               optimizer step; metrics.jsonl, W&B and checkpoints/step_<k> use the same k)
  loss, tok/s  those of the last gathered step (the gathers are the only moments the logging
               rank knows every rank's numbers: the first step, then every log_interval)
  elapsed      wall time since this process's first step started (start-up excluded)
  ETA          steps left x the mean wall time of this process's steps so far, the first one
               left out once there are others (it carries warm-up: allocation, first kernels);
               on the live line, less the time the running step has had

Interactive (stdout is a terminal): the line is redrawn in place every `refresh_s` while a
step runs, so a slow step shows its time growing; the gathered rows print as lines that
stay. Not interactive (a file, a pipe, a scheduler's log): one line per gather, plus a
`still in step k` line when a step has run `heartbeat_s` without any line, so a log never
falls silent for minutes. Progress lines are never written to metrics.jsonl.

Every duration is read from `now` (time.monotonic: a wall-clock jump does not move elapsed
or ETA); tests pass a fake clock so the printed times do not depend on the machine's load.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Optional, TextIO

RUN_LOG = "run.log"


def clock(seconds: float) -> str:
    """1:05 / 1:02:03: a duration as a person reads it."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Progress:
    def __init__(self, total_steps: int, first_step: int, job_dir: Optional[str], stream: Optional[TextIO] = None,
                 interactive: Optional[bool] = None, refresh_s: float = 2.0, heartbeat_s: float = 60.0,
                 now: Callable[[], float] = time.monotonic):
        """`first_step`: the first step this process runs (1, or k + 1 after resuming step_k).
        `now`: the clock every duration is read from (seconds; only differences matter)."""
        self.total, self.first, self.now = total_steps, first_step, now
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.refresh_s, self.heartbeat_s = refresh_s, heartbeat_s
        self.log = open(os.path.join(job_dir, RUN_LOG), "a", buffering=1) if job_dir else None
        self.lock = threading.Lock()
        self.current: Optional[int] = None  # the step running now
        self.step_start = 0.0
        self.t0: Optional[float] = None  # when the first step started
        self.durations: list[float] = []
        self.last_row: Optional[dict] = None
        self.last_line_at = self.now()
        self.drawn = False  # an interactive status line is on screen
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    # -- events from the training loop ---------------------------------------------------
    def step_started(self, k: int) -> None:
        now = self.now()
        with self.lock:
            if not self.durations and self.current is None:
                self.t0 = now
                self.thread.start()
            self.current, self.step_start = k, now

    def step_done(self, seconds: float) -> None:
        with self.lock:
            self.durations.append(seconds)
            self.current = None

    def gathered(self, row: dict, text: str) -> None:
        """A gathered step's console line (framework.report.sinks), with elapsed and ETA added."""
        with self.lock:
            self.last_row = row
            self._line(f"{text} | elapsed {clock(self._elapsed())} | ETA {self._eta(row['step'])}")

    def say(self, text: str) -> None:
        """Any other line of the logging rank (a stop, a warning worth keeping in run.log)."""
        with self.lock:
            self._line(text)

    def close(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        with self.lock:
            self._clear()
            if self.log is not None:
                self.log.close()
                self.log = None

    # -- numbers -------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return self.now() - self.t0 if self.t0 is not None else 0.0

    def _eta(self, done: int, running: float = 0.0) -> str:
        """Steps left after `done` at the mean step time, less what the running step has had."""
        measured = self.durations[1:] or self.durations
        if not measured:
            return "n/a"
        return clock(max(0.0, (self.total - done) * sum(measured) / len(measured) - running))

    def status(self) -> str:
        """The live line: the running step, how long it has run, the last gathered numbers."""
        k = self.current
        running = self.now() - self.step_start
        last = self.last_row
        known = (f" | loss {last['loss']:.4f} | {last['tokens_per_s']:,.0f} tok/s (step {last['step']})"
                 if last else "")
        eta = self._eta(k - 1, running) if k is not None else "n/a"
        return (f"step {k:>4}/{self.total} running {clock(running)}{known} | elapsed {clock(self._elapsed())} "
                f"| ETA {eta}")

    # -- output --------------------------------------------------------------------------
    def _line(self, text: str) -> None:
        self._clear()
        print(text, file=self.stream, flush=True)
        if self.log is not None:
            self.log.write(text + "\n")
        self.last_line_at = self.now()

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.drawn = False

    def _tick(self) -> None:
        period = self.refresh_s if self.interactive else min(self.refresh_s, self.heartbeat_s)
        while not self.stop_event.wait(period):
            with self.lock:
                if self.current is None:
                    continue
                if self.interactive:
                    self.stream.write("\r\x1b[2K" + self.status())
                    self.stream.flush()
                    self.drawn = True
                elif self.now() - self.last_line_at >= self.heartbeat_s:
                    self._line("still in " + self.status())


class _Tee:
    """A text stream that also appends each complete line to run.log; of a line redrawn with
    carriage returns (a progress bar) only what it finally showed."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log, self.partial = stream, log, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.partial += text
        if "\n" in self.partial:
            lines, self.partial = self.partial.rsplit("\n", 1)
            self.log.write("".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines.split("\n")))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def console_to_run_log(job_dir: str):
    """The launching process's stdout and stderr (banner, summary, failure report, config
    errors) also go to <job dir>/run.log, where the logging rank appends its own lines
    (Progress): run.log is then the job's whole console. Appends line by line (O_APPEND), so
    the two processes' lines never cut into each other."""
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, RUN_LOG), "a", buffering=1) as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def grad_field(r: dict) -> str:
    """The console's gradient field: the norm, and fp16-mixed's loss scale."""
    norm = "grad overflow (step skipped)" if r["grad_norm"] is None else f"grad {r['grad_norm']:.3f}"
    if "loss_scale" not in r:
        return norm
    return f"{norm} | scale {r['loss_scale']:g} (skipped {r['skipped_steps']})"
