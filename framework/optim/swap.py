"""ZeRO-Infinity's NVMe tier for the optimizer's states (`parallelism.offload_device=nvme`).

With ZeRO-Offload (framework/optim/master.py) the masters and the optimizer's states live in
host memory. With the NVMe tier the states (AdamW's m and v: 8 of a parameter's 12 offloaded
bytes; the masters stay in host memory) live in a file under `parallelism.nvme_path`, one
region per unit (a ZeRO unit's slice, else a parameter), moved by an explicit pool, as
DeepSpeed's pipelined optimizer swapper does:
- the step walks the units in order; one I/O thread reads unit k+1 from the drive into a
  host buffer while unit k steps in another, and writes unit k-1 back from a third. Host
  memory for the states is `DEPTH` buffers of the largest unit's states, whatever the model's
  depth (`host_peak_bytes`: the most the step held at once, counted where it allocates;
  tests/test_offload_nvme.py);
- the first step (and the first after a checkpoint's load) steps each unit on states made in
  host memory and writes them out unit by unit; a checkpoint's load itself holds them once;
- between steps the optimizer's state entries are views of a shared read-only-by-convention
  map of the file (the checkpoint and the memory report read them; the kernel pages them in
  only when read). Reads and writes go through the page cache (buffered `pread`/`pwrite`, not
  O_DIRECT): a unit's clean pages are dropped after it is read (POSIX_FADV_DONTNEED), dirty
  ones are the kernel's to write back.

The file's blocks are reserved for every unit the first time states exist (posix_fallocate:
no write ever meets a full disk, which through the map would kill the process with SIGBUS);
a drive without the room is told then, as ENOSPC, naming the path, the bytes needed and the
bytes free, before anything is written. The file is unlinked as soon as it is opened and
mapped (the descriptor and the map keep its blocks): no crash leaves one behind. It is
scratch, never a saved state: a run resumes from its checkpoints (framework/checkpoint),
which the offload leaves alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

ALIGN = 4096  # bytes: each unit's region (and each state in it) starts on a page
DEPTH = 3  # host buffers: the unit stepping, the next one being read, the last one being written


@dataclass(frozen=True)
class OffloadTarget:
    """Where ZeRO-Offload keeps the optimizer's states: "cpu" (host memory) or "nvme" (a file
    under `path`); `disk_bytes`: debug.offload_disk_bytes, the room the drive is taken to have."""

    device: str = "cpu"
    path: Optional[str] = None
    disk_bytes: Optional[int] = None
    params: bool = False  # parallelism.offload_params: ZeRO 3's parameter slices on the drive too (param_swap.py)


def offload_of(run) -> Optional[OffloadTarget]:
    """A run's offload target; None without parallelism.offload_optimizer."""
    p = run.parallelism
    if not p.offload_optimizer:
        return None
    return OffloadTarget(p.offload_device, p.nvme_path, run.debug.offload_disk_bytes, p.params_on_drive)


class StateSwap:
    """The optimizer's per-element states of `units` (the tensors it steps) on the drive,
    stepped through a pool of host buffers (module docstring)."""

    def __init__(self, target: OffloadTarget, units: list[torch.Tensor]):
        self.target = target
        self.units = units
        self.fd = -1
        self.map: Optional[torch.Tensor] = None  # uint8 over the whole file
        self.layout: list[tuple[str, torch.dtype]] = []  # per-element states, in each region's order
        self.place: dict[int, int] = {}  # id(unit) -> its region's byte offset
        self.bytes = 0  # reserved
        self.buffers: list[torch.Tensor] = []
        self.io = ThreadPoolExecutor(1, thread_name_prefix="nvme-io")  # one FIFO: a buffer's write precedes its reuse
        self.held = 0  # state bytes in host memory now (buffers, states made in memory)
        self.host_peak_bytes = 0

    # -- the file ---------------------------------------------------------------------------
    def _region(self, u: torch.Tensor) -> int:
        return sum(aligned(u.numel() * _size(d)) for _, d in self.layout)

    def _reserve(self, states: dict) -> None:
        """The file for every unit's states, laid out as `states` (one unit's, the first made)."""
        self.layout = [(k, v.dtype) for k, v in sorted(states.items()) if _per_element(v)]
        need = sum(self._region(u) for u in self.units)
        if need == 0:
            return
        self.fd, self.map = reserve(self.target, need, "the optimizer states", mapped=True)
        self.bytes, at = need, 0
        for u in self.units:
            self.place[id(u)] = at
            at += self._region(u)
        top = max(self._region(u) for u in self.units)
        self.buffers = [page_aligned(top) for _ in range(DEPTH)]
        self._hold(DEPTH * top)

    def _views(self, base: torch.Tensor, at: int, u: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for k, d in self.layout:
            n = u.numel() * _size(d)
            out[k] = base[at:at + n].view(d).view(u.shape)
            at += aligned(n)
        return out

    def _on_drive(self, u: torch.Tensor, st: dict) -> bool:
        """Whether `st` (unit u's states) are the map's views: the drive holds them."""
        if self.map is None or id(u) not in self.place or not st:
            return False
        return all(self.holds(v) for v in st.values() if _per_element(v))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of the file: a state the drive holds between steps."""
        return self.map is not None and self.map.data_ptr() <= t.data_ptr() < self.map.data_ptr() + self.map.numel()

    def _hold(self, n: int) -> None:
        self.held += n
        self.host_peak_bytes = max(self.host_peak_bytes, self.held)

    # -- I/O (on the pool's thread) -----------------------------------------------------------
    def _read(self, u: torch.Tensor, buf: torch.Tensor) -> None:
        n, at = self._region(u), self.place[id(u)]
        full_io(os.preadv, self.fd, buf[:n], at)
        os.posix_fadvise(self.fd, at, n, os.POSIX_FADV_DONTNEED)  # clean now: the buffer has them

    def _write(self, u: torch.Tensor, buf: torch.Tensor) -> None:
        full_io(os.pwritev, self.fd, buf[:self._region(u)], self.place[id(u)])

    def _fill(self, u: torch.Tensor, st: dict, buf: torch.Tensor) -> None:
        """States made (or loaded) in host memory into `buf`, laid out as on the drive."""
        made = {k: v for k, v in st.items() if _per_element(v)}
        if sorted(made) != [k for k, _ in self.layout] or any(
                made[k].dtype != d or made[k].numel() != u.numel() for k, d in self.layout):
            raise RuntimeError(f"optimizer states of a {u.numel()}-element unit are "
                               f"{ {k: (v.numel(), v.dtype) for k, v in sorted(made.items())} }, their place on the "
                               f"drive was laid out for {self.layout}: states that change in size or kind cannot "
                               "be offloaded to NVMe")
        n = sum(v.numel() * v.element_size() for v in made.values())
        self._hold(n)  # until they are in the buffer and dropped
        for k, v in self._views(buf, 0, u).items():
            v.copy_(made[k])
        self._hold(-n)

    # -- the step ---------------------------------------------------------------------------
    def step(self, inner: torch.optim.Optimizer) -> None:
        """Step `inner` unit by unit over the units that hold a gradient (their `.grad`s set),
        each on its states in a host buffer; every write has landed when this returns."""
        todo = [(u, u.grad) for u in self.units if u.grad is not None]
        for u, _ in todo:
            u.grad = None
        writes: dict[int, Future] = {}  # buffer -> its last write (a buffer is reused once it landed)
        reads: dict[int, Future] = {}

        def prefetch(k: int) -> None:
            if k < len(todo) and self._on_drive(todo[k][0], inner.state.get(todo[k][0], {})):
                reads[k] = self.io.submit(self._read, todo[k][0], self.buffers[k % DEPTH])

        try:
            prefetch(0)
            for k, (u, g) in enumerate(todo):
                prefetch(k + 1)  # unit k+1 comes off the drive while unit k steps
                st = inner.state.get(u, {})
                buf = self.buffers[k % DEPTH] if self.buffers else None
                read = reads.pop(k, None)
                if read is not None:
                    read.result()
                    st.update(self._views(buf, 0, u))
                u.grad = g
                inner.step()  # only u holds a gradient: torch's optimizers step only it
                u.grad = None
                st = inner.state[u]
                if self.map is None:
                    self._reserve(st)
                    if self.map is None:  # no per-element states (plain SGD): nothing to offload
                        continue
                    buf = self.buffers[k % DEPTH]
                if read is None:  # made by this step (or loaded) in memory: into the buffer, then dropped
                    if k % DEPTH in writes:
                        writes[k % DEPTH].result()
                    self._fill(u, st, buf)
                writes[k % DEPTH] = self.io.submit(self._write, u, buf)
                st.update(self._views(self.map, self.place[id(u)], u))
            for f in writes.values():
                f.result()
        except BaseException:
            for u, _ in todo:  # no state may stay a view of a buffer the next step's reads overwrite
                st = inner.state.get(u, {})
                for name, v in list(st.items()):
                    if _per_element(v) and any(_within(b, v) for b in self.buffers):
                        st[name] = v.clone()
            raise
        finally:
            for f in list(reads.values()) + list(writes.values()):
                f.cancel() or f.exception()  # the pool is idle when this returns, even after an error
            for u, g in todo:  # as torch's optimizers leave them (after an error too: the caller clears them)
                u.grad = g

    def close(self) -> None:
        self.io.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def reserve(target: OffloadTarget, need: int, what: str, mapped: bool) -> tuple[int, Optional[torch.Tensor]]:
    """A scratch file of `need` bytes under target.path, its blocks reserved and its name
    unlinked: (descriptor, a shared uint8 map of it when `mapped`). ENOSPC, naming the path and
    the bytes, when the drive (or debug.offload_disk_bytes) lacks the room: nothing written."""
    def full(free: int) -> OSError:
        return OSError(errno.ENOSPC, f"No space left on device for {what} offloaded to NVMe "
                                     f"(parallelism.nvme_path={target.path}: {need} bytes needed, {free} free); "
                                     "nothing was written", target.path)

    os.makedirs(target.path, exist_ok=True)
    free = shutil.disk_usage(target.path).free
    if target.disk_bytes is not None:  # the room of the emulated drive
        free = min(free, target.disk_bytes)
    if need > free:
        raise full(free)
    name = os.path.join(target.path, f"offload-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap")
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, need)
        except OSError as e:  # the drive filled meanwhile (another rank's file on it, say)
            if e.errno != errno.ENOSPC:
                raise
            raise full(shutil.disk_usage(target.path).free) from None
        return fd, (torch.from_file(name, shared=True, size=need, dtype=torch.uint8) if mapped else None)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(name)


def _within(base: torch.Tensor, t: torch.Tensor) -> bool:
    return base.data_ptr() <= t.data_ptr() < base.data_ptr() + base.numel() * base.element_size()


def _per_element(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0


def _size(d: torch.dtype) -> int:
    return torch.empty((), dtype=d).element_size()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def page_aligned(n: int) -> torch.Tensor:
    """A host buffer of n bytes starting on a page (a slice of a slightly larger one)."""
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + n]


def full_io(call, fd: int, t: torch.Tensor, at: int) -> None:
    """One pread/pwrite of all of `t`'s bytes (contiguous, on the host) at offset `at` (short
    transfers continued). Through the address, not t.numpy(): numpy's view would make the
    storage unresizable, and ZeRO 3's slices are dropped by resizing (param_swap.py)."""
    n = t.numel() * t.element_size()
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], at + done)
        if n == 0:
            raise OSError(errno.EIO, f"the NVMe swap file ended at byte {at + done}")
        done += n
