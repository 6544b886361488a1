"""ZeRO stages 0-3 at dp = 2 and 4 on this machine: per-rank model-state memory, measured
against the ZeRO paper's formula, and tokens/s.

Runs `python run.py` for every (dp, zero) on gpt2-tiny with the same global batch (16
sequences of 128 tokens per step), each twice (REPEATS, interleaved), then writes
results.md (the table) and zero_memory.png (measured vs formula per stage) to out_dir.

    python experiments/zero_memory/sweep.py [out_dir]
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=gpt2-tiny", "data=pycode", "data.max_files=100", "data.seq_len=128", "logger=none",
          "trainer.steps=12", "trainer.micro_batch_size=4", "metrics.skip_first=3", "trainer.log_interval=12",
          "schedule=flush"]
DP = {2: ["parallelism=dp2", "schedule.microbatches=2"], 4: ["parallelism=dp4", "schedule.microbatches=1"]}
REPEATS = 2
MiB = 2 ** 20


def run_case(dp: int, zero: int, out: Path) -> dict:
    job = out / f"dp{dp}_zero{zero}"
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *DP[dp], f"parallelism.zero={zero}", f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((job / "summary.json").read_text())


def _row(dp: int, zero: int, runs: list[dict]) -> str:
    r = max(runs[0]["ranks"], key=lambda x: x["params_bytes"] + x["grads_bytes"] + x["optimizer_bytes"])
    measured = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
    formula = r["model_state_formula_bytes"]
    tps = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in runs)
    return (f"| {dp} | {zero} | {r['params_bytes'] / MiB:.3f} / {r['grads_bytes'] / MiB:.3f} / "
            f"{r['optimizer_bytes'] / MiB:.3f} | {measured / MiB:.3f} | {formula / MiB:.3f} "
            f"| {100 * (measured - formula) / formula:+.2f} % | {r['model_state_formula_bf16_bytes'] / MiB:.3f} "
            f"| {r['zero_transient_peak_bytes'] / MiB:.3f} | {tps} | {runs[0]['loss']:.4f} |")


def table(results: dict) -> str:
    head = ("| dp | zero | params / grads / optimizer per rank (MiB) | measured model states (MiB) | formula, fp32 "
            "(MiB) | measured vs formula | formula, bf16 form (MiB) | transient peak (MiB) | tokens/s (run 1 / run 2) "
            "| final loss |")
    return "\n".join([head, "|" + "---|" * 10] + [_row(dp, z, runs) for (dp, z), runs in results.items()])


def plot(results: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, dp in zip(axes, (2, 4), strict=True):
        zs = [0, 1, 2, 3]
        ranks = [results[dp, z][0]["ranks"][0] for z in zs]
        parts = {k: [r[k] / MiB for r in ranks] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
        bottom = [0.0] * 4
        for k, vals in parts.items():
            ax.bar([z - 0.2 for z in zs], vals, 0.4, bottom=bottom, label=k.replace("_bytes", " (measured)"))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.bar([z + 0.2 for z in zs], [r["model_state_formula_bytes"] / MiB for r in ranks], 0.4, color="grey",
               label="ZeRO formula (fp32)")
        ax.set_title(f"dp = {dp}: model states per rank")
        ax.set_xticks(zs, [f"zero {z}" for z in zs])
    axes[0].set_ylabel("MiB")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs" / "zero_memory")
    results = {(dp, z): [] for dp in (2, 4) for z in (0, 1, 2, 3)}
    for i in range(REPEATS):
        for dp, z in results:
            results[dp, z].append(run_case(dp, z, out / f"run{i + 1}"))
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available, "
               f"torch {torch.__version__}")
    text = f"Measured on: {machine}\n\n{table(results)}\n"
    (out / "results.md").write_text(text)
    plot(results, out / "zero_memory.png")
    print(text)


if __name__ == "__main__":
    main()
