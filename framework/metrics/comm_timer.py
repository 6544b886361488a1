"""Where a rank waits on communication, per parallel dimension: the step-time breakdown's
source (framework/metrics/breakdown.py).

One `CommTimer` per rank (`ParallelContext.timer`); the code that issues a dimension's
collectives wraps each call in `timer.span(dim)`: tp and cp (TPComm), ep's all-to-alls
(EPComm), our ZeRO's gathers and reduce-scatters and the explicit gradient reductions after
backward (dp), the tied-embedding sum (pp). A span is the time the rank's work waited for
the call: on CPU host time around it (gloo runs the transfer while the host waits: the
transfer plus the wait for the slowest peer); on CUDA two events on the compute stream,
read after the step (no host sync per call: the span is the compute stream's wait for
the collective, i.e. the exposed time).

Threads (parallelism.overlap_dualpipe): each thread has its own open span, and a span from
a pair's F thread is marked (`last_side`), so the breakdown can tell whose compute hid it.

Nested spans count once, in the outermost (a gradient sync over tp inside the dp span is
dp's). Not seen: torch DDP's bucketed all-reduce (its C++ reducer overlaps the last
backward; what it exposes stays in that backward's compute) and FSDP2's own collectives.

Total beside exposed (`totals`, the breakdown's `comm_total_<dim>_s`): a synchronous call's
total is its span; an overlapped one (issued with `async_op`, waited for later: the
overlaps of parallelism.overlap_*) is registered with `issued(dim, works)` and its total
runs from the issue to its completion, read by a callback on the Work's future (on CPU,
gloo's thread marks the moment); its later wait is a span with `overlapped=True`, exposed
but not added to the total again. Where the completion cannot be seen (CUDA, whose
collective futures complete at enqueue; gloo's reduce-scatter, whose Work has no future)
the total counts the call's exposed wait only: a lower bound, so `comm_hidden` reads 0
there, never more than was hidden.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

import torch

from framework.metrics.timestamps import clock_for
from framework.parallel.side_thread import on_side

DIMS = ("dp", "tp", "pp", "ep", "cp")


class CommTimer:
    def __init__(self, device: torch.device):
        self.clock = clock_for(device)
        self.spans: list[tuple] = []  # this step's (dim, what, start mark, end mark)
        self._open = threading.local()  # per thread: a pair's two threads time their own calls
        self._lock = threading.Lock()
        self.side: set[int] = set()  # indices of spans from a pair's F thread (side_thread.py)
        self.last_side: set[int] = set()  # the last take()'s: indices into what it returned
        self.host = device.type != "cuda"  # completion times of overlapped calls are readable
        self.overlapped: set[int] = set()  # indices of spans that wait for an overlapped call
        self.async_calls: list[tuple[str, float, list]] = []  # (dim, issue time, completion times)
        self.totals: dict[str, float] = {}  # the last step's, set by take()

    def begin_step(self) -> None:
        """Before the step's first span (CUDA: anchors event times to the host clock)."""
        self.clock.begin_step()
        self.spans, self.overlapped, self.async_calls, self.side = [], set(), [], set()

    @property
    def open(self) -> Optional[str]:
        """The calling thread's open span's dimension (None: none open)."""
        return getattr(self._open, "dim", None)

    @contextlib.contextmanager
    def span(self, dim: str, what: str = "", overlapped: bool = False):
        if self.open is not None:  # nested: the outer span owns the time
            yield
            return
        self._open.dim, start = dim, self.clock.mark()
        try:
            yield
        finally:
            end = self.clock.mark()
            with self._lock:
                if overlapped:
                    self.overlapped.add(len(self.spans))
                if on_side():
                    self.side.add(len(self.spans))
                self.spans.append((dim, what or dim, start, end))
            self._open.dim = None

    def issued(self, dim: str, works) -> bool:
        """An overlapped call was just issued: its total runs until its last Work completes.
        False when that cannot be seen (CUDA; a Work without a future, as gloo's
        reduce-scatter): the caller's wait then counts in the total as a synchronous span."""
        if not self.host or self.open is not None:
            return False
        try:
            futures = [w.get_future() for w in works if w is not None]
        except RuntimeError:  # "Work::getFuture not implemented"
            return False
        done: list[float] = []
        for f in futures:
            f.add_done_callback(lambda _f: done.append(time.time()))
        self.async_calls.append((dim, time.time(), done))
        return True

    def take(self) -> list[tuple[str, str, float, float]]:
        """This step's spans as (dim, what, start, end) in unix seconds; call once the step's
        work is done (CUDA: the events have fired). Sets `totals`."""
        sec = self.clock.seconds
        out = [(d, w, sec(s), sec(e)) for d, w, s, e in self.spans]
        totals = dict.fromkeys(DIMS, 0.0)
        for i, (d, _, s, e) in enumerate(out):
            if i not in self.overlapped or not self.host:
                totals[d] += e - s
        for d, issued, done in self.async_calls:
            totals[d] += max(done, default=issued) - issued
        self.totals, self.last_side = totals, self.side
        self.spans, self.overlapped, self.async_calls, self.side = [], set(), [], set()
        return out


@contextlib.contextmanager
def timed(timer: Optional[CommTimer], dim: str, what: str = "", overlapped: bool = False):
    """`timer.span` when there is a timer (runners built without one time nothing)."""
    if timer is None:
        yield
    else:
        with timer.span(dim, what, overlapped):
            yield


def issued(timer: Optional[CommTimer], dim: str, works) -> bool:
    """`timer.issued` when there is a timer: whether the wait is an `overlapped` span."""
    return timer is not None and timer.issued(dim, works)
