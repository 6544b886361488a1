"""Tensor-parallel layers over one rank's tp group (Megatron-LM, Shoeybi et al., 2019), and the
plan that applies them to a transformers model by module name.

Sharded over tp (each parameter carries `tp_shard`: which rows / columns of the
transformers tensor it holds):
- column-parallel linear: output features (GPT-2's fused `c_attn` per head, so a rank holds
  whole q, k and v heads). Forward: none (its input entered the region once per attention /
  MLP: `enter_tp_region`, identity, or all-gather of sequence shards). Backward: the entry's
  conjugate (all-reduce of the input gradient, or reduce-scatter).
- row-parallel linear: input features. Forward: all-reduce of the partial outputs (or
  reduce-scatter to sequence shards), then the replicated bias. Backward: none (or all-gather).
- vocab-parallel embedding: vocabulary rows, padded to a multiple of tp. Forward: each rank
  looks up the ids in its range, zeros elsewhere, then all-reduce (or reduce-scatter).
- vocab-parallel head + cross-entropy: the LM head's vocabulary rows; logits stay sharded
  (B, T, V/tp): the loss all-reduces a max, a sum of exponentials and the target logit per
  token, never the full logits. Padding columns are masked to -inf, so they carry no
  probability and no gradient.
Replicated: norms, position embeddings, row-parallel biases. Without sequence parallelism
their gradients are identical on every tp rank. With it (Korthikanti et al., 2022) they see
only this rank's sequence shard, so `sync_replicated_grads` all-reduces them over tp. A
per-head norm (Qwen3's q_norm / k_norm, style `head_norm`) is replicated but applied to
this rank's heads only: its gradient is partial over tp with or without sequence
parallelism (`tp_partial`), and is all-reduced over tp either way.

One file past ~300 lines on purpose: the layers, the plan styles that build them and the
shard geometry they share (TPShard, shard / full tensor) are read together; the collectives
themselves live in tp_comm.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from framework.comm.tp_comm import TPComm, enter_tp_region, exit_tp_region


@dataclass(frozen=True, eq=False)
class TPShard:
    dim: int  # which dim of the transformers tensor is split
    index: torch.Tensor  # the positions along it this rank holds; >= full_size is vocab padding
    full_size: int


def column_index(n: int, comm: TPComm, parts: int = 1) -> torch.Tensor:
    """This rank's slice of each of `parts` equal, fused blocks of n features ([q|k|v]: parts=3)."""
    per_part = n // parts
    width = per_part // comm.size
    assert width * comm.size * parts == n, f"{n} features in {parts} parts do not split over tp={comm.size}"
    start = comm.rank * width
    return torch.cat([torch.arange(i * per_part + start, i * per_part + start + width) for i in range(parts)])


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def vocab_rows(vocab: int, comm: TPComm) -> tuple[int, int, torch.Tensor]:
    """This rank's rows of the padded vocabulary: (width, start, their indices)."""
    width = padded_vocab(vocab, comm.size) // comm.size
    start = comm.rank * width
    return width, start, torch.arange(start, start + width)


def shard_tensor(full: torch.Tensor, spec: TPShard) -> torch.Tensor:
    """This rank's part of a transformers-shaped tensor (a weight, or an optimizer state of
    one): `full_tensor`'s inverse."""
    t = full.detach()
    pad = int(spec.index.max()) + 1 - t.size(spec.dim)
    if pad > 0:  # vocab padding rows start at zero and, masked from the loss, stay there
        t = torch.cat([t, t.new_zeros(*t.shape[:spec.dim], pad, *t.shape[spec.dim + 1:])], spec.dim)
    return t.index_select(spec.dim, spec.index.to(t.device))


def _shard(full: torch.Tensor, spec: TPShard) -> nn.Parameter:
    p = nn.Parameter(shard_tensor(full, spec).clone(), requires_grad=full.requires_grad)
    p.tp_shard = spec
    return p


def _matmul(x: torch.Tensor, w: torch.Tensor, conv1d: bool) -> torch.Tensor:
    # transformers' Conv1D (GPT-2) stores (in, out); nn.Linear stores (out, in). The shard keeps
    # the source layout so its rows / columns map one-to-one to the transformers tensor.
    return x @ w if conv1d else F.linear(x, w)


class _SequenceGatherLinear(torch.autograd.Function):
    """All-gather the sequence shards and multiply, saving only the shard: backward gathers
    again (Megatron's sequence-parallel linear). Saving the gathered input instead would keep
    the (B, T, H) tensor that sequence parallelism exists to shard (Korthikanti et al., sec. 4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, comm, conv1d):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.conv1d = comm, conv1d
        return _matmul(comm.all_gather(x, 1), weight, conv1d)  # (B, T, out/tp)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        total = ctx.comm.all_gather(x, 1).to(g.dtype)  # (B, T, in)
        w = weight.to(g.dtype)  # autocast ran the forward matmul in g's dtype
        grad_total = g @ (w.t() if ctx.conv1d else w)
        g2, t2 = g.reshape(-1, g.size(-1)), total.reshape(-1, total.size(-1))
        grad_w = t2.t() @ g2 if ctx.conv1d else g2.t() @ t2
        grad_x = ctx.comm.reduce_scatter(grad_total, 1)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None, None


def column_entry(x: torch.Tensor, weight: torch.Tensor, comm: TPComm, sequence_parallel: bool, conv1d: bool,
                 mm: Callable = _matmul):
    """Enter the tp region and multiply: copy_to_tp_region, or the sequence gather above. Another
    `mm` (FP8, framework/models/fp8.py) multiplies the gathered input with its own autograd."""
    if sequence_parallel and mm is _matmul:
        return _SequenceGatherLinear.apply(x, weight, comm, conv1d)
    return mm(enter_tp_region(x, comm, sequence_parallel), weight, conv1d)


class ColumnParallelLinear(nn.Module):
    """`enters=True`: the layer is the region's only reader and enters it itself (GPT-2's
    c_attn and c_fc); otherwise its module's pre-hook entered once for several (Llama).
    `mm`: the matmul (FP8's replaces it: framework/models/fp8.py)."""

    def __init__(self, module: nn.Module, comm: TPComm, parts: int = 1, enters: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.enters, self.sequence_parallel = comm, enters, sequence_parallel
        self.conv1d = not isinstance(module, nn.Linear)
        dim = 1 if self.conv1d else 0
        n = module.weight.size(dim)
        index = column_index(n, comm, parts)
        self.weight = _shard(module.weight, TPShard(dim, index, n))
        self.bias = _shard(module.bias, TPShard(0, index, n)) if module.bias is not None else None
        self.mm = _matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters:
            y = column_entry(x, self.weight, self.comm, self.sequence_parallel, self.conv1d, self.mm)
        else:
            y = self.mm(x, self.weight, self.conv1d)  # (B, T, out/tp)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    def __init__(self, module: nn.Module, comm: TPComm, sequence_parallel: bool):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.conv1d = not isinstance(module, nn.Linear)
        dim = 0 if self.conv1d else 1
        n = module.weight.size(dim)
        self.weight = _shard(module.weight, TPShard(dim, column_index(n, comm), n))
        self.bias = module.bias  # replicated: added once, after the sum
        self.mm = _matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exit_tp_region(self.mm(x, self.weight, self.conv1d), self.comm, self.sequence_parallel)  # (B, T[/tp], out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, module: nn.Embedding, comm: TPComm, sequence_parallel: bool):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        vocab = module.weight.size(0)
        self.width, self.start, index = vocab_rows(vocab, comm)
        self.weight = _shard(module.weight, TPShard(0, index, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.width)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, H), partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.comm, self.sequence_parallel)


class VocabParallelHead(nn.Module):
    """The LM head, vocabulary rows split; shares the embedding's shard when tied."""

    def __init__(self, module: nn.Linear, comm: TPComm, sequence_parallel: bool, tied: nn.Parameter | None):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.vocab = module.weight.size(0)
        self.width, self.start, index = vocab_rows(self.vocab, comm)
        self.weight = tied if tied is not None else _shard(module.weight, TPShard(0, index, self.vocab))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return column_entry(h, self.weight, self.comm, self.sequence_parallel, False)  # (B, T, Vp/tp)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        valid = max(0, min(self.width, self.vocab - self.start))
        return vocab_parallel_cross_entropy(logits, labels, self.comm, self.start, valid)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits: three small all-reduces per token in
    forward (max, sum of exp, target logit), none in backward."""

    @staticmethod
    def forward(ctx, logits, labels, comm, start, valid):
        # At least fp32 (bf16 logits), fp64 in verification mode. `.to` may return the logits
        # themselves: below, x is cloned before masking and replaced before the in-place exp.
        x = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.size(-1))  # (N, Vp/tp)
        if valid < x.size(1):
            x = x.clone()
            x[:, valid:] = float("-inf")  # vocab padding: no probability mass
        peak = comm.all_reduce(x.max(-1).values, op=dist.ReduceOp.MAX)
        x = x - peak.unsqueeze(1)
        target = labels.reshape(-1) - start
        elsewhere = (target < 0) | (target >= valid)
        target = target.masked_fill(elsewhere, 0)
        picked = comm.all_reduce(x.gather(1, target.unsqueeze(1)).squeeze(1).masked_fill(elsewhere, 0.0))
        exp = x.exp_()
        total = comm.all_reduce(exp.sum(-1))
        loss = (total.log() - picked).mean()
        ctx.save_for_backward(exp.div_(total.unsqueeze(1)), target, elsewhere)  # softmax, in place
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, target, elsewhere = ctx.saved_tensors
        grad = softmax  # backward runs once (no retain_graph), so the saved buffer is reused
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, target] -= (~elsewhere).to(grad.dtype)
        grad.mul_(g / grad.size(0))
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, labels, comm: TPComm, start: int, valid: int) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, labels, comm, start, valid)


def _entry_hook(comm: TPComm, sequence_parallel: bool) -> Callable:
    """Forward pre-hook on an attention / MLP module: its input enters the tp region once,
    however many column-parallel projections read it (Llama's q, k, v; gate and up)."""

    def hook(module, args, kwargs):
        if args:
            return (enter_tp_region(args[0], comm, sequence_parallel), *args[1:]), kwargs
        kwargs["hidden_states"] = enter_tp_region(kwargs["hidden_states"], comm, sequence_parallel)
        return args, kwargs

    return hook


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def style_of(plan: dict[str, str], name: str):
    """The plan's style for a module name (the first pattern that matches), or None."""
    return next((style for pattern, style in plan.items() if _matches(pattern, name)), None)


def apply_plan(model: nn.Module, plan: dict[str, str], comm: TPComm, sequence_parallel: bool,
               localize_heads: Callable[[nn.Module, int], None]) -> None:
    """Replace / hook the modules a plan names. Styles: vocab_embedding, vocab_head, rowwise;
    colwise and colwise_qkv (input already in the region), colwise_entry and
    colwise_qkv_entry (the layer enters the region itself); attention (region entry hook +
    heads per rank), heads (heads per rank only), mlp (region entry hook), head_norm (a
    replicated norm over this rank's heads: its weights marked `tp_partial`)."""
    replaced: dict[int, nn.Parameter] = {}  # id of a transformers weight -> its shard (for tying)
    for pattern, style in plan.items():
        names = [n for n, _ in model.named_modules() if _matches(pattern, n)]
        assert names, f"TP plan entry {pattern!r} matches no module"
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent, module = model.get_submodule(parent_name), model.get_submodule(name)
            if style == "head_norm":
                for q in module.parameters():
                    q.tp_partial = True
                continue
            if style in ("attention", "heads", "mlp"):
                if style != "heads":
                    module.register_forward_pre_hook(_entry_hook(comm, sequence_parallel), with_kwargs=True)
                if style != "mlp":
                    localize_heads(module, comm.size)
                continue
            new = _build(style, module, comm, sequence_parallel, replaced.get(id(module.weight)))
            replaced[id(module.weight)] = new.weight
            setattr(parent, attr, new)


def _build(style: str, module: nn.Module, comm: TPComm, sp: bool, tied) -> nn.Module:
    if style == "vocab_embedding":
        return VocabParallelEmbedding(module, comm, sp)
    if style == "vocab_head":
        return VocabParallelHead(module, comm, sp, tied)
    if style.startswith("colwise"):
        return ColumnParallelLinear(module, comm, parts=3 if "qkv" in style else 1, enters=style.endswith("_entry"),
                                    sequence_parallel=sp)
    if style == "rowwise":
        return RowParallelLinear(module, comm, sp)
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def shard_numels(model: nn.Module, plan: dict[str, str], tp: int) -> dict[int, int]:
    """Elements one tp rank holds of each parameter the plan shards (id -> count), from the
    plan alone: works on the meta model, for the dry run's estimate."""
    out = {}
    for pattern, style in plan.items():
        for name, module in model.named_modules():
            if not _matches(pattern, name) or style in ("attention", "heads", "mlp", "head_norm"):
                continue
            w = module.weight
            if style.startswith("vocab"):
                out[id(w)] = padded_vocab(w.size(0), tp) // tp * w.size(1)
                continue
            out[id(w)] = w.numel() // tp
            if style.startswith("colwise") and module.bias is not None:
                out[id(module.bias)] = module.bias.numel() // tp
    return out


def is_tp_sharded(p: torch.Tensor) -> bool:
    """A tp shard (or a ZeRO buffer made only of tp shards): each tp rank holds different values."""
    return hasattr(p, "tp_shard") or getattr(p, "tp_sharded", False)


def sync_replicated_grads(params: list[nn.Parameter], comm: TPComm, sequence_parallel: bool = True) -> None:
    """Sum over tp, in one flattened bucket, the gradients of replicated parameters each tp
    rank holds only a part of: with sequence parallelism all of them (each rank's holds its
    sequence shard's contribution), else only the `tp_partial` ones (per-head norms)."""
    grads = [p.grad for p in params if p.grad is not None and not is_tp_sharded(p)
             and (sequence_parallel or getattr(p, "tp_partial", False))]
    if grads:
        flat = comm.all_reduce(_flatten_dense_tensors(grads))
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)


def full_tensor(p: torch.Tensor, spec: TPShard, comm: TPComm) -> torch.Tensor:
    """The transformers tensor a shard came from: all-gather over tp, put every row / column
    back at its index, drop vocab padding."""
    shards = comm.all_gather(p.detach().movedim(spec.dim, 0), 0)  # rank order, split dim first
    index = comm.all_gather(spec.index.to(p.device), 0)
    full = torch.empty_like(shards).index_copy_(0, index, shards)
    return full[:spec.full_size].movedim(0, spec.dim)
