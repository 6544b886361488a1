"""Predict a pipeline layout from one finished job, without running it:

    python -m framework.simulate <job dir> [schedule=NAME] [schedule.microbatches=M]
                                 [schedule.virtual_stages=V] [parallelism.pp=P] [parallelism.ep=E]
                                 [--png FILE] [--json]

The job's calibration.json (every pipeline run writes it: per-stage op durations, host gap,
link latency, time outside the pipeline, activation bytes; framework/sim/calibrate.py)
is rescaled to the target partition (framework/sim/whatif.py) and the target schedule's
real plan is run through the clock (framework/sim/clock.py). Prints the
predicted step time, bubble and activation peak per rank; `--png` draws the predicted
Gantt chart. With no override it replays the job itself (`replay: true`: its own durations
on its own layout, beside its measurement; a prediction is of a layout not run).
`dry_run=true sim.from=<job dir>` puts the same prediction in the dry-run plan;
`search.mode=simulate` ranks a sweep's candidates by it (docs/simulator.md).

`parallelism.ep` (MoE models): each stage's forward and backward move by the all-to-all of
the target ep minus the job's (framework/sim/alltoall.py: its volume, and its time from
the job's own all-to-all when it ran with ep > 1, else from the p2p link). Expert compute per
rank is unchanged by ep in expectation: a rank's experts are E / ep of them, but the ep ranks'
tokens are redistributed to them, so each rank still runs N x k assignments per micro-batch.
A pp = 1 job (written with ep > 1) has no per-stage times: it predicts pp = 1 layouts only
(ep, micro-batches), its fwd/bwd scaled by micro-batches plus the all-to-all change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config import ConfigError, RunConfig, check_overrides, load_config, read_config
from framework.sim.alltoall import A2ACost, cost_of, moe_layers, shift_stages, step_bytes
from framework.sim.calibrate import Calibration
from framework.sim.replay import Predicted, flat_replay, replay, rules_for, timeline_records
from framework.sim.whatif import rescale
from framework.models import meta_hf_model
from framework.parallel.pipeline.schedules import get, load_modules, names, resolve
from framework.validate import validate_model
from framework.validate.common import positive, suggest
from framework.validate.expert import check_expert_parallel

KEYS = ("schedule", "schedule.name", "schedule.microbatches", "schedule.virtual_stages", "parallelism.pp",
        "parallelism.partition", "parallelism.ep")


def load_job(job_dir: str) -> tuple[RunConfig, dict, Calibration, dict]:
    """(config, run_info, calibration, summary) of a finished pipeline (or pp = 1, ep > 1) job."""
    fix = "give the directory of a completed run with parallelism.pp > 1 or parallelism.ep > 1"
    if not os.path.isdir(job_dir):
        raise ConfigError("sim.from", job_dir, "is a file, not a job directory" if os.path.exists(job_dir)
                          else "no such directory", fix)
    paths = {name: os.path.join(job_dir, name) for name in ("config.yaml", "run_info.json", "calibration.json",
                                                            "summary.json")}
    missing = [n for n, p in paths.items() if not os.path.exists(p)]
    if missing:
        raise ConfigError("sim.from", job_dir, f"has no {', '.join(missing)}: not a finished pipeline job (pp > 1) "
                          "(or pp = 1 with ep > 1) of this framework's version", fix)
    try:
        info, cal, summary = (_json(paths[n]) for n in ("run_info.json", "calibration.json", "summary.json"))
        cal = Calibration.from_json(cal)
    except (OSError, ValueError, TypeError, KeyError) as e:  # truncated, or of another version
        raise ConfigError("sim.from", job_dir, f"a file is unreadable ({type(e).__name__}: {e})", fix) from None
    return read_config(paths["config.yaml"]), info, cal, summary


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def predicts(job_dir: str, run: RunConfig) -> bool:
    """Whether the job's calibration can predict `run` at all: a pipeline from a pipeline job,
    a pp = 1 layout from a pp = 1 job (the dry run predicts only then)."""
    with open(os.path.join(job_dir, "calibration.json")) as f:
        flat = json.load(f).get("fwd_bwd_s") is not None
    return (run.parallelism.pp == 1) == flat


def target_config(src: RunConfig, overrides: list[str], check: bool = True) -> RunConfig:
    """The job's config with the layout overrides (`schedule=NAME` picks the schedule and its
    preset virtual-stage count, as the Hydra group does). `check`: a size the job derives
    (trainer.global_batch_size) and an override contradicts is an error, as in run.py."""
    dot = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if key not in KEYS:
            close = suggest(key, list(KEYS))
            raise ConfigError(key, value or None, "is not a layout key the simulator rescales"
                              + (f". Did you mean {' or '.join(close)}?" if close else ""),
                              f"use key=value with one of {', '.join(KEYS)}")
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
    for key, n in (("schedule.microbatches", dst.schedule.microbatches),
                   ("schedule.virtual_stages", dst.schedule.virtual_stages), ("parallelism.ep", dst.parallelism.ep)):
        positive(key, n)
    if check:
        check_overrides(dst, dot)
    if (dst.parallelism.pp, dst.parallelism.partition) != (src.parallelism.pp, src.parallelism.partition):
        dst.schedule.op_times = None  # per-rank times of another pipeline: measured again (fill_measured_times)
    return dst


def _known_schedule(key: str, name: str, src: RunConfig) -> None:
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
    dst = target or target_config(src, overrides or [])
    check_expert_parallel(dst)
    if cal.fwd_bwd_s is not None:
        return _flat_what_if(job_dir, src, cal, dst)
    fill_measured_times(dst, job_dir)
    p, m, v = dst.parallelism.pp, dst.schedule.microbatches, dst.schedule.virtual_stages
    sched = resolve(dst.schedule)
    if p < 2:
        raise ConfigError("parallelism.pp", p, "has no pipeline to simulate", "simulate a layout with pp >= 2")
    bad = sched.why_not(p, m, v)
    if bad is not None:
        raise ConfigError(bad.key, {"schedule.microbatches": m, "schedule.virtual_stages": v}.get(bad.key, p),
                          bad.reason, bad.fix)
    vocab = src.model.vocab_size or info["vocab_size"]
    sp, sv = src.parallelism.pp, src.schedule.virtual_stages
    blocks = _blocks(dst, vocab)
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
    return _result(job_dir, dst, pred, not same or a2a["changed"], a2a, own)


def _result(job_dir: str, dst: RunConfig, pred: Predicted, rescaled: bool, a2a: dict, replay: bool) -> dict:
    """`replay`: the job's own layout at its own durations (a replay of it, not a prediction)."""
    p = dst.parallelism
    return {"source": job_dir, "replay": replay, "schedule": dst.schedule.name, "pp": p.pp, "ep": p.ep,
            "microbatches": dst.schedule.microbatches, "virtual_stages": dst.schedule.virtual_stages,
            "tokens_per_step": dst.tokens_per_step, **pred.keys(),
            "predicted_tokens_per_s": dst.tokens_per_step / pred.step_time_s,
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
        raise ConfigError("parallelism.pp", dst.parallelism.pp, f"cannot be predicted from {job_dir}: a pp = 1 job "
                          "has no per-stage times", "simulate a pipeline from a finished pipeline job")
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


def describe(result: dict) -> str:
    ep = f" ep={result['ep']}" if result.get("ep", 1) > 1 or "a2a_model" in result else ""
    lines = [f"{result['schedule']} pp={result['pp']}{ep} m={result['microbatches']} v={result['virtual_stages']} "
             f"({'replay of' if result.get('replay') else 'predicted from'} {result['source']}"
             f"{', rescaled' if result['rescaled'] else ''}): "
             f"step {result['predicted_step_time_s'] * 1e3:.1f} ms | {result['predicted_tokens_per_s']:,.0f} tokens/s "
             f"| bubble {result['predicted_bubble_fraction']:.3f}"]
    if "a2a_model" in result:
        lines.append(f"  all-to-all: {result['a2a_bytes_per_step'] / 2**20:.2f} MiB and "
                     f"{result['a2a_s_per_step'] * 1e3:.1f} ms per step and rank, {result['a2a_cost']}")
    for r, (b, a) in enumerate(zip(result["predicted_rank_bubble_fraction"], result["predicted_activation_peak_bytes"])):
        lines.append(f"  pp rank {r}: bubble {b:.3f} | activation peak {a / 2**20:.1f} MiB")
    return "\n".join(lines)


def draw(pred: Predicted, path: str, title: str) -> None:
    from framework.metrics.timeline import render_timeline

    render_timeline(timeline_records(pred), path, title)


def main(argv: list[str]) -> int:
    """Bad arguments (an unknown key or schedule, a value of the wrong type, a directory that
    is not a finished job) are one `config error:` / `error:` line and exit 2, no traceback."""
    parser = argparse.ArgumentParser(prog="python -m framework.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_dir")
    parser.add_argument("overrides", nargs="*", help=f"key=value with a key in {', '.join(KEYS)}")
    parser.add_argument("--png", help="write the predicted Gantt chart here")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.error = _usage_error
    args = parser.parse_args(argv)
    try:
        result = what_if(args.job_dir, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    pred = result.pop("_predicted")
    print(json.dumps(result, indent=1) if args.json else describe(result))
    if args.png and pred.sim is None:
        print("config error: --png: a pp = 1 prediction has no pipeline timeline to draw", file=sys.stderr)
        return 2
    if args.png:
        try:
            draw(pred, args.png, f"{'replay' if result['replay'] else 'predicted'}: {result['schedule']} pp={result['pp']} "
                 f"m={result['microbatches']} "
                 f"v={result['virtual_stages']}, step {result['predicted_step_time_s'] * 1e3:.1f} ms, "
                 f"bubble {result['predicted_bubble_fraction']:.3f}")
        except OSError as e:
            print(f"error: --png {args.png}: cannot be written ({e.strerror or e}). Fix: give a writable path",
                  file=sys.stderr)
            return 2
    return 0


def _usage_error(message: str) -> None:
    """argparse's complaint as one line (its default prints the usage block above it)."""
    print(f"error: {message}. Fix: python -m framework.simulate <job dir> [key=value ...] [--png FILE] [--json] "
          "(--help lists the keys)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
