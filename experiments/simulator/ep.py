"""How well does the simulator's ep what-if (docs/simulator.md, "Expert parallelism") predict
another expert-parallel size on this machine? Each case one run of run.py (synthetic data,
moe-tiny's shape, dp 2, micro-batch 2 x 128 tokens, 2 micro-batches, 20 steps, 4 warm-up):

- pp 1: ep 2 and ep 1, three runs each (the run-to-run spread): the all-to-all volume model
  against the bytes sent, each ep 2 run's replay against its median step, and the what-if
  ep 2 -> ep 1 (the measured all-to-all bandwidth) against the ep 1 runs' median;
- pp 2 (dp 2 x pp 2: 4 ranks on 2 cores, oversubscribed): one ep 2 and one ep 1 run, the
  what-if both ways (ep 1 -> ep 2 prices the all-to-all with the p2p link: no all-to-all
  calibration).
Errors are signed, predicted / measured - 1.

    python experiments/simulator/ep.py [out_dir]        (resumes: a case with a summary is kept)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import read_config  # noqa: E402
from framework.sim.alltoall import step_bytes  # noqa: E402
from framework.sim.cli import what_if  # noqa: E402

BASE = ["model=moe-tiny", "data=synthetic", "data.seq_len=128", "logger=none", "trainer.steps=20",
        "metrics.skip_first=4", "trainer.micro_batch_size=2", "schedule.microbatches=2"]
CASES = {**{f"pp1_ep{ep}_{rep}": ["parallelism=dp2", f"parallelism.ep={ep}"] for ep in (2, 1) for rep in range(3)},
         **{f"pp2_ep{ep}": ["parallelism=dp2_pp2", f"parallelism.ep={ep}"] for ep in (2, 1)}}


def run(out: Path, name: str, overrides: list[str]) -> dict:
    job = out / name
    if not (job / "summary.json").exists():
        subprocess.run([sys.executable, str(ROOT / "run.py"), *BASE, *overrides, f"hydra.run.dir={job}"], cwd=ROOT,
                       check=True, capture_output=True)
    return json.loads((job / "summary.json").read_text())


def bytes_sent(job: Path) -> tuple[float, float]:
    """(model, measured median a2a_bytes over the measured steps) of one job."""
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()][4:]
    cfg = read_config(str(job / "config.yaml"))
    layers = cfg.model.n_layer // cfg.parallelism.pp
    return step_bytes(cfg, layers), statistics.median(r["a2a_bytes"] for r in rows)


def main(out: Path) -> None:
    s = {name: run(out, name, ov) for name, ov in CASES.items()}
    print("| job | model bytes | measured bytes (median, max over ranks) | replay error |")
    print("|---|---|---|---|")
    for name in [n for n in CASES if "ep2" in n]:
        model, measured = bytes_sent(out / name)
        print(f"| {name} | {model:,.0f} | {measured:,.0f} ({measured / model - 1:+.1%}) | "
              f"{s[name].get('predicted_step_time_error', float('nan')):+.1%} |")
    ep1 = statistics.median(s[f"pp1_ep1_{r}"]["step_time_s"] for r in range(3))
    ep1_runs = sorted(s[f"pp1_ep1_{r}"]["step_time_s"] * 1e3 for r in range(3))
    print(f"\npp 1, ep 1 measured: {', '.join(f'{t:.1f}' for t in ep1_runs)} ms (median {ep1 * 1e3:.1f})")
    print("\n| from | to | predicted ms | measured ms | error | all-to-all model |")
    print("|---|---|---|---|---|---|")
    for rep in range(3):
        w = what_if(str(out / f"pp1_ep2_{rep}"), ["parallelism.ep=1"])
        print(f"| pp1_ep2_{rep} ({s[f'pp1_ep2_{rep}']['step_time_s'] * 1e3:.1f} ms) | ep 1 | "
              f"{w['predicted_step_time_s'] * 1e3:.1f} | {ep1 * 1e3:.1f} | {w['predicted_step_time_s'] / ep1 - 1:+.1%} | "
              f"{w['a2a_model']} |")
    for src, dst, ep in (("pp2_ep2", "pp2_ep1", 1), ("pp2_ep1", "pp2_ep2", 2)):
        w = what_if(str(out / src), [f"parallelism.ep={ep}"])
        m = s[dst]["step_time_s"]
        print(f"| {src} ({s[src]['step_time_s'] * 1e3:.1f} ms) | ep {ep} | {w['predicted_step_time_s'] * 1e3:.1f} | "
              f"{m * 1e3:.1f} | {w['predicted_step_time_s'] / m - 1:+.1%} | {w['a2a_model']} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/simulator_ep"))
