"""ZeRO-Infinity's NVMe tier for ZeRO 3's parameters (`parallelism.offload_params`).

Under ZeRO 3 each rank keeps its 1/dp slice of every unit's 16-bit parameters (`FlatUnit.shard`,
framework/parallel/zero_unit.py) only to all-gather it. With this tier the slices live in a
file under `parallelism.nvme_path`, one region each, and in memory only around their use:
- `fetch` (before a unit's all-gather, forward and backward, each micro-batch) reads the slice
  back into its storage, and in training reads the next unit's ahead on the I/O thread, in the
  order the previous step fetched them (forwards and backwards as the schedule ran them; a
  guess that misses costs a synchronous read; evaluation forwards read without guessing);
- `release` (once the all-gather has landed) drops the slice's storage: the file holds it,
  unchanged until the update;
- `store` (the update's copy of the masters into the slices, and a checkpoint's load) fills
  each slice from its master, writes it and drops it, two slices in flight at most.
So between steps a rank holds no slice of its parameters, and within one at most the unit
being gathered and the one read ahead (`resident_peak`). The file is made as the optimizer's
states' is (framework/optim/swap.py `reserve`: blocks reserved before anything is written, a
full drive told as ENOSPC, unlinked at once); it is scratch: the checkpoint stores the masters.
Masters, optimizer states (swap.py) and gradients (the slice's `.grad`) are not moved by this tier.

On CUDA the slices go through a host copy (synchronous here: the device's I/O path has not run
on a GPU yet); on a CPU rank the drive is read straight into the slice.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from framework.optim.swap import OffloadTarget, aligned, full_io, reserve


class ParamSwap:
    def __init__(self, target: OffloadTarget, slices: list[torch.Tensor]):
        self.slices = slices
        self.place: dict[int, int] = {}
        at = 0
        for t in slices:
            self.place[id(t)] = at
            at += aligned(_nbytes(t))
        self.bytes = at
        self.fd, _ = reserve(target, at, "the parameters", mapped=False)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="nvme-params")
        self.reads: dict[int, Future] = {}  # id(slice) -> its read in flight
        self.order: list[int] = []  # this step's fetches so far (slice indices)
        self.last: list[int] = []  # the previous step's
        self.index = {id(t): i for i, t in enumerate(slices)}
        self.resident = sum(1 for t in slices if t.untyped_storage().nbytes())  # slices in memory now (as built: all)
        self.resident_peak = 0  # the most in memory whenever one is brought in (the first store only drops)

    # -- storage ----------------------------------------------------------------------------
    def _alloc(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(_nbytes(t))
            self.resident += 1
            self.resident_peak = max(self.resident_peak, self.resident)

    def _drop(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.nbytes():
            st.resize_(0)
            self.resident -= 1

    def _read(self, t: torch.Tensor) -> None:
        host = t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
        full_io(os.preadv, self.fd, host.detach().view(-1).view(torch.uint8), self.place[id(t)])
        if host is not t:
            t.detach().copy_(host)

    def _write(self, t: torch.Tensor) -> None:
        # CUDA: a device-to-host copy that waits for the slice, on the I/O thread inside the
        # update's store (after the step's compute), where the drive needs the bytes on the host
        host = t.detach() if t.device.type == "cpu" else t.detach().cpu()
        full_io(os.pwritev, self.fd, host.view(-1).view(torch.uint8), self.place[id(t)])

    # -- use --------------------------------------------------------------------------------
    def fetch(self, t: torch.Tensor, training: bool = True) -> None:
        """`t` (a slice) in memory, read from the drive; in training, the next slice of the
        previous step's order read ahead (an evaluation's forwards neither read ahead nor
        count in the order the next step guesses from)."""
        read = self.reads.pop(id(t), None)
        if read is not None:
            read.result()
        elif t.untyped_storage().nbytes() == 0:
            self._alloc(t)
            self._read(t)
        if not training:
            return
        self.order.append(self.index[id(t)])
        pos = len(self.order)
        if pos < len(self.last):
            nxt = self.slices[self.last[pos]]
            if nxt.untyped_storage().nbytes() == 0 and id(nxt) not in self.reads:
                self._alloc(nxt)  # on this thread: the allocator's bookkeeping stays here
                self.reads[id(nxt)] = self.io.submit(self._read, nxt)

    def release(self, t: torch.Tensor) -> None:
        """`t`'s storage dropped (the drive holds it); a read ahead for it is waited for first."""
        read = self.reads.pop(id(t), None)
        if read is not None:
            read.result()
        self._drop(t)

    def store(self, fill) -> None:
        """Every slice refilled by `fill(i, slice)`, written and dropped, two in flight at most.
        Ends a step: its fetch order becomes the next one's guess."""
        for t in self.slices:
            if id(t) in self.reads:
                self.release(t)
        writes: list[Optional[Future]] = [None, None]
        for i, t in enumerate(self.slices):
            if writes[i % 2] is not None:
                writes[i % 2].result()
                self._drop(self.slices[i - 2])
            self._alloc(t)
            fill(i, t)
            writes[i % 2] = self.io.submit(self._write, t)
        for w in writes:
            if w is not None:
                w.result()
        for t in self.slices[-2:]:
            self._drop(t)
        if self.order:
            self.last, self.order = self.order, []

    def close(self) -> None:
        self.io.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

