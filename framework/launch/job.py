"""What the launching (Hydra) process does for one job: validate -> plan or prepare -> launch.

Everything that can reject a config runs here, before any rank starts: schema and
semantic validation, the device check, the data (tokenizer vocabulary, enough samples)
and the model (positions of a pretrained checkpoint).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict
from typing import Optional

import torch

from framework import checkpoint
from framework.config import ConfigError, RunConfig, to_yaml
from framework.data import prepare
from framework.device import resolve_device, threads_per_rank
from framework.report.files import write_report
from framework.launch.diagnosis import RankFailure
from framework.launch.local import launch_local
from framework.report.records import RunInfo
from framework.metrics.bubble import analytic_bubble, analytic_source
from framework.schedules import resolve
from framework.metrics.flops import active_expert_params, flops_per_token, matmul_params
from framework.metrics.peak import NO_UNIT, PENDING, device_peak, fixed_peak
from framework.models import build_hf_model, fp8, with_pretrained_sizes
from framework.launch.plan import make_plan, render_plan
from framework.precision import policy_of
from framework.report.closing import summary_lines
from framework.launch.jobdir import completed_summary, set_aside_checkpoints, write_outcome
from framework.report.files import set_aside_previous
from framework.train.signals import Stopped
from framework.sim.sweep import predict_job
from framework.metrics.calibrate import read_calibration
from framework.sim.cli import describe, fill_measured_times, what_if
from framework.sim.source import predicts
from framework.validate import check_job_dir, validate, validate_model


def meta_model(run: RunConfig, vocab_size: int):
    """The transformers model on the meta device: shapes and counts without memory."""
    if run.model.pretrained:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run.model.pretrained))
    return build_hf_model(run.model, vocab_size, run.trainer.seed, device="meta")


def _peak(run: RunConfig, device_type: str) -> tuple[Optional[float], str]:
    """fp64 / config / the cached CPU probe here; a CUDA peak is left pending for the ranks
    (framework/metrics/peak.py), since looking up the GPU here would create a CUDA context."""
    fixed = fixed_peak(run)
    if fixed is not None:
        return fixed
    if device_type == "cuda":
        return None, PENDING
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(run.world_size, run.trainer.cpu_threads_per_rank))  # one rank's
    try:
        return device_peak(run.trainer.precision, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def run_info(run: RunConfig, device_type: str, job_dir: Optional[str] = None) -> RunInfo:
    """`job_dir`: where trainer.resume=auto looks (None: no resume)."""
    resume = checkpoint.resolve_resume(run, job_dir) if job_dir else None  # before the data: fails fast
    prepared = prepare(run)
    vocab = run.model.vocab_size or prepared.vocab_size
    model = meta_model(run, vocab)
    validate_model(run, model)  # positions, tp sizes, stage partition
    c = model.config
    fpt = flops_per_token(matmul_params(model), c.num_hidden_layers, c.hidden_size, run.data.seq_len)
    peak, source = _peak(run, device_type)
    s = run.schedule
    sched, pp = resolve(s), run.parallelism.pp
    bubble = analytic_bubble(sched, pp, s.microbatches, s.virtual_stages, run.trainer.steps)
    if resume is not None:
        checkpoint.check_compatible(run, resume, vocab, model)  # every recorded size, every stored shape
    if job_dir:
        set_aside_checkpoints(job_dir, resume)
    return RunInfo(prepared.tokens_path, prepared.vocab_size, prepared.num_samples, fpt, peak, source, bubble,
                   resume_from=resume, val_tokens_path=prepared.val_tokens_path,
                   val_num_samples=prepared.val_num_samples,
                   model_params=sum(p.numel() for p in model.parameters()),  # unique: a tied weight once
                   p2p_message_bytes=p2p_message_bytes(run, c.hidden_size),
                   expert_flops_per_token=6.0 * active_expert_params(model),
                   bubble_analytic_source=analytic_source(sched, pp, s.microbatches, s.virtual_stages))


def p2p_message_bytes(run: RunConfig, hidden: int) -> int:
    """One pipeline message (an activation or its gradient): micro_batch_size x seq_len
    (/ tp under sequence parallelism) x hidden, in fp32 (fp64 when verifying)."""
    p = run.parallelism
    seq = run.data.seq_len // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    return run.trainer.micro_batch_size * seq * hidden * policy_of(run).comm_bytes


def startup_banner(run: RunConfig, info: RunInfo, device_type: str) -> str:
    t, p = run.trainer, run.parallelism
    per_dp_rank = t.micro_batch_size * run.schedule.microbatches
    assert per_dp_rank * p.dp == run.global_batch
    derived = " (trainer.global_batch_size)" if t.global_batch_size is not None else ""
    return (f"world {run.world_size} = {world_factors(p)} on {device_type} | "
            f"model {_model_text(run, info)} | data {run.data.name} ({info.num_samples} x {run.data.seq_len} tokens)\n"
            f"global batch {run.global_batch} seqs{derived} = micro_batch_size {t.micro_batch_size} x microbatches "
            f"{run.schedule.microbatches} x dp {p.dp} | {run.tokens_per_step} tokens/step | "
            f"{info.flops_per_token / 1e6:.2f} MFLOP/token | {_peak_text(info)}{_resume_text(info)}")


def world_factors(p) -> str:
    """The factors whose product is the world: cp when it cuts sequences (ep lives inside dp)."""
    cp = f" x cp {p.cp}" if p.cp > 1 else ""
    ep = f" (ep {p.ep} within dp x cp)" if p.ep > 1 else ""
    return f"dp {p.dp}{cp} x tp {p.tp} x pp {p.pp}{ep}"


def _resume_text(info: RunInfo) -> str:
    if not info.resume_from:
        return ""
    k = checkpoint.read_meta(info.resume_from)["step"]
    return f"\nresuming from {info.resume_from} (saved after step {k}): continuing at step {k + 1}"


def _model_text(run: RunConfig, info: RunInfo) -> str:
    m = run.model
    source = (f"weights from {info.resume_from}" if info.resume_from else f"from {m.pretrained}" if m.pretrained
              else "random init")
    return (f"{m.name} ({m.arch}, {m.n_layer} layers, n_embd {m.n_embd}, {m.n_head} heads, "
            f"vocab {m.vocab_size or 'of the data'}; {source})")


def _peak_text(info: RunInfo) -> str:
    if info.peak_source == PENDING:
        return "peak: each rank looks up its GPU's datasheet peak"
    if info.peak_source.startswith(NO_UNIT):
        return f"WARNING: no MFU ({info.peak_source})"
    if info.peak_flops_per_rank is None:
        return "no MFU (fp64 has no peak to compare with)"
    return f"peak {info.peak_flops_per_rank / 1e12:.3f} TFLOP/s per rank ({info.peak_source})"


def write_job_files(run: RunConfig, info: RunInfo, job_dir: str) -> None:
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(run))
    with open(os.path.join(job_dir, "run_info.json"), "w") as f:
        json.dump(asdict(info), f, indent=2)


def sim_inputs(run: RunConfig) -> None:
    """sim.from feeds a schedule that builds from measured times (zb-auto) before validation
    proves its lists; a bad sim.from is a ConfigError here, before any rank starts. Its
    calibration.json is read (bounded, checked) first, so no later reader of it (zb-auto's
    times, the dry run's prediction, search.mode=simulate) meets a bad one."""
    if run.sim.source:
        read_calibration(run.sim.source)
        fill_measured_times(run, run.sim.source)


def dry_run(run: RunConfig, job_dir: str) -> dict:
    vocab = run.model.vocab_size or _vocab_without_data(run)
    model = meta_model(run, vocab)
    plan = make_plan(run, model, validate_model(run, model))
    note = None
    if run.sim.source and predicts(run.sim.source, run):  # the simulator's prediction of this layout
        result = what_if(run.sim.source, target=run)  # refused when the run does other work than the job
        result.pop("_predicted")
        plan["simulated"] = result
    elif run.sim.source:
        note = (f"note: no prediction: sim.from={run.sim.source} is a "
                f"{'pipeline job: it predicts pipelines' if run.parallelism.pp == 1 else 'pp = 1 job: it predicts pp = 1'}"
                f" only, and this run has parallelism.pp={run.parallelism.pp}")
    if run.hardware.name != "none":  # the cost model's price of this layout (docs/cost_model.md)
        plan["cost_model"] = cost_model(run, vocab, plan)
    print(render_plan(plan))
    if "simulated" in plan:
        print(describe(plan["simulated"]))
    if "cost_model" in plan:
        from framework.sim.cost.describe import describe as describe_cost

        print(describe_cost(plan["cost_model"]))
    if note:
        print(note)
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
    return plan


def cost_model(run: RunConfig, vocab: int, plan: dict) -> dict:
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import job_of, price, report

    prof, job = Profile.of(run.hardware), job_of(run, vocab)
    states = [max(m["model_state_bytes"] for m in plan["memory_estimate_per_rank"] if m["pp_rank"] == r)
              for r in range(run.parallelism.pp)]
    return report(prof, job, price(prof, job), states)


def check_memory_budget(run: RunConfig) -> Optional[int]:
    """search.memory_budget_bytes: a layout whose fullest rank the dry-run planner (model on
    the meta device, no data, no rank) puts above the budget is rejected here, so a search
    never launches it. The estimate is model states only (parameters, gradients, optimizer
    states, ZeRO-sharded, tp shards exact); activations are not in it (search.mode=simulate
    adds the simulator's activation peak, framework/sim/sweep.py). Returns the estimate
    (None when neither a budget nor the simulate mode asks for it)."""
    budget = run.search.memory_budget_bytes
    if budget is None and (run.search.mode != "simulate" or run.hardware.name != "none"):
        return None  # a cluster's search prices memory from shapes (framework/sim/cost/plan.py): no build
    vocab = run.model.vocab_size or _vocab_without_data(run)
    model = meta_model(run, vocab)
    plan = make_plan(run, model, validate_model(run, model))
    need = max(m["model_state_bytes"] for m in plan["memory_estimate_per_rank"])
    if budget is not None and need > budget:
        raise ConfigError("search.memory_budget_bytes", budget,
                          f"the dry-run planner puts {need:,} bytes ({need / 2**20:.1f} MiB) of model states "
                          f"(parameters, gradients, optimizer states; activations not counted) on the fullest rank of "
                          f"dp {run.parallelism.dp} x tp {run.parallelism.tp} x pp {run.parallelism.pp}, "
                          f"zero {run.parallelism.zero}",
                          "raise the budget, or a layout that shards more (tp, pp, parallelism.zero)")
    return need


def _vocab_without_data(run: RunConfig) -> int:
    from framework.data import get_tokenizer

    return run.data.vocab_size if run.data.name == "synthetic" else get_tokenizer(run.data.tokenizer).vocab_size


def run_job(run: RunConfig, job_dir: str, set_aside: bool = True) -> Optional[dict]:
    """Validate, then dry-run, prepare for an external launcher, or launch locally.
    However it ends, the job directory says so (`write_outcome`) and holds no earlier
    run's results (`set_aside_previous`). `set_aside=False`: the caller did that already
    (run.py, before its console went to run.log: a run.log found now is this run's own)."""
    if (done := checkpoint.finished(run, job_dir)) is not None:
        print(f"{job_dir}: finished already ({done['steps']} of trainer.steps={run.trainer.steps} steps, "
              "summary.json completed): nothing to run", flush=True)
        return done
    if set_aside:
        set_aside_previous(job_dir)
    try:
        check_job_dir(job_dir)
        sim_inputs(run)
        validate(run)
        if run.model.pretrained:
            run.model = with_pretrained_sizes(run.model)
        model_states = check_memory_budget(run)
        if run.dry_run:
            return dry_run(run, job_dir)
        if run.search.mode == "simulate":  # predicted, not run (framework/sim/sweep.py)
            result = predict_job(run, job_dir, model_states, run.model.vocab_size or _vocab_without_data(run))
            print(describe(result) if "hardware" not in result else result["line"], flush=True)
            return result
        device_type = resolve_device(run.device)
        info = run_info(run, device_type, job_dir)
    except ConfigError as e:
        write_outcome(job_dir, "rejected", str(e))
        raise
    write_job_files(run, info, job_dir)
    print(f"job directory {os.path.abspath(job_dir)}", flush=True)
    print(startup_banner(run, info, device_type), flush=True)
    cores = os.cpu_count() or 1
    if device_type == "cpu" and run.launcher == "local" and run.world_size > cores:
        print(f"WARNING: {run.world_size} ranks on {cores} CPU cores: the ranks take turns on the cores, so step "
              "times include waiting for one; compare layouts of the same rank count (docs/sweeps.md)", flush=True)
    fp8_note = fp8.note(run.precision.fp8, run.model.n_embd, device_type)
    if fp8_note:
        print(f"NOTE: {fp8_note}", flush=True)
    if run.launcher == "external":
        print(f"launch the {run.world_size} ranks with, on each node (this job directory on a filesystem every node "
              "sees; torchrun's options, docs/multinode.md):\n  python -m framework.launch.node --nnodes=<N> "
              f"--nproc-per-node=<{run.world_size} / N> --rdzv-backend=c10d --rdzv-endpoint=<host:port> "
              f"{shlex.quote(job_dir)}\n(plain `torchrun <the same options> -m framework.worker {shlex.quote(job_dir)}` "
              "runs the ranks too, but writes no summary.json or error.txt when one fails)")
        return None
    try:
        summary = launch_local(run, job_dir, info)
    except RankFailure as e:
        write_report(os.path.join(job_dir, "error.txt"), str(e))
        print(str(e), file=sys.stderr, flush=True)
        write_outcome(job_dir, "failed", e.reason)
        raise
    except Stopped as e:
        if (summary := completed_summary(job_dir)) is None:
            write_outcome(job_dir, "interrupted", f"stopped by {e.name}")
            raise
        print(f"stopped by {e.name} after the last step: the job completed", flush=True)
    print(summary_lines(summary), flush=True)
    print(f"results in {os.path.abspath(job_dir)}: summary.json, metrics.jsonl, run.log"
          + (", trace.json, timeline.png" if run.parallelism.pp > 1 else ""), flush=True)
    return summary
