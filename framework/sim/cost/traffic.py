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
- cp, per block and micro-batch (framework/parallel/context_parallel.py): allgather, K and V
  all-gathered forward ((B, kv heads / tp, T, d) each), reduce-scattered backward; ring,
  cp - 1 passes of the rank's K and V to its neighbour forward and of their gradients
  backward ("ring": p2p, priced as a send); a2a, q, k, v and the output all-to-all forward,
  the four conjugates backward. Selective and full recomputation repeat the forward's.
Left out: single scalars (the overflow flag, gradient norms' partial sums, the flush's
1-element all-reduce) and integer payloads (routing counts, DDP's bucket layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.parallel.pipeline.partition import uniform
from framework.comm.tensor_parallel import padded_vocab  # the vocab-parallel rows, as the layers pad them
from framework.schedules import get
from framework.sim.cost.shapes import ModelShape


@dataclass(frozen=True)
class Collective:
    dim: str  # tp | dp | pp | ep | edp | embedding | cp
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send | ring (cp's p2p pass)
    nbytes: float  # one call's payload
    n: int  # group size
    calls: float  # per step

    @property
    def total(self) -> float:
        return self.nbytes * self.calls


@dataclass(frozen=True)
class Unit:
    """A ZeRO unit: parameters sharing flat buffers (framework/parallel/zero.py). `buffers`:
    (elements, group) of each: tp shards, replicated, tp-partial (summed over tp) over dp;
    experts over edp. With tp = 1 nothing is a shard or partial: one dense buffer."""

    sharded: int = 0
    replicated: int = 0
    partial: int = 0
    experts: int = 0
    gathers: int = 2  # ZeRO 3: all-gathers per micro-batch (the embedding + head unit: 1)

    def __add__(self, o: Unit) -> Unit:
        return Unit(self.sharded + o.sharded, self.replicated + o.replicated, self.partial + o.partial,
                    self.experts + o.experts, self.gathers)

    @property
    def params(self) -> int:
        return self.sharded + self.replicated + self.partial + self.experts

    def buffers(self) -> list[tuple[int, str]]:
        return [(n, g) for n, g in ((self.sharded, "dp"), (self.replicated, "dp"), (self.partial, "dp"),
                                    (self.experts, "edp")) if n]


def block_unit(s: ModelShape, tp: int, ep: int) -> Unit:
    """One block on one tp (and ep) rank."""
    h, kv, f = s.hidden, s.kv_dim, s.ffn
    partial = 2 * s.head_dim if s.arch == "qwen3_moe" else 0  # q / k norms over this rank's heads
    if s.arch == "gpt2":
        sharded = (3 * h * h + 3 * h) + h * h + (f * h + f) + h * f
        replicated = 2 * s.norm_params() + 2 * h  # ln_1, ln_2, the two row-parallel biases
    else:
        sharded = 2 * h * h + 2 * kv * h + (0 if s.experts else 3 * h * f)
        replicated = 2 * s.norm_params() + s.experts * h  # the norms, the router
    experts = s.experts * 3 * h * s.expert_ffn // ep if s.experts else 0
    if tp == 1:
        return Unit(replicated=sharded + replicated + partial, experts=experts)
    return Unit(sharded // tp, replicated, partial, experts)


def _table(s: ModelShape, tp: int) -> Unit:
    n = padded_vocab(s.vocab, tp) // tp * s.hidden  # vocab-parallel rows
    return Unit(sharded=n) if tp > 1 else Unit(replicated=n)


def outer_unit(s: ModelShape, tp: int, first: bool, last: bool, head_table: bool) -> Unit:
    """What a first and / or last stage holds outside its blocks: the token table and GPT-2's
    positions; the final norm and, when `head_table`, the LM head's table."""
    u = Unit(gathers=1)
    if first:
        u = u + _table(s, tp) + Unit(replicated=s.positions * s.hidden)
    if last:
        u = u + Unit(replicated=s.norm_params()) + (_table(s, tp) if head_table else Unit())
    return u


def _pad(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def stages_of(job, rank_pp: int) -> list[int]:
    smap = get(job.schedule).stage_map(job.pp, job.virtual_stages)
    return [st for st in range(job.pp * job.virtual_stages) if smap.rank(st) == rank_pp]


def _table_ranks(job) -> tuple[int, int]:
    """Pipeline ranks of the first and the last stage (one rank in a V)."""
    smap = get(job.schedule).stage_map(job.pp, job.virtual_stages)
    return smap.rank(0), smap.rank(job.pp * job.virtual_stages - 1)


def tied_pair(job) -> bool:
    """A tied table whose two uses sit on two pipeline ranks: two copies, reduced together."""
    first, last = _table_ranks(job)
    return job.shape.tied and job.pp > 1 and first != last


def rank_units(job, rank_pp: int) -> list[Unit]:
    """The ZeRO units on pipeline rank `rank_pp` (tp coordinate 0), as the runners build them:
    pp = 1, one per block and one for the embedding with the head; pp > 1, one per chunk
    (its blocks, and its embedding or head), and the tied table's second copy on the last
    stage in a unit of its own (framework/train/pipeline_runner.py)."""
    s, lay = job.shape, job.lay
    nstages = job.pp * job.virtual_stages
    parts = uniform(s.layers, nstages)
    block = block_unit(s, lay.tp, lay.ep)
    if job.pp == 1:
        return [block] * s.layers + [outer_unit(s, lay.tp, True, True, not s.tied)]
    units = []
    for st in stages_of(job, rank_pp):
        first, last = st == 0, st == nstages - 1
        chunk = outer_unit(s, lay.tp, first, last, not s.tied)
        for _ in parts[st]:
            chunk = chunk + block
        units.append(chunk)
        if last and tied_pair(job):
            units.append(_table(s, lay.tp))
    return units


def step_collectives(job, rank_pp: int = 0) -> list[Collective]:
    """Every modelled collective of one step on pipeline rank `rank_pp` (tp, dp coordinate 0)."""
    s, lay, m = job.shape, job.lay, job.microbatches
    nstages = job.pp * job.virtual_stages
    parts = uniform(s.layers, nstages)
    smap = get(job.schedule).stage_map(job.pp, job.virtual_stages)
    out: list[Collective] = []
    for st in stages_of(job, rank_pp):
        first, last = st == 0, st == nstages - 1
        nb = len(parts[st])
        for c in (c for calls in pass_collectives(job, nb, first, last).values() for c in calls):
            out.append(Collective(c.dim, c.op, c.nbytes, c.n, c.calls * m))
        if job.pp > 1:  # to a neighbour stage on another rank (a V's turn stays on its rank)
            msg = lay.tokens * s.hidden * lay.act_bytes // (lay.tp if lay.sp else 1)
            peers = sum(0 <= nb_st < nstages and smap.rank(nb_st) != rank_pp for nb_st in (st - 1, st + 1))
            out += [Collective("pp", "send", msg, 2, m * peers)]
    out += after_pipeline(job, rank_pp)
    return [c for c in out if c.calls and c.nbytes]


def after_pipeline(job, rank_pp: int) -> list[Collective]:
    """What a rank reduces once the step's micro-batches are done: the tied table between the
    first and last stage, the routing statistics, sequence parallelism's replicated
    gradients, and dp's (with ZeRO 3's gathers, which run inside the pipeline)."""
    s, lay = job.shape, job.lay
    units = rank_units(job, rank_pp)
    moe_layers = sum(len(uniform(s.layers, job.pp * job.virtual_stages)[st]) for st in stages_of(job, rank_pp)) \
        if s.experts else 0
    out: list[Collective] = []
    if tied_pair(job) and rank_pp in _table_ranks(job):
        table = padded_vocab(s.vocab, lay.tp) // lay.tp * s.hidden
        out.append(Collective("embedding", "all_reduce", table * job.reduce_bytes, 2, 1))
    if moe_layers and job.dp > 1:  # the step's routing statistics, one row per layer (moe_layer.py;
        row = s.experts + 4 + lay.ep  # aux-loss values not counted), and the smallest margin
        out += [Collective("dp", "all_reduce", moe_layers * row * 8, job.dp, 1),
                Collective("dp", "all_reduce", moe_layers * 8, job.dp, 1)]
    # replicated gradients seen by sequence shards (all of them under SP; the per-head norms always)
    sync = sum(u.replicated + u.partial if lay.sp else u.partial for u in units)
    if lay.tp > 1 and sync:
        out.append(Collective("tp", "all_reduce", sync * job.reduce_bytes, lay.tp, 1))
    return out + _dp(job, units)


def dense_reduction(job, rank_pp: int) -> Collective:
    """ZeRO 0: the rank's dense gradient all-reduce over dp (after_pipeline's, alone): what
    `parallelism.overlap_grad_reduce` issues chunk by chunk in the cooldown."""
    return _dp(job, rank_units(job, rank_pp))[0]


def pass_collectives(job, blocks: int, first: bool, last: bool) -> dict[str, list[Collective]]:
    """{F, B: the tp and ep collectives of one micro-batch's pass through a stage (chunk) of
    `blocks` blocks, calls per micro-batch}; B includes what recomputation repeats."""
    lay, s = job.lay, job.shape
    out: dict[str, list[Collective]] = {"F": [], "B": []}
    _cp(out, s, lay, blocks)
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
    if lay.recompute and lay.partition != "none":
        # Pa's checkpoint recomputes the whole block (both exits again) from its input, which
        # it all-gathers first: tp slices of ceil(h t / tp) elements
        again = 2
        add("B", "all_gather", blocks, -(-lay.tokens * s.hidden // n) * n * lay.act_bytes)
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


def _cp(out: dict, s: ModelShape, lay, blocks: int) -> None:
    """Context parallelism's attention traffic of one micro-batch through `blocks` blocks."""
    if lay.cp == 1:
        return
    a, tp, n = lay.act_bytes, lay.tp, lay.cp
    again = lay.recompute or lay.selective  # the forward's collectives once more inside the backward
    kv = lay.tokens * s.kv_dim // tp * a  # the rank's K (or V)
    if lay.cp_comm == "allgather":
        fwd, bwd = [("all_gather", kv * n, 2)], [("reduce_scatter", kv * n, 2)]
    elif lay.cp_comm == "ring":
        fwd = bwd = [("ring", 2 * kv, n - 1)]
    else:
        q = lay.tokens * s.hidden // tp * a
        fwd = bwd = [("all_to_all", q, 2), ("all_to_all", kv, 2)]
    out["F"] += [Collective("cp", op, nbytes, n, calls * blocks) for op, nbytes, calls in fwd]
    out["B"] += [Collective("cp", op, nbytes, n, calls * blocks) for op, nbytes, calls in bwd]
    if again:
        out["B"] += [Collective("cp", op, nbytes, n, calls * blocks) for op, nbytes, calls in fwd]


def _dp(job, units: list[Unit]) -> list[Collective]:
    """The dp (and, for experts, edp) reductions and ZeRO's gathers of one step."""
    dp, lay, m = job.dp, job.lay, job.microbatches
    size = {"dp": dp, "edp": dp // lay.ep}
    if job.zero == 0:  # torch DDP over every dense gradient; the experts' own over edp
        dense = sum(u.params - u.experts for u in units)
        experts = sum(u.experts for u in units)
        return [Collective("dp", "all_reduce", dense * job.reduce_bytes, dp, dp > 1),
                Collective("edp", "all_reduce", experts * job.reduce_bytes, size["edp"], size["edp"] > 1)]
    out: list[Collective] = []
    reduces = 1 if job.zero == 1 else m  # ZeRO 1 once per step; 2 and 3 as each micro-batch's complete
    for u in units:
        for count, dim in u.buffers():
            n = size[dim]
            if n == 1:
                continue
            full = _pad(count, n)
            out.append(Collective(dim, "reduce_scatter", full * job.reduce_bytes, n, reduces))
            # ZeRO 3: before every micro-batch's forward and backward; the embedding / head
            # unit stays gathered from its forward to its backward (the tied head is used last)
            out.append(Collective(dim, "all_gather", full * lay.act_bytes, n, 1 if job.zero < 3 else u.gathers * m))
    return out
