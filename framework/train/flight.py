"""A rank's flight recorder: its last actions and collectives, readable from outside.

Each rank writes into a small memory-mapped file `<job_dir>/.flight/rank<r>` (a ring of
the last `SLOTS` notes plus a header: pid, time of the last note, note count). Writing a
note is a `struct.pack_into` on shared memory (plus a clock read): no write call, no flush,
cheap enough for every pipeline action and p2p batch. Times are CLOCK_MONOTONIC, one clock
for every process of the node, immune to wall-clock steps. The file is filled with zeros
when created, so a full disk fails there (the rank then runs without a recorder) rather
than with SIGBUS on a later note. The launcher's watchdog (framework/launch/watchdog.py) reads
the files: a rank stopped with SIGSTOP or stuck in a C call cannot dump its own memory,
but the page cache still holds what it last wrote. The header names the rank's host, so a
job on several nodes (its job directory on a shared filesystem) names a remote rank by host;
another node sees a remote file as its filesystem shows it (on NFS, seconds late), and a
remote rank's times are on that node's clock (the watchdog compares only changes it saw).

A note is either an action (compute, Python) or a wait (a collective or p2p wait the rank
is blocked in until its peers arrive). The watchdog uses the difference: a rank whose last
note is a wait is a victim of a stall elsewhere, not the stall.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass

from framework.topology import NullRecorder

FLIGHT_DIR = ".flight"
SLOTS = 64
TEXT = 112  # bytes of text per note (longer notes are cut)
HOST = 64  # bytes of host name
_HEADER = struct.Struct(f"<qdq{HOST}s")  # pid, time of the last note (time.monotonic()), notes written, host
_SLOT = struct.Struct(f"<d?{TEXT}s")  # time, is a wait, text
SIZE = _HEADER.size + SLOTS * _SLOT.size


def path_of(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, FLIGHT_DIR, f"rank{rank}")


class FlightRecorder:
    """The writing side, one per rank (created first thing in the rank)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bytes(SIZE))  # allocated now: no SIGBUS on a full disk later
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)
        self.count, self.pid, self.host = 0, os.getpid(), socket.gethostname().encode()[:HOST]
        self.note("rank started")

    @classmethod
    def create(cls, path: str):
        """A recorder, or (unwritable job dir, full disk, a filesystem without shared mmap)
        a NullRecorder: the hang watchdog then sees the rank as never started."""
        try:
            return cls(path)
        except (OSError, ValueError) as e:
            print(f"flight recorder {path} unavailable ({e}); hang detection will not see this rank",
                  file=sys.stderr, flush=True)
            return NullRecorder()

    def note(self, text: str, wait: bool = False) -> None:
        now = time.monotonic()
        _SLOT.pack_into(self._map, _HEADER.size + (self.count % SLOTS) * _SLOT.size, now, wait,
                        text.encode()[:TEXT])
        self.count += 1
        _HEADER.pack_into(self._map, 0, self.pid, now, self.count, self.host)

    def close(self) -> None:
        self._map.close()
        self._file.close()


@dataclass
class Note:
    time: float
    wait: bool
    text: str


@dataclass
class Flight:
    """The reading side: one rank's state as its file shows it."""

    rank: int
    pid: int
    last_progress: float  # on the clock of the rank's node
    notes: list[Note]  # oldest first
    host: str = ""
    count: int = 0  # notes written so far: a change is progress, whichever node's clock reads it

    @property
    def waiting(self) -> bool:
        return bool(self.notes) and self.notes[-1].wait


def read(job_dir: str, rank: int) -> Flight | None:
    """None while the rank has not created its file yet (or it is unreadable)."""
    try:
        with open(path_of(job_dir, rank), "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    pid, last, count, host = _HEADER.unpack_from(data, 0)
    if count == 0:
        return None
    notes = []
    for i in range(max(0, count - SLOTS), count):
        t, wait, raw = _SLOT.unpack_from(data, _HEADER.size + (i % SLOTS) * _SLOT.size)
        notes.append(Note(t, wait, raw.rstrip(b"\0").decode(errors="replace")))
    return Flight(rank, pid, last, notes, host.rstrip(b"\0").decode(errors="replace"), count)


def process_state(pid: int) -> str:
    """Linux process state letter (R running, S sleeping, D disk, T stopped, Z zombie),
    or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def dead_ranks(job_dir: str, node_ranks: range, me: int) -> list[int]:
    """Other ranks of this node whose process has exited (or is a zombie). Only this node's:
    another host's pids mean nothing in this /proc."""
    out, host = [], socket.gethostname()
    for r in node_ranks:
        f = read(job_dir, r) if r != me else None
        if f is not None and f.host in ("", host) and process_state(f.pid) in ("Z", "X", "gone"):
            out.append(r)
    return out
