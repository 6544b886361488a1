"""ZeRO-Infinity's NVMe tier for the optimizer's states (`parallelism.offload_device=nvme`).

With ZeRO-Offload (framework/optim/master.py) the masters and the optimizer's states live in
host memory. With the NVMe tier the states (AdamW's m and v: 8 of a parameter's 12 offloaded
bytes; the masters stay in host memory) live in a file under `parallelism.nvme_path`, as
views of one shared memory map of it: the host optimizer steps them where they are and the
kernel's page cache moves them between the drive and memory (pages the step wrote go back
to the drive; under memory pressure the ones it read are dropped). What this is not:
DeepSpeed's explicit asynchronous I/O pool, which reads unit k+1 while unit k steps with a
fixed host budget; here the budget is the kernel's.

The states are created by the optimizer's first step (or by a checkpoint's load) in host
memory and moved into the map right after it (`adopt`), so that step holds them in memory
once; every later step keeps them in the map. The file's blocks are reserved when it is made
(posix_fallocate: a write through the map can never meet a full disk, which would kill the
process with SIGBUS); a drive without the room is told then, as ENOSPC, naming the path, the
bytes needed and the bytes free, before anything is written. The file is unlinked as soon as
it is mapped: the map keeps its blocks, and no crash leaves one behind. It is scratch, never
a saved state: a run resumes from its checkpoints (framework/checkpoint), which the offload
leaves alone.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Optional

import torch

ALIGN = 64  # bytes: each state's view starts on a cache line (and any dtype's element)


@dataclass(frozen=True)
class OffloadTarget:
    """Where ZeRO-Offload keeps the optimizer's states: "cpu" (host memory) or "nvme" (a file
    under `path`); `disk_bytes`: debug.offload_disk_bytes, the room the drive is taken to have."""

    device: str = "cpu"
    path: Optional[str] = None
    disk_bytes: Optional[int] = None


def offload_of(run) -> Optional[OffloadTarget]:
    """A run's offload target; None without parallelism.offload_optimizer."""
    p = run.parallelism
    if not p.offload_optimizer:
        return None
    return OffloadTarget(p.offload_device, p.nvme_path, run.debug.offload_disk_bytes)


class StateSwap:
    """The optimizer's per-element states in file-backed maps (module docstring)."""

    def __init__(self, target: OffloadTarget):
        self.target = target
        self.maps: list[torch.Tensor] = []  # uint8, each a whole reserved file
        self._slot: dict[tuple[int, str], tuple[int, int, int]] = {}  # (param, state) -> (map, offset, bytes)
        self.bytes = 0  # reserved in all

    def _full(self, need: int, free: int) -> OSError:
        return OSError(errno.ENOSPC, f"No space left on device for the optimizer states offloaded to NVMe "
                                     f"(parallelism.nvme_path={self.target.path}: {need} bytes needed, {free} free); "
                                     "nothing was written", self.target.path)

    def _reserve(self, need: int) -> torch.Tensor:
        os.makedirs(self.target.path, exist_ok=True)
        free = shutil.disk_usage(self.target.path).free
        if self.target.disk_bytes is not None:  # the room left of the emulated drive, this rank's maps counted
            free = min(free, self.target.disk_bytes - self.bytes)
        if need > free:
            raise self._full(need, free)
        name = os.path.join(self.target.path, f"optimizer-states-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap")
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, need)
            except OSError as e:  # the drive filled meanwhile (another rank's file on it, say)
                if e.errno != errno.ENOSPC:
                    raise
                raise self._full(need, shutil.disk_usage(self.target.path).free) from None
            return torch.from_file(name, shared=True, size=need, dtype=torch.uint8)
        finally:
            os.close(fd)
            os.unlink(name)

    def adopt(self, state: dict) -> None:
        """Move every per-element state tensor of `state` (the optimizer's: param -> {name:
        tensor}) into a map, in place of the host tensor; 0-d states (step) stay. Each
        (parameter, state) gets its place once, in the file reserved when it first appears (a
        parameter whose first gradient comes later gets a file of its own then); later calls
        move only what is not in place (a checkpoint's load replaces the states with host
        tensors, refilled into the same places)."""
        wanted = [(p, st, k) for p, st in state.items() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.dim() > 0 and not self._holds(v)]
        new = [(p, st, k) for p, st, k in wanted if (id(p), k) not in self._slot]
        if new:
            size = sum(_aligned(_nbytes(st[k])) for _, st, k in new)
            self.maps.append(self._reserve(size))
            at = 0
            for p, st, k in new:
                self._slot[(id(p), k)] = (len(self.maps) - 1, at, _nbytes(st[k]))
                at += _aligned(_nbytes(st[k]))
            self.bytes += size
        for p, st, k in wanted:
            i, at, nbytes = self._slot[(id(p), k)]
            v = st[k]
            if _nbytes(v) != nbytes:
                raise RuntimeError(f"optimizer state {k!r} is {_nbytes(v)} bytes now, its place on the drive "
                                   f"{nbytes}: a state that changes size cannot be offloaded to NVMe")
            view = self.maps[i][at:at + nbytes].view(v.dtype).view(v.shape)
            view.copy_(v)
            st[k] = view

    def _holds(self, t: torch.Tensor) -> bool:
        return any(m.data_ptr() <= t.data_ptr() < m.data_ptr() + m.numel() for m in self.maps)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
