"""Expert parallelism over one rank's ep group (GShard, Lepikhin et al., 2020; Megatron-core's
all-to-all token dispatcher; torchtitan's expert parallel).

Sharded over ep (`parallelism.ep`, carved out of dp: framework/topology.py): the routed
experts of every MoE layer. Rank j of an ep group holds experts [j E/ep, (j+1) E/ep) of the
fused `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I); each such parameter carries
`ep_shard` (a `TPShard` along dim 0: which experts, out of how many), which materialisation,
checkpoints and the export read as they read `tp_shard`.
Replicated: everything else, the router included (each rank routes its own tokens).

Forward: the router picks k experts per token on the token's own rank; tokens are sorted by
expert; the counts per expert are exchanged (an all-to-all of E integers), then the tokens
(`dispatch_to_experts`: an uneven `all_to_all_single`); each rank runs its experts over the
tokens it received (a per-expert loop: the CPU path), and `combine_from_experts` sends the
outputs back (the inverse all-to-all), where they are weighted and summed per token.
Backward: the conjugate all-to-alls (each with the send and receive splits swapped).

Gradients: an expert's gradient on rank j sums the contributions of every rank of the ep
group that sent it tokens, so each replica of an expert holds ep ranks' worth of data. The
weights enter the expert computation through `scale_grad(w, 1 / ep)`, after which averaging
over the expert data parallel group (edp = dp / ep: the replicas of the same experts) gives
exactly the dp average the dense parameters get: expert parameters are reduced over edp
(grads.py `reduce_expert_grads`; ZeRO shards them over edp), everything else over dp.

Experts are not split over tp: with tp > 1 they are replicated over tp like the norms (the
same tokens on every tp rank, or with sequence parallelism each rank's sequence shard, whose
gradients `sync_replicated_grads` sums over tp). The ep group is a set of dp ranks at one tp
rank, as Megatron's with expert tp = tp.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.device import to_host
from framework.comm.comm_timer import timed
from framework.comm.side_thread import on_side
from framework.comm.tensor_parallel import TPShard
from framework.comm.tp_comm import TPComm


class EPComm(TPComm):
    """One rank's ep group: TPComm's all-gather (the export) plus the all-to-alls, with the
    bytes this rank sends to other ranks and the time spent in them. With a `timer` (runs),
    each call is a span of the step-time breakdown's (framework/comm/comm_timer.py: CUDA
    events read after the step, no host sync per call) and `take_a2a`'s seconds and spans
    come from those; without one (direct use) nothing is timed."""

    def __init__(self, group, size: int, rank: int, device=None, timer=None, side_group=None):
        self._side = side_group  # parallelism.overlap_dualpipe: the F thread's group (side_thread.py)
        super().__init__(group, size, rank, timer=timer, dim="ep")
        self.device = device if device is not None else torch.device("cpu")
        self.a2a_bytes = 0

    @property
    def group(self):
        return self._side if self._side is not None and on_side() else self._group

    @group.setter
    def group(self, group) -> None:
        self._group = group

    def take_a2a(self, timed: Optional[list] = None) -> tuple[int, float, list]:
        """(bytes, seconds, spans) of all-to-all since the last call (a step's when called once
        per step); the seconds and spans are the `ep` spans of `timed` (CommTimer.take)."""
        spans = [(w, s, e) for d, w, s, e in timed or [] if d == "ep"]
        out = (self.a2a_bytes, sum(e - s for _, s, e in spans), spans)
        self.a2a_bytes = 0
        return out

    def _timed(self, what: str, fn) -> None:
        with timed(self.timer, "ep", what):
            fn()

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   what: str = "a2a") -> torch.Tensor:
        """Rows of `x` in rank order, in_splits[r] of them to rank r; receives out_splits[r] from r."""
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self._timed(what, lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group))
        row = math.prod(x.shape[1:]) * x.element_size()  # (a rank may send no rows at all)
        self.a2a_bytes += (sum(in_splits) - in_splits[self.rank]) * row
        return out

    def exchange_counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        """`per_expert` (E,): the tokens this rank sends to each expert. Returns (ep, E/ep): the
        tokens each rank sends to each of this rank's experts (equal splits, E / ep each)."""
        local = per_expert.numel() // self.size
        out = torch.empty_like(per_expert)
        self._timed("a2a counts", lambda: dist.all_to_all_single(out, per_expert.contiguous(), group=self.group))
        self.a2a_bytes += (self.size - 1) * local * per_expert.element_size()
        return out.view(self.size, local)


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all in forward (`in_splits` rows to each rank, `out_splits` from each),
    the inverse all-to-all (splits swapped) in backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, comm, what):
        ctx.comm, ctx.out_splits, ctx.in_splits, ctx.what = comm, out_splits, in_splits, what
        return comm.all_to_all(x, out_splits, in_splits, f"a2a {what}")

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_to_all(g, ctx.in_splits, ctx.out_splits, f"a2a {ctx.what} (backward)"), None, None, None, None


def dispatch_to_experts(tokens: torch.Tensor, send: list[int], recv: list[int], comm: EPComm) -> torch.Tensor:
    """Tokens sorted by destination expert -> the ranks holding those experts. Forward:
    all-to-all (send[r] rows to rank r). Backward: all-to-all of the gradients back."""
    return _AllToAll.apply(tokens, recv, send, comm, "dispatch")


def combine_from_experts(outputs: torch.Tensor, send: list[int], recv: list[int], comm: EPComm) -> torch.Tensor:
    """The experts' outputs -> the ranks their tokens came from (dispatch's inverse: `send`
    and `recv` as given to dispatch). Forward: all-to-all. Backward: all-to-all."""
    return _AllToAll.apply(outputs, send, recv, comm, "combine")


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times `factor` in backward."""

    @staticmethod
    def forward(ctx, w, factor):
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity; its gradient made contiguous (torch._grouped_mm's backward rejects the
    expanded gradients a sum produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x)


class _ZeroGradWhere(torch.autograd.Function):
    """Identity; the gradient's rows (dim 0: experts) where `empty` set to exactly zero."""

    @staticmethod
    def forward(ctx, w, empty):
        ctx.save_for_backward(empty)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        (empty,) = ctx.saved_tensors
        return torch.where(empty.view(-1, *[1] * (g.dim() - 1)), torch.zeros_like(g), g), None


def _zero_grad_where(w: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    return _ZeroGradWhere.apply(w, empty)


def scale_grad(w: torch.Tensor, factor: float) -> torch.Tensor:
    return w if factor == 1 else _ScaleGrad.apply(w, factor)


def shard_spec(p: torch.Tensor) -> Optional[TPShard]:
    """Which positions of the transformers tensor this rank's `p` holds: its tp shard or its
    ep shard (experts), None when whole."""
    return getattr(p, "tp_shard", None) or getattr(p, "ep_shard", None)


def is_expert(p: torch.Tensor) -> bool:
    """An expert-parallel parameter (or a ZeRO buffer of them): reduced over edp, not dp."""
    return hasattr(p, "ep_shard") or getattr(p, "expert", False)


def expert_params(params) -> list[nn.Parameter]:
    return [p for p in params if is_expert(p)]


def shard_experts(experts: nn.Module, comm: EPComm) -> None:
    """Replace a fused experts module's (E, ...) parameters (on the meta device) by this
    rank's E / ep experts, each marked with its `ep_shard`."""
    total = experts.num_experts
    if total % comm.size:
        raise ValueError(f"{total} experts do not split over ep={comm.size}")  # validated before launch
    local = total // comm.size
    index = torch.arange(comm.rank * local, (comm.rank + 1) * local)
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        mine = (torch.empty((local, *full.shape[1:]), dtype=full.dtype, device=full.device)
                if full.device.type == "meta" else full.detach()[index].clone())  # debug.materialise_whole
        p = nn.Parameter(mine, requires_grad=full.requires_grad)
        p.ep_shard = TPShard(dim=0, index=index, full_size=total)
        setattr(experts, name, p)
    experts.local_experts, experts.first_expert = local, comm.rank * local


def run_experts(experts: nn.Module, tokens: torch.Tensor, per_expert: list[int], factor: float) -> torch.Tensor:
    """Each local expert's SwiGLU over its consecutive rows of `tokens`: one pair of matmuls
    per expert (`model.moe.experts_impl=loop`, every device and dtype; an expert with no rows
    still runs, on zero rows, so its weights get a (zero) gradient on every rank and the
    reductions stay aligned), or two grouped GEMMs over all experts at once (`grouped`:
    torch._grouped_mm, fp32 / bf16, 16-byte-aligned widths; empty groups give zero gradients)."""
    gate_up, down = scale_grad(experts.gate_up_proj, factor), scale_grad(experts.down_proj, factor)
    if getattr(experts, "grouped", False):
        counts = torch.tensor(per_expert, device=tokens.device)
        offs = counts.cumsum(0).to(torch.int32)
        # Some GPUs' kernels leave garbage in an empty group's weight gradient (pytorch#172439):
        # an expert without rows gets exactly zero, as the loop gives it.
        gate_up, down = _zero_grad_where(gate_up, counts == 0), _zero_grad_where(down, counts == 0)
        dev = tokens.device.type
        if torch.is_autocast_enabled(dev):  # _grouped_mm is not on autocast's lists: cast as F.linear would
            dtype = torch.get_autocast_dtype(dev)
            tokens, gate_up, down = tokens.to(dtype), gate_up.to(dtype), down.to(dtype)
        h = torch._grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offs)
        gate, up = _contiguous_grad(h).chunk(2, dim=-1)
        return torch._grouped_mm(experts.act_fn(gate) * up, down.transpose(-2, -1), offs=offs)
    outs = []
    for e, rows in enumerate(tokens.split(per_expert)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, down[e]))
    return torch.cat(outs) if outs else tokens[:0]


def run_routed(experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               comm: Optional[EPComm]) -> tuple[torch.Tensor, int]:
    """The experts' weighted sum for each token of `x` (N, H), routed to `index` (N, k; E =
    dropped) with `weights` (N, k): sort by expert; with `comm` (ep > 1) dispatch, run this
    rank's experts, combine; without, run every expert here. Returns (output (N, H), the
    rows this rank's experts processed)."""
    total, k = experts.num_experts, index.size(1)
    flat = index.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < total]  # a dropped (token, slot) holds the sentinel E
        per_expert = torch.bincount(flat[order], minlength=total)
    tokens = x[order // k]
    if comm is None:
        out = run_experts(experts, tokens, to_host(per_expert, "moe routing").tolist(), 1.0)
    else:
        with torch.no_grad():
            recv_counts = comm.exchange_counts(per_expert)  # (ep, E/ep): from each rank, to each local expert
            # the layer's one host read: what this rank sends and receives (the splits)
            host = to_host(torch.cat([per_expert, recv_counts.flatten()]), "moe routing")
            ep, local = comm.size, experts.local_experts
            sent, got = host[:total].view(ep, -1), host[total:].view(ep, local)
            send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
            # received rows are grouped by source rank, then local expert: regroup by expert
            source_major = torch.arange(sum(recv), device=x.device).split(got.flatten().tolist())
            by_expert = [source_major[s * local + e] for e in range(local) for s in range(ep)]
            perm = torch.cat(by_expert) if by_expert else torch.zeros(0, dtype=torch.long, device=x.device)
        received = dispatch_to_experts(tokens, send, recv, comm)
        out = run_experts(experts, received[perm], got.sum(0).tolist(), 1.0 / comm.size)
        out = torch.empty_like(out).index_copy(0, perm, out)  # back to source-major order
        out = combine_from_experts(out, send, recv, comm)
    y = torch.zeros_like(x).index_add(0, order // k, (out * weights.reshape(-1)[order, None]).to(x.dtype))
    return y, int(tokens.size(0) if comm is None else received.size(0))
