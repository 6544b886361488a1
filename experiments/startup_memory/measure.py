"""Start-up peak RSS per rank: per-rank materialisation against the whole-model build.

Runs `python run.py model=gpt2-medium` (vocabulary 50257: the real 355M-parameter model,
1.42 GB in fp32) at pp 4 and at tp 4, each with the default start-up (the model built on the
meta device, each rank materialising only its part) and with `debug.materialise_whole=true`
(every rank builds the whole model first, then keeps its part: the start-up before this
change). One training step each; the numbers are taken before it. Writes results.md.

What a number is: `startup_rss_peak_bytes` is the rank's peak resident memory (ru_maxrss)
once its model part is built, before the first step (no gradients, optimizer states or
activations yet); `rss_before_build_bytes` is its resident memory just before the build
(Python, torch, transformers, the process group). Their difference is what building costs.

    python experiments/startup_memory/measure.py [out_dir]
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=gpt2-medium", "model.vocab_size=50257", "model.max_positions=64", "data=synthetic",
          "data.vocab_size=50257", "data.seq_len=32", "data.num_samples=64", "logger=none", "trainer.steps=1",
          "trainer.micro_batch_size=1", "metrics.skip_first=0", "metrics.peak_tflops=1.0"]
LAYOUTS = {"pp4": ["parallelism=pp4", "schedule=flush", "schedule.microbatches=4"],
           "tp4": ["parallelism=tp4", "schedule.microbatches=1"]}
MiB = 2 ** 20


def run_case(layout: str, whole: bool, out: Path) -> dict:
    job = out / f"{layout}_{'whole' if whole else 'per_rank'}"
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *LAYOUTS[layout], f"debug.materialise_whole={whole}",
           f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((job / "summary.json").read_text())


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in LAYOUTS:
        for whole in (True, False):
            s = run_case(layout, whole, out)
            for r in s["ranks"]:
                build = r["startup_rss_peak_bytes"] - r["rss_before_build_bytes"]
                rows.append((layout, "whole model, then its part" if whole else "per rank (meta, then its part)",
                             r["rank"], r["params_bytes"] / MiB, r["rss_before_build_bytes"] / MiB,
                             r["startup_rss_peak_bytes"] / MiB, build / MiB))
    lines = [f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}, CPU (gloo). gpt2-medium, vocabulary 50257: 354.8M parameters, "
             "1353 MiB in fp32.", "",
             "| layout | start-up | rank | its parameters (MiB) | RSS before build (MiB) | start-up peak RSS (MiB) "
             "| build cost (MiB) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d:.0f} | {e:.0f} | {f:.0f} | {g:.0f} |" for a, b, c, d, e, f, g in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "experiments" / "startup_memory" / "runs")
