"""Ring attention (`parallelism.cp_comm=ring`): context parallelism's K / V passed around the
cp group by point-to-point instead of all-gathered (Liu et al., 2023; Megatron's `p2p`).

Sharded: as in context_parallel.py (each rank's tokens; parameters whole). Forward: cp - 1
passes; at pass s a rank holds the K / V block of cp rank (r - s) mod cp, sends it on to
r + 1 and receives the next from r - 1 (one batch of an isend and an irecv: NCCL's one Work
per batch). Each block's scores against the local queries, causal work only (each query
chunk against the block's key chunks at or before it: past ones unmasked, the diagonal one
causal, future ones skipped; `ContextParallel.parts`), are merged by the online softmax (running max, sum of exponentials, weighted values; in at least
fp32): the log-sum-exp merge, so the result is softmax over every key. A block wholly in the
queries' future is passed on without a product. Backward: autograd's; the pass's conjugate
sends each block's gradient back the other way, so dK and dV travel back around the ring to
the rank that owns the keys.

The blocks are products under autograd (no fused kernel): each saves its (B, heads, c, L)
probabilities per query chunk, so a rank's attention memory is that of its queries against
the keys they see, as with the all-gather; what the ring changes is the traffic (p2p to
neighbours, never the whole K / V at once).

Overlap (`parallelism.overlap_cp_ring`): in forward, pass s + 1's batch is issued before
block s is multiplied and waited for after it, so the transfer runs under the block's
attention (Megatron's and torchtitan's ring do the same); the exposed time (the `cp` span)
is the wait alone, and the pass's total adds its time in flight before that wait (on CPU a
watcher thread stamps its completion, gloo's send / receive Works having no future; on
CUDA it is not seen: comm_timer.py), so `comm_hidden_cp` reads the share the products hid.
In backward, pass s + 1's conjugate issues the gradient's transfer and hands autograd
zeros; a `_Wait` node, created before block s's product (autograd runs a graph's ready
nodes latest-created first), runs after that product's backward and adds the received
gradient: the transfer runs under block s's backward. Off: every pass issued and waited
for at once. The values are the same either way (the received gradient is added
where the synchronous pass would have added it): only when a transfer is waited for moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework.comm.comm_timer import watch


class _Pass(torch.autograd.Function):
    """Forward: to the next cp rank, from the previous. Backward: the gradient the other way."""

    @staticmethod
    def forward(ctx, x, cp, started=None, later=None):
        """`started`: this pass's batch, issued earlier by `start` (the overlap); else now.
        `later` (the overlap): backward issues the gradient's pass into it and returns
        zeros; `_Wait` adds the received gradient once the block before has run backward."""
        ctx.cp, ctx.later = cp, later
        return finish(cp, started if started is not None else start(cp, x, +1, overlapped=False))

    @staticmethod
    def backward(ctx, g):
        if ctx.later is None:
            return exchange(ctx.cp, g.contiguous(), -1), None, None, None
        ctx.later["started"] = start(ctx.cp, g.contiguous(), -1)
        return torch.zeros_like(g), None, None, None


class _Wait(torch.autograd.Function):
    """Identity in forward, made before its block's product so that, in backward (run in
    reverse creation order), the product's backward runs between the next pass's backward
    (which issues the gradient's transfer into `later`) and this node (which waits for it)."""

    @staticmethod
    def forward(ctx, x, cp, later):
        ctx.cp, ctx.later = cp, later
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        started = ctx.later.pop("started", None)
        return (g if started is None else g + finish(ctx.cp, started)), None, None


def start(cp, x: torch.Tensor, step: int, overlapped: bool = True) -> tuple:
    """Issue: send `x` to cp rank r + step, receive the same shape from r - step (one batch:
    NCCL's one Work). `x` must not change until `finish`."""
    me, n = cp.comm.rank, cp.comm.size
    out = torch.empty_like(x)
    # on the cp group's own communicator (NCCL: its own stream), not behind a pipeline's receives
    group = cp.comm.group
    ops = [dist.P2POp(dist.isend, x, cp.ranks[(me + step) % n], group=group),
           dist.P2POp(dist.irecv, out, cp.ranks[(me - step) % n], group=group)]
    cp.comm.bytes_sent += x.numel() * x.element_size()
    works = dist.batch_isend_irecv(ops)
    # overlapped: a watcher stamps the completion (gloo's p2p Works have no future: comm_timer.py)
    return (watch(cp.comm.timer, cp.comm.dim, works) if overlapped else works), x, out


def finish(cp, started: tuple) -> torch.Tensor:
    """Wait for a started pass (the `cp` span: the exposed time); the received tensor."""
    works, _sent, out = started  # the sent tensor is held until here
    with cp.comm.timed():
        for work in works:
            work.wait()
    return out


def exchange(cp, x: torch.Tensor, step: int) -> torch.Tensor:
    return finish(cp, start(cp, x, step, overlapped=False))


def ring_attention(cp, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """(B, heads, n, d) local queries, (B, kv heads, n, d) local K / V -> (B, n, heads, d)."""
    groups, d = query.size(1) // key.size(1), key.size(-1)
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    kv = torch.cat([key, value], dim=-1)  # one message per pass
    c = cp.chunk
    stats = [None, None]  # per query chunk: (running max, sum of exponentials, weighted values)
    skipped, started, later, n = [], None, None, cp.comm.size
    for s in range(n):
        if s:
            kv = _Pass.apply(kv, cp, started, later)
        if cp.overlap and s < n - 1:  # backward: the pass after this block under its product's backward
            later = {}
            kv = _Wait.apply(kv, cp, later)
        # the overlap: the next pass's transfer runs under this block's product
        started = start(cp, kv.detach(), +1) if cp.overlap and s < n - 1 else None
        block = (cp.comm.rank - s) % cp.comm.size
        if cp.skip[block]:  # built once on the host: no read of the mask per block
            skipped.append(kv)  # wholly in the queries' future: passed on, never multiplied
            continue
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in kv.split(d, dim=-1))
        for i, part in enumerate(cp.parts[block]):  # causal work only (ContextParallel.parts)
            if part is not None:
                stats[i] = _merge(cp, stats[i], query[:, :, i * c:(i + 1) * c], k, v, part, scaling, acc_dtype)
    out = torch.cat([acc / total for _, total, acc in stats], dim=2).to(query.dtype).transpose(1, 2).contiguous()
    return _Anchor.apply(out, *skipped) if skipped else out


def _merge(cp, stats, q, k, v, part, scaling, acc_dtype):
    """One query chunk against a block's first L keys (the last chunk of them causal when
    `diagonal`), merged into its running (max, total, acc) by the log-sum-exp rule."""
    L, diagonal = part
    k, v = k[:, :, :L], v[:, :, :L]
    cp.count(q, L)
    scores = (q @ k.transpose(-1, -2)).to(acc_dtype) * scaling
    if diagonal:
        scores = scores.masked_fill(~cp.causal[L], float("-inf"))
    # The first block (s = 0) is the rank's own, where every query sees at least itself: the
    # running max is finite from then on. It is a constant of the merge, taken off the graph
    # (an amax node would save the scores, and free them again once the max is dropped).
    block_max = scores.detach().amax(-1, keepdim=True)
    if stats is None:
        p = torch.exp(scores - block_max)
        return block_max, p.sum(-1, keepdim=True), p @ v.to(acc_dtype)
    run_max, total, acc = stats
    new_max = torch.maximum(run_max, block_max)
    p = torch.exp(scores - new_max)
    rescale = torch.exp(run_max - new_max)
    return new_max, total * rescale + p.sum(-1, keepdim=True), acc * rescale + p @ v.to(acc_dtype)


class _Anchor(torch.autograd.Function):
    """Identity on `out` that hands each skipped block a zero gradient. Without it a skipped
    block's pass is not in the graph, its backward (a send and a receive) never runs on this
    rank while its neighbours' does: a deadlock (cp_balance=contiguous, where the first ranks
    skip the later blocks)."""

    @staticmethod
    def forward(ctx, out, *skipped):
        ctx.like = [(t.shape, t.dtype, t.device) for t in skipped]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return (g, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like))
