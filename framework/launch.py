"""The local launcher: start the ranks, watch them, and say how the job ended.

Locally the launching process starts `world_size` ranks (framework/worker.py) with the
torch elastic launcher (the library behind torchrun): when a rank exits with an error, the
agent stops the others (SIGTERM, then SIGKILL after 30 s). This module reads what the ranks
leave (failure records, flight recorders; it removes them once read) and imports nothing of
the rank side but its entry point; the same rank code runs under `torchrun -m framework.worker`.

How a failed job is told (`diagnose`, one block, printed once by framework.job):
- the root cause first: a rank that raised (its traceback, from the record it wrote before
  its peers could fail), or a rank that died without a traceback (killed by a signal:
  `rank 1 killed by SIGKILL`, e.g. kill -9 or the out-of-memory killer);
- then every other rank that failed, as a consequence.
A hang (`Watchdog`): when a rank makes no progress for trainer.hang_timeout_s, the job ends
naming the stalled rank(s) and `hang.txt` holds every rank's last actions and collectives.

Over ~300 lines: issue 20 (checkpoints and data past one node) rewrites this module and
splits it into a package by concern; split then, not twice.
"""

from __future__ import annotations

import json
import logging as _logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Optional

from . import flight
from .config import RunConfig
from .files import write_report
from .flight import process_state
from .signals import Stopped
from .worker import FAILURES_DIR, rank_main

HANG_FILE = "hang.txt"
# What elastic's start_processes installs handlers for (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class RankFailure(RuntimeError):
    """The job failed; str() is the whole report, `reason` its one-line headline."""

    def __init__(self, report: str, reason: str):
        super().__init__(report)
        self.reason = reason


# ---- failure diagnosis: pure functions of what the ranks and the launcher observed ----

@dataclass
class RankEnd:
    """How one rank ended, as far as the launcher can tell."""

    rank: int
    exitcode: Optional[int] = None  # None: unknown; < 0: killed by that signal
    record: Optional[dict] = None  # worker.record_failure: time, traceback, peers_dead
    first_seen: bool = False  # the failure elastic saw first (its one reported failure)

    @property
    def stopped(self) -> bool:
        """Ended the way the agent ends survivors once another rank failed (SIGTERM, seen
        as exit 143 through framework.signals, then SIGKILL), or by a stop signal."""
        return _stop_rank(self.exitcode) > 0


def _stop_rank(exitcode: Optional[int]) -> int:
    """How likely an exit is the agent's doing rather than a cause: 0 a crash or an outside
    signal, 1 SIGKILL (the user's kill -9, or the agent's after 30 s), 2 a stop signal."""
    if exitcode == -signal.SIGKILL:
        return 1
    return 2 if exitcode in (130, 143, -signal.SIGTERM, -signal.SIGINT) else 0


def read_records(job_dir: str) -> tuple[dict[int, dict], list[str]]:
    """The ranks' failure records, and a note for each unreadable one (an empty file on a
    full disk must not crash the report). The folder is removed: it is not a result."""
    folder = os.path.join(job_dir, FAILURES_DIR)
    records, notes = {}, []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    rec = json.load(f)
                records[int(rec["rank"])] = rec
            except (OSError, ValueError, KeyError, TypeError) as e:
                notes.append(f"(failure record {name} unreadable: {type(e).__name__}: {e}; disk full?)")
        shutil.rmtree(folder, ignore_errors=True)
    return records, notes


def _last_line(traceback_text: str) -> str:
    lines = [ln for ln in traceback_text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _root(ends: dict[int, RankEnd]) -> Optional[int]:
    """The earliest record (written before the recording rank's peers could fail) is the
    cause, unless a peer had already died without a record when it was written: then that
    rank is (the recorder failed because its connection to it closed); a rank the agent had
    stopped is never that peer unless nothing else is. With no record at all: the failure
    elastic saw first, then a signal other than the agent's, then any failed exit."""
    recorded = sorted((e.record["time"], r) for r, e in ends.items() if e.record)
    if recorded:
        first = recorded[0][1]
        dead = [d for d in ends[first].record.get("peers_dead", []) if d in ends and not ends[d].record]
        dead.sort(key=lambda d: _stop_rank(ends[d].exitcode))
        return dead[0] if dead else first
    order = [r for r, e in ends.items() if e.first_seen and e.exitcode]
    order += sorted((r for r, e in ends.items() if e.exitcode is not None and e.exitcode < 0),
                    key=lambda r: _stop_rank(ends[r].exitcode))
    order += [r for r, e in ends.items() if e.exitcode not in (None, 0)]
    return order[0] if order else None


def _describe(end: RankEnd) -> tuple[str, str]:
    """(headline, detail) of one rank's end."""
    if end.record:
        tb = end.record["traceback"]
        return f"rank {end.rank} failed: {_last_line(tb)}", tb
    if end.exitcode == -signal.SIGABRT:
        return (f"rank {end.rank} killed by SIGABRT",
                "no Python traceback: aborted in native code (an NCCL watchdog timeout or a C++ assertion)")
    if end.exitcode is not None and end.exitcode < 0:
        return (f"rank {end.rank} killed by {_signal_name(end.exitcode)}",
                "no Python traceback: the process was ended from outside (kill, the out-of-memory killer) "
                "or crashed in native code")
    if end.exitcode in (130, 143):
        return f"rank {end.rank} stopped by {'SIGINT' if end.exitcode == 130 else 'SIGTERM'}", ""
    code = "unknown" if end.exitcode is None else end.exitcode
    return f"rank {end.rank} exited with code {code} without a traceback", ""


def diagnose(ends: dict[int, RankEnd], notes: list[str]) -> RankFailure:
    root = _root(ends)
    if root is None:
        return RankFailure("the job failed, but no rank recorded why\n" + "\n".join(notes), "unknown failure")
    headline, detail = _describe(ends[root])
    others = [r for r, e in sorted(ends.items())
              if r != root and (e.record or (e.exitcode is not None and e.exitcode < 0
                                             and -e.exitcode not in (signal.SIGTERM, signal.SIGKILL)))]
    lines = [headline, detail.rstrip()]
    if others:
        lines.append("then, as a consequence: " + "; ".join(_describe(ends[r])[0] for r in others))
    return RankFailure("\n".join(ln for ln in lines + notes if ln), headline)


# ---- hang watchdog -------------------------------------------------------------------

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


# ---- the launch ------------------------------------------------------------------------

def _preload_forkserver() -> None:
    """Ranks start as forks of one server process that imported torch, transformers and
    the framework once (about 5 s of imports per rank with `spawn`; a sweep or the test
    suite starts hundreds of ranks). The server never runs torch ops or touches CUDA, so
    its forks are as clean as spawned processes: no OpenMP pool, no CUDA context.

    A fork inherits the *server's* environment, plus what elastic sets per rank (RANK,
    MASTER_ADDR, ...). So the server is restarted whenever this process's environment
    changed since it started (a W&B or HF variable set between two jobs must reach the
    ranks, as it would with spawn)."""
    import multiprocessing.forkserver as fs

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}  # elastic's own
    server = fs._forkserver  # the stdlib's per-process server; _stop is its own reset
    if getattr(server, "framework_env", None) != env:
        server._stop()
        server.framework_env = env
    fs.set_forkserver_preload(["framework.worker", "framework.trainer"])


def _ends(err, watchdog: Watchdog, job_dir: str) -> tuple[dict[int, RankEnd], list[str]]:
    """Each rank's end: its record, and its exit code (from the handles the watchdog kept,
    else elastic's one reported failure). Local launches are one node: rank = local rank."""
    records, notes = read_records(job_dir)
    ends = {r: RankEnd(r, record=rec) for r, rec in records.items()}
    for r in range(watchdog.world):
        f = flight.read(job_dir, r)
        p = watchdog.processes.get(f.pid) if f else None
        code = p._popen.returncode if p is not None and p._popen is not None else None  # joined by now
        if code is not None and code != 0:
            ends.setdefault(r, RankEnd(r)).exitcode = code
    for local_rank, failure in getattr(err, "failures", {}).items():
        ends.setdefault(local_rank, RankEnd(local_rank)).first_seen = True
        if ends[local_rank].exitcode is None:
            ends[local_rank].exitcode = failure.exitcode
    return ends, notes


def _quiet_elastic() -> None:
    """The agent logs every failed rank's traceback on ERROR lines, and a stop or the end of
    the survivors on WARNING lines; framework.job prints one report instead. Elastic sets a
    level on each of its module loggers (from $LOGLEVEL), so a parent's level is not enough."""
    for name in list(_logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            _logging.getLogger(name).setLevel(_logging.CRITICAL)


def launch_local(run: RunConfig, job_dir: str, info) -> Optional[dict]:
    """Start world_size ranks on this node, wait, return rank 0's summary, or raise
    RankFailure (a rank failed or hung) or Stopped (SIGINT / SIGTERM reached this process)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=run.world_size, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, as torchrun --standalone
        max_restarts=0, monitor_interval=0.2, start_method="forkserver",
    )
    _preload_forkserver()
    handlers = {s: signal.getsignal(s) for s in ELASTIC_SIGNALS}  # elastic replaces them
    watchdog = Watchdog(job_dir, run.world_size, run.trainer.hang_timeout_s).start()
    try:
        try:
            results = elastic_launch(config, rank_main)(job_dir, asdict(info))
        finally:  # before any diagnosis: a signal now is this process's again, not elastic's
            for s, h in handlers.items():
                signal.signal(s, h)
    except ChildFailedError as e:
        watchdog.stop()
        if watchdog.report is not None:
            read_records(job_dir)  # the killed ranks' records are consequences of the hang
            raise watchdog.report from None
        raise diagnose(*_ends(e, watchdog, job_dir)) from None
    except SignalException as e:
        shutil.rmtree(os.path.join(job_dir, FAILURES_DIR), ignore_errors=True)  # a stop blames no one
        raise Stopped(e.sigval) from None
    finally:
        watchdog.stop()
        shutil.rmtree(os.path.join(job_dir, flight.FLIGHT_DIR), ignore_errors=True)  # read; not a result
    return results[0]
