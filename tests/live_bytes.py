"""Bytes of live tensors, counted: a deterministic stand-in for resident memory in tests.

`LiveBytes` is a TorchDispatchMode: every CPU storage an op creates under it (not an input's,
which a view or an in-place op returns) is recorded by a weak reference, so a freed storage
drops out, and after each op the bytes of the storages still alive are summed; `peak` is the
largest sum: what the code under it allocated and held at once. It counts what this thread's
torch ops allocate and keep, exactly and whatever the machine's load or its C allocator
(RSS counts pages the allocator has not returned, the interpreter, the libraries, and moves
with both). What it cannot see: memory outside torch tensors, other threads, other
processes. Measured resident memory belongs in experiments/ (a script and its table)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage -> (weak reference, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place op returns an input's storage: memory that was there already
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                known = self.live.get(storage._cdata)
                if storage._cdata not in inputs and (known is None or known[0].expired()):
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
