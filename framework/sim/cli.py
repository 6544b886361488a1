"""Predict a pipeline layout from one finished job, without running it:

    python -m framework.simulate <job dir> [schedule=NAME] [schedule.microbatches=M]
                                 [schedule.virtual_stages=V] [parallelism.pp=P] [parallelism.ep=E]
                                 [--png FILE] [--json]
With no job: `--op-times F=..,B=..,W=..[,comm=..] schedule=NAME parallelism.pp=P
schedule.microbatches=M` (sim/optimes.py), or `hardware=PROFILE [run.py's overrides]` (sim/cost/plan.py).

The job's calibration.json (every pipeline run writes it: per-stage op durations, host gap,
link latency, time outside the pipeline, activation bytes; framework/metrics/calibrate.py)
is rescaled to the target partition (framework/sim/whatif.py) and the target schedule's
real plan is run through the clock (framework/schedules/clock.py). Prints the
predicted step time, bubble and activation peak per rank; `--png` draws the predicted
Gantt chart. With no override it replays the job itself (`replay: true`: its own durations
on its own layout, beside its measurement; a prediction is of a layout not run).
Only the layout changes: a target whose work per op differs from the job's (another model,
micro-batch size, sequence length, precision, tp) is refused, naming the key
(framework/sim/source.py), since the job's durations do not carry over to it.
`dry_run=true sim.from=<job dir>` puts the same prediction in the dry-run plan;
`search.mode=simulate` ranks a sweep's candidates by it (docs/simulator.md).

`parallelism.ep` (MoE models): each stage's forward and backward move by the all-to-all of
the target ep minus the job's (framework/sim/alltoall.py: its volume, and its time from
the job's own all-to-all when it ran with ep > 1, else from the p2p link). Expert compute per
rank is unchanged by ep in expectation: a rank's experts are E / ep of them, but the ep ranks'
tokens are redistributed to them, so each rank still runs N x k assignments per micro-batch.
A pp = 1 job (written with ep > 1) has no per-stage times: it predicts pp = 1 layouts only
(ep, micro-batches), its fwd/bwd scaled by micro-batches plus the all-to-all change.

This file is past ~300 lines on purpose: one parser and one error path for its three modes;
the no-job modes' work lives in their own modules (above), the what-if's here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config import ConfigError, RunConfig, check_overrides, load_config
from framework.commands import MOST_MICROBATCHES, OutputPath, Parser, command
from framework.sim.alltoall import A2ACost, cost_of, moe_layers, shift_stages, step_bytes
from framework.metrics.calibrate import Calibration
from framework.metrics.replay import Predicted, breakdown_of, flat_replay, replay, rules_for, timeline_records
from framework.sim.source import UNSCALED, check_same_work, load_job, other_work
from framework.sim.whatif import rescale
from framework.models import meta_hf_model
from framework.schedules import get, load_modules, names, resolve
from framework.validate import validate_model
from framework.validate.common import suggest
from framework.validate.ranges import check_ranges
from framework.validate.expert import check_expert_parallel

KEYS = ("schedule", "schedule.name", "schedule.microbatches", "schedule.virtual_stages", "parallelism.pp",
        "parallelism.partition", "parallelism.ep")


def target_config(src: RunConfig, overrides: list[str], check: bool = True, job_dir: str = "") -> RunConfig:
    """The job's config with the layout overrides (`schedule=NAME` picks the schedule and its
    preset virtual-stage count, as the Hydra group does). `check`: a size the job derives
    (trainer.global_batch_size) and an override contradicts is an error, as in run.py."""
    dot = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if key not in KEYS:
            _not_a_layout_key(src, job_dir, key, value)
        if not sep:
            raise ConfigError(key, None, "has no value", f"write {key}=<value>")
        if key in ("schedule", "schedule.name"):
            _known_schedule(key, value, src)
            dot.append(f"schedule.name={value}")
            if not any(o.startswith("schedule.virtual_stages=") for o in overrides):
                dot.append(f"schedule.virtual_stages={get(value).preset_chunks}")
        else:
            dot.append(item)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(src), OmegaConf.from_dotlist(dot))
    except OmegaConfBaseException as e:  # a value of the wrong type (schedule.microbatches=abc)
        key = getattr(e, "full_key", None) or "overrides"
        raise ConfigError(key, next((v for k, _, v in (o.partition("=") for o in dot) if k == key), None),
                          f"does not fit the schema ({str(e).splitlines()[0]})",
                          "give the key a value of its type (docs/configuration.md)") from None
    dst = load_config(cfg)
    check_ranges(dst)  # every key's rule (framework/config/), as run.py checks it
    if dst.schedule.microbatches > MOST_MICROBATCHES:  # the clock replays every one of them
        raise ConfigError("schedule.microbatches", dst.schedule.microbatches,
                          f"is more than {MOST_MICROBATCHES:,} (the simulator replays each micro-batch)",
                          f"give 1 to {MOST_MICROBATCHES:,}")
    if check:
        check_overrides(dst, dot)
    if (dst.parallelism.pp, dst.parallelism.partition) != (src.parallelism.pp, src.parallelism.partition):
        dst.schedule.op_times = None  # per-rank times of another pipeline: measured again (fill_measured_times)
    return dst


def _not_a_layout_key(src: RunConfig, job_dir: str, key: str, value: str) -> None:
    """An override the simulator does not take: empty, a key that changes the work per op
    (the job's durations do not carry over: framework/sim/source.py UNSCALED), or another key."""
    if not key:
        raise ConfigError("overrides", value or "", "an override without a key",
                          f"use key=value with one of {', '.join(KEYS)}")
    if any(key == p or key.startswith(p + ".") for p in UNSCALED):
        old = OmegaConf.select(OmegaConf.structured(src), key, default=None)
        raise other_work(job_dir or "(the job)", key, f"{key}={old}", _typed(value))
    close = suggest(key, list(KEYS))
    raise ConfigError(key, value or None, "is not a layout key the simulator rescales"
                      + (f". Did you mean {' or '.join(close)}?" if close else ""),
                      f"use key=value with one of {', '.join(KEYS)}")


def _typed(value: str):
    """An override's value as Hydra would read it (256, not '256'), for the message."""
    try:
        return yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        return value


def _known_schedule(key: str, name: str, src: RunConfig | None) -> None:
    if src is not None:
        load_modules(src.schedule.modules)  # the job's own schedules may register more
    if name not in names():
        close = suggest(name, names())
        raise ConfigError(key, name, "no such schedule" + (f". Did you mean {' or '.join(close)}?" if close else ""),
                          f"use one of {', '.join(names())} (python -m framework.schedules list)")


def _blocks(run: RunConfig, vocab: int) -> list[int]:
    return [len(r) for r in validate_model(run, meta_hf_model(run.model, vocab))]


def what_if(job_dir: str, overrides: list[str] | None = None, target: RunConfig | None = None) -> dict:
    """The prediction of `target` (or the job's config with `overrides`) from the job's
    calibration: a dict of predicted keys, and the `Predicted` under "_predicted"."""
    src, info, cal, summary = load_job(job_dir)
    dst = target or target_config(src, overrides or [], job_dir=job_dir)
    check_same_work(job_dir, src, info, dst)
    check_expert_parallel(dst)
    if cal.fwd_bwd_s is not None:
        return {**_flat_what_if(job_dir, src, cal, dst), **_rank_note(src, dst, summary)}
    p, m, v = dst.parallelism.pp, dst.schedule.microbatches, dst.schedule.virtual_stages
    sp, sv = src.parallelism.pp, src.schedule.virtual_stages
    if p < 2:
        raise ConfigError("sim.from", job_dir, f"is a pipeline job (parallelism.pp={sp}): its per-stage times "
                          f"predict pipelines (parallelism.pp >= 2), not parallelism.pp={p}",
                          "to predict a pp = 1 layout give sim.from a pp = 1 job run with parallelism.ep > 1 (it "
                          "writes calibration.json), or predict parallelism.pp >= 2")
    fill_measured_times(dst, job_dir)
    sched = resolve(dst.schedule)
    bad = sched.why_not(p, m, v)
    if bad is not None:
        raise ConfigError(bad.key, {"schedule.microbatches": m, "schedule.virtual_stages": v}.get(bad.key, p),
                          bad.reason, bad.fix)
    vocab = src.model.vocab_size or info["vocab_size"]
    blocks = _target_blocks(dst, vocab, overrides or [])
    new = rescale(cal, resolve(src.schedule), sp, sv, _blocks(src, vocab), sched, p, v, blocks)
    same = (sp, src.schedule.name, sv, src.parallelism.partition) == (p, dst.schedule.name, v, dst.parallelism.partition)
    used = cal if same else new  # the job's own layout: its own per-stage durations, no rescaling
    tmap = sched.stage_map(p, v)
    rank_layers = max(sum(blocks[tmap.stage(r, c)] for c in range(v)) for r in range(p))  # every block is MoE
    a2a = _a2a(job_dir, src, cal, dst, rank_layers)
    if a2a["changed"]:  # another ep: each stage's F and backward carry its MoE layers' all-to-all change
        used = shift_stages(used, tmap.stage, blocks, a2a["delta"])
    pred = replay(used, sched, p, m, v, dst.trainer.steps, rules_for(summary.get("device", "cpu")))
    own = same and m == src.schedule.microbatches and not a2a["changed"]  # the job's own layout: a replay
    result = {**_result(job_dir, dst, pred, not same or a2a["changed"], a2a, own), **_rank_note(src, dst, summary)}
    if sched.flushes:  # the step cut as the measured one is (replay.py's breakdown_of)
        result.update({f"predicted_time_{k}_s": v for k, v in breakdown_of(pred, used, tmap).items()})
    return result


def _target_blocks(dst: RunConfig, vocab: int, overrides: list[str]) -> list[int]:
    """Blocks per stage of the target. A what-if that changed the stage count (parallelism.pp,
    the schedule's virtual stages) so that the job's partition no longer fits names the key
    that was changed, not parallelism.partition, which the user did not touch."""
    try:
        return _blocks(dst, vocab)
    except ConfigError as e:
        given = dict(o.partition("=")[::2] for o in overrides)
        changed = next((k for k in ("parallelism.pp", "schedule.virtual_stages", "schedule", "schedule.name")
                        if k in given), None)
        if e.key != "parallelism.partition" or "parallelism.partition" in given or changed is None:
            raise
        problem = str(e).split(": ", 1)[1].rsplit(". Fix: ", 1)[0]
        p, v = dst.parallelism.pp, dst.schedule.virtual_stages
        value = {"parallelism.pp": p, "schedule.virtual_stages": v}.get(changed, given[changed])
        raise ConfigError(changed, value, f"makes {p * v} pipeline stages (parallelism.pp x "
                          f"schedule.virtual_stages = {p} x {v}), and the job's parallelism.partition="
                          f"{dst.parallelism.partition!r} gives: {problem}",
                          f"use at most {dst.model.n_layer} stages in all (model.n_layer={dst.model.n_layer}), or "
                          "add parallelism.partition=<a method or balance list that fits>") from None


def _result(job_dir: str, dst: RunConfig, pred: Predicted, rescaled: bool, a2a: dict, replay: bool) -> dict:
    """`replay`: the job's own layout at its own durations (a replay of it, not a prediction)."""
    p = dst.parallelism
    return {"source": job_dir, "replay": replay, "schedule": dst.schedule.name, "pp": p.pp, "ep": p.ep,
            "microbatches": dst.schedule.microbatches, "virtual_stages": dst.schedule.virtual_stages,
            "tokens_per_step": dst.tokens_per_step, **pred.keys(),
            "predicted_tokens_per_s": dst.tokens_per_step / pred.step_time_s,  # the job's total, all its ranks:
            "predicted_tokens_per_s_cluster": dst.tokens_per_step / pred.step_time_s,  # ... by its explicit name
            "predicted_tokens_per_s_per_gpu": dst.tokens_per_step / pred.step_time_s / dst.world_size,
            "predicted_rank_bubble_fraction": pred.rank_bubble_fraction,
            "predicted_activation_peak_bytes": pred.activation_peak_bytes,
            **{k: v for k, v in a2a.items() if k.startswith("a2a")}, "rescaled": rescaled, "_predicted": pred}


def _a2a(job_dir: str, src: RunConfig, cal: Calibration, dst: RunConfig, layers: int) -> dict:
    """The all-to-all of the target's ep against the job's (framework/sim/alltoall.py):
    `delta` per MoE layer and micro-batch {"F", "B"}, and the keys the prediction reports
    for the rank with the most MoE `layers` (metrics.jsonl's a2a_bytes is a max over ranks too)."""
    if src.parallelism.ep == dst.parallelism.ep == 1 or not moe_layers(dst):
        return {"changed": False, "delta": {"F": 0.0, "B": 0.0}}
    cost: A2ACost = cost_of(cal, src, job_dir)
    old, new = cost.layer_seconds(src), cost.layer_seconds(dst)
    return {"changed": src.parallelism.ep != dst.parallelism.ep, "delta": {op: new[op] - old[op] for op in new},
            "a2a_bytes_per_step": step_bytes(dst, layers),
            "a2a_s_per_step": layers * dst.schedule.microbatches * (new["F"] + new["B"]),
            "a2a_model": "measured" if cost.measured else "p2p", "a2a_cost": cost.describe()}


def _flat_what_if(job_dir: str, src: RunConfig, cal: Calibration, dst: RunConfig) -> dict:
    """A pp = 1 job (calibrated with ep > 1): its fwd/bwd per micro-batch x the target's m,
    plus the all-to-all change over every MoE layer, plus the rest of its step as measured."""
    if dst.parallelism.pp != 1:
        raise ConfigError("sim.from", job_dir, f"is a pp = 1 job: a pp = 1 job has no per-stage times to predict "
                          f"parallelism.pp={dst.parallelism.pp}",
                          "predict a pipeline from a finished pipeline job (parallelism.pp > 1)")
    a2a = _a2a(job_dir, src, cal, dst, moe_layers(dst))
    m_src, m = src.schedule.microbatches, dst.schedule.microbatches
    extra = moe_layers(dst) * m * (a2a["delta"]["F"] + a2a["delta"]["B"])
    pred = flat_replay(cal, m / m_src, extra)
    return _result(job_dir, dst, pred, m != m_src or a2a["changed"], a2a, m == m_src and not a2a["changed"])


def auto_op_times(job_dir: str, target: RunConfig) -> dict:
    """zb-auto's schedule.op_times for `target` from a job: per pipeline rank of the target
    (its pp and partition, one chunk per rank) T_F, T_I, T_W, rescaled like any what-if (a
    fused B split as the job's own I / W share, else in halves; the first stage's I
    computes nothing), and comm = the job's link latency."""
    src, info, cal, _ = load_job(job_dir)
    if cal.fwd_bwd_s is not None:
        raise ConfigError("sim.from", job_dir, "is a pp = 1 job: it has no per-stage times to build schedule.op_times "
                          "from", "give a finished pipeline job, or set schedule.op_times")
    check_same_work(job_dir, src, info, target)
    sched = resolve(src.schedule)
    vocab = src.model.vocab_size or info["vocab_size"]
    one = replace(sched, placement="loop", asynchronous=None)  # one chunk per rank, flushing, split form
    flat = target_config(target, ["schedule.virtual_stages=1"], check=False)
    p = target.parallelism.pp
    new = rescale(cal, sched, src.parallelism.pp, src.schedule.virtual_stages, _blocks(src, vocab), one, p, 1,
                  _blocks(flat, vocab))
    times = {op: [new.compute[f"{r},0,{op}"] for r in range(p)] for op in "FIW"}
    times["I"][0] = max(times["I"][0], 1e-6)  # > 0, as validation requires (it computes nothing)
    return {**times, "comm": cal.alpha_s}


def fill_measured_times(run: RunConfig, job_dir: str) -> None:
    """A schedule built from measured times (zb-auto) with schedule.op_times null takes
    them from `job_dir`, for this run's pipeline (what a run with sim.from builds)."""
    s = run.schedule
    if s.op_times is None and run.parallelism.pp > 1 and s.name in names() and get(s.name).configure is not None:
        s.op_times = auto_op_times(job_dir, run)


def _rank_note(src: RunConfig, dst: RunConfig, summary: dict) -> dict:
    """A target with another rank count: the source's per-rank times came from its own ranks
    sharing the machine (on a CPU, its cores), which the target shares otherwise."""
    if src.world_size == dst.world_size:
        return {}
    cores = f" on a {summary.get('device', 'cpu')} machine" if summary.get("device", "cpu") != "cpu" else ""
    return {"rank_count_note": f"the target runs {dst.world_size} ranks where the source ran {src.world_size}"
                               f"{cores}: the source's per-rank times were measured with {src.world_size} ranks "
                               "sharing the machine and may not carry over (on a CPU, ranks share its cores)"}


def describe(result: dict) -> str:
    ep = f" ep={result['ep']}" if result.get("ep", 1) > 1 or "a2a_model" in result else ""
    lines = [f"{result['schedule']} pp={result['pp']}{ep} m={result['microbatches']} v={result['virtual_stages']} "
             f"({'replay of' if result.get('replay') else 'predicted from'} {result['source']}"
             f"{', rescaled' if result['rescaled'] else ''}): "
             f"step {result['predicted_step_time_s'] * 1e3:.1f} ms | {result['predicted_tokens_per_s']:,.0f} tokens/s "
             + (f"in all, {result['predicted_tokens_per_s_per_gpu']:,.0f} per rank "
                if "predicted_tokens_per_s_per_gpu" in result else "")
             + f"| bubble {result['predicted_bubble_fraction']:.3f}"]
    if "a2a_model" in result:
        lines.append(f"  all-to-all: {result['a2a_bytes_per_step'] / 2**20:.2f} MiB and "
                     f"{result['a2a_s_per_step'] * 1e3:.1f} ms per step and rank, {result['a2a_cost']}")
    parts = {k[15:-2]: v for k, v in result.items() if k.startswith("predicted_time_")}
    if parts:
        lines.append("  per step, mean over pp ranks: " + " | ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms"
                                                                      for k, v in parts.items()))
    for r, (b, a) in enumerate(zip(result["predicted_rank_bubble_fraction"], result["predicted_activation_peak_bytes"])):
        lines.append(f"  pp rank {r}: bubble {b:.3f} | activation peak {a / 2**20:.1f} MiB")
    if result.get("rank_count_note"):
        lines.append(f"  WARNING: {result['rank_count_note']}")
    return "\n".join(lines)


def draw(pred: Predicted, path: str, title: str) -> None:
    from framework.metrics.timeline import render_timeline

    render_timeline(timeline_records(pred), path, title)


PNG_SUFFIXES = ("png", "svg", "pdf")  # what the timeline's matplotlib writes here (no suffix: a PNG)


def parser() -> Parser:
    p = Parser(prog="python -m framework.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("sim.from", metavar="JOB_DIR", nargs="?", help="a finished pipeline job's directory (or a pp = 1 "
                   "job's with parallelism.ep > 1): its calibration.json; none with --op-times")
    p.add_argument("--op-times", metavar="F=..,B=..,W=..[,comm=..]", help="replay the schedule at these per-rank op "
                   "times with no job (framework/sim/optimes.py); needs parallelism.pp and schedule.microbatches")
    p.add_argument("overrides", nargs="*", help=f"key=value with a key in {', '.join(KEYS)}")
    p.add_argument("--png", type=OutputPath(suffixes=PNG_SUFFIXES), help="write the predicted Gantt chart here")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    return p


@command
def main(argv: list[str]) -> int:
    """Bad arguments (an unknown key or schedule, a value of the wrong type, a directory that
    is not a finished job, an unwritable --png) are one `config error:` line and exit 2."""
    args = parser().parse_intermixed_args(argv)  # options may sit between the job and its overrides
    job_dir = vars(args)["sim.from"]
    if args.op_times is not None:  # no job: a first override took the job's place
        from framework.sim.optimes import command_line
        job, more = (None, [job_dir]) if job_dir is not None and "=" in job_dir else (job_dir, [])
        return command_line(job, args.op_times, more + args.overrides, args.json, args.png)
    overrides = ([job_dir] if job_dir and "=" in job_dir else []) + args.overrides
    if any(o.startswith("hardware=") for o in overrides):  # a cluster planned with no job
        from framework.sim.cost.plan import command_line as plan_cluster
        return plan_cluster(overrides, args.json, args.png)
    if job_dir is None:
        raise ConfigError("sim.from", None, "is required", "python -m framework.simulate --help lists its arguments: a "
                          "finished job's directory, --op-times F=..,B=..,W=.. or hardware=<profile> with no job")
    result = what_if(job_dir, args.overrides)
    pred = result.pop("_predicted")
    if args.png and pred.sim is None:
        raise ConfigError("--png", args.png, "a pp = 1 prediction has no pipeline timeline to draw",
                          "leave --png out for a pp = 1 job")
    print(json.dumps(result, indent=1) if args.json else describe(result))
    if args.png:
        try:
            draw(pred, args.png, f"{'replay' if result['replay'] else 'predicted'}: {result['schedule']} pp={result['pp']} "
                 f"m={result['microbatches']} "
                 f"v={result['virtual_stages']}, step {result['predicted_step_time_s'] * 1e3:.1f} ms, "
                 f"bubble {result['predicted_bubble_fraction']:.3f}")
        except OSError as e:  # checked before the prediction; the disk may still fill
            raise ConfigError("--png", args.png, f"cannot be written ({e.strerror or e})", "give a writable path") \
                from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
