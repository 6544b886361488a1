"""Measured vs analytic bubble of the zero-bubble schedules (with flush as the baseline) at
pp = 2 and 4, m = 4, 8, 16, on this machine.

One Hydra multirun per pp, then a table from the jobs' summary.json: the analytic bubble
at the run's own measured op times (`bubble_fraction_analytic`, from `op_time_s`: median
F, I, W or B compute), the same at T_F = T_I = T_W, the measured bubble, and the op times.
gpt2-tiny widths, 8 blocks, synthetic data, micro-batch 4, 12 steps (3 warm-up).

    python experiments/bubble/zero_bubble.py [sweep_dir] [--table]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ["flush", "zbh1", "zbh2", "interleaved-zb", "zbv", "dualpipev"]
MICROBATCHES = [4, 8, 16]
ARGS = ["data=synthetic", "logger=none", "trainer.micro_batch_size=4", "model.n_layer=8", "trainer.steps=12",
        "metrics.skip_first=3"]


def _ms(s: dict, op: str) -> str:
    t = s["op_time_s"].get(op)
    return f"{t * 1e3:.2f}" if t is not None else "-"


def main() -> None:
    """`--table`: only the table, from an earlier sweep (e.g. after re-running some jobs)."""
    args = [a for a in sys.argv[1:] if a != "--table"]
    sweep_root = Path(args[0] if args else ROOT / "outputs" / "bubble_zero_bubble")
    rows = []
    for pp in (2, 4):
        sweep = sweep_root / f"pp{pp}"
        if "--table" not in sys.argv:
            subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", f"parallelism=pp{pp}",
                            f"schedule={','.join(SCHEDULES)}", f"schedule.microbatches={','.join(map(str, MICROBATCHES))}",
                            *ARGS, f"hydra.sweep.dir={sweep}"], cwd=ROOT, check=True, capture_output=True, text=True)
        for job in sweep.iterdir():
            summary = job / "summary.json"
            if summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
                rows.append(json.loads(summary.read_text()))
    rows.sort(key=lambda s: (s["pp"], SCHEDULES.index(s["schedule"]), s["microbatches"]))
    lines = ["| pp | schedule | m | v | analytic at measured times | analytic at equal times | measured (mean of ranks) "
             "| measured - analytic (points) | T_F ms | T_I ms | T_W ms | T_B ms | tokens/s |", "|" + "---|" * 13]
    for s in rows:
        lines.append(f"| {s['pp']} | {s['schedule']} | {s['microbatches']} | {s['virtual_stages']} "
                     f"| {s['bubble_fraction_analytic']:.3f} | {s['bubble_fraction_analytic_equal_times']:.3f} "
                     f"| {s['bubble_fraction']:.3f} | {100 * (s['bubble_fraction'] - s['bubble_fraction_analytic']):+.1f} "
                     f"| {_ms(s, 'F')} | {_ms(s, 'I')} | {_ms(s, 'W')} | {_ms(s, 'B')} | {s['tokens_per_s']:,.0f} |")
    text = "\n".join(lines) + "\n"
    (sweep_root / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
