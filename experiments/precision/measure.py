"""The four training precisions on the same data: loss curves, tokens/s, bytes per rank, p2p bytes.

fp32, bf16-autocast, bf16-mixed and fp16-mixed train gpt2-tiny (4 layers, n_embd 128) on
the pycode corpus with the same seed, batch and schedule, on two pipeline stages (pp 2,
flush, 4 micro-batches of 8 x 128 tokens), so every step also sends activations and their
gradients between the stages. Then writes results.json, loss.png (the curves and each
mode's difference from fp32, smoothed over 20 steps) and prints the README table.

    python experiments/precision/measure.py [out_dir] [steps]

What each number includes: tokens/s is the median over the steps after warm-up (3) of
global tokens / the slowest rank's step time; model states are one rank's measured bytes
(parameters, gradients, master weights, optimizer states) beside this configuration's
formula; p2p bytes per step are computed (not counted on the wire): 2 messages (activation,
gradient) per micro-batch per stage boundary, each micro-batch x seq x hidden elements in
the policy's p2p dtype.
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
MODES = ("fp32", "bf16-autocast", "bf16-mixed", "fp16-mixed")
COMMON = ["model=gpt2-tiny", "data=pycode", "data.seq_len=128", "logger=none", "parallelism=pp2", "schedule=flush",
          "schedule.microbatches=4", "trainer.micro_batch_size=8", "trainer.warmup_steps=30", "trainer.log_interval=50",
          "metrics.skip_first=3", "optimizer.lr=1e-3"]
MiB = 2 ** 20


def run_mode(mode: str, out: Path, steps: int) -> dict:
    job = out / mode
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, f"trainer.steps={steps}", f"trainer.precision={mode}",
           f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    summary = json.loads((job / "summary.json").read_text())
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((job / "run_info.json").read_text())
    m, pp = 4, 2
    r0 = summary["ranks"][0]
    return {"mode": mode, "loss": [r["loss"] for r in rows], "tokens_per_s": summary["tokens_per_s"],
            "step_time_s": summary["step_time_s"], "skipped_steps": summary.get("skipped_steps"),
            "loss_scale": summary.get("loss_scale"), "p2p_message_bytes": info["p2p_message_bytes"],
            "p2p_bytes_per_step": 2 * m * (pp - 1) * info["p2p_message_bytes"],
            "rank0": {k: r0[k] for k in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes",
                                         "model_state_bytes", "model_state_formula_bytes",
                                         "model_state_formula_paper_bytes", "activation_peak_bytes")}}


def smooth(xs: list[float], w: int = 20) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def plot(results: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ref = smooth(results["fp32"]["loss"])
    for mode, r in results.items():
        s = smooth(r["loss"])
        a.plot(range(1, len(s) + 1), s, label=mode)
        b.plot(range(1, len(s) + 1), [x - y for x, y in zip(s, ref)], label=mode)
    a.set(xlabel="step", ylabel="training loss (20-step mean)", title="loss")
    b.set(xlabel="step", ylabel="loss - fp32's (20-step means)", title="difference from fp32")
    b.axhline(0, color="grey", lw=0.5)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict) -> str:
    ref = results["fp32"]["loss"]
    n = len(ref)
    tail = slice(n - 50, n)
    head = ("| mode | loss, mean of the last 50 steps | vs fp32 | tokens/s | rank 0 model states: params / grads / "
            "master / optimizer (MiB) | measured = formula | paper's form (MiB) | p2p bytes per step | skipped steps |")
    lines = [head, "|" + "---|" * 9]
    for mode, r in results.items():
        last = statistics.fmean(r["loss"][tail])
        s = r["rank0"]
        lines.append(
            f"| {mode} | {last:.4f} | {last - statistics.fmean(ref[tail]):+.4f} | {r['tokens_per_s']:,.0f} | "
            f"{s['params_bytes'] / MiB:.2f} / {s['grads_bytes'] / MiB:.2f} / {s['master_bytes'] / MiB:.2f} / "
            f"{s['optimizer_bytes'] / MiB:.2f} | {s['model_state_bytes'] == s['model_state_formula_bytes']} "
            f"({s['model_state_bytes']:,} B) | {s['model_state_formula_paper_bytes'] / MiB:.2f} | "
            f"{r['p2p_bytes_per_step']:,} | {r['skipped_steps'] if r['skipped_steps'] is not None else '-'} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/precision").resolve()
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    out.mkdir(parents=True, exist_ok=True)
    results = {mode: run_mode(mode, out, steps) for mode in MODES}
    results_path = Path(__file__).with_name("results.json")
    results_path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "steps": steps,
                                        "results": results}, indent=1))
    plot(results, Path(__file__).with_name("loss.png"))
    print(table(results))


if __name__ == "__main__":
    main()
