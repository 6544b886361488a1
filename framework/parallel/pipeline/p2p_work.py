"""The Works of a pipeline rank's point-to-point batches (executor.py issues them).

gloo returns one Work per op of a `batch_isend_irecv`, NCCL one coalesced Work per call;
`BatchWork` hides the difference (a compute waits for its own receive's Work on gloo, for
its group's on NCCL), and `debug.coalesced_p2p` makes gloo behave as NCCL (`_MergedWork`).
"""

from __future__ import annotations

import torch.distributed as dist


class BatchWork:
    """One handle for a group's Works: NCCL returns one coalesced Work, gloo one per op."""

    def __init__(self, works, tensors, segment: int):
        self.works = list(works or [])
        self.tensors = tensors  # keep sent tensors and receive buffers alive until done
        self.segment = segment  # which run() call issued it (a step, for async schedules)
        self.done = [False] * len(self.works)
        self.waited = False

    def wait_for(self, i: int) -> None:
        """Op i's Work alone when each op has one (gloo); else the group's one Work."""
        self._wait(i if len(self.works) > 1 else 0)

    def _wait(self, i: int) -> None:
        if not self.done[i]:  # once: a gloo receive Work waited a second time blocks forever
            self.works[i].wait()
            self.done[i] = True

    def wait(self) -> None:
        for i in range(len(self.works)):
            self._wait(i)
        self.waited = True

    def is_completed(self) -> bool:
        # gloo reports a send complete only once it is waited for; waited means done.
        return self.waited or all(d or w.is_completed() for d, w in zip(self.done, self.works))


class _MergedWork:
    """debug.coalesced_p2p: gloo's per-op Works behind one, as NCCL returns them."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def batch_isend_irecv(ops: list, coalesced: bool) -> list:
    works = dist.batch_isend_irecv(ops)
    return [_MergedWork(works)] if coalesced and works else works
