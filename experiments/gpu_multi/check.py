"""The first run of the framework across several GPUs (NCCL between ranks has never run):
each distributed layout against the single process, with its breakdown and its syncs.

Usage (repository root): python experiments/gpu_multi/check.py --out DIR [--device cuda|cpu]
    [--only NAME,NAME]     (experiments/gpu_multi/check.sh wraps it for a lent machine)

Every layout trains the same tiny model (GPT-2 shape, 4 blocks of width 64, or the MoE) for
STEPS steps on synthetic tokens in fp32, with the same global batch as its single-process
reference (one process: `parallelism=single`), launched as `python run.py` (one rank per
GPU on CUDA, NCCL; gloo on CPU). Checked per layout: every step's loss and gradient norm
equal the reference's within TOLERANCE (fp32: the reduction order differs between layouts;
a wrong gradient moves them by ~1e-3 or more; the MoE's bound is wider, see TOLERANCE). The
fp64 equality of every layout is the suite's (tests/); this asks whether NCCL runs them. Reported beside: the step-time breakdown's
parts (summary.json's `time_*_s`), the host syncs the framework counted in its last step
(`rank_host_syncs`), and on CUDA torch's own count of synchronising calls over the whole run
(`torch.cuda.set_sync_debug_mode("warn")` through experiments/single_device/syncs). A layout
needing more ranks than the machine has GPUs is skipped and said so.

Prints one JSON line per layout and a last line {"ok": bool, ...}; exits 1 when a layout
that ran differs from its reference or failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# Relative per step on loss and gradient norm. Dense: fp32 round-off across reduction orders
# moves them ~1e-7 (measured 1.1e-7 on CPU); the MoE's router turns that into up to 7e-5 (a
# token near a tie), so it gets 10x the dense bound.
TOLERANCE = {"dense": dict(rtol=2e-4, atol=1e-6), "moe": dict(rtol=2e-3, atol=1e-6)}
COMMON = ["data=synthetic", "logger=none", f"trainer.steps={STEPS}", "trainer.log_interval=1", "metrics.skip_first=0",
          "trainer.precision=fp32", "trainer.warmup_steps=1", "optimizer.lr=3e-3", "trainer.micro_batch_size=2",
          "data.seq_len=64", "trainer.global_batch_size=null", "metrics.peak_tflops=1.0"]
DENSE = ["model=gpt2-tiny", "model.n_layer=4", "model.n_embd=64", "model.n_head=4"]
MOE = ["model=moe-tiny"]
# name -> (model, layout overrides, reference's micro-batches: the layout's global batch / 2)
LAYOUTS = {
    "pp2_flush": (DENSE, ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4"], 4),
    "pp2_zbh1": (DENSE, ["parallelism=pp2", "schedule=zbh1", "schedule.microbatches=4"], 4),
    "pp2_interleaved": (DENSE, ["parallelism=pp2", "schedule=interleaved", "schedule.virtual_stages=2",
                                "schedule.microbatches=4"], 4),
    "tp2_sp": (DENSE, ["parallelism=tp2", "parallelism.sequence_parallel=true", "schedule.microbatches=4"], 4),
    "dp2_zero3": (DENSE, ["parallelism=dp2", "parallelism.zero=3", "schedule.microbatches=2"], 4),
    "cp2_ring_overlap": (DENSE, ["parallelism=single", "parallelism.cp=2", "parallelism.cp_comm=ring",
                                 "parallelism.overlap_cp_ring=true", "schedule.microbatches=4"], 4),
    # ep 2 x dp 2 x pp 2 (4 ranks), dualpipev; its F / B overlap only off CUDA (refused there: issue 47)
    "ep2_dualpipev": (MOE, ["parallelism=dp2_pp2", "parallelism.ep=2", "schedule=dualpipev",
                            "schedule.microbatches=4"], 8),
}
SYNC_WARNING = "called a synchronizing CUDA operation"


def launch(overrides: list[str], job: Path, device: str, count_syncs: bool) -> tuple[int, str]:
    env = dict(os.environ)
    if count_syncs:  # every synchronising call warns (experiments/single_device/syncs/sitecustomize.py)
        env.update(COUNT_SYNCS="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT / "experiments/single_device/syncs"), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *overrides, f"device={device}", f"hydra.run.dir={job}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def rows(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def close(a: float, b: float, kind: str = "dense") -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE[kind]["rtol"], abs_tol=TOLERANCE[kind]["atol"])


def ranks_needed(overrides: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    from framework.config import load_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return load_config(compose("config", overrides=[*COMMON, *overrides])).world_size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="job directories and logs")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--only", default=",".join(LAYOUTS))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus = None
    if a.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    refs: dict[tuple, list[dict]] = {}
    ok = True
    for name in a.only.split(","):
        model, layout, ref_m = LAYOUTS[name]
        if name == "ep2_dualpipev" and a.device != "cuda":  # refused on CUDA until its own stream exists
            layout = [*layout, "parallelism.overlap_dualpipe=true"]
        need = ranks_needed([*model, *layout])
        if gpus is not None and need > gpus:
            print(json.dumps({"layout": name, "skipped": f"{need} ranks, {gpus} GPU(s)"}), flush=True)
            continue
        key = (tuple(model), ref_m)
        if key not in refs:
            job = out / f"reference_{'moe' if model is MOE else 'dense'}_m{ref_m}"
            rc, log = launch([*model, "parallelism=single", f"schedule.microbatches={ref_m}"], job, a.device, False)
            (out / f"{job.name}.log").write_text(log)
            if rc != 0:
                print(json.dumps({"layout": name, "reference_failed": rc, "log": str(out / f"{job.name}.log")}))
                ok = False
                continue
            refs[key] = rows(job)
        job = out / name
        rc, log = launch([*model, *layout], job, a.device, a.device == "cuda")
        (out / f"{name}.log").write_text(log)
        if rc != 0:
            print(json.dumps({"layout": name, "failed": rc, "log": str(out / f"{name}.log"), "tail": log[-1500:]}),
                  flush=True)
            ok = False
            continue
        got, ref, kind = rows(job), refs[key], "moe" if model is MOE else "dense"
        worst = max(max(abs(g[k] - r[k]) / max(abs(r[k]), 1e-12) for k in ("loss", "grad_norm"))
                    for g, r in zip(got, ref))
        same = len(got) == len(ref) == STEPS and all(close(g[k], r[k], kind) for g, r in zip(got, ref)
                                                   for k in ("loss", "grad_norm"))
        ok &= same
        summary = json.loads((job / "summary.json").read_text())
        print(json.dumps({
            "layout": name, "ranks": need, "same_as_single": same, "worst_rel_diff": worst,
            "tolerance": TOLERANCE[kind],
            "loss": [g["loss"] for g in got], "reference_loss": [r["loss"] for r in ref],
            "breakdown_s": {k: summary.get(k) for k in sorted(summary) if k.startswith("time_") and k.endswith("_s")},
            "bubble_fraction": summary.get("bubble_fraction"),
            "host_syncs_last_step": got[-1].get("rank_host_syncs"),
            "cuda_sync_warnings_whole_run": log.count(SYNC_WARNING) if a.device == "cuda" else None,
        }), flush=True)
    print(json.dumps({"ok": ok, "steps": STEPS, "device": a.device}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
