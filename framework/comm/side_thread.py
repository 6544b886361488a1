"""A pipeline rank's second thread, for `parallelism.overlap_dualpipe`: the F of an
overlapped F / B pair (DualPipe, DeepSeek-V3 arXiv 2412.19437) runs here while the rank's
main thread runs the B, so each one's communication (ep's all-to-alls) waits while the
other computes. On CPU the overlap is real: torch's kernels and gloo's waits release the
GIL.

Nothing is sharded here; what it changes is which process group a collective takes. A
group's collectives must be issued in one order on every rank, and two threads issuing on
one group would interleave differently on each rank, so the F thread's all-to-alls use a
second group over the same ranks (`ParallelContext.groups["ep_side"]`; `EPComm.group` picks
by `on_side()`). tp's and cp's collectives have no second group: validation refuses those
layouts (framework/validate/schedule.py).

CUDA: the F thread enqueues on the same compute stream as the main thread (in-order, so no
cross-stream lifetime hazards for the caching allocator); the overlap there is the host's
issue of kernels and NCCL calls, not a second stream's (not built).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

_local = threading.local()


def on_side() -> bool:
    """Whether the calling thread is a pair's F thread."""
    return getattr(_local, "side", False)


class SideThread:
    """One worker thread; `submit(fn)` runs fn there and returns its Future (`.result()`
    re-raises fn's exception in the caller, so a crash in the F thread ends the rank)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pair-forward")

    def submit(self, fn: Callable[[], None]) -> Future:
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def run() -> None:
            _local.side = True
            try:
                if stream is None:
                    fn()
                else:
                    with torch.cuda.stream(stream):  # a thread starts on the default stream
                        fn()
            finally:
                _local.side = False

        return self.pool.submit(run)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
