"""Expert parallelism on this machine: tokens/s, the all-to-all's share of the step and the
expert load over steps, for ep 1 / 2 / 4 at dp 4, dropless and with a capacity limit.

moe-tiny with 8 experts (top-2, 4 layers, hidden 128, expert width 128) on the pycode corpus,
the same seed, data and batch in every run: dp 4 (4 ranks), 1 micro-batch of 4 x 128 tokens
per rank (2,048 tokens per step), AdamW lr 1e-3, the Switch load-balancing loss at 0.01.
ep = 1 replicates every expert on every rank (DDP all-reduces them); ep = 2 / 4 split them
over 2 / 4 ranks (all-to-all dispatch and combine; expert gradients over expert dp). Then
writes results.json, load.png (each layer's load CV over steps per run) and prints the
README table.

    python experiments/moe/measure.py [out_dir] [steps] [repeats]

Each run is repeated (default 3, back to back in the order ep1, ep2, ep4, ...); the table gives
tokens/s and the all-to-all share as the median of the repeats with their range; the rest
(losses, loads, bytes) is the first repeat's, which the repeats reproduce (same seed).

What each number includes: tokens/s is the median over the steps after warm-up (3) of
global tokens / the slowest rank's step time; all-to-all share is the median over the same
steps of (the slowest rank's host seconds inside all-to-all, counts and tokens, forward and
backward) / step time, on CPU gloo the transfer plus the wait for the peers (4 ranks share 2
cores here, so waiting for a descheduled peer counts too); all-to-all bytes are what a rank
sends to other ranks per step (counted at the call, not on the wire); load CV, dead experts,
dropped fraction and the ep straggler factor are metrics.jsonl's (docs/metrics.md).
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=moe-tiny", "model.moe.experts=8", "data=pycode", "data.seq_len=128", "logger=none",
          "parallelism=dp4", "schedule.microbatches=1", "trainer.micro_batch_size=4", "trainer.warmup_steps=10",
          "trainer.log_interval=20", "metrics.skip_first=3", "optimizer.lr=1e-3",
          "model.moe.aux_losses=[{type:aux,coeff:0.01}]"]
RUNS = {f"ep{ep}{'-cf1' if cf else ''}": [f"parallelism.ep={ep}", f"model.moe.capacity_factor={cf or 'null'}"]
        for cf in (None, 1.0) for ep in (1, 2, 4)}
SKIP = 3


def run(name: str, overrides: list[str], out: Path, steps: int) -> dict:
    job = out / name
    if job.exists():  # a new repeat in a fresh directory (Hydra would set an old one aside)
        import shutil

        shutil.rmtree(job)
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *overrides, f"trainer.steps={steps}", f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    summary = json.loads((job / "summary.json").read_text())
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    kept = rows[SKIP:]
    layers = sorted(rows[0]["moe_layers"], key=int)
    return {
        "name": name, "tokens_per_s": summary["tokens_per_s"], "step_time_s": summary["step_time_s"],
        "loss": [r["loss"] for r in rows],
        "a2a_share": statistics.median(r.get("a2a_s", 0.0) / r["step_time_s"] for r in kept),
        "a2a_bytes": statistics.median(r.get("a2a_bytes", 0) for r in kept),
        "load_cv": {i: [r["moe_layers"][i]["load_cv"] for r in rows] for i in layers},
        "dead_experts": statistics.fmean(r["moe_dead_experts"] for r in kept),
        "dropped_fraction": statistics.fmean(r["moe_dropped_fraction"] for r in kept),
        "ep_straggler": statistics.fmean(statistics.fmean(r["moe_layers"][i]["ep_straggler"] for i in layers)
                                         for r in kept),
        "tokens_per_expert_last": {i: rows[-1]["moe_layers"][i]["tokens_per_expert"] for i in layers},
    }


def plot(results: dict, path: Path) -> None:
    layers = list(next(iter(results.values()))["load_cv"])
    fig, axes = plt.subplots(1, len(layers), figsize=(4 * len(layers), 3.5), sharey=True)
    for ax, layer in zip(axes, layers, strict=True):
        for name, r in results.items():
            ax.plot(range(1, len(r["load_cv"][layer]) + 1), r["load_cv"][layer], label=name, lw=1)
        ax.set(xlabel="step", title=f"layer {layer}: expert load CV")
    axes[0].set_ylabel("std / mean of tokens per expert")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict) -> str:
    head = ("| run | tokens/s | step time (ms) | all-to-all share of step | all-to-all bytes sent per rank per step | "
            "load CV, mean over layers: first 10 / last 10 steps | dropped fraction | dead experts per step | "
            "ep straggler (max / mean tokens received) | loss, mean of the last 10 steps |")
    lines = [head, "|" + "---|" * 10]
    for name, r in results.items():
        tps, share = r["repeats"]["tokens_per_s"], r["repeats"]["a2a_share"]

        def cv(window):
            return statistics.fmean(statistics.fmean(v[window]) for v in r["load_cv"].values())
        lines.append(f"| {name} | {statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | "
                     f"{1e3 * statistics.median(r['repeats']['step_time_s']):.0f} | "
                     f"{100 * statistics.median(share):.1f} % ({100 * min(share):.1f}-{100 * max(share):.1f}) | "
                     f"{r['a2a_bytes']:,.0f} | {cv(slice(0, 10)):.3f} / {cv(slice(-10, None)):.3f} | "
                     f"{100 * r['dropped_fraction']:.1f} % | {r['dead_experts']:.2f} | {r['ep_straggler']:.3f} | "
                     f"{statistics.fmean(r['loss'][-10:]):.4f} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/moe").resolve()
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for i in range(repeats):  # whole rounds, so a slow spell of the machine hits every run alike
        for name, overrides in RUNS.items():
            r = run(name, overrides, out, steps)
            first = results.setdefault(name, {**r, "repeats": {"tokens_per_s": [], "a2a_share": [], "step_time_s": []}})
            for k in first["repeats"]:
                first["repeats"][k].append(r[k])
    Path(__file__).with_name("results.json").write_text(json.dumps(
        {"machine": platform.processor() or platform.machine(), "steps": steps, "repeats": repeats,
         "results": results}, indent=1))
    plot(results, Path(__file__).with_name("load.png"))
    print(table(results))


if __name__ == "__main__":
    main()
