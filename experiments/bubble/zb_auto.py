"""zb-auto's measured bubble, built from measured op times, beside zbh1 / zbh2 and flush.

For pp 2 and 4 and m 4, 8, 16 (gpt2-tiny widths, 8 blocks, synthetic data, micro-batch 4,
12 steps, 3 warm-up): a flush run, then zb-auto with `sim.from=` that flush run (its op
times and link latency) at the default memory limit (p, ZB-H1's memory) and at 2p-1
(ZB-H2's), and zbh1 / zbh2 in the same pass. The table: analytic bubble at the run's own
op times, the simulator's replay, the measured bubble, tokens/s.

    python experiments/bubble/zb_auto.py [out_dir] [--table]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["data=synthetic", "logger=none", "trainer.micro_batch_size=4", "model.n_layer=8", "trainer.steps=12",
        "metrics.skip_first=3"]


def cases(pp: int, m: int, out: Path) -> list[tuple[str, list[str]]]:
    flush = out / f"pp{pp}-m{m}-flush"
    return [("flush", [f"hydra.run.dir={flush}"]),
            ("zbh1", [f"hydra.run.dir={out / f'pp{pp}-m{m}-zbh1'}"]),
            ("zbh2", [f"hydra.run.dir={out / f'pp{pp}-m{m}-zbh2'}"]),
            ("zb-auto", [f"sim.from={flush}", f"hydra.run.dir={out / f'pp{pp}-m{m}-zb-auto'}"]),
            ("zb-auto", [f"sim.from={flush}", f"schedule.memory_limit_microbatches={2 * pp - 1}",
                         f"hydra.run.dir={out / f'pp{pp}-m{m}-zb-auto-lim{2 * pp - 1}'}"])]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else ROOT / "outputs" / "bubble_zb_auto")
    lines = ["| pp | schedule | memory limit | m | analytic at measured times | predicted (replay) | measured "
             "| tokens/s |", "|" + "---|" * 8]
    for pp in (2, 4):
        for m in (4, 8, 16):
            for name, extra in cases(pp, m, out):
                job = Path(extra[-1].split("=", 1)[1])
                if "--table" not in sys.argv and not (job / "summary.json").exists():
                    subprocess.run([sys.executable, str(ROOT / "run.py"), f"parallelism=pp{pp}", f"schedule={name}",
                                    f"schedule.microbatches={m}", *ARGS, *extra], cwd=ROOT, capture_output=True)
                if not (job / "summary.json").exists():
                    continue
                s = json.loads((job / "summary.json").read_text())
                if s.get("status") != "completed":
                    continue
                limit = next((e.split("=")[1] for e in extra if "memory_limit" in e),
                             {"zbh1": str(pp), "zbh2": str(2 * pp - 1), "zb-auto": f"{pp} (default)"}.get(name, "-"))
                lines.append(f"| {pp} | {name} | {limit} | {m} | {s['bubble_fraction_analytic']:.3f} "
                             f"| {s['predicted_bubble_fraction']:.3f} | {s['bubble_fraction']:.3f} "
                             f"| {s['tokens_per_s']:,.0f} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
