"""The communication a step hides under compute, one function per overlap, each a `Job`
option (price.job_of: which run key sets it; one the framework does not build has no key
and is set on a Job in code, as experiments/cluster_model does for published systems).

- `tp_comm_overlap` (Megatron-Core's tp_comm_overlap, Transformer Engine's userbuffers; with
  sequence parallelism only, as there): each all-gather of a block pipelined with the GEMM
  it feeds (q k v, the MLP's first), each reduce-scatter with the GEMM it follows (the
  attention's and the MLP's output projections); in backward the conjugates beside the
  same linears' gradient GEMMs (I and W; I alone under a schedule that splits the backward,
  whose W runs later). A collective hides at most its own linear's time:
  per block, each of the four linears hides min(its collectives, its GEMMs). Not built by
  the framework (its tp collectives are synchronous).
- `overlap_grad_reduce` (the run's key): pp > 1 without ZeRO (or ZeRO 1), each chunk's
  share of the dp reduction starts after the chunk's last backward in the clock's timeline
  (one link: in turn), what runs past the pipeline's end exposed (`chunk_reduce_after`);
  ZeRO at pp 1 (our per-unit reduce-scatter), in each micro-batch that reduces (ZeRO 1: the
  last; 2 / 3: every one) one unit's share exposed and the others' only past the time the
  link is free in the micro-batch's backward (ZeRO 3's gathers there take their share of
  it: `zero_reduce_hidden`); DeepSpeed's overlap_comm, FSDP's.
- `param_gather_overlap` (Megatron's distributed optimizer's overlap_param_gather; ZeRO 1 /
  2): the updated parameters' all-gather runs in the next step's forward, unit by unit
  ahead of the layer that needs it: the first unit's exposed, the rest only past the
  forward of the rank's first micro-batch (`param_gather_hidden`). Not built by the
  framework (its ZeRO 1 / 2 gather after the update). ZeRO 3's per-micro-batch gathers
  overlap their compute with `zero3_prefetch` (the run's overlap_param_gather), in price.py.
"""

from __future__ import annotations

from framework.schedules import get
from framework.schedules.base import Op
from framework.sim.cost.collectives import collective_s, group_link
from framework.sim.cost.ops import block_ops
from framework.sim.cost.traffic import after_pipeline, dense_reduction, pass_collectives, rank_units
from framework.topology import ParallelDims

# the link a dimension's groups run at (edp spans dp's ranks; the tied table's pair, pp's)
LINK_OF = {"edp": "dp", "embedding": "pp"}
# a block's linears beside its tp collectives: (attention in, attention out, MLP in, MLP out)
_BESIDE = ({"qkv", "q", "kv"}, {"o"}, {"fc", "gate_up"}, {"proj", "down"})


def dims_of(job) -> ParallelDims:
    return ParallelDims(job.pp, job.dp, job.lay.tp, job.lay.ep, job.lay.cp)


def calls_s(prof, job, calls: list) -> float:
    """The calls' seconds, cp's ring passes as p2p (pp's sends are the pipeline clock's)."""
    dims = dims_of(job)
    return sum(collective_s("p2p" if c.op == "ring" else c.op, c.nbytes, c.n,
                            group_link(prof, dims, LINK_OF.get(c.dim, c.dim))) * c.calls
               for c in calls if c.op != "send" and c.n > 1 and c.calls and c.nbytes)  # no group: no link needed


def tp_hidden(prof, job, blocks: int, ph: str) -> float:
    """Seconds of one micro-batch's tp collectives a stage of `blocks` blocks hides in pass
    ph ("F" | "B") under `tp_comm_overlap` (module docstring); 0 without it."""
    if not (job.tp_comm_overlap and job.lay.sp and job.lay.tp > 1):
        return 0.0
    calls = [c for c in pass_collectives(job, 1, False, False)[ph] if c.dim == "tp"]  # one block's
    n = sum(c.calls for c in calls)
    if not n:
        return 0.0
    each = calls_s(prof, job, calls) / n
    ops = block_ops(job.shape, job.lay)
    # B's collectives are priced into I; a split schedule runs W later, so only I's GEMMs hide them
    phases = "F" if ph == "F" else ("I" if Op.W in get(job.schedule).ops else "IW")
    hidden = 0.0
    for names in _BESIDE:
        gemms = [o for o in ops if o.name in names and o.kind == "gemm"]
        if gemms:  # a MoE block's experts: no tp collective beside them here
            hidden += min(n / len(_BESIDE) * each, sum(prof.seconds(gemms, job.lay.dtype, p) for p in phases))
    return blocks * hidden


def zero_reduce_hidden(prof, job, backward_s: float) -> float:
    """pp 1, ZeRO, overlap_grad_reduce: the seconds of the step's reduce-scatters hidden
    under the backward (`backward_s`: the link's free time in one micro-batch's backward,
    its duration less ZeRO 3's gathers there: one link carries both, in turn)."""
    reduce = calls_s(prof, job, [c for c in after_pipeline(job, 0) if c.op == "reduce_scatter"])
    units, times = len(rank_units(job, 0)), 1 if job.zero == 1 else job.microbatches
    share = reduce / times / units  # one unit's reduce-scatter in one micro-batch
    return reduce - times * (share + max(0.0, (units - 1) * share - backward_s))


def chunk_reduce_after(prof, job, pred) -> float:
    """pp > 1, overlap_grad_reduce: what runs after the pipeline, the worst rank's."""
    after = 0.0
    end = max(t.end for tl in pred.timeline.values() for t in tl)
    for r, tl in pred.timeline.items():
        dense = calls_s(prof, job, [dense_reduction(job, r)] if job.zero == 0 else  # ZeRO 1: the units' reduce-scatters
                        [c for c in after_pipeline(job, r) if c.op == "reduce_scatter"])
        last = {}  # chunk -> the end of its last backward
        for t in tl:
            if t.action.op.ends_backward:
                last[t.action.chunk] = t.end
        done = 0.0
        for chunk_end in sorted(last.values()):
            done = max(done, chunk_end) + dense / len(last)
        after = max(after, calls_s(prof, job, after_pipeline(job, r)) - dense + max(0.0, done - end))
    return after


def param_gather_hidden(prof, job, compute: dict) -> float:
    """ZeRO 1 / 2 with `param_gather_overlap`: the seconds of the updated parameters'
    all-gather hidden under the next step's first forward, the worst rank's exposure
    (`compute`: (rank, chunk, op) -> seconds)."""
    if not (job.param_gather_overlap and job.zero in (1, 2) and job.dp > 1):
        return 0.0
    hidden = None
    for r in range(job.pp):
        gather = calls_s(prof, job, [c for c in after_pipeline(job, r) if c.op == "all_gather"])
        first = sum(t for (rank, _, op), t in compute.items() if rank == r and op == "F")  # micro-batch 0, each chunk
        share = gather / len(rank_units(job, r))
        mine = min(gather - share, first)
        hidden = mine if hidden is None else min(hidden, mine)
    return hidden or 0.0
