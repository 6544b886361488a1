"""Context parallelism (`parallelism.cp`): each sequence cut over the cp ranks of a group.

Sharded: the sequence dimension of every activation. A sample's T tokens are cut into 2 cp
chunks; under `cp_balance=headtail` cp rank r holds chunks r and 2 cp - 1 - r, so every rank
has an early and a late piece and the causal attention work is equal across the group
(`contiguous`: rank r holds chunks 2r and 2r + 1, kept to measure the imbalance). Positions
follow the tokens: GPT-2's learned positions and Llama's / Qwen3's rotary are taken at each
token's place in the whole sequence (`ContextParallel.index`).
Replicated: the parameters, whole on every cp rank. Their gradients are averaged, and ZeRO
shards them, over dp x cp (topology.py's dp group spans both); every cp rank holds the same
number of tokens, so the mean of the ranks' mean losses is the mean over every token of the
global batch.
Collectives: attention only; every other op is token-local. `cp_comm=ring`: K / V blocks
passed around the group by p2p, merged by log-sum-exp (ring_attention.py). `cp_comm=a2a`
(Ulysses): all-to-alls trade the sequence split for a head split around the core
(ulysses.py). `cp_comm=allgather` (Llama 3's):
forward all-gathers K and V over the cp group, puts them in sequence order and attends each
local query chunk to the keys up to it (past chunks unmasked, its own causal: SDPA with a
lower-right causal bias, no mask tensor; causal work only, as in the ring); backward
reduce-scatters dK and dV (each rank gets the sum of every rank's queries' gradient for its own keys). The
attention runs through transformers' attention interface (`ATTENTION`, registered once), so
the models are not copied. `cp_comm_bytes` tallies the bytes as `tp_comm_bytes` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from framework.timestamps import clock_for
from framework.parallel.ring_attention import ring_attention
from framework.comm.tp_comm import TPComm, gather_from_sequence_parallel_region
from framework.parallel.ulysses import repeat_kv, ulysses_attention

ATTENTION = "framework_context_parallel"


def token_index(seq_len: int, cp: int, rank: int, balance: str) -> torch.Tensor:
    """The positions (in the whole sequence) of the tokens cp rank `rank` holds, in order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in token_pieces(cp, rank, balance)])


class ContextParallel:
    """One rank's cp group: its comm (with the byte tally) and where its tokens sit."""

    def __init__(self, comm: TPComm, seq_len: int, balance: str, device, method: str = "allgather",
                 ranks: Optional[list[int]] = None, overlap: bool = False):
        self.comm, self.method, self.device = comm, method, device
        self.overlap = overlap  # parallelism.overlap_cp_ring: the ring's next transfer under this block (ring_attention.py)
        # cp_comm_s: seconds inside this group's collectives, from the step's CommTimer spans
        # (CUDA: events read after the step); without a timer, untimed
        # The attention's time: marks of the step's clock (CUDA events on the compute stream,
        # read after the step; host time on CPU), never a host sync per layer.
        self.clock = comm.timer.clock if comm.timer is not None else clock_for(device)
        self._forward, self._backward = [], []  # this step's (start, end) marks; backward spans
        self.ranks = ranks  # the cp group's global ranks, in cp-rank order (the ring's peers)
        host = [token_index(seq_len, comm.size, r, balance) for r in range(comm.size)]
        self.indices = [i.to(device) for i in host]
        self.index = self.indices[comm.rank]  # this rank's tokens
        self.tokens = len(self.index)
        # Causal work only, planned once on the host (no read per block). The sequence is 2 cp
        # chunks of c tokens; a rank's queries are its two chunks, a block's keys another rank's
        # two (the ring's block j: cp rank j's keys). Query chunk i against a block needs the
        # key chunks at or before it: a prefix of the block's keys (its chunks are in order),
        # wholly in the past (unmasked) but for the diagonal chunk (causal: `causal[L]`).
        self.chunk = c = seq_len // (2 * comm.size)
        self.parts = [[p and (p[0] * c, p[1]) for p in row] for row in causal_parts(comm.size, comm.rank, balance)]
        self.skip = [all(part is None for part in parts) for parts in self.parts]
        # the gathered chunks (rank order) in sequence order and back: cuts and a cat (a
        # cat saves nothing for backward, an index_select its index)
        self.pieces = [k for r in range(comm.size) for k in token_pieces(comm.size, r, balance)]
        self.seq_order = sorted(range(len(self.pieces)), key=self.pieces.__getitem__)  # gathered chunk of each
        self.prefix = [(q + 1) * c for q in token_pieces(comm.size, comm.rank, balance)]  # query chunk i: keys [0, prefix[i])
        # lower-right causal masks (c, L): every key but the last chunk's later ones
        self.causal = {L: torch.ones(c, L, dtype=torch.bool).tril(L - c).to(device) for L in (c, 2 * c)}
        self.score_elements = 0  # query x key scores computed so far (a host count of shapes: the FLOPs' test)

    def take(self, timed: Optional[list] = None) -> dict:
        """This step's (since the last call) `cp_comm_bytes`, `cp_comm_s` (seconds inside cp
        collectives, waits for peers included: the `cp` spans of `timed`, the CommTimer's
        take(), when the comm has a timer) and `cp_attention_s`: the attention functions'
        forward and backward seconds less `cp_comm_s`, i.e. this rank's attention compute, what
        the cp ranks' imbalance compares."""
        el = self.clock.elapsed
        forward = sum(el(s, e) for s, e in self._forward)
        backward = sum(max(el(c["start"], e) for e in c["end"]) for c in self._backward if "start" in c and c.get("end"))
        comm_s = sum(e - s for d, _, s, e in timed or [] if d == "cp")
        out = {"cp_comm_bytes": self.comm.take_bytes(), "cp_comm_s": comm_s,
               "cp_attention_s": max(0.0, forward + backward - comm_s)}
        self._forward, self._backward = [], []
        return out

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (B, T) batch."""
        return x[:, self.index].contiguous()

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(B, h, T, d) gathered in cp-rank order -> sequence order."""
        c = self.chunk
        return torch.cat([t.narrow(2, g * c, c) for g in self.seq_order], dim=2)

    def to_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_sequence`."""
        c = self.chunk
        return torch.cat([t.narrow(2, k * c, c) for k in self.pieces], dim=2)

    def count(self, query: torch.Tensor, keys: int) -> None:
        """Add one product's scores, (B, heads, queries) x `keys` (shapes only: no sync)."""
        self.score_elements += query.numel() // query.size(-1) * keys


def token_pieces(cp: int, rank: int, balance: str) -> tuple[int, int]:
    """The two chunks (of 2 cp) cp rank `rank` holds, in order."""
    return (rank, 2 * cp - 1 - rank) if balance == "headtail" else (2 * rank, 2 * rank + 1)


def causal_parts(cp: int, rank: int, balance: str) -> list[list[Optional[tuple[int, bool]]]]:
    """Per block j (cp rank j's two key chunks, in sequence order) and query chunk i of
    `rank`: None (both keys in its future), or (n, diagonal): the block's first n chunks,
    the last of them the query's own (causal) when `diagonal`, else all in its past. The
    cost model's activation terms read the same plan (sim/cost/activations.py)."""
    out = []
    for j in range(cp):
        keys, row = token_pieces(cp, j, balance), []
        for q in token_pieces(cp, rank, balance):
            need = [k for k in keys if k <= q]
            row.append((len(need), need[-1] == q) if need else None)
        out.append(row)
    return out


class _Stamp(torch.autograd.Function):
    """Identity; its backward marks the step's clock into `span[what]`: on the attention's
    output the backward's start, on its inputs its ends (q, k and v each: the latest counts)."""

    @staticmethod
    def forward(ctx, x, cp, span, what):
        ctx.cp, ctx.span, ctx.what = cp, span, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        t = ctx.cp.clock.mark()
        if ctx.what == "start":
            ctx.span["start"] = t
        else:
            ctx.span.setdefault("end", []).append(t)
        return g, None, None, None


def attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: (B, heads, T/cp, d) q, k, v of this rank's tokens ->
    (B, T/cp, heads, d), timed forward and backward (`ContextParallel.take`)."""
    cp: ContextParallel = module.context_parallel
    if attention_mask is not None:  # the split models pass none (packed, unpadded sequences)
        raise ValueError("context parallelism takes no attention mask: the causal mask is built from positions")
    t0, span = cp.clock.mark(), {}
    if torch.is_grad_enabled():
        cp._backward.append(span)  # a span whose backward never runs (a recomputed forward's) is not counted
        query, key, value = (_Stamp.apply(t, cp, span, "end") for t in (query, key, value))
    out = _core(cp, module, query, key, value, dropout, scaling)
    if torch.is_grad_enabled():
        out = _Stamp.apply(out, cp, span, "start")
    cp._forward.append((t0, cp.clock.mark()))
    return out, None


def _core(cp: ContextParallel, module, query, key, value, dropout, scaling) -> torch.Tensor:
    """K and V over the cp group by `cp.method`; causal work only (`ContextParallel.parts`,
    `prefix`): past keys unmasked, the diagonal chunk causal, the future skipped."""

    if cp.method == "ring":
        return ring_attention(cp, query, key, value, scaling if scaling is not None else query.size(-1) ** -0.5)
    if cp.method == "a2a":
        return ulysses_attention(cp, module, query, key, value, dropout, scaling)
    key, value = (gather_from_sequence_parallel_region(t, cp.comm, dim=2) for t in (key, value))  # (B, h, T, d)
    key, value = (cp.to_sequence(t) for t in (key, value))
    key, value, c = repeat_kv(key, query.size(1)), repeat_kv(value, query.size(1)), cp.chunk
    outs = []
    for i, L in enumerate(cp.prefix):  # each query chunk against the keys up to it: causal work only
        q = query[:, :, i * c:(i + 1) * c]
        cp.count(q, L)
        outs.append(F.scaled_dot_product_attention(q, key[:, :, :L], value[:, :, :L], attn_mask=causal_lower_right(c, L),
                                                   dropout_p=dropout if module.training else 0.0, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def install(model: nn.Module, cp: ContextParallel) -> None:
    """Route every attention module of a split model (split.py's SplitLM) through `attention`,
    give its embedding and blocks the tokens' global positions, and let it cut ids and labels
    to this rank's tokens."""
    _register()
    routed = 0
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "config"):  # transformers' attention
            module.context_parallel = cp
            module.config._attn_implementation = ATTENTION
            routed += 1
        if hasattr(module, "positions"):  # the GPT-2 embedding, split.py's blocks
            module.positions = cp.index
    if not routed:  # a cp rank would attend to its own tokens only: wrong, and silently so
        raise ValueError(f"context parallelism found no transformers attention module in {type(model).__name__}")
    if getattr(model, "moe", None) is not None:  # MoE's aux-loss counts span the whole sequence
        model.moe.cp_group, model.moe.cp = cp.comm.group, cp.comm.size
    model.context = cp
