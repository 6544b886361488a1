"""Weight versions for the asynchronous schedules (PipeDream 1F1B weight stashing, 2BW).

The chunk's own parameters are the master copy: only the optimizer writes them. A
micro-batch's forward and backward run on a frozen snapshot of the version it is due (the
schedule's `AsyncRule.version_of`), taken right after the update that produced it, through
`torch.func.functional_call`. Autograd then keeps exactly that snapshot for the backward,
and the optimizer's in-place update of the master never touches a tensor a pending
backward saved. Gradients land on the snapshot and are moved to the master at the update.
A snapshot is freed after the backward of the last micro-batch that uses it, so stage s
holds at most p - s snapshots when it updates after every micro-batch (PipeDream 1F1B) and
2 when it updates once a step (PipeDream-2BW), plus the master; their bytes are reported
as `weight_version_bytes` (peak).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

import torch
from torch import nn


class VersionUses:
    """uses[k]: how many of the run's n micro-batches run on weight version k, counted when
    first asked (version_of never decreases in j: a binary search, not a table of the whole
    run), then counted down as they finish."""

    def __init__(self, version_of: Callable[[int], int], n: int):
        self.version_of, self.n, self.left = version_of, n, {}

    def _first_at(self, v: int) -> int:
        return bisect_left(range(self.n), v, key=self.version_of)

    def __getitem__(self, v: int) -> int:
        if v not in self.left:
            self.left[v] = self._first_at(v + 1) - self._first_at(v)
        return self.left[v]

    def __setitem__(self, v: int, count: int) -> None:
        self.left[v] = count


class WeightVersions:
    def __init__(self, chunk: nn.Module, uses: VersionUses, tracker=None):
        """`uses[k]`: how many micro-batches run on version k on this stage (a fresh count:
        this object counts down). Snapshots are weights, so the activation tracker is told to
        leave them out."""
        self.chunk, self.tracker = chunk, tracker
        self.names = [n for n, _ in chunk.named_parameters()]
        self.master = [p for _, p in chunk.named_parameters()]
        self.uses = uses
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.applied = 0  # updates applied to the master so far
        self.peak_bytes = 0
        self._snapshot()

    def _snapshot(self) -> None:
        if self.uses[self.applied] > 0:
            self.versions[self.applied] = [p.detach().clone().requires_grad_(True) for p in self.master]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())
            if self.tracker is not None:
                self.tracker.exclude(self.versions[self.applied])

    def live_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.versions.values() for t in ts)

    def params(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.versions:
            raise RuntimeError(f"weight version {version} is not held (applied {self.applied}, "
                               f"held {sorted(self.versions)})")
        return dict(zip(self.names, self.versions[version], strict=True))

    def backward_done(self, version: int) -> None:
        self.uses[version] -= 1

    def take_grads(self, version: int) -> None:
        """Move the gradients accumulated on a snapshot to the master (for the optimizer)."""
        for p, s in zip(self.master, self.versions[version], strict=True):
            p.grad = s.grad
            s.grad = None
        if self.uses[version] == 0:
            self.uses.left.pop(version)
            if self.tracker is not None:
                self.tracker.include_again(self.versions[version])
            del self.versions[version]

    def updated(self) -> None:
        """After the optimizer stepped the master: the next version exists."""
        self.applied += 1
        self._snapshot()
