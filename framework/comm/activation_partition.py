"""ZeRO-R's partitioned activation checkpoints, Pa and Pa+cpu (Rajbhandari et al., 2020, sec. 6.1;
DeepSpeed's `partition_activations` / `cpu_checkpointing`, Megatron-LM's
`distribute_saved_activations`).

With full recomputation every block keeps only its input for the backward; under tensor
parallelism (without sequence parallelism) that input is the same whole (B, T, H) tensor on
every tp rank: tp copies of one activation. Sharded over tp: the saved block inputs. Each tp
rank keeps its 1/tp slice of the flattened input (padded to a multiple of tp).
Forward: none (the block runs without a graph, as any recomputing checkpoint).
Backward: one all-gather of the input over tp (counted in `tp_comm_bytes`), then the block is
recomputed from it and back-propagated.
Pa+cpu keeps the slice in host memory instead (pinned, copied without blocking on CUDA):
not device memory, so the activation tracker does not count it; the copy back is issued when
the block's backward starts.

Unlike torch's non-reentrant checkpoint, the recomputation runs the whole block (the
Megatron / DeepSpeed checkpoint function does too), so the MLP's exit all-reduce is repeated
(framework/sim/cost/traffic.py counts it). The RNG state and the autocast state of the
forward are restored for the recomputation, as torch's checkpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.comm.tp_comm import TPComm


@dataclass(frozen=True, eq=False)
class Partition:
    """How a SplitLM checkpoints its blocks: the tp group it shards inputs over, and whether
    the shards go to host memory."""

    comm: TPComm
    to_cpu: bool = False

    def checkpoint(self, block, h: torch.Tensor) -> torch.Tensor:
        return _PartitionedCheckpoint.apply(h, block, self)


def slice_numel(numel: int, tp: int) -> int:
    """Elements of one rank's slice of a `numel`-element input (the input padded to tp slices)."""
    return -(-numel // tp)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _PartitionedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, block, part: Partition):
        comm = part.comm
        ctx.block, ctx.part, ctx.shape, ctx.dtype = block, part, h.shape, h.dtype
        ctx.device = h.device
        ctx.autocast = _autocast_state(h.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(h.device) if h.device.type == "cuda" else None
        with torch.no_grad():
            out = block(h)
        per = slice_numel(h.numel(), comm.size)
        flat = h.detach().reshape(-1)
        piece = torch.zeros(per, dtype=h.dtype, device=h.device)
        mine = flat[comm.rank * per:(comm.rank + 1) * per]
        piece[:mine.numel()].copy_(mine)  # its own storage: the whole input can be freed
        if part.to_cpu:
            cuda = h.device.type == "cuda"
            ctx.host = torch.empty(per, dtype=h.dtype, device="cpu", pin_memory=cuda)
            ctx.host.copy_(piece, non_blocking=cuda)  # the stream orders it before piece's reuse
        else:
            ctx.save_for_backward(piece)
        return out

    @staticmethod
    def backward(ctx, grad):
        part = ctx.part
        if part.to_cpu:
            piece = ctx.host.to(ctx.device, non_blocking=ctx.device.type == "cuda")
        else:
            piece, = ctx.saved_tensors
        numel = ctx.shape.numel()
        full = part.comm.all_gather(piece, 0)[:numel].view(ctx.shape)
        h = full.detach().requires_grad_(True)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=ctx.device.type):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                out = ctx.block(h)
        torch.autograd.backward(out, grad)
        return h.grad, None, None
