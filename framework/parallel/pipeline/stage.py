"""Pipeline stages: this rank's model chunks, and the collectives around a pipeline step.

Sharded: transformer blocks over the pp group (stage g, placed by the schedule's StageMap,
holds the blocks `partition` gives it); the embedding on stage 0, the head on the last
stage (in a V both on pp rank 0, so a tied embedding needs no embedding-group sum there).
Each rank builds the model on the meta device and materialises only its chunks, with
exactly the weights of the single-process run (framework/models/materialise.py); every
other parameter stays an empty tensor under its name.

Collectives after a step's last backward (Megatron's finalize-grads order):
- dp: all-reduce (mean) of every chunk's gradients over the dp group, one flattened
  bucket per chunk. torch DDP is not used here: its reducer expects each forward's
  backward to follow before the next forward, which pipeline schedules break.
- tied embeddings: the input embedding (stage 0) and the LM head (last stage) share one
  weight in the single model. Each copy gets only its stage's gradient, so the two are
  summed over the embedding group {first stage, last stage} (Megatron's embedding group);
  identical updates then keep the copies identical.
- gradient norm for clipping (framework/parallel/grads.py): squared norms summed over the
  pp group (and tp), the tied weight counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework.models import SplitLM
from framework.models.materialise import release
from framework.parallel.pipeline.partition import partition


def _numel(m) -> int:
    return sum(p.numel() for p in m.parameters()) if m is not None else 0


def stage_ranges(method, full: SplitLM, num_stages: int) -> list[range]:
    return partition(method, list(full.blocks), num_stages, _numel(full.embedding), _numel(full.head))


def build_chunks(full: SplitLM, ranges: list[range], smap, pp_rank: int) -> list[SplitLM]:
    """This rank's chunks (chunk c is stage smap.stage(pp_rank, c): c*pp + pp_rank in a loop,
    pp_rank and 2pp-1-pp_rank in a V); unowned parameters are freed."""
    num_stages = smap.num_stages
    chunks = []
    for c in range(smap.v):
        g = smap.stage(pp_rank, c)
        chunks.append(full.stage(ranges[g], first=g == 0, last=g == num_stages - 1))
    kept = [p for ch in chunks for p in ch.parameters()]
    if hasattr(full, "fill"):
        full.fill(kept)  # a model built on the meta device: only this rank's stages get memory
    owned = {id(p) for p in kept}
    for p in full.hf_model.parameters():
        if id(p) not in owned:
            release(p, device=kept[0].device if kept else "cpu")  # keep the name, drop the memory
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


def sum_tied_grad(weight, group) -> None:
    if weight is not None and group is not None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=group)


def stage_state_dict(full: SplitLM, chunks: list[SplitLM], tp_comm=None, ep_comm=None) -> dict[str, torch.Tensor]:
    """This rank's parameters under their transformers names and shapes (for the merged
    checkpoint). Tensor-parallel shards are gathered over tp (every tp rank must call it),
    expert-parallel experts over ep (every ep rank must call it)."""
    from framework.comm.tensor_parallel import full_tensor

    owned = {id(p) for ch in chunks for p in ch.parameters()}
    out = {}
    for n, p in full.hf_model.named_parameters(remove_duplicate=False):
        if id(p) in owned:
            spec, ep_spec = getattr(p, "tp_shard", None), getattr(p, "ep_shard", None)
            if ep_spec is not None:
                out[n] = full_tensor(p, ep_spec, ep_comm).cpu()
            else:
                out[n] = (full_tensor(p, spec, tp_comm) if spec is not None else p.detach()).cpu()
    return out
