"""MoE routing and load balancing: which experts each token goes to, with which weights, and
the losses and statistics that keep the experts evenly loaded (issue 22; docs/moe.md).

`route(weight, hidden, cfg, seq_len)` maps N tokens to k of E experts:
- scores: `softmax` over the router logits (Switch / GShard / Mixtral / Qwen3-MoE) or
  `sigmoid` per expert (DeepSeek-V3), in at least fp32 (fp64 stays fp64, for verification runs);
- an optional expert `bias` (DeepSeek-V3's auxiliary-loss-free balancing, arXiv:2412.19437
  section 2.1.2) is added to the scores only to choose the top k, never to the combine weights;
  `updated_bias` is its update rule;
- an optional capacity (GShard arXiv:2006.16668, Switch arXiv:2101.03961): each expert takes at
  most ceil(capacity_factor * T * k / E) (token, slot) assignments of each sequence of T tokens;
  the rest are dropped (index E, weight 0) by score (`probs`) or by position (`position`), as
  Megatron-core's `moe_token_drop_policy`. The capacity group is one sequence (GShard's "group",
  here of size T), not the call's tokens as in Megatron-core: a call's tokens are the
  micro-batch, or under sequence parallelism a tp rank's shard of it, so a per-call capacity
  would drop differently for every micro-batch size and tp / SP split (docs/moe.md);
- auxiliary losses, as Megatron-core's `moe_utils` defines them: `aux` (Switch's load-balancing
  loss), `seq_aux` (DeepSeek-V2/V3's sequence-wise loss) and `z` (ST-MoE's router z-loss,
  arXiv:2202.08906).

The aux losses must not be added to the LM loss (the runner reports that one); `attach_aux_loss`
hangs them on an activation so that their gradient enters backward (Megatron-core's
`MoEAuxLossAutoScaler`), scaled as the LM loss's gradient is (`AuxLossScale`).

Sequence parallelism splits a micro-batch's tokens over the tensor-parallel ranks (`sp_group`,
each rank a contiguous shard of every sequence). A balance loss counts tokens over the whole
micro-batch, so with `sp_group` the counts (f_e, the token numbers) are all-reduced over that
group in forward (integers, no gradient, one collective), while each rank's probability sums
stay local: each rank's `aux_loss` is then its own tokens'
share, and the SUM of the shares over the group is the loss of the whole micro-batch (its
gradient needs no collective). Capacity decides per whole sequence: the shards' (score, expert)
pairs are all-gathered over `sp_group` first (one small collective), so every layout drops
exactly the single process's assignments given the same scores. How close the scores came to
a decision is `stats["margin"]`: layouts agree while their score round-off stays below it.
Context parallelism (`cp_group`) cuts sequences into pieces the same way for the counts (summed
over cp too); its ranks' gradients are averaged, not summed, so moe_layer.py scales each
rank's share by cp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from framework.config import MoEConfig
from framework.comm.tp_comm import all_gather_single

SCORES = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
AUX_LOSSES = ("aux", "seq_aux", "z")


@dataclass
class Routing:
    index: torch.Tensor  # (N, k) int64 expert ids; a dropped (token, slot) holds E
    weights: torch.Tensor  # (N, k) combine weights in the logits' dtype; 0 where dropped
    logits: torch.Tensor  # (N, E) router logits
    aux_loss: Optional[torch.Tensor]  # scalar with grad: sum of coeff * loss (None without aux losses)
    # Detached, this rank's tokens: tokens_per_expert (E,) assignments before dropping, dropped,
    # entropy_sum, tokens, margin (the smallest score gap at a top-k or capacity decision, fp64),
    # and each configured aux loss's value (this rank's share under sp_group).
    stats: dict[str, torch.Tensor]


def route(weight: torch.Tensor, hidden: torch.Tensor, cfg: MoEConfig, seq_len: int, *,
          bias: Optional[torch.Tensor] = None, sp_group=None, cp_group=None) -> Routing:
    """Route `hidden` (N, H), row-major over (batch, seq) with `seq_len` tokens of each sequence
    on this rank, with the router `weight` (E, H). `bias` (E,): DeepSeek-V3's expert bias, for
    the choice only. `sp_group`: the sequence-parallel group whose ranks hold the other shards
    of these sequences (tp rank order); it defines the aux losses' counts and the capacity
    groups (module docstring). None runs no collective. `cp_group`: the context-parallel group,
    whose ranks hold the sequences' other pieces: the aux losses' counts are summed over it too
    (dropless routing only: capacity's per-sequence decision assumes contiguous shards)."""
    logits = F.linear(hidden, weight)  # (N, E)
    n, e, k = logits.shape[0], logits.shape[1], cfg.top_k
    scores = _scores(logits, cfg.score)  # (N, E) in at least fp32
    choice = scores if bias is None else scores + bias.detach().to(scores.dtype)
    top, index = torch.topk(choice, k, dim=-1)
    if bias is not None:  # biased choice, unbiased weights (DeepSeek-V3 eq. 16)
        top = scores.gather(-1, index)
    chosen = top  # the unnormalised scores of the choices: the probs drop policy ranks these
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = top.to(logits.dtype)
    margin = _topk_margin(choice.detach(), index)

    routing_map = torch.zeros(n, e, dtype=torch.bool, device=logits.device).scatter_(1, index, True)
    dropless = cfg.capacity_factor is None or math.isinf(cfg.capacity_factor)
    group = seq_len * (1 if dropless or sp_group is None else dist.get_world_size(sp_group))  # a whole sequence
    capacity = expert_capacity(cfg.capacity_factor, group, k, e)
    dropped = torch.zeros((), dtype=torch.int64, device=logits.device)
    if capacity is not None and capacity < group:  # an expert gets a token once: never over-full
        keep, cap_margin = _keep_per_sequence(index, chosen.detach(), capacity, cfg.drop_policy, e, seq_len, sp_group)
        index = index.masked_fill(~keep, e)
        weights = weights.masked_fill(~keep, 0)
        dropped = (~keep).sum()
        margin = torch.minimum(margin, cap_margin)

    normed = scores if cfg.score == "softmax" else _normalise(scores)  # per-token distribution over experts
    with torch.no_grad():
        stats = {"tokens_per_expert": routing_map.sum(0).to(scores.dtype), "dropped": dropped.to(scores.dtype),
                 "entropy_sum": -torch.xlogy(normed, normed).sum(),
                 "tokens": torch.tensor(float(n), dtype=scores.dtype, device=scores.device),
                 "margin": margin.to(torch.float64)}
    aux_loss = None
    if cfg.aux_losses:
        losses = _aux_losses(logits, normed, routing_map, cfg, seq_len, sp_group, cp_group)
        aux_loss = sum(float(a["coeff"]) * losses[a["type"]] for a in cfg.aux_losses)
        stats.update({name: value.detach() for name, value in losses.items()})
    return Routing(index=index, weights=weights, logits=logits, aux_loss=aux_loss, stats=stats)


def expert_capacity(capacity_factor: Optional[float], tokens: int, top_k: int, experts: int) -> Optional[int]:
    """ceil(capacity_factor * T * k / E) assignments per expert and capacity group of T tokens
    (one sequence); None = dropless (null or inf)."""
    if capacity_factor is None or math.isinf(capacity_factor):
        return None
    return math.ceil(capacity_factor * tokens * top_k / experts)


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    # Exactly qwen3_moe._router's softmax (in at least fp32), so the default routing is bit-equal to it.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if score == "softmax":
        return F.softmax(logits, dtype=dtype, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits.to(dtype))
    raise ValueError(f"model.moe.score={score!r}: must be one of {', '.join(SCORES)}")


def _normalise(scores: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores as a distribution per token (Megatron-core / DeepSeek-V3's s'); the clamp
    only matters when every score underflows to 0."""
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def _topk_margin(choice: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The smallest gap, over tokens, between the k-th chosen score and the best one not chosen:
    the top-k choice is the same in two layouts whose scores differ by less (inf when k = E)."""
    if index.shape[1] == choice.shape[1] or choice.shape[0] == 0:
        return torch.tensor(math.inf, dtype=torch.float64, device=choice.device)
    kth = choice.gather(-1, index[:, -1:])  # topk sorts: the last is the k-th
    rest = choice.scatter(-1, index, -math.inf).amax(-1, keepdim=True)
    return (kth - rest).min().to(torch.float64)


def _keep_per_sequence(index: torch.Tensor, chosen: torch.Tensor, capacity: int, policy: str, experts: int,
                       seq_len: int, sp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, k) bool: the assignments kept, deciding per (sequence, expert) over whole sequences.
    Under sequence parallelism this rank holds positions [r T/s, (r+1) T/s) of each sequence, so
    the (score, expert id) pairs of the other shards are all-gathered first (N x 2k numbers, in
    fp64: exact for fp32 scores and integer ids): every tp rank then decides from the same
    values the single process sees, and keeps its own shard's rows."""
    n, k = index.shape
    if seq_len < 1 or n % seq_len:
        raise ValueError(f"capacity: {n} tokens are not whole sequences of {seq_len}")
    b = n // seq_len
    if sp_group is None:
        return _within_capacity(index, chosen, capacity, policy, experts, seq_len)
    shards, me = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    packed = torch.cat([chosen.to(torch.float64), index.to(torch.float64)], dim=1).contiguous()  # (N, 2k)
    full = packed.new_empty(shards * n, 2 * k)  # (s*B*T/s, 2k), shard-major
    all_gather_single(full, packed, group=sp_group)
    full = full.view(shards, b, seq_len, 2 * k).transpose(0, 1).reshape(b * shards * seq_len, 2 * k)  # (B*T, 2k)
    keep, margin = _within_capacity(full[:, k:].long(), full[:, :k], capacity, policy, experts, shards * seq_len)
    return keep.view(b, shards, seq_len, k)[:, me].reshape(n, k), margin


def _within_capacity(index: torch.Tensor, chosen: torch.Tensor, capacity: int, policy: str, experts: int,
                     group_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, k) bool: the assignments each expert keeps, at most `capacity` per expert in each run
    of `group_len` consecutive tokens (a sequence); and the decision's margin: under
    `probs`, the smallest gap between an over-full expert's last kept and first dropped score
    (inf if none; `position` compares no scores). Stable sorts make ties deterministic: among
    equal scores the earlier token (flattened order) wins."""
    n, groups = index.shape[0], index.shape[0] // group_len
    group = torch.arange(n, device=index.device).div(group_len, rounding_mode="floor").unsqueeze(1)  # (N, 1)
    bucket = (group * experts + index).reshape(-1)  # (N*k,) (sequence, expert), token-major
    if policy == "probs":
        order = torch.sort(chosen.reshape(-1), descending=True, stable=True).indices
    elif policy == "position":
        order = torch.arange(bucket.numel(), device=bucket.device)
    else:
        raise ValueError(f"model.moe.drop_policy={policy!r}: must be one of {', '.join(DROP_POLICIES)}")
    order = order[torch.sort(bucket[order], stable=True).indices]  # grouped by bucket, priority order within
    counts = torch.bincount(bucket, minlength=groups * experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(bucket.numel(), device=bucket.device) - starts[bucket[order]]  # place within its bucket
    keep = torch.empty_like(bucket, dtype=torch.bool).scatter_(0, order, rank < capacity)
    margin = torch.tensor(math.inf, dtype=torch.float64, device=index.device)
    if policy == "probs" and bucket.numel() > 1:  # no .any() / indexing by a mask: no host sync on CUDA
        s, sb = chosen.reshape(-1)[order].to(torch.float64), bucket[order]
        edge = (rank[:-1] == capacity - 1) & (sb[:-1] == sb[1:])  # last kept, followed by a dropped one
        margin = torch.where(edge, s[:-1] - s[1:], margin).min()
    return keep.view_as(index), margin


def _aux_losses(logits: torch.Tensor, normed: torch.Tensor, routing_map: torch.Tensor, cfg: MoEConfig,
                seq_len: int, sp_group, cp_group=None) -> dict[str, torch.Tensor]:
    """The configured losses, uncoefficiented, in normed's dtype (>= fp32). With f_e the fraction
    of assignments to expert e (no gradient, before dropping) and P_e the mean normalised score:
    aux = E * sum_e f_e P_e over the call's tokens (Megatron-core switch_load_balancing_loss_func);
    seq_aux = the same per sequence, averaged over sequences (sequence_load_balancing_loss_func;
    DeepSeek-V3 eq. 17-20); z = mean_n logsumexp(logits_n)^2 (z_loss_func; ST-MoE eq. 5)."""
    n, e = routing_map.shape
    k, types = cfg.top_k, {a["type"] for a in cfg.aux_losses}
    if "seq_aux" in types and (seq_len < 1 or n % seq_len):
        raise ValueError(f"seq_aux: {n} tokens are not whole sequences of {seq_len}")
    b = n // seq_len if "seq_aux" in types else 0
    # Integer counts, summed over sp_group in one collective:
    # [per expert (E), tokens, per sequence and expert (B*E), tokens per sequence]
    per_seq = routing_map.view(b, seq_len, e).sum(1) if b else routing_map.new_zeros(0, e, dtype=torch.int64)
    counts = torch.cat([routing_map.sum(0), routing_map.new_tensor([n], dtype=torch.int64), per_seq.reshape(-1),
                        routing_map.new_tensor([seq_len], dtype=torch.int64)])
    for group in (sp_group, cp_group):  # a sequence's tokens: over tp (SP) x cp
        if group is not None:
            dist.all_reduce(counts, group=group)
    counts = counts.to(normed.dtype)
    per_expert, tokens, per_seq, seq_tokens = counts[:e], counts[e], counts[e + 1:e + 1 + b * e].view(b, e), counts[-1]
    out = {}
    if "aux" in types:
        f = per_expert / (tokens * k)
        out["aux"] = e * (f * normed.sum(0) / tokens).sum()  # this rank's share of P_e
    if "seq_aux" in types:
        f = per_seq / (seq_tokens * k)  # (B, E)
        p = normed.view(b, seq_len, e).sum(1) / seq_tokens  # (B, E) this rank's share
        out["seq_aux"] = (e * (f * p).sum(-1)).mean()
    if "z" in types:
        out["z"] = torch.logsumexp(logits.to(normed.dtype), dim=-1).square().sum() / tokens
    return out


@dataclass
class AuxLossScale:
    """What the LM loss's gradient is multiplied by (1 / micro-batches x loss scale): the runner
    owns it and sets it before each micro-batch's backward, which reads it then."""

    value: float = 1.0


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output` in forward; in backward, also d(aux_loss) = scale.value (Megatron-core's
    MoEAuxLossAutoScaler), so the aux loss trains without being added to the reported loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
        ctx.scale = scale  # the holder, not its value: the runner sets it after forward
        ctx.save_for_backward(aux_loss)
        return output  # returned as-is (no copy); autograd forbids modifying it in place

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale.value, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    """`output` unchanged; backward through it also backpropagates `scale.value * aux_loss`. The
    result aliases `output`: clone it before any in-place change (autograd raises otherwise)."""
    return _AttachAuxLoss.apply(output, aux_loss, scale)


@torch.no_grad()
def updated_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update (section 2.1.2): b_e + rate * sign(mean - load_e),
    raising under-loaded experts and lowering over-loaded ones. Pass the counts of the whole step
    summed over every data-parallel rank, so every rank computes the same bias."""
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)
