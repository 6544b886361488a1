"""Model FLOPs per token, a matmul peak probe, and MFU.

Training FLOPs per token = 6N + 12·L·h·s: 6N for the forward and backward matmuls of N
parameters (2 forward + 4 backward per parameter per token) and 12·L·h·s for attention
scores and values over context s (Kaplan et al., 2020, "Scaling Laws for Neural Language
Models", sec. 2.1; Chowdhery et al., 2022, PaLM, appendix B; nanoGPT's estimate_mfu).
N counts every parameter except those of embedding tables (nn.Embedding: token and
position embeddings are lookups, no matmul), as torchtitan's
get_dense_model_nparams_and_flops does: Llama's untied embed_tokens is left out, its
lm_head counted; GPT-2's tied wte counts once, through the LM head matmul it also serves.
Norm weights and biases are counted (as nanoGPT does; they are <1% of N). For GPT-2 124M
at s = 1024 this gives nanoGPT's 855,166,464 FLOPs per token. Mixture-of-Experts models count
active parameters: a token runs top_k of each layer's E routed experts, so the routed
experts count k / E of their parameters (`inactive_expert_params`), and a step whose capacity
dropped a fraction d of the (token, expert) assignments executed 6 R k / E d fewer FLOPs per
token (R the routed experts' parameters; `executed_flops_per_token`): the logged tflops and
mfu count the executed assignments. Activation recomputation is
not counted: this is *model* FLOPs, so checkpointed runs show lower MFU. The peak it is
divided by: framework/metrics/peak.py.
"""

from __future__ import annotations

import time

import torch
from torch import nn


def matmul_params(model: nn.Module) -> int:
    """N: unique parameters of every module but the embedding tables.

    A tied LM head (an nn.Linear holding the token embedding's weight) counts that weight
    once, as the matmul it is; the lookup alone counts nothing.
    """
    used = {id(p): p for m in model.modules() if not isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)}
    n = sum(p.numel() for p in used.values())
    return n - inactive_expert_params(model)


def active_expert_params(model: nn.Module) -> int:
    """Routed-expert parameters one token runs when no assignment is dropped: R k / E."""
    routed, experts, k = _routed(model)
    return routed * k // experts if experts else 0


def executed_flops_per_token(flops_per_token: float, expert_flops_per_token: float, dropped_fraction: float) -> float:
    """A step's FLOPs per token counting only the expert assignments it executed:
    `expert_flops_per_token` (6 R k / E) is the routed experts' share when nothing is dropped;
    a dropped assignment runs no expert matmul, forward or backward."""
    return flops_per_token - expert_flops_per_token * dropped_fraction


def _routed(model: nn.Module) -> tuple[int, int, int]:
    """(R, E, k): the routed experts' parameters, experts per layer, top_k; (0, 0, 0) when dense."""
    c = getattr(model, "config", None)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    k = getattr(c, "num_experts_per_tok", None)
    if not experts or not k:
        return 0, 0, 0
    return sum(p.numel() for name, p in model.named_parameters() if ".experts." in name), experts, k


def inactive_expert_params(model: nn.Module) -> int:
    """Routed-expert parameters a token does not use: each token runs top_k of the E routed
    experts of a layer, so of the routed experts' R parameters only R k / E are active (the
    router, attention, norms and any shared expert are active for every token). 0 for dense
    models. Read from the transformers config (num_experts / num_local_experts,
    num_experts_per_tok) and the fused experts' names (`*.experts.*`)."""
    routed, experts, k = _routed(model)
    return routed * (experts - k) // experts if experts else 0


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * n_layer * n_embd * seq_len


def probe_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                     seconds: float = 0.5) -> float:
    """Best sustained matmul FLOP/s of one (n x n) @ (n x n) on this device and thread count.

    The MFU denominator on CPU and on GPUs without a datasheet entry (framework/metrics/
    peak.py caches it per machine): an attainable peak, not the datasheet one, so CPU MFU
    reads as "share of what this core's GEMM reaches".
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, caches
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = max(best, 4 * 2.0 * n ** 3 / (time.perf_counter() - t0))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(tokens_per_s: float, flops_per_tok: float, world_size: int, peak_flops_per_rank: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per rank over the per-rank peak."""
    return tokens_per_s * flops_per_tok / world_size / peak_flops_per_rank
