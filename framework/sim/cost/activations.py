"""Saved activations: the bytes autograd keeps from a micro-batch's forward until its backward,
per (micro-batch, chunk) on one rank, and the peak over the schedule's real action list.

What is counted is what the framework's ActivationTracker (metrics/memory.py) measures: each
tensor saved for backward, storages counted once, parameters excluded. The terms are read off
the framework's own models (transformers' blocks under SDPA's flash path; the tp layers of
framework/comm/tensor_parallel.py), per token of the micro-batch; `t` the micro-batch's tokens, `tn`
the tokens of norms and residuals (t / tp under sequence parallelism), `a` the activation dtype:
- GPT-2: LayerNorm saves its input and mean / rstd; c_attn its input (the norm's output, or
  under SP its sequence shard: _SequenceGatherLinear gathers again in backward); SDPA q, k, v
  (views of c_attn's output: 3 h / tp), its output (which c_proj reads as a view) and the
  log-sum-exp per head; GELU (tanh form: x, tanh, 0.5 x, 1 + tanh) four 4 h / tp tensors and
  c_proj's input one more. 4 h tn + t (4 h + heads + 5 ffn) / tp, plus 4 tn statistics.
- Llama: RMSNorm saves its input, the normalised tensor and (as the next linear's input) its
  output, which under SP is the gathered (t, h) tensor (one gather for q, k, v); rotary's cos
  and sin (s x head_dim each, per block); SDPA q, k, v (grouped: kv / tp), output and
  log-sum-exp; SwiGLU gate, silu(gate), up and their product, 4 ffn / tp.
- Qwen3-MoE: llama's attention plus q_norm / k_norm (input, rstd, normalised); per layer the
  router's probabilities (E), top-k indices (int64), weights; per row an expert processes (R)
  the permuted token (h) and its gate-up / silu / product (4 expert_ffn); per assignment the
  rank's router made (t k) the combined expert output and the weighted one (h each), its
  weight and three index tensors (int64). Without ep R = t k. Under ep R is what the rank
  received (`received`; the default t k is the expectation: the real share depends on the
  routing), and each received row adds the expert's output that index_copy keeps for
  backward (h) and the regrouping permutation (int64).
- Embedding (first stage): the ids (int64; GPT-2's positions too; under tp the local ids and a
  bool mask). Head (last stage): the final norm as above, the LM head's input, the logits'
  log-softmax (at least fp32: the loss upcasts), the labels and the loss's weight; under tp the
  vocab-parallel loss's softmax of the padded shard (t Vp / tp), local targets and their mask.
Recomputation (trainer.activation_checkpointing) keeps each block's input only (h tn); in its
backward one block's full set lives again for a moment: `recompute_transient`, added to the
memory per GPU, not to the saved peak (the tracker sees only what checkpointing keeps). With
ZeRO-R's Pa (trainer.partition_activations, tp > 1 without SP) the input is kept as its 1/tp
slice, ceil(h t / tp); with Pa+cpu nothing of it stays in device memory.

The terms are exact for fp32 and fp64 runs here (tests/test_comm_bytes.py compares them with
the measured peak of every layout it runs). Under bf16 autocast the framework also saves fp32
or bf16 copies the terms do not count; 16-bit runs take `a` = 2 with fp32 statistics, as
Korthikanti et al. (2022) count them. Dropout masks are not counted (the presets' dropout is 0).
"""

from __future__ import annotations

from typing import Optional

from framework.parallel.context_parallel import causal_parts, token_pieces
from framework.parallel.pipeline.partition import uniform
from framework.schedules import get
from framework.schedules.base import Op
from framework.sim.cost.shapes import Layout, ModelShape

INDEX = 8  # int64 ids, labels and routing indices


def _stats_bytes(lay: Layout) -> int:
    return 4 if lay.act_bytes < 4 else lay.act_bytes  # norms' statistics and the log-sum-exp: fp32 at least


def _tokens(lay: Layout) -> int:
    """A micro-batch's tokens on one rank: a cp rank holds 1 / cp of each sequence."""
    return lay.tokens


def _expanded(s: ModelShape, kv_heads: int) -> int:
    """Width (features per token, all heads) of K or V as SDPA saves them when the core gets a
    mask: transformers repeats GQA's KV heads to every query head, a copy unless one KV head
    is left (then the repeat is a view of it)."""
    return s.hidden if kv_heads > 1 else s.kv_dim


def _core(s: ModelShape, lay: Layout) -> float:
    """What the attention core adds beyond q, k, v and its output: SDPA's log-sum-exp, and
    under cp (causal work only: context_parallel.py):
    all-gather: the gathered K and V in sequence order (GQA's expanded, `_expanded`) in place
    of the local k, v, each query chunk's copy (SDPA takes a chunk of a strided q), and per
    query chunk whose keys run past its own chunk the (c x L) mask
    that torch's lower-right causal bias materialises off CUDA (a flash kernel takes none;
    counted, as this machine measures it), on the fullest rank;
    a2a: the all-to-all's q, K, V (every token, heads / cp) in place of the local q, k, v and
    the core's output before the all-to-all back (a new tensor: the local output is
    another); SDPA's own causal attention, no mask. Under selective recomputation nothing
    (its inputs stay)."""
    if lay.selective:
        return 0.0
    if lay.cp > 1 and lay.cp_comm == "ring":
        return _ring(s, lay)
    tp, a, t = lay.tp, lay.act_bytes, _tokens(lay)
    out = t * s.heads // tp * _stats_bytes(lay)
    if lay.cp == 1:
        return out
    kv_heads = s.kv_heads // tp
    if lay.cp_comm == "a2a":
        kv = _expanded(s, kv_heads // lay.cp)
        return out + (t * s.hidden + 2 * (kv - s.kv_dim) * t) // tp * a
    local_kv = 0 if s.arch == "gpt2" else 2 * s.kv_dim * t // tp  # GPT-2's are views of c_attn's output
    gathered = 2 * _expanded(s, kv_heads) * lay.micro_batch * lay.seq_len // tp
    c = lay.seq_len // (2 * lay.cp)
    masks = max(sum(c * (k + 1) * c for k in token_pieces(lay.cp, r, lay.cp_balance) if k > 0) for r in range(lay.cp))
    return out + (gathered - local_kv + t * s.hidden // tp) * a + masks * a


def _ring(s: ModelShape, lay: Layout) -> float:
    """ring_attention.py's saved tensors, in place of the local q, k, v (which it copies) and
    SDPA's log-sum-exp, on the fullest rank (`causal_parts`: which key chunks each query
    chunk multiplies). Per block multiplied: K (GQA's repeated; else the passed K / V
    buffer) and V (GQA's repeated, in fp32 / fp64). Per (query chunk, block) product of L
    keys: the query chunk's copy, the probabilities (B, heads, c, L) in the accumulation
    dtype (fp32 at least), the bool mask of a diagonal part (c x L), and in 16-bit runs V's
    accumulation-dtype copy, autocast's bf16 of it and of the probabilities. Then each
    merge's rescale, and the final acc and total. (The scores are not kept: the row maxima
    are taken off the graph.)"""
    tp, a, st, t, b = lay.tp, lay.act_bytes, _stats_bytes(lay), _tokens(lay), lay.micro_batch
    n, c, hd = lay.seq_len // lay.cp, lay.seq_len // (2 * lay.cp), s.hidden // tp
    bh, grouped = b * s.heads // tp, s.heads != s.kv_heads
    block = b * n * hd * a if grouped else 2 * b * n * s.kv_dim // tp * a
    block += b * n * hd * a if grouped and a >= st else 0
    fullest = 0
    for r in range(lay.cp):
        total, merges = 0, [0, 0]
        for row in causal_parts(lay.cp, r, lay.cp_balance):
            total += block if any(row) else 0
            for i, part in enumerate(row):
                if part is None:
                    continue
                L, merges[i] = part[0] * c, merges[i] + 1
                total += b * c * hd * a + bh * c * L * st + (c * L if part[1] else 0)
                total += b * L * hd * (st + a) + bh * c * L * a if a < st else 0
        fullest = max(fullest, total + sum(m - 1 for m in merges) * bh * c * st)
    return fullest + bh * n * (s.head_dim + 1) * st - t * (s.hidden + 2 * s.kv_dim) // tp * a


def block_bytes(s: ModelShape, lay: Layout, received: Optional[float] = None) -> float:
    """One block's saved bytes for one micro-batch on one rank (no full recomputation).
    `received`: MoE only, the rows this rank's experts process in this micro-batch (the run's
    `tokens_received_per_ep_rank`); default t k, exact without ep, the expectation under it."""
    tp, a, st, t = lay.tp, lay.act_bytes, _stats_bytes(lay), _tokens(lay)
    tn = t // tp if lay.sp else t
    h, kv, heads = s.hidden, s.kv_dim, s.heads
    core = _core(s, lay)
    if s.arch == "gpt2":
        return 4 * h * tn * a + t * (4 * h + 5 * s.ffn) // tp * a + 4 * tn * st + core
    norm = (2 * h * tn + h * t) * a + tn * st  # input, normalised, output (the linears' input)
    attn = 2 * norm + t * (2 * h + 2 * kv) // tp * a + core + 2 * lay.seq_len // lay.cp * s.head_dim * a
    if s.arch == "qwen3_moe":  # q_norm / k_norm: input and normalised per head, rstd
        attn += t * (2 * h + 2 * kv) // tp * a + t * (heads + s.kv_heads) // tp * st
    if not s.experts:
        return attn + 4 * t * s.ffn // tp * a
    k, e = s.top_k, s.experts
    # Under SP the MoE layer routes this rank's sequence shard (its experts whole on every tp
    # rank): its norm's output is not gathered, and every term counts the shard's tokens
    attn -= (t - tn) * h * a
    t = tn
    routed = t * k  # assignments this rank's router made (dropless)
    rows = routed if received is None else received  # rows its experts process
    ep_rows = rows * (h * a + INDEX) if lay.ep > 1 else 0  # index_copy's expert outputs; the permutation
    return (attn + t * (e + 1 + k) * a + t * k * INDEX  # router: probabilities, sum, weights; top-k
            + routed * (2 * h + 1) * a + 3 * routed * INDEX  # combined and weighted outputs, weights; indices
            + rows * (h + 4 * s.expert_ffn) * a + ep_rows)  # permuted rows; SwiGLU


def embedding_bytes(s: ModelShape, lay: Layout) -> float:
    """The ids (under tp: this shard's local ids and the bool mask of the others'), GPT-2's
    positions (a new arange per micro-batch; under cp the rank's one index tensor, counted
    once per rank by `peak_bytes` instead)."""
    return _tokens(lay) * (INDEX + (lay.tp > 1)) + (lay.seq_len * INDEX if s.arch == "gpt2" and lay.cp == 1 else 0)


def head_bytes(s: ModelShape, lay: Layout) -> float:
    tp, a, st, t = lay.tp, lay.act_bytes, _stats_bytes(lay), _tokens(lay)
    tn = t // tp if lay.sp else t
    h, logit = s.hidden, max(a, 4)
    if s.arch == "gpt2":
        norm = 2 * h * tn * a + 2 * tn * st  # input, output (the head's input; its shard under SP)
    else:
        norm = (2 * h * tn + h * t) * a + tn * st
    if tp > 1:  # the vocab-parallel loss: softmax of the padded shard, local targets, their mask
        return norm + t * -(-s.vocab // tp) * logit + t * (INDEX + 1)
    return norm + t * s.vocab * logit + t * INDEX + logit  # log-softmax, labels, the loss's weight


def chunk_bytes(s: ModelShape, lay: Layout, blocks: int, first: bool, last: bool,
                received: Optional[list[float]] = None) -> float:
    """One (micro-batch, chunk)'s saved bytes: its blocks (their inputs only under
    recomputation), the embedding on the first stage, the head on the last. `received`: MoE,
    per block the rows this rank's experts process (block_bytes; default the expectation)."""
    tn = _tokens(lay) // lay.tp if lay.sp else _tokens(lay)
    if lay.recompute and lay.partition == "cpu":
        body = 0.0  # Pa+cpu: the inputs' slices are in host memory
    elif lay.recompute and lay.partition == "tp":  # Pa: each input's 1/tp slice (padded: tp slices)
        body = blocks * -(-s.hidden * tn // lay.tp) * lay.act_bytes
    elif lay.recompute:
        body = blocks * s.hidden * tn * lay.act_bytes
    else:
        body = sum(block_bytes(s, lay, r) for r in (received or [None] * blocks))
    return (body + (embedding_bytes(s, lay) if first else 0.0)
            + (head_bytes(s, lay) if last else 0.0))


def recompute_transient(s: ModelShape, lay: Layout) -> float:
    """Under recomputation, one block's full saved set while its backward runs."""
    return block_bytes(s, lay) if lay.recompute else 0.0


def peak_bytes(s: ModelShape, lay: Layout, pp: int, microbatches: int, schedule, v: int = 1,
               blocks: Optional[list[int]] = None) -> list[float]:
    """Per pipeline rank: the most saved bytes alive at once, walking the schedule's action
    list (an F adds its chunk's bytes, the action ending its backward, B or W, frees them).
    `schedule`: a registry name or a Schedule; `blocks`: per stage (default: uniform)."""
    sched = get(schedule) if isinstance(schedule, str) else schedule
    smap = sched.stage_map(pp, v)
    counts = blocks or [len(r) for r in uniform(s.layers, pp * v)]
    size = {}
    for stage, n in enumerate(counts):
        size[(smap.rank(stage), smap.chunk(stage))] = chunk_bytes(s, lay, n, stage == 0, stage == len(counts) - 1)
    # cp: GPT-2's positions are the rank's one index tensor, shared by its micro-batches
    shared = {smap.rank(0): lay.seq_len // lay.cp * INDEX if s.arch == "gpt2" and lay.cp > 1 else 0.0}
    if pp == 1:
        return [size[(0, 0)] + shared[0]]
    out = []
    for r, acts in sorted(sched.generate(pp, microbatches, v, 1).items()):
        alive = peak = 0.0
        for act in acts:
            if act.op is Op.F:
                alive += size[(r, act.chunk)]
                peak = max(peak, alive)
            elif act.op.ends_backward:
                alive -= size[(r, act.chunk)]
        out.append(peak + shared.get(r, 0.0))
    return out
