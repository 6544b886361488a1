"""tp vs pp vs dp at 4 ranks on this machine: tokens/s and memory per rank.

Runs `python run.py` for dp4, tp4 (with and without sequence parallelism), pp4 and
tp2_pp2 on the same model and global batch (16 sequences of 128 tokens per step), each
twice (REPEATS, interleaved so drift of the shared machine hits every case alike), then
prints a Markdown table from the jobs' summary.json files and writes it to results.md.

    python experiments/tp_vs_pp/sweep.py [out_dir]
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=gpt2-tiny", "data=pycode", "data.max_files=100", "data.seq_len=128", "logger=none",
          "trainer.steps=15", "trainer.micro_batch_size=4", "metrics.skip_first=3", "trainer.log_interval=15",
          "schedule=flush"]
CASES = {  # 16 sequences per step in every case
    "dp4": ["parallelism=dp4", "schedule.microbatches=1"],
    "tp4": ["parallelism=tp4", "schedule.microbatches=4"],
    "tp4 + sequence parallel": ["parallelism=tp4", "schedule.microbatches=4", "parallelism.sequence_parallel=true"],
    "pp4 (flush)": ["parallelism=pp4", "schedule.microbatches=4"],
    "tp2_pp2 (flush)": ["parallelism=tp2_pp2", "schedule.microbatches=4"],
}
REPEATS = 2
MiB = 2 ** 20


def run_case(name: str, overrides: list[str], out: Path) -> dict:
    job = out / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *overrides, f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((job / "summary.json").read_text())


def table(results: dict[str, list[dict]]) -> str:
    head = ("| case | tokens/s (run 1 / run 2) | step time ms (run 1 / run 2) | params / grads / optimizer per rank, "
            "max (MiB) | activation peak per rank, max (MiB) | tp bytes sent per rank per step (MiB) "
            "| bubble measured / analytic | final loss |")
    lines = [head, "|" + "---|" * 8]
    for name, runs in results.items():
        s = runs[0]
        top = max(s["ranks"], key=lambda r: r["model_state_bytes"])
        tps = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in runs)
        ms = " / ".join(f"{x['step_time_s'] * 1e3:.0f}" for x in runs)
        lines.append(
            f"| {name} | {tps} | {ms} "
            f"| {top['params_bytes'] / MiB:.2f} / {top['grads_bytes'] / MiB:.2f} / {top['optimizer_bytes'] / MiB:.2f} "
            f"| {s['activation_peak_bytes_max'] / MiB:.1f} | {s['tp_comm_bytes'] / MiB:.1f} "
            f"| {s['bubble_fraction']:.2f} / {s['bubble_fraction_analytic']:.2f} | {s['loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs" / "tp_vs_pp")
    results = {name: [] for name in CASES}
    for i in range(REPEATS):
        for name, ov in CASES.items():
            results[name].append(run_case(name, ov, out / f"run{i + 1}"))
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available, "
               f"torch {torch.__version__}")
    text = f"Measured on: {machine}\n\n{table(results)}\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
