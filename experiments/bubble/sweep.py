"""Measured vs analytic bubble at pp = 2 over schedule x micro-batches, on this machine.

One Hydra multirun (`python run.py -m schedule=... schedule.microbatches=...`), then a
table from the jobs' summary.json files, written to results.md. Two model shapes:
`narrow` (gpt2-tiny widths, 8 blocks: the LM head makes the last stage ~5% heavier) and
`wide` (hidden 256, 64-token sequences: the head's share, so the stage imbalance, ~3%).

    python experiments/bubble/sweep.py narrow|wide [sweep_dir]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ["gpipe", "flush", "interleaved", "1f1b", "2bw"]
MICROBATCHES = [2, 4, 8]
# model.tie_embeddings=false: 1f1b / 2bw cannot keep a tied embedding, and the schedule
# presets do not change the model, so every schedule runs the same untied model.
ARGS = ["parallelism=pp2", "data=synthetic", "logger=none", "trainer.micro_batch_size=4", "model.n_layer=8",
        "model.tie_embeddings=false", "metrics.skip_first=3"]
SHAPES = {"narrow": ["trainer.steps=20"],
          "wide": ["trainer.steps=12", "model.n_embd=256", "model.n_head=4", "data.seq_len=64"]}


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "narrow"
    sweep = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / "outputs" / f"bubble_{shape}")
    subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", f"schedule={','.join(SCHEDULES)}",
                    f"schedule.microbatches={','.join(map(str, MICROBATCHES))}", *ARGS, *SHAPES[shape],
                    f"hydra.sweep.dir={sweep}"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    rows = []
    for job in sweep.iterdir():
        if (job / "summary.json").exists():
            s = json.loads((job / "summary.json").read_text())
            rows.append(s)
    rows.sort(key=lambda s: (SCHEDULES.index(s["schedule"]), s["microbatches"]))
    lines = ["| schedule | m | v | bubble analytic | bubble measured (mean of ranks) | measured - analytic (points) "
             "| bubble measured rank 0 / rank 1 | tokens/s | step ms |", "|" + "---|" * 9]
    for s in rows:
        per_rank = " / ".join(f"{r['bubble_fraction']:.3f}" for r in s["ranks"])
        lines.append(f"| {s['schedule']} | {s['microbatches']} | {s['virtual_stages']} | {s['bubble_fraction_analytic']:.3f} "
                     f"| {s['bubble_fraction']:.3f} | {100 * (s['bubble_fraction'] - s['bubble_fraction_analytic']):+.1f} "
                     f"| {per_rank} | {s['tokens_per_s']:,.0f} | {s['step_time_s'] * 1e3:.0f} |")
    text = "\n".join(lines) + "\n"
    (sweep / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
