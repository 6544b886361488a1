"""What a step's collectives carry, per rank: the cost model's bytes, tested equal to what the
framework hands to torch.distributed (metrics/comm_ledger.py) for layouts run here.

Payloads follow collectives.py (all-reduce: the tensor; all-gather: the gathered one;
reduce-scatter: the whole input; all-to-all: what a rank sends, its own part included;
p2p: the tensor). Per step, on the rank that holds pipeline stage(s) `stages` at tp and dp
coordinate 0, as the framework runs them:
- tp, per block and micro-batch (Megatron's f / g): forward, the attention's and the MLP's
  exit (all-reduce; with sequence parallelism an all-gather at entry and a reduce-scatter at
  exit); backward, their conjugates; activation checkpointing repeats the forward's in the
  backward. The vocab-parallel embedding's forward reduction and the head's entry (identity
  or all-gather forward, its conjugate backward). Sequence parallelism: the replicated
  parameters' gradients all-reduced once per step.
- dp: ZeRO 0, torch DDP's all-reduce of every gradient (reduce dtype); ZeRO >= 1, a
  reduce-scatter of each unit's flat gradient buffer (a block, or the embedding with the
  head; tp shards and replicated parameters in two buffers, each padded to a multiple of dp)
  and, for 1 and 2, the all-gather of the updated parameters; ZeRO 3 gathers each unit's
  parameters before every micro-batch's forward and backward instead.
- embedding: the tied token table's gradient all-reduced between the first and last stage.
- pp: one activation per micro-batch and chunk to the next stage in forward, one gradient
  back in backward (sequence-sharded under sequence parallelism).
- ep: per MoE layer and micro-batch, dispatch and combine in forward, both again backward,
  tokens x top_k rows of h (dropless routing; the ep group's mean: one rank's share
  depends on where its tokens are routed).
- dp, MoE: the step's routing statistics (a row per layer) and smallest margin.
Left out: single scalars (the overflow flag, gradient norms' partial sums, the flush's
1-element all-reduce) and integer payloads (routing counts, DDP's bucket layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.parallel.pipeline.partition import uniform
from framework.parallel.pipeline.schedules import get
from framework.sim.cost.shapes import ModelShape


@dataclass(frozen=True)
class Collective:
    dim: str  # tp | dp | pp | ep | edp | embedding
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send
    nbytes: float  # one call's payload
    n: int  # group size
    calls: float  # per step

    @property
    def total(self) -> float:
        return self.nbytes * self.calls


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def block_split(s: ModelShape, tp: int) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters of one block on one tp rank (experts excluded).
    With tp = 1 nothing is a shard: every parameter counts as replicated (one ZeRO buffer)."""
    h, kv, f = s.hidden, s.kv_dim, s.ffn
    if s.arch == "gpt2":
        sharded = (3 * h * h + 3 * h) + h * h + (f * h + f) + h * f
        replicated = 2 * s.norm_params() + 2 * h  # ln_1, ln_2, the two row-parallel biases
    else:
        sharded = 2 * h * h + 2 * kv * h + (0 if s.experts else 3 * h * f)
        replicated = 2 * s.norm_params() + (2 * s.head_dim if s.arch == "qwen3_moe" else 0) + s.experts * h
    return (sharded // tp, replicated) if tp > 1 else (0, sharded + replicated)


def expert_params(s: ModelShape, ep: int) -> int:
    """One block's routed experts on one ep rank."""
    return s.experts * 3 * s.hidden * s.expert_ffn // ep if s.experts else 0


def outer_split(s: ModelShape, tp: int, first: bool, last: bool) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters outside the blocks on a stage that is the first
    and / or the last: token table (vocab-parallel), positions, final norm, head."""
    table = padded_vocab(s.vocab, tp) // tp * s.hidden
    sharded = replicated = 0
    if first:
        sharded += table
        replicated += s.positions * s.hidden
    if last:
        replicated += s.norm_params()
        if not (s.tied and first):  # a tied head on the first stage is the same tensor
            sharded += table
    return (sharded, replicated) if tp > 1 else (0, sharded + replicated)


def _pad(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def stages_of(job, rank_pp: int) -> list[int]:
    smap = get(job.schedule).stage_map(job.pp, job.virtual_stages)
    return [st for st in range(job.pp * job.virtual_stages) if smap.rank(st) == rank_pp]


def rank_units(job, rank_pp: int) -> list[tuple[int, int, int, bool]]:
    """The ZeRO units on pipeline rank `rank_pp` (tp coordinate 0): (tp-sharded, replicated,
    expert parameters, is the embedding / head unit), one per block and one for the
    embedding and / or head of a first or last stage."""
    s, lay = job.shape, job.lay
    nstages = job.pp * job.virtual_stages
    parts = uniform(s.layers, nstages)
    units = []
    for st in stages_of(job, rank_pp):
        first, last = st == 0, st == nstages - 1
        units += [(*block_split(s, lay.tp), expert_params(s, lay.ep), False)] * len(parts[st])
        if first or last:
            units.append((*outer_split(s, lay.tp, first, last), 0, True))
    return units


def step_collectives(job, rank_pp: int = 0) -> list[Collective]:
    """Every modelled collective of one step on pipeline rank `rank_pp` (tp, dp coordinate 0)."""
    s, lay, m = job.shape, job.lay, job.microbatches
    nstages = job.pp * job.virtual_stages
    parts = uniform(s.layers, nstages)
    out: list[Collective] = []
    moe_layers = 0
    for st in stages_of(job, rank_pp):
        first, last = st == 0, st == nstages - 1
        nb = len(parts[st])
        for c in (c for calls in pass_collectives(job, nb, first, last).values() for c in calls):
            out.append(Collective(c.dim, c.op, c.nbytes, c.n, c.calls * m))
        if job.pp > 1:
            msg = lay.tokens * s.hidden * lay.act_bytes // (lay.tp if lay.sp else 1)
            out += [Collective("pp", "send", msg, 2, m * ((not last) + (not first)))]
        moe_layers += nb if s.experts else 0
    out += after_pipeline(job, rank_pp, moe_layers)
    return [c for c in out if c.calls and c.nbytes]


def after_pipeline(job, rank_pp: int, moe_layers: int = 0) -> list[Collective]:
    """What a rank reduces once the step's micro-batches are done: the tied table between the
    first and last stage, the routing statistics, sequence parallelism's replicated
    gradients, and dp's (with ZeRO 3's gathers, which run inside the pipeline)."""
    s, lay = job.shape, job.lay
    units = rank_units(job, rank_pp)
    out: list[Collective] = []
    if s.tied and job.pp > 1 and any(u[3] for u in units):
        table = padded_vocab(s.vocab, lay.tp) // lay.tp * s.hidden
        out.append(Collective("embedding", "all_reduce", table * job.reduce_bytes, 2, 1))
    if moe_layers and job.dp > 1:  # the step's routing statistics, one row per layer (moe_layer.py;
        row = s.experts + 4 + lay.ep  # aux-loss values not counted), and the smallest margin
        out += [Collective("dp", "all_reduce", moe_layers * row * 8, job.dp, 1),
                Collective("dp", "all_reduce", moe_layers * 8, job.dp, 1)]
    if lay.sp:
        out.append(Collective("tp", "all_reduce", sum(u[1] for u in units) * job.reduce_bytes, lay.tp, 1))
    return out + _dp(job, units)


def pass_collectives(job, blocks: int, first: bool, last: bool) -> dict[str, list[Collective]]:
    """{F, B: the tp and ep collectives of one micro-batch's pass through a stage (chunk) of
    `blocks` blocks, calls per micro-batch}; B includes what recomputation repeats."""
    lay, s = job.lay, job.shape
    out: dict[str, list[Collective]] = {"F": [], "B": []}
    if s.experts and lay.ep > 1:  # dispatch and combine, forward and backward
        rows = (lay.tokens // lay.tp if lay.sp else lay.tokens) * s.top_k
        a2a = Collective("ep", "all_to_all", rows * s.hidden * lay.act_bytes, lay.ep, 2 * blocks)
        out["F"].append(a2a)
        out["B"].append(a2a)
    if lay.tp == 1:
        return out
    act, n = lay.tokens * s.hidden * lay.act_bytes, lay.tp

    def add(ph: str, op: str, calls: int, nbytes: float = act) -> None:
        if calls:
            out[ph].append(Collective("tp", op, nbytes, n, calls))

    # Per block: F enters the attention and the MLP and exits both; B runs each conjugate.
    # Recomputation (torch's non-reentrant checkpoint, which stops once the last tensor the
    # backward needs is rebuilt) repeats both entries and the attention's exit; the MLP's
    # exit only when dropout follows it (its mask is saved).
    again = (1 + (s.dropout > 0)) if lay.recompute else 0
    if lay.sp:
        # GPT-2's c_attn / c_fc enter the region themselves and keep only their sequence
        # shard, so their backward gathers it again (Megatron's sequence-parallel linear);
        # Llama's entries are hooks whose gathered input the projections save.
        regather = 2 if s.arch == "gpt2" else 0
        add("F", "all_gather", 2 * blocks)
        add("F", "reduce_scatter", 2 * blocks)
        add("B", "all_gather", (2 + regather + (2 if lay.recompute else 0)) * blocks)
        add("B", "reduce_scatter", (2 + again) * blocks)
    else:
        add("F", "all_reduce", 2 * blocks)
        add("B", "all_reduce", (2 + again) * blocks)
    if first:  # the vocab-parallel lookup's exit, forward (under SP its conjugate gathers backward)
        add("F", "reduce_scatter" if lay.sp else "all_reduce", 1)
        add("B", "all_gather", int(lay.sp))
    if last:  # the head enters itself: forward (and, under SP, backward again), its conjugate
        add("F", "all_gather", int(lay.sp))
        add("B", "all_gather", int(lay.sp))
        add("B", "reduce_scatter" if lay.sp else "all_reduce", 1)
        # the vocab-parallel loss: a max, the target logit and a sum of exponentials per token
        add("F", "all_reduce", 3, lay.tokens * lay.act_bytes)
    return out


def _dp(job, units) -> list[Collective]:
    """The dp (and, for experts, edp) reductions and ZeRO's gathers of one step."""
    dp, lay, m = job.dp, job.lay, job.microbatches
    edp = dp // lay.ep
    out: list[Collective] = []
    experts = sum(u[2] for u in units)
    if job.zero == 0:
        dense = sum(u[0] + u[1] for u in units)
        out += [Collective("dp", "all_reduce", dense * job.reduce_bytes, dp, dp > 1)]
        out += [Collective("edp", "all_reduce", experts * job.reduce_bytes, edp, edp > 1)]
        return out
    # ZeRO 1 reduces once per step; 2 and 3 per unit as each micro-batch's gradients complete
    reduces = 1 if job.zero == 1 else m
    for sh, rep, ex, outer in units:
        for count, dim, n in ((sh, "dp", dp), (rep, "dp", dp), (ex, "edp", edp)):
            if not count or n == 1:
                continue
            full = _pad(count, n)
            out.append(Collective(dim, "reduce_scatter", full * job.reduce_bytes, n, reduces))
            # ZeRO 3: before every micro-batch's forward and backward; the embedding / head
            # unit stays gathered from its forward to its backward (the tied head is used last)
            gathers = 1 if job.zero in (1, 2) else (m if outer else 2 * m)
            out.append(Collective(dim, "all_gather", full * lay.act_bytes, n, gathers))
    return out
