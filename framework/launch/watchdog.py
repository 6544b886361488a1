"""The hang watchdog: a thread in the launching process that ends a job whose ranks stopped progressing.

It reads every rank's flight recorder (framework/flight.py) twice a second. When a rank
has made no progress for trainer.hang_timeout_s, the job ends naming the stalled rank(s)
and `hang.txt` holds every rank's last actions and collectives. The stalled rank is the one
stopped (process state `T`), else the one not blocked waiting on a peer, else (a deadlock)
all of them. It stands down once a rank has failed: that is told as a failure.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .. import flight
from ..files import write_report
from ..flight import process_state
from .diagnosis import RankFailure

HANG_FILE = "hang.txt"


@dataclass
class Watchdog:
    """A thread in the launching process: reads every rank's flight recorder twice a second;
    when one has made no progress for `timeout_s` it writes hang.txt and kills the ranks.
    It also keeps the ranks' multiprocessing handles, so their exit codes (the signal that
    killed one) are known after the launch."""

    job_dir: str
    world: int
    timeout_s: float
    report: Optional[RankFailure] = None
    processes: dict[int, multiprocessing.Process] = field(default_factory=dict)  # pid -> handle
    _done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Watchdog:
        shutil.rmtree(os.path.join(self.job_dir, flight.FLIGHT_DIR), ignore_errors=True)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(0.5):
            self._keep_handles()
            flights = {r: flight.read(self.job_dir, r) for r in range(self.world)}
            if self._failing(flights):
                return  # a failure is being torn down (survivors may sit in C until SIGKILL): not a hang
            now = time.monotonic()
            stalled = [r for r, f in flights.items() if _stalled(f, now, self._started, self.timeout_s)]
            if stalled:
                self._fire(flights, stalled, now)
                return

    def _failing(self, flights: dict) -> bool:
        """A rank failed or exited with an error: the failure path tells that, not this."""
        if any(f is not None and f.notes and f.notes[-1].text.startswith("rank failed") for f in flights.values()):
            return True
        return any(p._popen is not None and p._popen.returncode not in (None, 0) for p in self.processes.values())

    def _keep_handles(self) -> None:
        # The stdlib's registry of this process's children (a private name, stable since
        # Python 3.0): the only place the ranks' exit statuses arrive. Read, never polled
        # here, so the launcher's own joins are not raced.
        try:
            for p in list(multiprocessing.process._children):
                if p.pid is not None:
                    self.processes.setdefault(p.pid, p)
        except (AttributeError, RuntimeError):
            pass

    def _fire(self, flights: dict, stalled: list[int], now: float) -> None:
        states = {r: process_state(f.pid) if f else "not started" for r, f in flights.items()}
        suspects = ([r for r in stalled if states[r] in ("T", "t")]  # stopped (SIGSTOP) / traced
                    or [r for r in stalled if flights[r] and not flights[r].waiting]  # not blocked on a peer
                    or stalled)
        headline = (f"hang: rank{'s' if len(suspects) > 1 else ''} {', '.join(map(str, suspects))} made no "
                    f"progress for {self.timeout_s:g} s (trainer.hang_timeout_s)")
        text = hang_text(headline, flights, states, now)
        path = os.path.join(self.job_dir, HANG_FILE)
        if not write_report(path, text):
            text += f"\n(could not write {path})"
        self.report = RankFailure(text + f"\nevery rank was killed (SIGKILL); this report is in {path}", headline)
        # The handles of the ranks this launcher started (never a reused pid), and the pids a
        # recorder names in case a handle was not seen yet.
        pids = {pid for pid, p in self.processes.items() if p._popen is not None and p._popen.returncode is None}
        pids |= {f.pid for f in flights.values() if f is not None and f.pid in self.processes}
        if not self.processes:
            pids |= {f.pid for f in flights.values() if f is not None}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stalled(f: Optional[flight.Flight], now: float, started: float, timeout_s: float) -> bool:
    if f is None:  # never started (e.g. stuck before its recorder existed)
        return now - started > timeout_s
    if f.notes and f.notes[-1].text.startswith(("rank finished", "rank failed")):
        return False
    return now - f.last_progress > timeout_s


def hang_text(headline: str, flights: dict, states: dict, now: float) -> str:
    state_names = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "STOPPED (SIGSTOP)",
                   "t": "stopped by a tracer", "Z": "zombie", "gone": "exited"}
    lines = [headline, "", "Each rank's last actions and collectives (flight recorder, oldest first; "
             "'WAIT' = blocked until its peers arrive):"]
    for r, f in flights.items():
        if f is None:
            lines.append(f"\nrank {r}: never started (no flight recorder)")
            continue
        lines.append(f"\nrank {r} (pid {f.pid}, {state_names.get(states[r], states[r])}): last progress "
                     f"{now - f.last_progress:.1f} s ago")
        for n in f.notes[-12:]:
            lines.append(f"  {n.time - now:+9.3f} s  {'WAIT ' if n.wait else '     '}{n.text}")
    return "\n".join(lines) + "\n"
