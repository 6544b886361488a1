"""Where the step goes, per dimension, with and without each overlap built so far.

Usage (repository root): python experiments/overlap/measure.py [--out DIR] [--steps N] [--repeats R]
                          [--only A,B]   (the configurations whose name contains A or B)
                          [--collect]    (only print the table of the jobs already in --out)

Each configuration is `python run.py ...` (GPT-2 widths 256, 8 blocks, fp32, synthetic
data, N steps, medians over the steps after the first two), R times, the configurations
alternating within a repeat so a noisy neighbour hits them alike. Printed per
configuration: step time (median over repeats, spread min-max) and the step-time breakdown
(summary.json's `time_<part>_s` medians: framework/metrics/breakdown.py), exposed
communication per dimension first; then dp's and cp's whole communication time
(`comm_total_<dim>_s`) and the share of it the overlap hid (`comm_hidden_<dim>`).

Layouts, each where one dimension's communication is large:
- dp: dp 2 x pp 2, 8 micro-batches, flush and interleaved (v 2), `parallelism.overlap_grad_reduce`
  off / on (each chunk's all-reduce issued after its last backward); our ZeRO 2 at dp 2,
  off / on (each unit's reduce-scatter issued as its gradients complete);
- ZeRO 3 at dp 2, ours and FSDP2, `parallelism.overlap_param_gather` off / on (the next
  unit's all-gather prefetched), ours also with both overlaps;
- cp: cp 2 with the ring at sequence 1,024, `parallelism.overlap_cp_ring` off / on;
- tp: tp 2 (pp 1), and tp 2 x pp 2 (no tp overlap built: exposed = all of it);
- pp: pp 2 (its bubble and transfers);
- ep: the MoE model (moe-tiny at the same widths, 8 layers, 4 experts of width 512, top 2)
  at ep 2 x dp 2 x pp 2, dualpipev, `parallelism.overlap_dualpipe` off / on (each pair's F
  on a second thread beside the other chunk's B).
Machine: 2 CPU cores; 4-rank layouts are oversubscribed (4 processes on 2 cores), so a
collective's background thread competes with compute for a core: overlap here is smaller
than on devices whose communication has its own engine.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = ["model=gpt2-tiny", "model.n_layer=8", "model.n_embd=256", "model.n_head=4", "data=synthetic",
         "data.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "metrics.skip_first=2"]
# ep: the MoE model at the same widths (8 layers of 4 experts, top 2), ep 2 x dp 2 x pp 2
MOE = ["model=moe-tiny", "model.moe.expert_inner=512", "parallelism=dp2_pp2", "parallelism.ep=2",
       "schedule.microbatches=8"]
LONG = ["data.seq_len=1024", "model.max_positions=1024", "trainer.micro_batch_size=1", "schedule.microbatches=4"]
CONFIGS = {
    "dp2 pp2 flush": ["parallelism=dp2_pp2", "schedule=flush", "schedule.microbatches=8"],
    "dp2 pp2 flush + overlap_grad_reduce": ["parallelism=dp2_pp2", "schedule=flush", "schedule.microbatches=8",
                                            "parallelism.overlap_grad_reduce=true"],
    "dp2 pp2 interleaved": ["parallelism=dp2_pp2", "schedule=interleaved", "schedule.virtual_stages=2",
                            "schedule.microbatches=8"],
    "dp2 pp2 interleaved + overlap_grad_reduce": ["parallelism=dp2_pp2", "schedule=interleaved",
                                                  "schedule.virtual_stages=2", "schedule.microbatches=8",
                                                  "parallelism.overlap_grad_reduce=true"],
    "zero2 dp2": ["parallelism=zero2", "schedule.microbatches=8"],
    "zero2 dp2 + overlap_grad_reduce": ["parallelism=zero2", "schedule.microbatches=8",
                                        "parallelism.overlap_grad_reduce=true"],
    "zero3 dp2": ["parallelism=zero3", "schedule.microbatches=8"],
    "zero3 dp2 + overlap_param_gather": ["parallelism=zero3", "schedule.microbatches=8",
                                         "parallelism.overlap_param_gather=true"],
    "zero3 dp2 + both": ["parallelism=zero3", "schedule.microbatches=8", "parallelism.overlap_param_gather=true",
                         "parallelism.overlap_grad_reduce=true"],
    "fsdp2 zero3 dp2": ["parallelism=zero3", "parallelism.zero_impl=fsdp2", "schedule.microbatches=8"],
    "fsdp2 zero3 dp2 + overlap_param_gather": ["parallelism=zero3", "parallelism.zero_impl=fsdp2",
                                               "schedule.microbatches=8", "parallelism.overlap_param_gather=true"],
    "cp2 ring seq 1024": ["parallelism=single", "parallelism.cp=2", "parallelism.cp_comm=ring", *LONG],
    "cp2 ring seq 1024 + overlap_cp_ring": ["parallelism=single", "parallelism.cp=2", "parallelism.cp_comm=ring",
                                            "parallelism.overlap_cp_ring=true", *LONG],
    "tp2": ["parallelism=tp2", "schedule.microbatches=8"],
    "tp2 pp2 flush": ["parallelism=tp2_pp2", "schedule=flush", "schedule.microbatches=8"],
    "pp2 flush": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=8"],
    "ep2 dp2 pp2 dualpipev": [*MOE, "schedule=dualpipev"],
    "ep2 dp2 pp2 dualpipev + overlap_dualpipe": [*MOE, "schedule=dualpipev", "parallelism.overlap_dualpipe=true"],
}
PARTS = ("comm_dp", "comm_tp", "comm_pp", "comm_ep", "comm_cp", "bubble", "compute", "optimizer", "host", "data")


def job_dir(out: Path, tag: str) -> Path:
    return out / tag.replace(" ", "_").replace("+", "plus")


def run(out: Path, tag: str, args: list[str], steps: int) -> dict:
    job = job_dir(out, tag)
    model = [a for a in MODEL if not a.startswith("model=")] if any(a.startswith("model=") for a in args) else MODEL
    cmd = [sys.executable, "run.py", *model, *args, f"trainer.steps={steps}", f"hydra.run.dir={job}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tag}: {r.stderr[-2000:]}")
    return json.loads((job / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/overlap")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--collect", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    configs = {name: args for name, args in CONFIGS.items() if any(o in name for o in a.only.split(","))}
    got: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(a.repeats):
        for name, args in configs.items():
            if a.collect:
                got[name].append(json.loads((job_dir(out / f"r{rep}", name) / "summary.json").read_text()))
                continue
            got[name].append(run(out / f"r{rep}", name, args, a.steps))
            print(f"repeat {rep} {name}: {got[name][-1]['step_time_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    totals = [f"comm_total_{d}_s" for d in ("dp", "ep", "cp")]
    hidden = [f"comm_hidden_{d}" for d in ("dp", "ep", "cp")]
    print("| layout | step ms (median, min-max) | " + " | ".join(f"{p} ms" for p in PARTS)
          + " | dp total ms (hidden) | ep total ms (hidden) | cp total ms (hidden) |")
    print("|---|---|" + "---|" * (len(PARTS) + 3))
    for name, runs in got.items():
        steps = [r["step_time_s"] * 1e3 for r in runs]
        parts = [statistics.median(r[f"time_{p}_s"] for r in runs) * 1e3 for p in PARTS]
        whole = [f"{statistics.median(r[t] for r in runs) * 1e3:.1f} ({statistics.median(r[h] for r in runs):.0%})"
                 for t, h in zip(totals, hidden)]
        print(f"| {name} | {statistics.median(steps):.1f} ({min(steps):.1f}-{max(steps):.1f}) | "
              + " | ".join(f"{x:.1f}" for x in parts) + " | " + " | ".join(whole) + " |")


if __name__ == "__main__":
    main()
