"""Data parallelism over the dp group (Li et al., 2020, "PyTorch Distributed").

Sharded: the data: each dp rank reads its own slice of the global batch (framework.data).
Replicated: parameters, gradients and optimizer states.
Forward: no collective. Backward: torch DDP all-reduces (averages) gradients over the dp
group in buckets overlapped with backward, only on the step's last micro-batch; the
earlier ones run under `no_sync` so accumulation costs one all-reduce per step.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..topology import ParallelContext


def wrap(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """DDP over ctx.dp_group; the bare model when dp = 1 (no peers, nothing to reduce)."""
    if ctx.dims.dp == 1:
        return model
    # Rotary inv_freq is the only buffer and is identical everywhere: no per-forward sync.
    # torch 2.13 renamed the flag; the supported range (2.6-2.13) has one or the other.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        process_group=ctx.dp_group,
        # Gradients live in DDP's buckets instead of a second copy (memory accounting dedups).
        gradient_as_bucket_view=True,
        **no_buffer_sync,
    )


_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


def sync_context(wrapped: nn.Module, last_microbatch: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the step's last."""
    if last_microbatch or not isinstance(wrapped, DistributedDataParallel):
        return contextlib.nullcontext()
    return wrapped.no_sync()
