"""dp scaling on this machine: tokens/s and memory per rank for dp = 1 and 2.

Runs `python run.py experiment=dp_scaling ...` for three layouts, each twice (REPEATS) to
show run-to-run spread, then prints a Markdown table from the jobs' summary.json files and
writes it to results.md. dp=1 with 2 micro-batches vs dp=2 is weak scaling (same work per
rank); dp=1 with 4 micro-batches vs dp=2 is strong scaling (same global batch, so the same
losses).

    python experiments/dp_scaling/sweep.py [out_dir]
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CASES = {  # name -> overrides; experiment=dp_scaling fixes model, data, steps and micro-batch size 8
    "dp=1, 2 micro-batches": ["parallelism=single", "schedule.microbatches=2"],  # 16 seqs per step
    "dp=1, 4 micro-batches": ["parallelism=single", "schedule.microbatches=4"],  # 32 seqs per step
    "dp=2, 2 micro-batches each": ["parallelism=dp2", "schedule.microbatches=2"],  # 32 seqs per step
}
REPEATS = 2
MiB = 2 ** 20


def run_case(name: str, overrides: list[str], out: Path) -> dict:
    job = out / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [sys.executable, str(ROOT / "run.py"), "experiment=dp_scaling", *overrides, f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((job / "summary.json").read_text())


def table(results: dict[str, list[dict]]) -> str:
    head = ("| case | ranks | global batch (seqs) | tokens/s (run 1 / run 2) | step time ms (run 1 / run 2) "
            "| params / grads / optimizer per rank (MiB) | activation peak per rank (MiB) | RSS peak per rank (MiB) "
            "| final loss |")
    lines = [head, "|" + "---|" * 9]
    for name, runs in results.items():
        s, r = runs[0], runs[0]["ranks"][0]
        tps = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in runs)
        ms = " / ".join(f"{x['step_time_s'] * 1e3:.0f}" for x in runs)
        lines.append(
            f"| {name} | {s['world_size']} | {s['global_batch']} | {tps} | {ms} "
            f"| {r['params_bytes'] / MiB:.2f} / {r['grads_bytes'] / MiB:.2f} / {r['optimizer_bytes'] / MiB:.2f} "
            f"| {max(x['activation_peak_bytes'] for x in s['ranks']) / MiB:.1f} "
            f"| {max(x['rss_peak_bytes'] for x in s['ranks']) / MiB:.0f} | {s['loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs" / "dp_scaling")
    results = {name: [] for name in CASES}
    for i in range(REPEATS):  # interleaved, so slow drift of the machine hits every case alike
        for name, ov in CASES.items():
            results[name].append(run_case(name, ov, out / f"run{i + 1}"))
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available, torch {torch.__version__}"
    text = f"Measured on: {machine}\n\n{table(results)}\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
