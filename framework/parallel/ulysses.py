"""Ulysses attention (`parallelism.cp_comm=a2a`; Jacobs et al., 2023, DeepSpeed-Ulysses;
Megatron's `a2a`): context parallelism that trades the sequence split for a head split
around the attention core.

Sharded: as in context_parallel.py (each rank's T / cp tokens; parameters whole) everywhere
but inside the core. Forward: one all-to-all over the cp group takes q, k and v from (this
rank's tokens, every head) to (every token, heads / cp of them); attention is then ordinary
causal attention over the whole sequence for those heads (the tokens arrive in cp-rank
order and are put in sequence order, `ContextParallel.to_sequence`, so SDPA's own causal
attention runs: no mask tensor, and a flash kernel skips the future); a
second all-to-all takes the output back to (this rank's tokens, every head). Backward: the
conjugate all-to-alls (sequence -> heads for the output's gradient, heads -> sequence for
dq, dk, dv). The head counts (per tp rank, KV heads too) must divide by cp
(validate/context.py). Each all-to-all sends (cp - 1) / cp of the tensor (the tally).
"""

from __future__ import annotations

import torch


def all_to_all(cp, x: torch.Tensor, heads_to_sequence: bool) -> torch.Tensor:
    """(B, h, n, d) -> (B, h / cp, cp n, d) when `heads_to_sequence`, else the inverse."""
    c = cp.comm.size
    b, h, n, d = x.shape
    if heads_to_sequence:  # send head block j to cp rank j; receive rank j's tokens of my heads
        send = x.reshape(b, c, h // c, n, d).permute(1, 0, 2, 3, 4)
    else:  # send token block j (cp rank j's tokens) back to rank j; receive my tokens' head block j
        send = x.reshape(b, h, c, n // c, d).permute(2, 0, 1, 3, 4)
    out = cp.comm.all_to_all(send)
    if heads_to_sequence:  # (cp, B, h / cp, n, d) -> (B, h / cp, cp n, d)
        return out.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * n, d)
    return out.permute(1, 0, 2, 3, 4).reshape(b, h * c, n // c, d)  # (cp, B, h, n / cp, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, heads_to_sequence):
        ctx.cp, ctx.heads_to_sequence = cp, heads_to_sequence
        return all_to_all(cp, x, heads_to_sequence)

    @staticmethod
    def backward(ctx, g):
        return all_to_all(ctx.cp, g, not ctx.heads_to_sequence), None, None


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: (B, kv heads, n, d) -> (B, heads, n, d), as transformers repeats them (a copy,
    but a view when one KV head is left: the activation model's `_expanded`); the
    all-gather's core (context_parallel.py) uses it too."""
    b, kv, n, d = t.shape
    return t if kv == heads else t[:, :, None].expand(b, kv, heads // kv, n, d).reshape(b, heads, n, d)


def ulysses_attention(cp, module, query, key, value, dropout: float, scaling) -> torch.Tensor:
    """(B, heads, n, d) q and (B, kv heads, n, d) k, v of this rank's tokens -> (B, n, heads, d)."""
    q, k, v = (cp.to_sequence(_AllToAll.apply(t, cp, True)) for t in (query, key, value))
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))  # GQA: every query head its K / V head
    n = 2 * cp.comm.size  # the causal count, chunk by chunk (as the ring's and the all-gather's): chunk i sees i + 1
    cp.count(q[:, :, :cp.chunk], cp.chunk * n * (n + 1) // 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout if module.training else 0.0,
                                                           is_causal=True, scale=scaling)
    out = _AllToAll.apply(cp.to_ranks(out), cp, False)  # (B, heads, n, d)
    return out.transpose(1, 2).contiguous()
