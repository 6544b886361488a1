"""Timestamps for pipeline actions, honest on CPU and on CUDA.

CPU (`HostClock`): the host runs each op to completion, so `time.time()` before a receive's
`wait()`, after it and after the compute is exactly receive wait, then compute.

CUDA (`CudaEventClock`): the host only enqueues. `work.wait()` makes the *stream* wait for
the receive and returns at once, so host timestamps around it would put the receive wait
into the next compute and the measured bubble would collapse to 0. Each mark is instead a
CUDA event recorded on the compute stream: the one after `wait()` fires when the stream
has really received, the one after the compute when the kernels are done. Events are read
once, at the end of the step (after the step's flush synchronised the host with the
stream), against an anchor event recorded on an idle stream at the step's start, whose
host time is known: time(event) = anchor's host time + anchor.elapsed_time(event). No
action synchronises the host.
"""

from __future__ import annotations

import time

import torch

from framework.device import wait


class HostClock:
    def begin_step(self) -> None:
        wait(None, "clock")  # counted where CUDA's begin_step waits (framework/device.py)

    def mark(self) -> float:
        return time.time()

    def seconds(self, mark: float) -> float:
        return mark

    def elapsed(self, a: float, b: float) -> float:
        return b - a

    def sync(self) -> None:
        wait(None, "clock")  # nothing to wait for; counted where a CUDA rank would wait


class CudaEventClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.anchor, self.anchor_host = None, 0.0

    def begin_step(self) -> None:
        self.sync()  # the stream is idle now, so the anchor fires at once ...
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(torch.cuda.current_stream(self.device))
        self.anchor_host = time.time()  # ... at this host time (to within the record call)

    def mark(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def seconds(self, mark: torch.cuda.Event) -> float:
        mark.synchronize()  # already passed after the step's flush; a no-op wait then
        return self.anchor_host + self.anchor.elapsed_time(mark) / 1e3

    def elapsed(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        """Seconds from mark `a` to mark `b` (no anchor needed; read after the step)."""
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def sync(self) -> None:
        """The host waits for the compute stream (not the device: a device-wide sync would
        also wait for sends still pending on NCCL's stream, i.e. for a peer)."""
        wait(self.device, "clock")


def clock_for(device: torch.device):
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


def now(device: torch.device) -> float:
    # Time the work, not the kernel launches (CUDA: the host waits for the compute stream;
    # counted on every device). A step takes a fixed number of these (the runners' phase
    # boundaries), never one per layer, micro-batch or collective.
    wait(device, "clock")
    return time.time()
