"""Pipeline stages: this rank's model chunks, and the collectives around a pipeline step.

Sharded: transformer blocks over the pp group (stage g = chunk * pp + pp_rank holds the
blocks `partition` gives it); the embedding on stage 0, the head on the last stage.
Each rank builds the whole seeded model (so every stage starts from exactly the weights
of the single-process run), keeps its chunks and frees every other parameter.

Collectives after a step's last backward (Megatron's finalize-grads order):
- dp: all-reduce (mean) of every chunk's gradients over the dp group, one flattened
  bucket per chunk. torch DDP is not used here: its reducer expects each forward's
  backward to follow before the next forward, which pipeline schedules break.
- tied embeddings: the input embedding (stage 0) and the LM head (last stage) share one
  weight in the single model. Each copy gets only its stage's gradient, so the two are
  summed over the embedding group {first stage, last stage} (Megatron's embedding group);
  identical updates then keep the copies identical.
- gradient norm for clipping: squared norms summed over the pp group, the tied weight
  counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...models import SplitLM
from .partition import partition


def _numel(m) -> int:
    return sum(p.numel() for p in m.parameters()) if m is not None else 0


def stage_ranges(method, full: SplitLM, num_stages: int) -> list[range]:
    return partition(method, list(full.blocks), num_stages, _numel(full.embedding), _numel(full.head))


def build_chunks(full: SplitLM, ranges: list[range], pp: int, pp_rank: int, v: int) -> list[SplitLM]:
    """This rank's chunks (chunk c is stage c*pp + pp_rank); unowned parameters are freed."""
    num_stages = pp * v
    chunks = []
    for c in range(v):
        g = c * pp + pp_rank
        chunks.append(SplitLM(full.embedding if g == 0 else None, [full.blocks[i] for i in ranges[g]],
                              full.head if g == num_stages - 1 else None, hf_model=full.hf_model,
                              checkpoint_blocks=full.checkpoint_blocks))
    owned = {id(p) for ch in chunks for p in ch.parameters()}
    for p in full.hf_model.parameters():
        if id(p) not in owned:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # keep the name, drop the memory
            p.requires_grad_(False)
    return chunks


def tied_weight(full: SplitLM, chunks: list[SplitLM]):
    """The embedding weight shared by the first and last stage, if this rank holds a copy."""
    hf = full.hf_model
    w_in, w_out = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    if w_in is not w_out:
        return None
    has_first = any(ch.embedding is not None for ch in chunks)
    has_last = any(ch.head is not None for ch in chunks)
    return w_in if (has_first or has_last) and not (has_first and has_last) else None


def all_reduce_grads(params: list[nn.Parameter], group, world: int) -> None:
    """Average gradients over `group` in one flattened bucket."""
    grads = [p.grad for p in params if p.grad is not None]
    if world == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= world
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def sum_tied_grad(weight, group) -> None:
    if weight is not None and group is not None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=group)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group, skip=None) -> torch.Tensor:
    """Global L2 norm over all pipeline stages (pre-clip), then clip in place."""
    grads = [p.grad for p in params if p.grad is not None and p is not skip]
    local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(local, group=pp_group)
    norm = local.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def stage_state_dict(full: SplitLM, chunks: list[SplitLM]) -> dict[str, torch.Tensor]:
    """This rank's parameters under their transformers names (for the merged checkpoint)."""
    owned = {id(p) for ch in chunks for p in ch.parameters()}
    return {n: p.detach().cpu() for n, p in full.hf_model.named_parameters(remove_duplicate=False) if id(p) in owned}
