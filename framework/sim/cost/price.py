"""A layout's step on a hardware profile, from the op lists alone (no run): the composition.

Per stage and pass, an op list (ops.py) priced on the profile (hardware.py) plus the
collectives the pass waits for: tp's all-reduces (or, with sequence parallelism, its
all-gathers and reduce-scatters) and ep's all-to-alls, each on the critical path but what
`Job.tp_comm_overlap` hides (Megatron-Core's tp_comm_overlap: overlaps.py). Host time: a block's launch path (the profile's `host_us`)
either overlaps the kernels (`host_overlaps`: a GPU's asynchronous stream; the pass takes
the larger) or adds to them (a CPU, where one thread does both).
Context parallelism (traffic.py's cp collectives): the all-gather's and the all-to-all's
exposed; the ring's p2p passes, with `Job.cp_ring_overlap` (a run's
`parallelism.overlap_cp_ring`; Megatron's p2p and picotron's ring always: the default of a
Job built in code), overlap the blockwise products they feed, forward and backward: an
overlapped pass costs only what exceeds its block's attention; without it, all of it.
The pipeline: the schedule's real plan (p2p.comm_plan) through the clock (clock.py) under
NCCL's rules, p2p at the pp group's link; pp = 1 is m x (F + I + W).
After the pipeline, not overlapped with it: the dp gradient reduction (ZeRO 0 / 1: an
all-reduce; 2 / 3: a reduce-scatter) in the reduce dtype, ZeRO's all-gather of the updated
parameters (1, 2), and the optimizer step over the rank's shard. With
`Job.overlap_grad_reduce` (pp > 1: the run's `parallelism.overlap_grad_reduce`) the
dense all-reduce (ZeRO 1: the units' reduce-scatters) is cut evenly over a rank's chunks,
each part starting after its chunk's last backward in the clock's timeline (one link: in
turn); only what runs past the
pipeline's end is exposed (`comm_s["dp"]`; the hidden part in `comm_hidden_s`). With
`Job.overlap_grad_reduce` and ZeRO at pp = 1 (our ZeRO's per-unit reduce-scatter, issued
as each unit's gradients complete), in each micro-batch that reduces (ZeRO 1: the last;
2 / 3: every one) one unit's share stays exposed and the others' only what exceeds the
micro-batch's backward. ZeRO 3 gathers each chunk's parameters before every micro-batch's F
and B: added to them, or overlapping them (`Job.zero3_prefetch`: the run's
`parallelism.overlap_param_gather`, DeepSpeed's and FSDP's prefetch); ZeRO 1 / 2's gather of
the updated parameters in the next step's forward with `Job.param_gather_overlap`
(Megatron's distributed optimizer's overlap_param_gather). The overlaps' arithmetic:
overlaps.py. DualPipe's pairs
(`Job.dualpipe_overlap`): each pair's all-to-alls under the other op's compute (pairs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.schedules.p2p import comm_plan
from framework.parallel.pipeline.partition import uniform
from framework.schedules import get
from framework.schedules.base import DEFAULT
from framework.schedules.clock import Costs, predict
from framework.sim.cost.pairs import hidden_s, paired_costs
from framework.sim.cost.activations import peak_bytes, recompute_transient
from framework.sim.cost.collectives import group_link
from framework.sim.cost.overlaps import (calls_s, chunk_reduce_after, dims_of, param_gather_hidden, tp_hidden,
                                         zero_reduce_hidden)
from framework.sim.cost.traffic import Collective, after_pipeline, pass_collectives, rank_units, step_collectives
from framework.sim.cost.ops import flops, optimizer_ops, stage_ops
from framework.sim.cost.hardware import Profile
from framework.sim.cost.offload import checkpoint_copy_s, offload_step_s, param_drive_s
from framework.sim.cost.shapes import Layout, ModelShape


@dataclass(frozen=True)
class Job:
    """What is priced: a model, one micro-batch's layout, and the rest of the layout."""

    shape: ModelShape
    lay: Layout
    dp: int = 1  # the replicas, data x cp: the gradient reduction's (and ZeRO's) group
    pp: int = 1
    microbatches: int = 1
    schedule: str = DEFAULT
    virtual_stages: int = 1
    zero: int = 0
    master: bool = True  # fp32 master weights (the mixed modes)
    reduce_bytes: int = 4  # the gradient reduction's dtype (fp32 in the mixed modes)
    # ZeRO 3's all-gathers overlap the compute they feed (DeepSpeed's and FSDP's prefetch):
    # each F and B lasts max(compute, gather); false (ours): they add
    zero3_prefetch: bool = False
    overlap_grad_reduce: bool = False  # ZeRO 0, pp > 1: each chunk's dp all-reduce under the cooldown; ZeRO, pp 1:
    # each unit's reduce-scatter under the backward of the units before it
    cp_ring_overlap: bool = True  # cp's ring passes hide under their block's product (forward and backward)
    dualpipe_overlap: bool = False  # a pairs schedule (dualpipev): each pair's ep all-to-alls under the other's compute
    # Megatron-Core's tp_comm_overlap (with SP): each tp collective beside the GEMM it feeds or follows (overlaps.py)
    tp_comm_overlap: bool = False
    # Megatron's overlap_param_gather (ZeRO 1 / 2): the updated parameters gathered in the next forward (overlaps.py)
    param_gather_overlap: bool = False
    # ZeRO-Offload (parallelism.offload_optimizer): the update on the host, priced by offload.py;
    # "nvme": its states on the node's drives (parallelism.offload_device=nvme)
    offload: str = "none"  # none | cpu | nvme
    # parallelism.offload_params: ZeRO 3's parameter slices on the drives too (offload.py param_drive_s)
    offload_params: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.lay.tp  # dp: the replicas (cp included)


@dataclass
class Priced:
    step_s: float
    pipeline_s: float
    bubble: float
    comm_s: dict = field(default_factory=dict)  # dimension -> seconds on the critical path per step
    optimizer_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    tflops_per_gpu: float = 0.0  # model FLOPs (metrics/flops.py's count)
    mfu: float = 0.0
    hfu: float = 0.0  # executed FLOPs (recomputation included)
    stage_s: dict = field(default_factory=dict)  # (rank, chunk, op) -> seconds
    comm_hidden_s: dict = field(default_factory=dict)  # dimension -> seconds an overlap hid (not in comm_s)


def partition_of(t) -> str:
    """Layout.partition of a TrainerConfig: none | tp (Pa) | cpu (Pa+cpu)."""
    return ("cpu" if t.cpu_checkpointing else "tp") if t.partition_activations else "none"


def job_of(run, vocab: int) -> Job:
    """What a RunConfig prices as: its model, micro-batch, layout, schedule and precision
    (the GEMM table's dtype: the MFU peak's column, fp64 for fp64)."""
    from framework.precision import bytes_of, policy_of

    pol, p, s = policy_of(run), run.parallelism, run.schedule
    lay = Layout(run.trainer.micro_batch_size, run.data.seq_len, p.tp, p.sequence_parallel and p.tp > 1, p.ep,
                 run.trainer.activation_checkpointing, pol.gemm_dtype, bytes_of(pol.comm_dtype), p.cp, p.cp_comm,
                 run.trainer.recompute == "selective", p.cp_balance, pol.fp8, run.trainer.compile == "blocks",
                 partition_of(run.trainer))
    return Job(ModelShape.of(run.model, vocab), lay, p.replicas, p.pp, s.microbatches, s.name, s.virtual_stages, p.zero,
               pol.master_dtype is not None, bytes_of(pol.grad_reduce_dtype),
               zero3_prefetch=p.overlap_param_gather, overlap_grad_reduce=p.overlap_grad_reduce,
               cp_ring_overlap=p.overlap_cp_ring, dualpipe_overlap=p.overlap_dualpipe,
               offload=p.offload_device if p.offload_optimizer else "none",
               offload_params=p.params_on_drive)


def _combine(prof: Profile, dev: float, host: float) -> float:
    return max(dev, host) if prof.host_overlaps else dev + host


def stage_times(prof: Profile, job: Job, blocks: int, first: bool, last: bool) -> tuple[dict, float, float]:
    """({F, I, W: seconds of one micro-batch}, executed FLOPs, model FLOPs) of one stage (chunk)."""
    s, lay = job.shape, job.lay
    ops = stage_ops(s, lay, blocks, first, last)
    dev = {ph: prof.seconds(ops, lay.dtype, ph) for ph in "FIW"}
    host = prof.host_us.get(s.arch, prof.host_us.get("llama", {"F": 0.0, "B": 0.0}))
    out = {"F": _combine(prof, dev["F"], blocks * host["F"] * 1e-6)}
    back, hb = dev["I"] + dev["W"], blocks * host["B"] * 1e-6
    for ph in "IW":  # the backward's host time, split as its kernels' time
        out[ph] = _combine(prof, dev[ph], hb * (dev[ph] / back if back else 0.5))
    comm = pass_collectives(job, blocks, first, last)  # tp, ep and cp's collectives: on the critical path ...
    out["cp"] = 0.0
    out["ep_F"], out["ep_B"] = (calls_s(prof, job, [c for c in comm[ph] if c.dim == "ep"]) for ph in "FB")
    for ph, pas in (("F", "F"), ("B", "I")):
        ring = [c for c in comm[ph] if c.op == "ring"]  # ... but the ring's passes, each hidden behind
        attention = prof.seconds([o for o in ops if o.kind == "attention"], lay.dtype, pas)  # a block's product
        exposed = max(0.0, calls_s(prof, job, ring) - (attention if job.cp_ring_overlap else 0.0))
        cp = calls_s(prof, job, [c for c in comm[ph] if c.dim == "cp" and c.op != "ring"]) + exposed
        out["tp_hidden_" + ph] = tp_hidden(prof, job, blocks, ph)
        out[pas] += calls_s(prof, job, [c for c in comm[ph] if c.op != "ring"]) + exposed - out["tp_hidden_" + ph]
        out["cp"] += cp
    if lay.recompute and lay.partition == "cpu":  # Pa+cpu: each block input's slice down in F, up in B
        copy = checkpoint_copy_s(prof, -(-s.hidden * lay.tokens // lay.tp), lay.act_bytes, blocks)
        out["F"], out["I"] = out["F"] + copy, out["I"] + copy
    return out, flops(ops, model=False), flops(ops)


def price(prof: Profile, job: Job) -> Priced:
    s, lay, p, v, m = job.shape, job.lay, job.pp, job.virtual_stages, job.microbatches
    sched = get(job.schedule)
    if not sched.flushes:
        raise ValueError(f"schedule {job.schedule} never flushes: the cost model prices flushing schedules")
    smap = sched.stage_map(p, v)
    parts = uniform(s.layers, p * v)
    compute, executed, model, cp_s, ep, tp_hid = {}, 0.0, 0.0, [0.0] * p, {}, [0.0] * p
    for stage, blocks in enumerate(parts):
        t, ex, mo = stage_times(prof, job, len(blocks), stage == 0, stage == len(parts) - 1)
        r, c = smap.rank(stage), smap.chunk(stage)
        for op in "FIW":
            compute[(r, c, op)] = t[op]
        compute[(r, c, "B")] = t["I"] + t["W"]
        ep[(r, c, "F")], ep[(r, c, "B")] = t["ep_F"], t["ep_B"]
        executed, model = executed + ex * m, model + mo * m
        cp_s[r] += t["cp"] * m
        tp_hid[r] += (t["tp_hidden_F"] + t["tp_hidden_B"]) * m
    dims = dims_of(job)
    comm = _rank_comm(prof, job)
    if lay.cp > 1:  # exposed: inside F and B already; the ring's less what its products hide
        comm["cp"] = max(cp_s)
    # tp_comm_overlap: F and B are shorter by what each rank hides; reported, the least any rank hid
    hidden: dict = {"tp": min(tp_hid)} if job.tp_comm_overlap and min(tp_hid) > 0 else {}
    if "tp" in hidden:
        comm["tp"] = max(0.0, comm.get("tp", 0.0) - hidden["tp"])
    after, gather = comm.pop("after"), comm.pop("gather")
    for key in [k for k in compute if k[2] in "FIB"]:  # ZeRO 3: a chunk's parameters gathered before its F and B
        compute[key] = max(compute[key], gather) if job.zero3_prefetch else compute[key] + gather
    if p == 1:
        pipeline, bubble = m * (compute[(0, 0, "F")] + compute[(0, 0, "B")]), 0.0
        if job.overlap_grad_reduce and job.zero >= 1 and job.dp > 1:
            # the link is free for them only while it gathers nothing (ZeRO 3 gathers in each B)
            hidden["dp"] = zero_reduce_hidden(prof, job, compute[(0, 0, "B")] - gather)
            after, comm["dp"] = after - hidden["dp"], max(0.0, comm.get("dp", 0.0) - hidden["dp"])
    else:
        link = group_link(prof, dims, "pp")
        msg = lay.tokens * s.hidden * lay.act_bytes // (lay.tp if lay.sp else 1)
        costs = Costs(compute, {}, link.alpha_us * 1e-6, link.GBps * 1e9, msg)
        lists, pairs = sched.generate(p, m, v, 1), job.dualpipe_overlap and sched.pairs
        if pairs:  # DualPipe's F&B: each pair's all-to-alls under the other's compute (pairs.py)
            costs.paired = paired_costs(compute, ep, p)
            hidden["ep"] = hidden_s(compute, costs.paired, lists)
            comm["ep"] = max(0.0, comm.get("ep", 0.0) - hidden["ep"])
        pred = predict(comm_plan(lists, smap, pairs), smap, costs, True, "nccl")
        pipeline, bubble = pred.pipeline_s, pred.bubble
        if job.overlap_grad_reduce and job.zero <= 1 and job.dp > 1:
            overlapped = chunk_reduce_after(prof, job, pred)
            hidden["dp"] = max(0.0, after - overlapped)  # what leaves the critical path (the worst rank's)
            after, comm["dp"] = overlapped, max(0.0, comm.get("dp", 0.0) - hidden["dp"])
    if job.param_gather_overlap and job.zero in (1, 2) and job.dp > 1:
        hid = param_gather_hidden(prof, job, compute)
        hidden["dp"] = hidden.get("dp", 0.0) + hid
        after, comm["dp"] = after - hid, max(0.0, comm.get("dp", 0.0) - hid)
    params = max(rank_params(job, r) for r in range(p))
    shard = params / job.dp if job.zero >= 1 else params
    if job.offload != "none":  # the gradients down, the host's step (its states from the drive), the parameters up
        sharing = min(prof.gpus_per_node, job.world) if job.offload == "nvme" else 0
        opt = offload_step_s(prof, shard, lay.act_bytes, s.param_tensors() / p, sharing)
        if job.offload_params:  # the slices written after the update; read one unit ahead of each gather,
            reads, writes = param_drive_s(prof, shard, lay.act_bytes, sharing, m)  # so under the compute
            opt += writes
            exposed = max(0.0, reads - pipeline)  # where the drives are slower than the passes they hide behind
            if exposed:
                comm["nvme_params"], after = exposed, after + exposed
    else:
        opt_dev = prof.seconds(optimizer_ops(shard, lay.act_bytes, job.master), lay.dtype)
        opt = _combine(prof, opt_dev, s.param_tensors() / p * prof.host_us.get("optimizer_tensor", 0.0) * 1e-6)
    step = pipeline + after + opt
    tokens = lay.tokens * m * job.dp
    per_gpu = model * job.dp * lay.tp / step / job.world  # model FLOPs of all stages / world / step
    return Priced(step, pipeline, bubble, comm, opt, tokens / step / job.world, per_gpu / 1e12,
                  per_gpu / prof.peak(lay.dtype), executed * job.dp * lay.tp / step / job.world / prof.peak(lay.dtype),
                  compute, hidden)


def rank_params(job: Job, rank_pp: int) -> float:
    """Parameters on pipeline rank `rank_pp` (tp rank 0): its blocks, tp-sharded (experts
    ep-sharded), and its embedding or head (traffic.py's ZeRO units, unpadded)."""
    return sum(u.params for u in rank_units(job, rank_pp))


def _rank_comm(prof: Profile, job: Job) -> dict:
    """Seconds per step on the busiest pipeline rank (each key's own maximum): each
    dimension's collectives (dp with edp and the tied table's pair; p2p is part of the
    pipeline); `zero3_gather`, ZeRO 3's gathers; `after`, what runs once the pipeline is done
    (the reductions, ZeRO 1 / 2's gather); `gather`, ZeRO 3's gather before one micro-batch's
    F or B of one chunk."""
    def zero3(c: Collective) -> bool:  # (cp: stage_times', where the ring's overlap is known)
        return job.zero == 3 and c.op == "all_gather"

    out: dict = {}
    for r in range(job.pp):
        calls, after = step_collectives(job, r), after_pipeline(job, r)
        dim = {c: "dp" if c.dim in ("edp", "embedding") else c.dim for c in calls}
        mine = {k: calls_s(prof, job, [c for c in calls if dim[c] == k and not zero3(c)]) for k in ("tp", "ep", "dp")}
        mine["zero3_gather"] = calls_s(prof, job, [c for c in calls if zero3(c)])
        mine["after"] = calls_s(prof, job, [c for c in after if not zero3(c)])
        mine["gather"] = calls_s(prof, job, [c for c in after if zero3(c)]) / (2 * job.microbatches *
                                                                                job.virtual_stages)
        out = {k: max(v, out.get(k, 0.0)) for k, v in mine.items()}
    return out


def report(prof: Profile, job: Job, r: Priced, state_bytes) -> dict:
    """The dry run's `cost_model` entry: the prediction and the assumptions it used.
    `state_bytes`: model states per pipeline rank (the plan's exact formula), or one number
    for every rank. Memory per GPU: a pipeline rank's states + its saved-activation peak over
    the schedule (activations.py) + under recomputation one block's transient set; `fits`
    compares the fullest rank's with the device."""
    s, lay = job.shape, job.lay
    acts = peak_bytes(s, lay, job.pp, job.microbatches, job.schedule, job.virtual_stages)
    states = list(state_bytes) if isinstance(state_bytes, (list, tuple)) else [state_bytes] * job.pp
    transient = recompute_transient(s, lay)
    # the fullest rank's own parts (the largest states and the largest activations may be on two ranks)
    need, fullest = max((st + a + transient, r) for r, (st, a) in enumerate(zip(states, acts)))
    capacity = prof.memory_gib * 2 ** 30
    return {"hardware": prof.name, "source": prof.source, "gpus": job.world, "step_s": r.step_s,
            "pipeline_s": r.pipeline_s, "bubble": r.bubble, "comm_s": r.comm_s, "optimizer_s": r.optimizer_s,
            "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "tokens_per_s_cluster": r.tokens_per_s_per_gpu * job.world,
            "tflops_per_gpu": r.tflops_per_gpu, "mfu": r.mfu,
            "hfu": r.hfu, "model_state_bytes_max": max(states), "activation_peak_bytes_max": max(acts),
            "recompute_transient_bytes": transient, "memory_per_gpu_bytes": need, "memory_bytes": capacity,
            "memory_fullest_pp_rank": fullest, "memory_parts_bytes": {
                "model_states": states[fullest], "activations": acts[fullest], "recompute_transient": transient},
            "fits": need <= capacity, "oom_reason": None if need <= capacity else oom_reason(need, capacity),
            "dtype": job.lay.dtype,
            "comm_hidden_s": r.comm_hidden_s,
            "assumptions": "no overlap of communication with compute (but cp's ring passes"
                           f"{' and the dp reduction under backward' if r.comm_hidden_s.get('dp') else ''}"
                           f"{' and ZeRO 3 gathers under compute' if job.zero3_prefetch else ''}"
                           f"{' and tp collectives beside their GEMMs' if job.tp_comm_overlap else ''}"
                           f"{' and the parameter gather under the next forward' if job.param_gather_overlap else ''}"
                           f"{' and each DualPipe pair all-to-all under the other op' if job.dualpipe_overlap else ''}); "
                           "ring collectives; "
                           "host path "
                           f"{'overlapped with' if prof.host_overlaps else 'added to'} the kernels; memory: model "
                           "states + saved activations (framework/sim/cost/activations.py; no allocator "
                           "fragmentation, workspaces, p2p buffers or framework runtime)"
                           f"{'; ZeRO-Offload: the update on the host after the backward, the gradients down and the parameters up over the host link, on the critical path; masters and optimizer states in host memory (offload.py)' if job.offload != 'none' else ''}"
                           f"{', the states read from and written to the node drives each step, shared by its GPUs' if job.offload == 'nvme' else ''}"
                           f"{'; the parameter slices on the drives (offload_params): written after the update (in optimizer_s), read before each gather (2 x microbatches), one unit ahead, exposed only past the passes compute (comm_s nvme_params)' if job.offload_params else ''}"}


def oom_reason(need: float, capacity: float) -> str:
    return f"out of memory: {need / 2 ** 30:.1f} GiB > {capacity / 2 ** 30:.1f} GiB per GPU"
