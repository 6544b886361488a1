"""Data parallelism over the dp group (Li et al., 2020, "PyTorch Distributed").

Sharded: the data: each dp rank reads its own slice of the global batch (framework.data).
Replicated: parameters, gradients and optimizer states.
Forward: no collective. Backward: torch DDP all-reduces (averages) gradients over the dp
group in buckets overlapped with backward, only on the step's last micro-batch; the
earlier ones run under `no_sync` so accumulation costs one all-reduce per step. With
16-bit parameters the buckets are reduced in the precision policy's reduce dtype.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from framework.topology import ParallelContext


def wrap(model: nn.Module, ctx: ParallelContext, reduce_dtype: Optional[torch.dtype] = None,
         ignore: Sequence[nn.Parameter] = (), bucket_mb: Optional[float] = None) -> nn.Module:
    """DDP over ctx.dp_group; the bare model when dp = 1 (no peers, nothing to reduce).
    `reduce_dtype` (the precision policy's, when not the parameters'): each bucket is
    all-reduced in it (a transient copy) and rounded back into the parameters' gradients.
    `ignore`: parameters DDP leaves alone (expert-parallel experts, reduced over edp).
    `bucket_mb` (`parallelism.bucket_mb`, CB): DDP's buckets of that size, the first one too
    (torch's default: 25 MiB, and 1 MiB for the first)."""
    if ctx.dims.dp == 1:
        return model
    if ignore:
        names = {id(p): n for n, p in model.named_parameters()}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [names[id(p)] for p in ignore])
    # Rotary inv_freq is the only buffer and is identical everywhere: no per-forward sync.
    # torch 2.13 renamed the flag; the supported range (2.6-2.13) has one or the other.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        process_group=ctx.dp_group,
        # Gradients live in DDP's buckets instead of a second copy (memory accounting dedups).
        gradient_as_bucket_view=True,
        **no_buffer_sync,
        **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}),
    )
    if reduce_dtype is not None and reduce_dtype != next(model.parameters()).dtype:
        ddp.register_comm_hook(ctx.dp_group, _reduce_in(reduce_dtype))
    return ddp


def _reduce_in(dtype: torch.dtype):
    """A DDP communication hook: the bucket's mean over the group computed in `dtype`
    (16-bit gradients summed in fp32, as FSDP2's reduce_dtype does)."""

    def hook(group, bucket):
        buf = bucket.buffer()
        wide = buf.to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

        def back(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)

    return hook


_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


def sync_context(wrapped: nn.Module, last_microbatch: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the step's last."""
    if last_microbatch or not isinstance(wrapped, DistributedDataParallel):
        return contextlib.nullcontext()
    return wrapped.no_sync()
