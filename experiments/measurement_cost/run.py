"""What measuring costs (issue 46, item 3), measured inside one process.

With `metrics.activations=sampled` and `trainer.log_interval=2`, a run alternates a step
with every per-step measurement on (the saved-activation tracker's hook on every saved
tensor, the model states' bytes walked: framework/train/trainer.py, tracks_activations)
and a step with the minimum the framework always runs (the one clock's marks, the step-time
breakdown, the comm spans, host_syncs, the CPU-load reading). Each measured step k (even)
is paired with step k + 1 (odd, untracked): their ratio is the cost of measuring, free of
the 20-25 % that separate two processes on this machine (two runs of one setting differ by
that much; the steps inside one run by a few per cent). Prints one JSON line per run and a
markdown table: per layout, untracked / tracked step time as the median of the pairs'
ratios over every run, with its 10th-90th percentile and the pair count.

    .venv/bin/python experiments/measurement_cost/run.py --runs 3 --out /tmp/mcost

Steps 1-2 (warm-up, and step 1 always tracked) are left out; the step time is the one
metrics.jsonl reports (data + forward / backward + update, the one clock).
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 26
COMMON = ["data=synthetic", "logger=none", f"trainer.steps={STEPS}", "metrics.skip_first=2", "trainer.log_interval=2",
          "metrics.activations=sampled", "trainer.precision=fp32", "trainer.warmup_steps=1"]
LAYOUTS = {  # many saved tensors per step: 24 narrow blocks, or 8 micro-batches through 2 stages
    "single_narrow24": ["parallelism=single", "model=gpt2-tiny", "model.n_layer=24", "model.n_embd=32",
                        "model.n_head=2", "data.seq_len=128", "trainer.micro_batch_size=4", "schedule.microbatches=4"],
    "pp2_flush_m8": ["parallelism=pp2", "schedule=flush", "model=gpt2-tiny", "data.seq_len=64",
                     "trainer.micro_batch_size=2", "schedule.microbatches=8"],
    "dp2_tiny": ["parallelism=dp2", "model=gpt2-tiny", "data.seq_len=64", "trainer.micro_batch_size=4",
                 "schedule.microbatches=4"],
}


def run(layout: str, out: Path, k: int) -> list[float]:
    """untracked / tracked step time of each pair (step k even, tracked; k + 1 untracked)."""
    job = out / f"{layout}_{k}"
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *LAYOUTS[layout], f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
    t = {r["step"]: r["step_time_s"] for r in map(json.loads, (job / "metrics.jsonl").read_text().splitlines())}
    return [t[s + 1] / t[s] for s in range(4, STEPS, 2) if s + 1 in t]


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default="/tmp/measurement_cost")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ratios: dict[str, list[float]] = {name: [] for name in a.layouts.split(",")}
    for k in range(a.runs):
        for layout in ratios:
            r = run(layout, out, k)
            ratios[layout] += r
            print(json.dumps({"layout": layout, "run": k, "untracked_over_tracked": [round(x, 4) for x in r],
                              "median": round(statistics.median(r), 4)}), flush=True)
    print("\n| layout | untracked / tracked step time: median of pairs | 10th-90th percentile | pairs |")
    print("|---|---|---|---|")
    for layout, v in ratios.items():
        print(f"| {layout} | {statistics.median(v):.3f} | {pct(v, 0.1):.3f}-{pct(v, 0.9):.3f} | {len(v)} |")


if __name__ == "__main__":
    main()
