"""Gradient collectives every layout shares: dp averaging, and the global norm for clipping.

The global gradient norm must be the norm of the single model's gradient however it is
split: squared norms are summed over the pp group (each stage holds different parameters)
and over the tp group for tensor-parallel shards, while a parameter that tp replicates is
counted once (on tp rank 0), as in Megatron's `param_is_not_tensor_parallel_duplicate`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from framework.optim.master import flat_views
from framework.comm.expert_parallel import expert_params, is_expert
from framework.comm.tensor_parallel import is_tp_sharded


BUCKET_ELEMENTS = 2 ** 24  # per all-reduce when widened (precision.reduce_dtype): 64 MiB of fp32


def bucket_elements(bucket_mb: Optional[float], dtype: torch.dtype) -> Optional[int]:
    """`parallelism.bucket_mb` (ZeRO-R's constant-size buffers, CB) in elements of `dtype`."""
    return None if bucket_mb is None else max(1, int(bucket_mb * 2 ** 20) // dtype.itemsize)


def all_reduce_grads(params: list[nn.Parameter], group, world: int, dtype: Optional[torch.dtype] = None,
                     bucket_mb: Optional[float] = None) -> None:
    """Average gradients over `group`, flattened: in one bucket when reduced in their own
    dtype; in `dtype` (the precision policy's reduce dtype, wider than the gradients) in
    buckets of BUCKET_ELEMENTS, each rounded back into the gradients, so the transient is one
    bucket's wide copy, not the stage's. `bucket_mb` (CB): buckets of that size either way (a
    gradient larger than it is one bucket of its own)."""
    for bucket in _buckets(params, world, dtype, bucket_mb):
        finish_all_reduce([_issue(bucket, group, dtype, False)], world)


def start_all_reduce(params: list[nn.Parameter], group, world: int, dtype: Optional[torch.dtype] = None) -> list:
    """`all_reduce_grads`' collectives issued and not waited for (the overlap of
    `parallelism.overlap_grad_reduce`; every bucket's copy is held until finished):
    [(work, bucket, flat)] for `finish_all_reduce`."""
    return [_issue(bucket, group, dtype, True) for bucket in _buckets(params, world, dtype)]


def finish_all_reduce(pending: list, world: int) -> None:
    """Wait for issued buckets, average, copy back into the gradients (a GradBuffer's slice
    reduced in its own dtype is the gradients: nothing to copy)."""
    for work, bucket, flat in pending:
        if work is not None:
            work.wait()
        flat /= world
        if isinstance(bucket, torch.Tensor):
            if flat is not bucket:
                bucket.copy_(flat)  # the wide copy rounded back
        else:
            torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))  # one copy op (casting back)


class GradBuffer:
    """Parameters' gradients as views of flat buffers, one per dtype (Megatron's grad buffer):
    autograd accumulates into them in place, so the dp all-reduce reads them as they are, with
    no flatten copy per step. Kept between steps, as DDP's buckets are; `attach` zeroes them
    and hands the views out at a step's start (the optimizer's `zero_grad` drops them). Every
    parameter then holds a gradient, zero where it took no part: for the parameters of a
    pipeline chunk, which all take part in each micro-batch."""

    def __init__(self, params: list[nn.Parameter], bucket_mb: Optional[float] = None):
        self.params, self.flats, self.views = params, [], []
        self.bucket_mb = bucket_mb  # CB: every reduction in slices of this size (else as `_pieces` says)
        kinds = list(dict.fromkeys((p.dtype, p.device) for p in params))
        for dtype, device in kinds:
            ps = [p for p in params if (p.dtype, p.device) == (dtype, device)]
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            self.views += list(zip(ps, flat_views(flat, ps)))
            self.flats.append(flat)

    def attach(self) -> None:
        for flat in self.flats:
            flat.zero_()
        for p, view in self.views:
            p.grad = view

    def start_all_reduce(self, group, world: int, dtype: Optional[torch.dtype] = None, async_op: bool = True) -> list:
        """The buffers' all-reduces issued (`start_all_reduce`'s pending form): in place when
        reduced in their own dtype; widened (`dtype`), in slices of BUCKET_ELEMENTS."""
        return [_issue(piece, group, dtype, async_op) for piece in self._pieces(world, dtype)]

    def all_reduce(self, group, world: int, dtype: Optional[torch.dtype] = None) -> None:
        """One piece at a time: the transient is one piece's wide copy."""
        for piece in self._pieces(world, dtype):
            finish_all_reduce([_issue(piece, group, dtype, False)], world)

    def _pieces(self, world: int, dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
        if world == 1:
            return []
        out = []
        for flat in self.flats:
            wide = dtype if dtype is not None else flat.dtype
            step = (bucket_elements(self.bucket_mb, wide) if self.bucket_mb is not None
                    else BUCKET_ELEMENTS if wide != flat.dtype else max(flat.numel(), 1))
            out += [flat[at:at + step] for at in range(0, flat.numel(), step)]
        return out


def _buckets(params: list[nn.Parameter], world: int, dtype: Optional[torch.dtype],
             bucket_mb: Optional[float] = None) -> list[list[torch.Tensor]]:
    grads = [p.grad for p in params if p.grad is not None]
    if world == 1 or not grads:
        return []
    widen = dtype is not None and dtype != grads[0].dtype
    limit = bucket_elements(bucket_mb, dtype or grads[0].dtype) if bucket_mb is not None else BUCKET_ELEMENTS
    buckets, size = [[]], 0
    for g in grads:
        if (widen or bucket_mb is not None) and buckets[-1] and size + g.numel() > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    return buckets


def _issue(bucket, group, dtype: Optional[torch.dtype], async_op: bool) -> tuple:
    """`bucket`: gradients to flatten, or a GradBuffer's slice (reduced where it is)."""
    flat = bucket if isinstance(bucket, torch.Tensor) else _flatten_dense_tensors(bucket)
    if dtype is not None and dtype != flat.dtype:
        flat = flat.to(dtype)
    return dist.all_reduce(flat, group=group, async_op=async_op), bucket, flat


def _counted(p: nn.Parameter, tp_comm) -> bool:
    return tp_comm is None or tp_comm.size == 1 or tp_comm.rank == 0 or is_tp_sharded(p)


def _local(g: torch.Tensor) -> torch.Tensor:
    """FSDP2's DTensor gradient: this rank's dim-0 chunk (a view; its padding not part of it),
    whose squares the `dp_group` sum adds up as for zero.py's slices."""
    return g.to_local() if isinstance(g, DTensor) else g


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group=None, tp_comm=None,
                   skip: Optional[nn.Parameter] = None, dp_group=None, ep_group=None) -> torch.Tensor:
    """Global L2 norm over tp shards and pipeline stages (pre-clip), then clip in place.
    `skip`: a weight this rank holds a second copy of (a tied embedding on the last stage).
    `dp_group`: ZeRO (ours or FSDP2), where each dp rank holds a different slice of the gradient.
    `ep_group` (without ZeRO): expert parallelism, where each ep rank holds different experts
    (their squares are summed over it; ZeRO's dp sum covers them)."""
    counted = [p for p in params if p.grad is not None and p is not skip and _counted(p, tp_comm)]
    # At least fp32 (bf16 gradients), fp64 in verification mode; decided from `params`, not
    # the counted grads, so a rank with none still joins the all-reduces in the same dtype.
    dtype = torch.promote_types(params[0].dtype if params else torch.float32, torch.float32)
    device = counted[0].grad.device if counted else (params[0].device if params else None)

    def squares(ps):
        # One multi-tensor norm (torch's clip_grad_norm_ kernel), accumulated in `dtype`, not
        # a pow and a sum per tensor: the dispatched ops do not grow with the tensor count.
        grads = [_local(p.grad) for p in ps]
        grads = [g for g in grads if g.numel() > 0]
        if not grads:
            return torch.zeros((), dtype=dtype, device=device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=dtype)).pow(2).sum()

    if ep_group is not None:
        local = squares([p for p in counted if not is_expert(p)])
        experts = squares([p for p in counted if is_expert(p)])
        dist.all_reduce(experts, group=ep_group)
        local = local + experts
    else:
        local = squares(counted)
    if tp_comm is not None and tp_comm.size > 1:
        local = tp_comm.all_reduce(local)
    for group in (pp_group, dp_group):
        if group is not None:
            dist.all_reduce(local, group=group)
    norm = local.sqrt()
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        scale_grads(params, coef)
    return norm


def scale_grads(params: list[nn.Parameter], factor: torch.Tensor) -> None:
    """Every gradient multiplied by `factor` (a tensor: no host read) in one multi-tensor op."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> Optional[torch.Tensor]:
    """What clipping to `max_norm` multiplies the gradients by (None: clipping is off). The
    one formula: the runners' update (framework/train/update.py) and the pipeline reference share it."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None


def reduce_expert_grads(params, ctx, dtype: Optional[torch.dtype] = None, bucket_mb: Optional[float] = None) -> None:
    """Average expert-parallel experts' gradients over the expert data parallel group (once per
    step, after the last micro-batch's backward; DDP and the dp all-reduce leave them out)."""
    if ctx.dims.ep > 1:
        all_reduce_grads(expert_params(params), ctx.edp_group, ctx.dims.edp, dtype, bucket_mb)


def nonfinite(params: list[nn.Parameter]) -> torch.Tensor:
    """Whether this rank's own gradients hold an inf or a nan (a bool tensor, no host sync):
    the local half of the loss scaler's overflow flag (framework/train/update.py reduces it over every
    rank). Read from the gradients, not from the global norm: a norm reduced over some groups
    only (DDP's replicas are not in it) would hide an inf held by a rank outside them. The max
    |g| (one fused read per device and dtype, torch's own grouping) is non-finite iff an
    element is: max propagates nan, and no sum can overflow."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=params[0].device if params else None)
    return ~torch.isfinite(torch.nn.utils.get_total_norm(grads, float("inf")))


def inject_inf(params: list[nn.Parameter]) -> nn.Parameter:
    """debug.inf_grad_rank: one inf, in the first element of one gradient this rank holds after
    the reductions; only this rank sees it. The gradient is one no other rank holds a copy of
    where the layout has such: an expert's (ep), else a tp shard's, else the first (a ZeRO
    slice or FSDP2 chunk is this rank's alone; under DDP every replica holds the same)."""
    held = [p for p in params if p.grad is not None and _local(p.grad).numel() > 0]
    pick = ([p for p in held if is_expert(p)] + [p for p in held if is_tp_sharded(p)] + held)[0]
    g = _local(pick.grad)
    g[(0,) * g.dim()] = float("inf")
    return pick
