"""The ops of one micro-batch on one rank, with their shapes, per pass: F (forward), I (the
input's gradient) and W (the weights' gradient); B = I + W.

Each `CostOp` carries two FLOP counts:
- `flops`: what the rank executes (GEMM 2 m n k; flash attention's causal half, forward
  2 b h s^2 d, backward 2.5x that (FlashAttention-2's count); recomputation's second forward);
- `model_flops`: this rank's share of metrics/flops.py's count, 6 N + 12 L h s per token
  (N: every parameter but the lookup tables, routed experts at k / E; attention without the
  causal half; recomputation not counted). A parameter's 6 FLOPs per token are 2 in F, 2 in
  I, 2 in W; attention's 12 h s are 4 in F and 8 in I. A piece replicated over tp (norms,
  a row-parallel bias, MoE experts) is shared: each tp rank carries 1 / tp of it, so the
  ranks of a layout sum to the model's count exactly (tests/test_cost_model.py).
Memory-bound ops carry `bytes` (read + written); GEMMs their (m, n, k); attention
(batch x heads, s, head_dim). What is not an op: fused bias adds (inside the GEMM), dropout
(training runs here use dropout 0), the collectives (framework/sim/cost/collectives.py).

Layouts (framework/sim/cost/shapes.py `Layout`): tp splits heads and MLP widths (Megatron's
column / row parallel), the LM head over the vocabulary; sequence parallelism runs norms,
residuals and the embedding on T / tp tokens; ep gives each rank E / ep experts and, in
expectation, T k assignments (its tokens' k, spread over every rank's experts, and as many
back from the other ep ranks); recomputation repeats each block's F inside its I. cp: a rank's T / cp tokens (`Layout.tokens`);
its attention is causal work only (context_parallel.py): the all-gather's and Ulysses' SDPA
run the causal share (a flash kernel skips the future: 1 / cp of the causal count), the
ring's explicit products multiply each query chunk against the key chunks at or before it,
the diagonal chunk whole under its mask: (2 cp + 1) / (2 cp) of the causal count over the
group, 1 / cp of it per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from framework.sim.cost.shapes import Layout, ModelShape
from framework.sim.cost.traffic import block_unit, outer_unit


@dataclass(frozen=True)
class CostOp:
    name: str
    kind: str  # "gemm" | "attention" | "memory"
    phase: str  # "F" | "I" | "W"
    model_flops: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    shape: tuple = ()  # gemm (m, n, k); attention (batch x heads, s, head_dim)
    count: int = 1  # identical kernels (a rank's experts)
    dtype: str = ""  # a GEMM's own dtype ("fp8": precision.fp8); "": the layout's
    fused: bool = False  # a compiled block's generated kernel: streams at the profile's copy rate


# Casting one operand of E elements (a bytes each) to FP8 with dynamic scaling (torchao's
# hp_tensor_to_float8_dynamic), as kernels and bytes. Eager, 6 kernels: abs (read E a, write
# E a), amax (read E a), the upcast to fp32 (read E a, write 4 E; none from fp32: 5 kernels),
# the scale multiply and the saturating clamp (read and write 4 E each), the cast (read 4 E,
# write E); and the scale itself from the amax in 4 scalar kernels (7 rowwise: rounded to a
# power of two). Compiled: one reduction (the amax: read E a) and one fused scale-clamp-cast
# (read E a, write E). Not priced: the layout copies _scaled_mm's operands need (a transposed
# contiguous copy of W in I and of dY and x in W: 2 E bytes each).
def _cast_ops(phase: str, elements: float, a: int, rowwise: bool, compiled: bool) -> list[CostOp]:
    if compiled:
        return [CostOp("fp8_cast", "memory", phase, bytes=elements * (2 * a + 1) / 2, count=2, fused=True)]
    upcast = elements * (a + 4) if a != 4 else 0.0
    sized = elements * 3 * a + upcast + elements * (8 + 8 + 5)
    kernels = 6 if a != 4 else 5
    return [CostOp("fp8_cast", "memory", phase, bytes=sized / kernels, count=kernels),
            CostOp("fp8_scale", "memory", phase, count=7 if rowwise else 4)]


def _fp8(ops: list[CostOp], lay: Layout, readers: int = 1) -> list[CostOp]:
    """A linear's three GEMMs at FP8 with the casts of their operands (torchao casts each
    GEMM's two operands, the backward's again: F x, W; I dY, W; W dY, x). `readers`: the
    model's linears this op merges that read the same x (Llama's k and v, gate and up: 2):
    eager, each casts x itself; compiled, the graph casts it once (common subexpressions)."""
    if lay.fp8 == "none":
        return ops
    (f, i, _w) = ops
    t, n_out, k_in = f.shape
    x, w, dy = t * k_in, k_in * n_out, t * n_out
    a, row = lay.act_bytes, lay.fp8 == "rowwise"
    xs = (x,) * (1 if lay.compiled else readers)
    casts = [c for ph, es in (("F", (*xs, w)), ("I", (dy, w)), ("W", (dy, *xs))) for e in es
             for c in _cast_ops(ph, e, a, row, lay.compiled)]
    return [replace(o, dtype="fp8") for o in ops] + casts


def _linear(name: str, t: int, k_in: int, n_out: int, model_params: float, tp: int) -> list[CostOp]:
    """y = x W: F (t, n, k); I dX = dY W^T (t, k, n); W dW = X^T dY (k, n, t). `model_params`:
    the full layer's weights + bias (the model count's share is model_params / tp)."""
    f = 2.0 * t * model_params / tp
    return [CostOp(name, "gemm", "F", f, 2.0 * t * k_in * n_out, shape=(t, n_out, k_in)),
            CostOp(name, "gemm", "I", f, 2.0 * t * k_in * n_out, shape=(t, k_in, n_out)),
            CostOp(name, "gemm", "W", f, 2.0 * t * k_in * n_out, shape=(k_in, n_out, t))]


def _memory(name: str, nbytes: float, model_f: float = 0.0, backward: float = 2.0, weights: bool = False) -> list:
    """A memory-bound op: F moves `nbytes`, its gradient `backward` x that. `model_f`: the
    model count's F share of its parameters (norms), mirrored in I and W (2 + 2 + 2)."""
    out = [CostOp(name, "memory", "F", model_f, bytes=nbytes)]
    if backward:
        out.append(CostOp(name, "memory", "I", model_f if weights else 0.0, bytes=backward * nbytes))
    if weights:
        out.append(CostOp(name, "memory", "W", model_f))
    return out


def block_ops(s: ModelShape, lay: Layout) -> list[CostOp]:
    """One transformer block's ops for one micro-batch on one rank."""
    tp, a, t = lay.tp, lay.act_bytes, lay.tokens
    tn = t // tp if lay.sp else t  # tokens of the norms and residuals
    h, kv, hd = s.hidden, s.kv_dim, s.head_dim
    norm = "layer_norm" if s.arch == "gpt2" else "rms_norm"
    norm_f = 2.0 * t * s.norm_params() / tp
    ops = _memory(norm, 2 * tn * h * a, norm_f, weights=True)
    if s.arch == "gpt2":
        ops += _fp8(_linear("qkv", t, h, 3 * h // tp, 3 * h * h + 3 * h, tp), lay)
    else:
        ops += _fp8(_linear("q", t, h, h // tp, h * h, tp), lay) + _fp8(_linear("kv", t, h, 2 * kv // tp, 2 * h * kv, tp), lay, 2)
        ops += _memory("rotary", 2 * t * (h + kv) // tp * a)
        if s.arch == "qwen3_moe":
            ops += _memory("rms_norm", 2 * t * (h + kv) // tp * a, 2.0 * t * 2 * hd / tp, weights=True)
    bh = lay.micro_batch * s.heads // tp
    causal = 2.0 * bh * lay.seq_len ** 2 * hd  # executed forward: 4 b h s^2 d / 2
    if lay.cp > 1:  # causal work only; the ring's diagonal chunks multiplied whole (module docstring)
        causal *= (1 + 1 / (2 * lay.cp) if lay.cp_comm == "ring" else 1) / lay.cp
    attn_model = 4.0 * t * lay.seq_len * h / tp
    ops += [CostOp("attention", "attention", "F", attn_model, causal, shape=(bh, lay.seq_len, hd)),
            CostOp("attention", "attention", "I", 2 * attn_model, 2.5 * causal, shape=(bh, lay.seq_len, hd))]
    ops += _fp8(_linear("o", t, h // tp, h, h * h + (h if s.bias else 0), tp), lay)
    if lay.compiled:  # the residual add and the next norm in one kernel: the sum is written once, not read back
        ops += _memory(f"add_{norm}", 4 * tn * h * a, norm_f, backward=1.0, weights=True)
    else:
        ops += _memory("add", 3 * tn * h * a, backward=0.0)  # residual; its gradient passes through
        ops += _memory(norm, 2 * tn * h * a, norm_f, weights=True)
    ops += _mlp(s, lay, t, tn)
    ops += _memory("add", 3 * tn * h * a, backward=0.0)
    if lay.compiled:  # every elementwise op a generated kernel (fp8 casts are marked already)
        ops = [replace(o, fused=True) if o.kind == "memory" else o for o in ops]
    if lay.recompute:  # the block's forward again, inside its backward: executed, not model FLOPs
        ops += [replace(o, phase="I", model_flops=0.0) for o in ops if o.phase == "F"]
    return ops


def _mlp(s: ModelShape, lay: Layout, t: int, tn: int) -> list[CostOp]:
    tp, a, h, f = lay.tp, lay.act_bytes, s.hidden, s.ffn
    if s.experts:
        # router on the rank's tokens (replicated over tp); each of its E / ep experts gets
        # tn k ep / E assignment rows in expectation (tn k in all), gate_up then down
        ops = _linear("router", tn, h, s.experts, h * s.experts * t / tn, tp)  # its model share: t tokens / tp
        local, rows = s.experts // lay.ep, max(1, round(tn * s.top_k * lay.ep / s.experts))
        share = t * s.top_k * 3 * h * s.expert_ffn / tp  # the model count: k experts per token, over tp
        for name, k_in, n_out, frac in (("experts_gate_up", h, 2 * s.expert_ffn, 2 / 3),
                                        ("experts_down", s.expert_ffn, h, 1 / 3)):
            ops += [replace(o, model_flops=2.0 * share * frac, count=local) for o in
                    _linear(name, rows, k_in, n_out, 0, 1)]
        ops += _memory("silu_mul", 3 * tn * s.top_k * s.expert_ffn * a)
        ops += _memory("permute", 4 * tn * s.top_k * h * a)  # dispatch / combine gathers and the weighted sum
        return ops
    if s.gated:
        return (_fp8(_linear("gate_up", t, h, 2 * f // tp, 2 * h * f, tp), lay, 2) + _memory("silu_mul", 3 * t * f // tp * a)
                + _fp8(_linear("down", t, f // tp, h, f * h, tp), lay))
    return (_fp8(_linear("fc", t, h, f // tp, h * f + f, tp), lay) + _memory("gelu", 2 * t * f // tp * a)
            + _fp8(_linear("proj", t, f // tp, h, f * h + h, tp), lay))


def embedding_ops(s: ModelShape, lay: Layout) -> list[CostOp]:
    """The first stage's lookup (and GPT-2's positions): no model FLOPs, a gradient scatter."""
    tn = lay.tokens // lay.tp if lay.sp else lay.tokens
    nbytes = 2 * tn * s.hidden * lay.act_bytes * (2 if s.arch == "gpt2" else 1)
    return [CostOp("embedding", "memory", "F", bytes=nbytes), CostOp("embedding", "memory", "W", bytes=2 * nbytes)]


def head_ops(s: ModelShape, lay: Layout) -> list[CostOp]:
    """The last stage's final norm, LM head (vocabulary over tp) and cross entropy (in fp32:
    the logits read, upcast, log-softmax; its gradient the same again)."""
    tp, a, t = lay.tp, lay.act_bytes, lay.tokens
    tn = t // tp if lay.sp else t
    norm = "layer_norm" if s.arch == "gpt2" else "rms_norm"
    ops = _memory(norm, 2 * tn * s.hidden * a, 2.0 * t * s.norm_params() / tp, weights=True)
    ops += _linear("lm_head", t, s.hidden, s.vocab // tp, s.vocab * s.hidden, tp)
    return ops + _memory("cross_entropy", t * s.vocab // tp * (a + 8))


def stage_ops(s: ModelShape, lay: Layout, blocks: int, first: bool, last: bool) -> list[CostOp]:
    """A pipeline stage (chunk) holding `blocks` blocks, the embedding if `first`, the head if
    `last`, and each micro-batch's gradient accumulation: autograd adds every parameter's new
    gradient into .grad (read both, write one), the token table's too, which torch's dense
    embedding backward first writes whole (V x h, however few tokens looked it up)."""
    ops = embedding_ops(s, lay) if first else []
    ops += block_ops(s, lay) * blocks
    ops += head_ops(s, lay) if last else []
    params = block_unit(s, lay.tp, lay.ep).params * blocks + outer_unit(s, lay.tp, first, last, True).params
    table = (s.vocab // lay.tp * s.hidden) if first else 0
    return ops + [CostOp("add", "memory", "W", bytes=(3 * params + table) * lay.act_bytes)]


def optimizer_ops(params: float, param_bytes: int, master: bool) -> list[CostOp]:
    """AdamW over a rank's `params` (its ZeRO shard): read the gradient, the fp32 master (or
    the parameter), m and v, write them back (and the low-precision copy from the master),
    plus the gradient norm's read of every gradient."""
    state = 4 * 3  # fp32 master (or parameter), m, v
    nbytes = params * (param_bytes + 2 * state + (param_bytes if master else 0) + param_bytes)
    return [CostOp("adamw", "memory", "U", bytes=nbytes)]


def flops(ops: list[CostOp], phase: str | None = None, model: bool = True) -> float:
    pick = [o for o in ops if phase is None or o.phase in phase]
    return sum((o.model_flops if model else o.flops * o.count) for o in pick)
