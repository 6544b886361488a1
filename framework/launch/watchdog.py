"""The hang watchdog: a thread in a launching process that ends a job whose ranks stopped progressing.

It reads every rank's flight recorder (framework/train/flight.py) twice a second. When a rank
has made no progress for trainer.hang_timeout_s, the job ends naming the stalled rank(s)
and `hang.txt` holds every rank's last actions and collectives. The stalled rank is the one
stopped (process state `T`), else the one not blocked waiting on a peer, else (a deadlock,
once every unfinished rank is stalled or REMOTE_GRACE_S later) all of them. It stands down
once a rank has failed: that is told as a failure.

On several nodes (`nodes` > 1, launch/node.py) every node's launcher runs one, reading every
rank's recorder from the shared job directory, but it looks at processes (/proc, signals)
and clocks only for the ranks it started itself: another node's pids and monotonic clock
mean nothing here. A remote rank's progress is a change of its note count seen on this
watchdog's clock. So the node that hosts a stall names it (it sees the stopped process);
a node whose own stalled ranks only wait on peers leaves it REMOTE_GRACE_S to do so, then
names what it sees. The first to name a hang writes hang.txt (an exclusive link); every
other node's watchdog then kills its own ranks too, and every node tells the same report.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from framework.train import flight
from framework.report.files import write_report
from framework.train.flight import process_state
from framework.launch.diagnosis import RankFailure

HANG_FILE = "hang.txt"
REMOTE_GRACE_S = 10.0
STATE_NAMES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "STOPPED (SIGSTOP)",
               "t": "stopped by a tracer", "Z": "zombie", "gone": "exited", "remote": "on another node"}


@dataclass
class Watchdog:
    """A thread in the launching process: reads every rank's flight recorder twice a second;
    when one has made no progress for `timeout_s` it writes hang.txt and kills the ranks.
    It also keeps the ranks' multiprocessing handles, so their exit codes (the signal that
    killed one) are known after the launch."""

    job_dir: str
    world: int
    timeout_s: float
    nodes: int = 1  # the launchers that start the job's ranks: one per node (1: this one starts all)
    report: Optional[RankFailure] = None
    processes: dict[int, multiprocessing.Process] = field(default_factory=dict)  # pid -> handle
    _done: threading.Event = field(default_factory=threading.Event)
    _deferred: Optional[float] = field(default=None, init=False)  # when only waiting ranks first stalled

    def start(self) -> Watchdog:
        if self.nodes == 1:  # on several nodes another node's ranks may have started already
            shutil.rmtree(os.path.join(self.job_dir, flight.FLIGHT_DIR), ignore_errors=True)
        self._host = socket.gethostname()
        self._started = time.monotonic()
        self._first_flight: Optional[float] = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (notes written, when this watchdog saw that)
        self._deferred: Optional[float] = None
        self._thread = threading.Thread(target=self._loop, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(0.5):
            self._keep_handles()
            if self.nodes > 1 and self._follow():
                return  # another node's watchdog named a hang
            flights = {r: flight.read(self.job_dir, r) for r in range(self.world)}
            if self._failing(flights):
                return  # a failure is being torn down (survivors may sit in C until SIGKILL): not a hang
            now = time.monotonic()
            self._observe(flights, now)
            own = self.own_ranks(flights)
            stalled = [r for r, f in flights.items() if self._stalled(f, own, now)]
            suspects = self._suspects(flights, stalled, own, now)
            if suspects:
                self._fire(flights, suspects, own, now)
                return

    def own_ranks(self, flights: dict) -> set[int]:
        """The ranks this launcher started: their processes and clock are this node's."""
        if self.nodes == 1:
            return set(flights)
        return {r for r, f in flights.items() if f is not None and f.host == self._host and f.pid in self.processes}

    def exit_codes(self, flights: dict) -> dict[int, int]:
        """The exit code of each of this launcher's ranks that has ended (after the launch)."""
        own = self.own_ranks(flights)
        out = {}
        for r, f in flights.items():
            p = self.processes.get(f.pid) if f is not None and r in own else None
            if p is not None and p._popen is not None and p._popen.returncode is not None:  # joined by now
                out[r] = p._popen.returncode
        return out

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

    def _observe(self, flights: dict, now: float) -> None:
        for r, f in flights.items():
            if f is not None:
                self._first_flight = self._first_flight or now
                if self._seen.get(r, (None,))[0] != f.count:
                    self._seen[r] = (f.count, now)

    def _age(self, r: int, f: flight.Flight, own: set[int], now: float) -> float:
        """Seconds since the rank's last note: its own clock when it is this node's, else since
        this watchdog saw its note count change."""
        return now - f.last_progress if r in own else now - self._seen[r][1]

    def _stalled(self, f: Optional[flight.Flight], own: set[int], now: float) -> bool:
        if f is None:  # never started (e.g. stuck before its recorder existed); on several nodes
            # the ranks start together after the rendezvous, which waits for the slowest node
            since = self._started if self.nodes == 1 else self._first_flight
            return since is not None and now - since > self.timeout_s
        if f.notes and f.notes[-1].text.startswith(("rank finished", "rank failed")):
            return False
        return self._age(f.rank, f, own, now) > self.timeout_s

    def _suspects(self, flights: dict, stalled: list[int], own: set[int], now: float) -> list[int]:
        """Whom to name, or [] for not yet: a stopped rank of this node, else one of its
        ranks not blocked on a peer; else, once every unfinished rank is stalled or after a
        grace, every stalled rank (a deadlock) -- on several nodes over every node's ranks
        this one sees.

        Only stalled ranks are named, but a stopped rank is looked for among all of this
        node's: the peers blocked on it may cross the timeout first (their last note, the
        WAIT, can be older than its last note), and naming them would name the victims."""
        if not stalled:
            self._deferred = None
            return []
        live = [r for r, f in flights.items() if r in own and f is not None]
        stopped = [r for r in live if process_state(flights[r].pid) in ("T", "t")]  # SIGSTOP / traced
        if stopped:
            return [r for r in stopped if r in stalled]  # [] until it has crossed the timeout itself
        named = [r for r in stalled if r in live and not flights[r].waiting]  # not blocked on a peer
        if named:
            return named
        unfinished = [r for r, f in flights.items() if f is None or not (
            f.notes and f.notes[-1].text.startswith(("rank finished", "rank failed")))]
        if self.nodes == 1 and set(unfinished) <= set(stalled):
            return stalled  # everyone left is blocked: a deadlock
        # Only waiting ranks are stalled: the rank they wait on may cross the timeout on a
        # later poll (then it is named above), or, on several nodes, another node may name it.
        self._deferred = self._deferred or now
        if now - self._deferred < REMOTE_GRACE_S:
            return []
        return [r for r in stalled if flights[r] and not flights[r].waiting] or stalled

    def _fire(self, flights: dict, suspects: list[int], own: set[int], now: float) -> None:
        states = {r: "not started" if f is None else process_state(f.pid) if r in own else "remote"
                  for r, f in flights.items()}
        ages = {r: self._age(r, f, own, now) for r, f in flights.items() if f is not None}
        hosts = self.nodes > 1
        names = ", ".join(f"{r} (host {flights[r].host if flights[r] else 'unknown'})" if hosts else str(r)
                          for r in suspects)
        headline = (f"hang: rank{'s' if len(suspects) > 1 else ''} {names} made no "
                    f"progress for {self.timeout_s:g} s (trainer.hang_timeout_s)")
        text = hang_text(headline, flights, states, ages, hosts)
        path = os.path.join(self.job_dir, HANG_FILE)
        if hosts:
            text = _publish(path, text)
            headline = text.splitlines()[0]
        elif not write_report(path, text):
            text += f"\n(could not write {path})"
        self.report = RankFailure(text + f"\nevery rank was killed (SIGKILL); this report is in {path}", headline)
        self._kill_own(flights)

    def _follow(self) -> bool:
        """Another node's watchdog wrote hang.txt: adopt its report and end this node's ranks."""
        path = os.path.join(self.job_dir, HANG_FILE)
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            return False
        self.report = RankFailure(text + f"\nevery rank was killed (SIGKILL); this report is in {path}",
                                  text.splitlines()[0] if text else "hang")
        self._kill_own({r: flight.read(self.job_dir, r) for r in range(self.world)})
        return True

    def _kill_own(self, flights: dict) -> None:
        # The handles of the ranks this launcher started (never a reused pid), and the pids a
        # recorder names in case a handle was not seen yet (on one node only: on several, a
        # pid in another node's recorder is another machine's process).
        own = self.own_ranks(flights)
        pids = {pid for pid, p in self.processes.items() if p._popen is not None and p._popen.returncode is None}
        pids |= {f.pid for r, f in flights.items() if f is not None and r in own and f.pid in self.processes}
        if not self.processes and self.nodes == 1:
            pids |= {f.pid for f in flights.values() if f is not None}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _publish(path: str, text: str) -> str:
    """hang.txt on several nodes: the first watchdog to name a hang writes it (a hard link,
    which fails if the file exists, even on NFS); a later one returns what is there."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        try:
            os.link(tmp, path)
            return text
        except FileExistsError:
            with open(path) as f:
                return f.read() or text
        except OSError:  # a filesystem without hard links: last writer wins
            os.replace(tmp, path)
            return text
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as e:
        print(f"could not write {path}: {e}", file=sys.stderr, flush=True)
        return text + f"\n(could not write {path})"


def hang_text(headline: str, flights: dict, states: dict, ages: dict, hosts: bool = False) -> str:
    """`ages`: seconds since each rank's last note, on the reader's clock."""
    lines = [headline, "", "Each rank's last actions and collectives (flight recorder, oldest first; "
             "'WAIT' = blocked until its peers arrive):"]
    for r, f in flights.items():
        if f is None:
            lines.append(f"\nrank {r}: never started (no flight recorder)")
            continue
        where = f"host {f.host}, " if hosts else ""
        lines.append(f"\nrank {r} ({where}pid {f.pid}, {STATE_NAMES.get(states[r], states[r])}): last progress "
                     f"{ages[r]:.1f} s ago")
        for n in f.notes[-12:]:
            lines.append(f"  {n.time - f.last_progress - ages[r]:+9.3f} s  {'WAIT ' if n.wait else '     '}{n.text}")
    return "\n".join(lines) + "\n"
