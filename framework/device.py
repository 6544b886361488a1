"""Device and backend choice: the one place they are decided.

`device=auto` is CUDA when available, else CPU. CPU ranks use gloo and split the cores;
CUDA ranks use NCCL with one GPU per local rank. The launching process resolves the device
for validation and the banner; each rank resolves it again for itself (on another node
under torchrun the answer can differ).
"""

from __future__ import annotations

import os
from typing import Optional

import torch


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def threads_per_rank(ranks_per_node: int, fixed: Optional[int] = None) -> int:
    """A CPU rank's intra-op threads: `trainer.cpu_threads_per_rank` when set, else the
    node's cores split over its ranks (oversubscribed threads would distort timings)."""
    return fixed or max(1, (os.cpu_count() or 1) // ranks_per_node)


def share_cores_in_a_sweep(trainer) -> None:
    """A sweep's jobs get the same threads per rank, whatever their rank count: left to
    `threads_per_rank`, a 1-rank job would take both threads of a 2-core node while each rank
    of a 2-rank job got one, so the two would differ in intra-op threading as well as in
    layout (and a 2-thread rank suffers most from a neighbour on one core). One thread per
    rank is the CPU's stand-in for one GPU per rank: more ranks, more hardware. Set
    trainer.cpu_threads_per_rank to choose another count for every job."""
    if trainer.cpu_threads_per_rank is None:
        trainer.cpu_threads_per_rank = 1


def rank_device(requested: str, local_rank: int) -> torch.device:
    if resolve_device(requested) == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ---- the one place a rank waits for its device ----
# Every host-device synchronisation of a training step goes through `wait` (the host waits
# for the compute stream) or `to_host` (a tensor's values read on the host), each naming why.
# Both count their calls on every device (on CPU they are the points where a CUDA rank would
# wait), so a test can hold the count per step constant in layers and micro-batches
# (tests/test_syncs.py) and metrics.jsonl reports it (`host_syncs`, docs/metrics.md).
_SYNCS: dict[str, int] = {}


def wait(device: Optional[torch.device], why: str) -> None:
    """The host waits for `device`'s current stream (the compute stream only: a device-wide
    sync would also wait for sends pending on NCCL's stream, i.e. for a peer)."""
    _SYNCS[why] = _SYNCS.get(why, 0) + 1
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_host(t: torch.Tensor, why: str) -> torch.Tensor:
    """`t`'s values in host memory (a CPU tensor: read it there freely)."""
    _SYNCS[why] = _SYNCS.get(why, 0) + 1
    return t.detach().cpu()


def take_syncs() -> dict[str, int]:
    """The sync points since the last call, by reason (a step's when called once per step)."""
    out = dict(_SYNCS)
    _SYNCS.clear()
    return out
