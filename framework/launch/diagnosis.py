"""How the ranks ended, told as one block: pure functions of what the ranks and the launcher saw.

A failed job is told (`diagnose`, printed once by framework.launch.job) as:
- the root cause first: a rank that raised (its traceback, from the record it wrote before
  its peers could fail), or a rank that died without a traceback (killed by a signal:
  `rank 1 killed by SIGKILL`, e.g. kill -9 or the out-of-memory killer);
- then every other rank that failed, as a consequence.

The inputs are the ranks' failure records (`read_records`: `rank_failures/` in the job
directory, written by framework/train/worker.py) and each rank's exit code as its launcher saw it.
A record that says a peer failed first (a closed connection under gloo; an NCCL watchdog
timeout, abort or remote error: worker.CONNECTION_ERRORS) is a consequence wherever it falls
in time: another rank's own error is the cause. On several nodes (`hosts` given,
launch/node.py) each rank is named with its host, and such a record's writer saw only its own
node's dead peers, and wall clocks of two hosts differ a little.
Nothing here starts, watches or signals a process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass
from typing import Optional

from framework.train.worker import CONNECTION_ERRORS, FAILURES_DIR


class RankFailure(RuntimeError):
    """The job failed; str() is the whole report, `reason` its one-line headline."""

    def __init__(self, report: str, reason: str):
        super().__init__(report)
        self.reason = reason


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
        as exit 143 through framework.train.signals, then SIGKILL), or by a stop signal."""
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
    records, notes = peek_records(job_dir)
    shutil.rmtree(os.path.join(job_dir, FAILURES_DIR), ignore_errors=True)
    return records, notes


def peek_records(job_dir: str) -> tuple[dict[int, dict], list[str]]:
    """`read_records` without removing the folder (several nodes' launchers read it)."""
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
    return records, notes


def _exception(traceback_text: str) -> str:
    """The exception a traceback ends with, every line of it: what follows the last frame
    (an NCCL error spans several: `DistBackendError: NCCL error in: ...`, `ncclRemoteError:
    ...`, `Last error:`, ...)."""
    lines = traceback_text.rstrip().splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith(("Traceback", "  File ")):
            start = i + 1
    while start < len(lines) and (lines[start].startswith(" ") or not lines[start].strip()):
        start += 1  # the last frame's source line and its ^^^ markers
    return "\n".join(lines[start:]).strip() or "unknown error"


def _headline(traceback_text: str) -> str:
    """The exception's first line: its type and message (the last line of a multi-line
    message would be a detail, e.g. NCCL's `Last error:`)."""
    return _exception(traceback_text).splitlines()[0].strip()


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _victim(record: dict) -> bool:
    """The record of a rank that failed because a peer failed first (its connection closed,
    a collective it never joined timed out, its communicator was aborted)."""
    text = _exception(record["traceback"])
    return any(c in text for c in CONNECTION_ERRORS)


def _root(ends: dict[int, RankEnd], nodes: bool = False) -> Optional[int]:
    """The earliest record (written before the recording rank's peers could fail) is the
    cause, unless a peer had already died without a record when it was written: then that
    rank is (the recorder failed because its connection to it closed); a rank the agent had
    stopped is never that peer unless nothing else is. A victim's record (`_victim`) comes
    after any other. With no record at all: the failure elastic saw first, then a signal
    other than the agent's, then any failed exit. `nodes` (several nodes): a victim's dead
    peer may be one another node's record names, or one that node's agent saw die first."""
    recorded = sorted((_victim(e.record), e.record["time"], r) for r, e in ends.items() if e.record)
    if recorded:
        first = recorded[0][2]
        named = list(ends[first].record.get("peers_dead", []))
        if nodes and _victim(ends[first].record):
            named += [d for *_, r in recorded for d in ends[r].record.get("peers_dead", [])]
            named += [r for r, e in sorted(ends.items())
                      if e.first_seen and e.exitcode not in (None, 0) and _stop_rank(e.exitcode) < 2]
        dead = [d for d in dict.fromkeys(named) if d in ends and not ends[d].record]
        dead.sort(key=lambda d: _stop_rank(ends[d].exitcode))
        return dead[0] if dead else first
    order = [r for r, e in ends.items() if e.first_seen and e.exitcode]
    order += sorted((r for r, e in ends.items() if e.exitcode is not None and e.exitcode < 0),
                    key=lambda r: _stop_rank(ends[r].exitcode))
    order += [r for r, e in ends.items() if e.exitcode not in (None, 0)]
    return order[0] if order else None


def _describe(end: RankEnd, hosts: Optional[dict[int, str]] = None) -> tuple[str, str]:
    """(headline, detail) of one rank's end; `hosts`: name the rank's host too."""
    who = f"rank {end.rank}" + (f" (host {hosts.get(end.rank) or 'unknown'})" if hosts is not None else "")
    if end.record:
        tb = end.record["traceback"]
        return f"{who} failed: {_headline(tb)}", tb
    if end.exitcode == -signal.SIGABRT:
        return (f"{who} killed by SIGABRT",
                "no Python traceback: aborted in native code (an NCCL watchdog timeout or a C++ assertion)")
    if end.exitcode is not None and end.exitcode < 0:
        return (f"{who} killed by {_signal_name(end.exitcode)}",
                "no Python traceback: the process was ended from outside (kill, the out-of-memory killer) "
                "or crashed in native code")
    if end.exitcode in (130, 143):
        return f"{who} stopped by {'SIGINT' if end.exitcode == 130 else 'SIGTERM'}", ""
    code = "unknown" if end.exitcode is None else end.exitcode
    return f"{who} exited with code {code} without a traceback", ""


def diagnose(ends: dict[int, RankEnd], notes: list[str], hosts: Optional[dict[int, str]] = None) -> RankFailure:
    """`hosts` (rank -> host; a job on several nodes): each rank is named with its host."""
    root = _root(ends, nodes=hosts is not None)
    if root is None:
        return RankFailure("the job failed, but no rank recorded why\n" + "\n".join(notes), "unknown failure")
    headline, detail = _describe(ends[root], hosts)
    others = [r for r, e in sorted(ends.items())
              if r != root and (e.record or (e.exitcode is not None and e.exitcode < 0
                                             and -e.exitcode not in (signal.SIGTERM, signal.SIGKILL)))]
    lines = [headline, detail.rstrip()]
    if others:
        lines.append("then, as a consequence: " + "; ".join(_describe(ends[r], hosts)[0] for r in others))
    return RankFailure("\n".join(ln for ln in lines + notes if ln), headline)
