"""The dry run: rank layout, stage contents, the schedule's bubble (its closed form or its
schedule model) and a per-rank memory estimate.

Pure planning, no process group and no real tensors (the model is built on the meta
device), so it works for world sizes far beyond the machine it runs on.

Memory estimate per rank, model states only (activations depend on the schedule and are
measured in real runs): the parameters of the rank's stage, counted per tp rank exactly as
the TP plan shards them (matrices and column biases split, vocabulary padded to a multiple
of tp, norms and row biases whole); gradients the same size; optimizer states = parameters x the optimizer's state
ratio, found by stepping the configured optimizer once on a small tensor. A tied
embedding sits on the first and the last stage, as in Megatron.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from framework.config import RunConfig
from framework.metrics.bubble import analytic_bubble, analytic_label, analytic_source
from framework.models import ARCHS
from framework.metrics.model_states import config_model_states, optimizer_state_ratio, paper_form, zero_model_states
from framework.comm.tensor_parallel import shard_numels
from framework.schedules import resolve
from framework.schedules.clock import grid
from framework.precision import bytes_of, policy_of
from framework.topology import Coords, ParallelDims

MAX_DRAWN = {"pp": 4, "dp": 8, "tp": 8}


def _counter(run: RunConfig, hf_model: nn.Module, experts_only: bool = False):
    """Elements of a module's parameters on one tp (and ep) rank; `experts_only`: of its
    routed experts only (split over ep, and ZeRO-sharded over edp)."""
    tp, ep = run.parallelism.tp, run.parallelism.ep
    shards = shard_numels(hf_model, ARCHS[run.model.arch].TP_PLAN, tp) if tp > 1 else {}
    experts = {id(q) for m in hf_model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")
               for q in m.parameters()}
    for q in hf_model.parameters():
        if id(q) in experts:
            shards[id(q)] = q.numel() // ep
    return lambda params: sum(shards.get(id(q), q.numel()) for q in params if not experts_only or id(q) in experts)


def stage_table(run: RunConfig, hf_model: nn.Module, ranges: list[range]) -> list[dict]:
    split = ARCHS[run.model.arch].split(hf_model)
    count, count_experts = _counter(run, hf_model), _counter(run, hf_model, experts_only=True)
    emb, head = count(split.embedding.parameters()), count(split.head.parameters())
    out_w = count([hf_model.get_output_embeddings().weight])
    tied = run.model.tie_embeddings
    if tied:  # lm_head shares the embedding weight: parameters() of head already counted it
        head -= out_w
    stages = []
    smap = resolve(run.schedule).stage_map(run.parallelism.pp, run.schedule.virtual_stages)
    for s, r in enumerate(ranges):
        first, last = s == 0, s == len(ranges) - 1
        n = sum(count(split.blocks[i].parameters()) for i in r) + (emb if first else 0)
        if last:  # a tied weight on a rank that also holds the first stage (a V) is counted there
            n += head + (out_w if tied and not first and smap.rank(s) != 0 else 0)
        stages.append({"stage": s, "pp_rank": smap.rank(s), "chunk": smap.chunk(s), "blocks": [r.start, r.stop - 1],
                       "embedding": first, "head": last, "params": n,
                       "expert_params": sum(count_experts(split.blocks[i].parameters()) for i in r)})
    return stages


def draw_layout(dims: ParallelDims) -> str:
    """Rank numbers per pipeline stage as a dp x tp grid (the cube of Megatron's docstring, sliced)."""
    cp = f", cp={dims.cp}" if dims.cp > 1 else ""  # cp inside the replica coordinate (topology.py)
    out = [f"ranks = arange({dims.world_size}).view(pp={dims.pp}, dp={dims.data}{cp}, tp={dims.tp})"]
    width = len(str(dims.world_size - 1))
    for pp in range(min(dims.pp, MAX_DRAWN["pp"])):
        out.append(f"pp stage {pp}:" + " " * 4 + "  ".join(f"tp{t:<{width - 1}}" for t in range(min(dims.tp, MAX_DRAWN["tp"]))))
        for dp in range(min(dims.dp, MAX_DRAWN["dp"])):
            ranks = [(pp * dims.dp + dp) * dims.tp + t for t in range(min(dims.tp, MAX_DRAWN["tp"]))]
            more = " ..." if dims.tp > MAX_DRAWN["tp"] else ""
            row = f"dp {dims.data_rank(Coords(pp, dp, 0)):<{len(str(dims.data))}}" + (
                f" cp {dp % dims.cp}" if dims.cp > 1 else "")
            out.append(f"  {row} [ " + "  ".join(f"{r:>{max(width, 3)}}" for r in ranks) + f" ]{more}")
        if dims.dp > MAX_DRAWN["dp"]:
            out.append(f"  ... {dims.dp - MAX_DRAWN['dp']} more dp rows")
    if dims.pp > MAX_DRAWN["pp"]:
        out.append(f"... {dims.pp - MAX_DRAWN['pp']} more pipeline stages")
    return "\n".join(out)


def make_plan(run: RunConfig, hf_model: nn.Module, ranges: list[range]) -> dict:
    p, s = run.parallelism, run.schedule
    dims = ParallelDims.of(p)
    stages = stage_table(run, hf_model, ranges)
    ratio = optimizer_state_ratio(run.optimizer)
    memory = []
    for rank in range(p.pp):  # a rank holds its v chunks
        n = sum(st["params"] for st in stages if st["pp_rank"] == rank)
        e = sum(st["expert_params"] for st in stages if st["pp_rank"] == rank)  # of n; sharded over edp
        # This configuration's formula (the precision policy's dtypes, master copies, ZeRO over
        # dp, the experts' over edp) for the rank's n parameters, as one unit each: no per-unit
        # padding, no step counters (each under dp elements / a few bytes per tensor;
        # summary.json has the exact value).
        est = {k: a + b for (k, a), b in zip(
            config_model_states(p.zero, [n - e], p.replicas, policy_of(run), ratio, offload=p.offload_optimizer).items(),
            config_model_states(p.zero, [e], p.dp // p.ep, policy_of(run), ratio,
                                offload=p.offload_optimizer).values(), strict=True)}
        policy, word = policy_of(run), bytes_of(policy_of(run).state_dtype)
        bf16, paper = (sum(zero_model_states(p.zero, n - e, p.replicas, ratio, bf16=mixed, word=word).values()) +
                       sum(zero_model_states(p.zero, e, p.dp // p.ep, ratio, bf16=mixed, word=word).values())
                       for mixed in (True, policy.mixed))  # the run's own form: 2+2+12 mixed, else 4+4+8 (8+8+16)
        memory.append({"pp_rank": rank, "psi": n, "expert_psi": e, **est, "model_state_bytes": sum(est.values()),
                       "model_state_formula_bf16_bytes": int(bf16), "model_state_formula_paper_bytes": int(paper)})
    sched = resolve(s)
    activations, transient, why = _activations(run, hf_model, ranges, sched)
    for mem, act in zip(memory, activations or [None] * p.pp):
        mem["activation_bytes"] = act  # saved activations' peak (framework/sim/cost/activations.py) + transient
        mem["recompute_transient_bytes"] = transient if act is not None else None  # named: the line's parts add up
    lists = sched.generate(p.pp, s.microbatches, s.virtual_stages, 2)
    smap = sched.stage_map(p.pp, s.virtual_stages)
    schedule_grid = grid(lists, smap) if p.pp > 1 else ""  # async: its first two steps
    return {
        "world_size": dims.world_size, "dims": {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp, "ep": p.ep},
        "zero": p.zero,
        "precision": policy_of(run).mode,
        "groups": {d: dims.groups(d) for d in ("tp", "dp", "pp") + (("ep", "edp") if p.ep > 1 else ())
                   + (("cp",) if p.cp > 1 else ())},
        "layout": draw_layout(dims),
        "stages": stages, "schedule": {"name": s.name, "microbatches": s.microbatches,
                                       "virtual_stages": s.virtual_stages},
        "bubble_fraction_analytic": analytic_bubble(sched, p.pp, s.microbatches, s.virtual_stages,
                                                    run.trainer.steps),
        "bubble_analytic_source": analytic_source(sched, p.pp, s.microbatches, s.virtual_stages),
        "schedule_grid": schedule_grid,
        "global_batch": run.global_batch, "tokens_per_step": run.tokens_per_step,
        "optimizer_state_ratio": ratio, "memory_estimate_per_rank": memory,
        "activation_estimate": why,
    }


def _activations(run: RunConfig, hf_model: nn.Module, ranges: list[range], sched) -> tuple[Optional[list], float, str]:
    """Each pipeline rank's saved-activation peak by the cost model's activation model (the
    tensors autograd keeps in this framework's models, over the schedule's action list) plus
    under recomputation one block's recomputed set (also returned alone), and what it
    assumes, or None and why it has no estimate."""
    from framework.sim.cost.activations import peak_bytes, recompute_transient
    from framework.sim.cost.price import job_of

    p, s = run.parallelism, run.schedule
    try:
        job = job_of(run, hf_model.config.vocab_size)
        peaks = peak_bytes(job.shape, job.lay, p.pp, s.microbatches, sched, s.virtual_stages, [len(r) for r in ranges])
    except (ValueError, TypeError) as e:
        return None, 0.0, f"not estimated: {e}"
    extra = recompute_transient(job.shape, job.lay)
    return [a + extra for a in peaks], extra, ("saved tensors at their peak over the schedule" + (
        ", plus one block's recomputed set" if extra else "") + "; no p2p buffers, workspaces or fragmentation")


def _activation_text(mem: dict) -> str:
    """A rank's activations, the recomputed block's set named apart so the parts add up."""
    extra = mem.get("recompute_transient_bytes") or 0
    return f"activations {mem['activation_bytes'] / 2**20:.1f} MiB" + (
        f" (saved {(mem['activation_bytes'] - extra) / 2**20:.1f} + one block's recomputed set {extra / 2**20:.1f})"
        if extra else "")


def render_plan(plan: dict) -> str:
    cp = f"cp {plan['dims']['cp']} x " if plan["dims"].get("cp", 1) > 1 else ""
    lines = [f"dry run: {plan['world_size']} ranks (pp {plan['dims']['pp']} x dp {plan['dims']['dp']} x {cp}"
             f"tp {plan['dims']['tp']}), no rank started", plan["layout"], "", "groups (first 4 of each):"]
    for d, gs in plan["groups"].items():
        lines.append(f"  {d}: {len(gs)} groups of {len(gs[0])}: " + " ".join(str(g) for g in gs[:4]) + (" ..." if len(gs) > 4 else ""))
    lines.append("stages:")
    for st in plan["stages"]:
        parts = (["embedding"] if st["embedding"] else []) + [f"blocks {st['blocks'][0]}-{st['blocks'][1]}"] + (["head"] if st["head"] else [])
        lines.append(f"  stage {st['stage']} (pp rank {st['pp_rank']}, chunk {st['chunk']}): {' + '.join(parts)} "
                     f"| {st['params'] / 1e6:.2f}M params" + (f" per tp rank (tp {plan['dims']['tp']})"
                                                              if plan["dims"]["tp"] > 1 else ""))
    for mem in plan["memory_estimate_per_rank"]:
        lines.append(f"  pp rank {mem['pp_rank']} per rank est.: params {mem['params_bytes'] / 2**20:.1f} MiB, "
                     f"grads {mem['grads_bytes'] / 2**20:.1f} MiB, master {mem['master_bytes'] / 2**20:.1f} MiB, "
                     f"optimizer {mem['optimizer_bytes'] / 2**20:.1f} MiB (ZeRO-{plan['zero']}, {plan['precision']}; "
                     f"the paper's {paper_form(plan['precision'])} form "
                     f"{mem.get('model_state_formula_paper_bytes', mem['model_state_formula_bf16_bytes']) / 2**20:.1f}"
                     " MiB in all), "
                     + (_activation_text(mem) if mem.get("activation_bytes") is not None
                        else "activations not estimated"))
    if plan.get("activation_estimate"):  # absent from a plan.json written before the estimate existed
        lines.append(f"  activations: {plan['activation_estimate']}")
    s = plan["schedule"]
    lines.append(f"schedule {s['name']}: {s['microbatches']} micro-batches, {s['virtual_stages']} virtual stage(s); "
                 f"{analytic_label(plan['bubble_analytic_source'])} bubble {plan['bubble_fraction_analytic']:.3f} "
                 "at T_F = T_I = T_W")
    if plan["schedule_grid"]:
        lines.append("schedule grid (unit-time simulation; . = idle):\n" + plan["schedule_grid"])
    lines.append(f"global batch {plan['global_batch']} sequences = {plan['tokens_per_step']} tokens/step")
    return "\n".join(lines)
