"""Device and backend choice: the one place they are decided.

`device=auto` is CUDA when available, else CPU. CPU ranks use gloo and split the cores;
CUDA ranks use NCCL with one GPU per local rank. The launching process resolves the device
for validation and the banner; each rank resolves it again for itself (on another node
under torchrun the answer can differ).
"""

from __future__ import annotations

import os

import torch


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def threads_per_rank(ranks_per_node: int) -> int:
    """CPU ranks split the cores; oversubscribed intra-op threads would distort timings."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node)


def rank_device(requested: str, local_rank: int) -> torch.device:
    if resolve_device(requested) == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
