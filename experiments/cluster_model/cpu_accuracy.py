"""The cost model against real runs on this machine, calibrated by micro-benchmark only.

Usage (repository root): python experiments/cluster_model/cpu_accuracy.py [--out DIR] [--repeats 2]
    [--profile conf/hardware/cpu-local.yaml]

1. The profile comes from `python -m framework.sim.bench --device cpu --threads 1 --links 2
   --out conf/hardware/cpu-local.yaml` (run it first; no training run is read): GEMM, memory-
   bound ops, attention and the host path with one thread, the share of a rank when two
   ranks split this machine's two cores, and the gloo link between two local ranks.
2. Every run below is launched as `python run.py <overrides> hydra.run.dir=...`, `--repeats`
   times, the runs alternating (repeat 1 of every run, then repeat 2, ...) so a neighbour's
   load spreads over all of them; measured: summary.json's median step time (steps after
   metrics.skip_first), and the spread (min to max) over the repeats.
3. Each is predicted by `python -m framework.simulate hardware=cpu-local <the same overrides>`'s
   code (framework/sim/cost/plan.py: plan), which reads no job.
Printed: a markdown table of every run (measured with spread, predicted, error), the median
and max |error|, and every pair of runs whose measured gap exceeds both runs' spreads and
whose predicted order differs (the ranking check).
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COMMON = ["data=synthetic", "logger=none", "trainer.steps=7", "metrics.skip_first=2", "trainer.log_interval=7",
          "metrics.peak_tflops=1.0", "trainer.global_batch_size=null"]
WIDTHS = {  # three widths: gpt2-tiny, a middle one, GPT-2 124M (its 50,257-token vocabulary) at a short sequence
    "w128": ["model=gpt2-tiny", "data.seq_len=64", "trainer.micro_batch_size=4", "schedule.microbatches=4"],
    "w384": ["model=gpt2-tiny", "model.n_layer=6", "model.n_embd=384", "model.n_head=6", "data.seq_len=64",
             "trainer.micro_batch_size=2", "schedule.microbatches=4"],
    "w768": ["model=gpt2", "data.vocab_size=50257", "data.seq_len=64", "trainer.micro_batch_size=1",
             "schedule.microbatches=2"],
}
LAYOUTS = {"dp2": ["parallelism=dp2"], "tp2": ["parallelism=tp2"], "pp2": ["parallelism=pp2", "schedule=flush"],
           "dp2_zero3": ["parallelism=dp2", "parallelism.zero=3"]}
EXTRA = {  # beside the 12: ZeRO 1, sequence parallelism, expert parallelism
    "w384_dp2_zero1": WIDTHS["w384"] + ["parallelism=dp2", "parallelism.zero=1"],
    "w384_tp2_sp": WIDTHS["w384"] + ["parallelism=tp2", "parallelism.sequence_parallel=true"],
    "moe_ep2": ["model=moe-tiny", "data.seq_len=64", "trainer.micro_batch_size=4", "schedule.microbatches=4",
                "parallelism=dp2", "parallelism.ep=2"],
}


def runs() -> dict[str, list[str]]:
    out = {f"{w}_{name}": [*WIDTHS[w], *lay] for w in WIDTHS for name, lay in LAYOUTS.items()}
    return {**out, **EXTRA}


def measure(name: str, overrides: list[str], job_dir: Path) -> float:
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *overrides, f"hydra.run.dir={job_dir}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads((job_dir / "summary.json").read_text())["step_time_s"]


def predict(overrides: list[str], profile: str) -> dict:
    from framework.sim.cost.plan import plan

    return plan([*COMMON, *overrides, f"hardware={profile}"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/cpu_accuracy", help="job directories")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default="cpu-local", help="a conf/hardware/ option")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--reuse", action="store_true", help="read the job directories --out holds; launch nothing")
    args = ap.parse_args()
    todo = {k: v for k, v in runs().items() if not args.only or k in args.only.split(",")}
    measured: dict[str, list[float]] = {k: [] for k in todo}
    for rep in range(args.repeats):
        for name, over in todo.items():
            job = Path(args.out) / f"{name}_r{rep}"
            measured[name].append(json.loads((job / "summary.json").read_text())["step_time_s"] if args.reuse
                                  else measure(name, over, job))
            print(f"measured {name} repeat {rep}: {measured[name][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    rows, errors = [], {}
    for name, over in todo.items():
        pred = predict(over, args.profile)
        med = statistics.median(measured[name])
        errors[name] = pred["step_s"] / med - 1
        rows.append((name, med, min(measured[name]), max(measured[name]), pred))
    print("| run | measured step (spread) | predicted | error | predicted bubble | comm (tp / dp) |")
    print("|---|---|---|---|---|---|")
    for name, med, lo, hi, pred in rows:
        print(f"| {name} | {med * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {pred['step_s'] * 1e3:.1f} ms | "
              f"{errors[name]:+.1%} | {pred['bubble']:.3f} | {pred['comm_s']['tp'] * 1e3:.1f} / "
              f"{pred['comm_s']['dp'] * 1e3:.1f} ms |")
    absolute = [abs(e) for e in errors.values()]
    print(f"\nmedian |error| {statistics.median(absolute):.1%}, max {max(absolute):.1%} over {len(rows)} runs")
    flips = []
    for i, (a, ma, la, ha, pa) in enumerate(rows):
        for b, mb, lb, hb, pb in rows[i + 1:]:
            apart = la > hb or lb > ha  # the measured ranges do not overlap
            if apart and (ma < mb) != (pa["step_s"] < pb["step_s"]):
                flips.append(f"{a} vs {b}")
    pairs = sum(1 for i, r in enumerate(rows) for s in rows[i + 1:] if r[2] > s[3] or s[2] > r[3])
    print(f"ranking: {pairs - len(flips)} of {pairs} separable pairs kept" + (f"; flipped: {', '.join(flips)}"
                                                                                if flips else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
