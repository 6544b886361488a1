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

ZeRO-R's memory defragmentation (MD) for these checkpoints (`trainer.contiguous_checkpoints`,
DeepSpeed's `contiguous_memory_optimization`): a micro-batch's slices are views of one slab
(its blocks x the slice, on the device, or in host memory with Pa+cpu), taken from a free list
when the micro-batch's first block checkpoints and given back once its last slice was
gathered in the backward. After the first step the slabs are long-lived and reused: no
allocation per block and micro-batch, so short-lived slices cannot fragment the caching
allocator (CUDA's `fragmentation_bytes` reads the difference). The slab is saved once per
micro-batch, so the activation tracker counts exactly the slices' bytes, as without it.

Unlike torch's non-reentrant checkpoint, the recomputation runs the whole block (the
Megatron / DeepSpeed checkpoint function does too), so the MLP's exit all-reduce is repeated
(framework/sim/cost/traffic.py counts it). The RNG state and the autocast state of the
forward are restored for the recomputation, as torch's checkpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from framework.comm.tp_comm import TPComm


class Slab:
    """One micro-batch's slices of `n` block inputs, views of one buffer (MD)."""

    def __init__(self, data: torch.Tensor, per: int, n: int, pool: "SlabPool"):
        self.data, self.per, self.n, self.pool = data, per, n, pool
        self.taken = self.left = 0

    def next_piece(self) -> torch.Tensor:
        """The next slice: a tensor of its own over the slab's storage, not a view. A view
        shares its base's version counter, so writing the next piece would mark every piece
        saved before it as modified in place and fail their backward."""
        j = self.taken
        self.taken, self.left = j + 1, self.left + 1
        d = self.data
        return torch.empty(0, dtype=d.dtype, device=d.device).set_(
            d.untyped_storage(), d.storage_offset() + j * self.per, (self.per,))

    def gathered(self) -> None:
        """One slice used by its backward; the slab goes back once all of them were."""
        self.left -= 1
        if self.left == 0:
            self.pool.give(self)


class SlabPool:
    """Free slabs of the last shape taken, kept between steps (device memory a step's peak
    already held; not in the activation tracker's count between steps); `made`: slabs ever
    allocated (steady after the first step: as many as micro-batches in flight at once)."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.made = 0

    def take(self, n: int, per: int, dtype: torch.dtype, device: torch.device, pinned: bool) -> Slab:
        key = (n, per, dtype, str(device), pinned)
        for other in [k for k in self.free if k != key]:  # a new shape (another sequence length):
            del self.free[other]  # the old shape's spare slabs go back to the allocator
        spare = self.free.get(key)
        if spare:
            data = spare.pop()
        else:
            data = torch.empty(n * per, dtype=dtype, device=device, pin_memory=pinned)
            self.made += 1
        return Slab(data, per, n, self)

    def give(self, slab: Slab) -> None:
        d = slab.data
        self.free.setdefault((slab.n, slab.per, d.dtype, str(d.device), d.is_pinned()), []).append(d)


@dataclass(frozen=True, eq=False)
class Partition:
    """How a SplitLM checkpoints its blocks: the tp group it shards inputs over, whether the
    shards go to host memory, and whether a micro-batch's shards share one slab (MD)."""

    comm: TPComm
    to_cpu: bool = False
    contiguous: bool = False
    pool: SlabPool = field(default_factory=SlabPool)

    def slab(self, n: int, h: torch.Tensor) -> Optional[Slab]:
        """The slab for a micro-batch's next `n` checkpointed blocks (None without MD)."""
        if not self.contiguous:
            return None
        cuda = h.device.type == "cuda"
        return self.pool.take(n, slice_numel(h.numel(), self.comm.size), h.dtype,
                              torch.device("cpu") if self.to_cpu else h.device, self.to_cpu and cuda)

    def checkpoint(self, block, h: torch.Tensor, slab: Optional[Slab] = None) -> torch.Tensor:
        return _PartitionedCheckpoint.apply(h, block, self, slab)


def slice_numel(numel: int, tp: int) -> int:
    """Elements of one rank's slice of a `numel`-element input (the input padded to tp slices)."""
    return -(-numel // tp)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _PartitionedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, block, part: Partition, slab: Optional[Slab]):
        comm = part.comm
        ctx.block, ctx.part, ctx.shape, ctx.dtype, ctx.slab = block, part, h.shape, h.dtype, slab
        ctx.device = h.device
        ctx.autocast = _autocast_state(h.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(h.device) if h.device.type == "cuda" else None
        with torch.no_grad():
            out = block(h)
        per = slice_numel(h.numel(), comm.size)
        flat = h.detach().reshape(-1)
        mine = flat[comm.rank * per:(comm.rank + 1) * per]
        # its own storage (the whole input can be freed); the padding past the input is never read
        if part.to_cpu:
            cuda = h.device.type == "cuda"
            ctx.host = slab.next_piece() if slab is not None else \
                torch.empty(per, dtype=h.dtype, device="cpu", pin_memory=cuda)
            ctx.host[:mine.numel()].copy_(mine, non_blocking=cuda)  # the stream orders it before h's reuse
        else:
            piece = slab.next_piece() if slab is not None else torch.empty(per, dtype=h.dtype, device=h.device)
            piece[:mine.numel()].copy_(mine)
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
        if ctx.slab is not None:  # gathered: the slice's place in the slab is free
            ctx.slab.gathered()
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
        return h.grad, None, None, None
