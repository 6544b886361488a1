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

Nested spans count once, in the outermost (a gradient sync over tp inside the dp span is
dp's). Not seen: torch DDP's bucketed all-reduce (its C++ reducer overlaps the last
backward; what it exposes stays in that backward's compute) and FSDP2's own collectives.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from framework.metrics.timestamps import clock_for

DIMS = ("dp", "tp", "pp", "ep", "cp")


class CommTimer:
    def __init__(self, device: torch.device):
        self.clock = clock_for(device)
        self.spans: list[tuple] = []  # this step's (dim, what, start mark, end mark)
        self.open: Optional[str] = None

    def begin_step(self) -> None:
        """Before the step's first span (CUDA: anchors event times to the host clock)."""
        self.clock.begin_step()
        self.spans = []

    @contextlib.contextmanager
    def span(self, dim: str, what: str = ""):
        if self.open is not None:  # nested: the outer span owns the time
            yield
            return
        self.open, start = dim, self.clock.mark()
        try:
            yield
        finally:
            self.spans.append((dim, what or dim, start, self.clock.mark()))
            self.open = None

    def take(self) -> list[tuple[str, str, float, float]]:
        """This step's spans as (dim, what, start, end) in unix seconds; call once the step's
        work is done (CUDA: the events have fired)."""
        sec = self.clock.seconds
        out = [(d, w, sec(s), sec(e)) for d, w, s, e in self.spans]
        self.spans = []
        return out


@contextlib.contextmanager
def timed(timer: Optional[CommTimer], dim: str, what: str = ""):
    """`timer.span` when there is a timer (runners built without one time nothing)."""
    if timer is None:
        yield
    else:
        with timer.span(dim, what):
            yield
