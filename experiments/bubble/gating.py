"""Receives that gate only their own op, measured: this tree against an older checkout
(one Work per batch) on the same layouts, alternating.

Usage (repository root): python experiments/bubble/gating.py OLD_CHECKOUT [--out DIR] [--repeats R]

OLD_CHECKOUT: a checkout from before the gating rule (e.g. `git worktree add /tmp/old 7163177`).
Each configuration is `python run.py ...` in each tree (gpt2-tiny widths, 8 blocks, pp 2,
8 micro-batches of 4 x 128 synthetic tokens, 12 steps, medians over steps 4-12), R
repeats, alternating trees. Printed: the measured bubble and tokens/s per tree (median over
repeats, range), and the clock's prediction at zero link cost and equal op times per op
(the run's own measured means, from calibration.json) of the two p2p rules.
"""
import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COMMON = ["parallelism=pp2", "data=synthetic", "logger=none", "trainer.steps=12", "trainer.micro_batch_size=4",
          "schedule.microbatches=8", "metrics.skip_first=3", "model.n_layer=8"]
CONFIGS = {"zbh1": ["schedule=zbh1"], "interleaved-zb": ["schedule=interleaved-zb", "schedule.virtual_stages=2"]}


def run(tree: Path, job: Path, args: list[str]) -> dict:
    r = subprocess.run([sys.executable, str(tree / "run.py"), *COMMON, *args, f"hydra.run.dir={job}"], cwd=tree,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{job}: {r.stderr[-2000:]}")
    return json.loads((job / "summary.json").read_text())


def predicted(job: Path, name: str, v: int) -> tuple[float, float]:
    """(one Work per batch, groups): the clock at this run's mean op times, no link cost."""
    from framework.schedules.p2p import RankPlan, comm_plan
    from framework.schedules import get
    from framework.metrics.calibrate import Calibration
    from framework.schedules.clock import Costs, predict

    cal = Calibration.from_json(json.loads((job / "calibration.json").read_text()))
    sched = get(name)
    smap = sched.stage_map(2, v)
    plans = comm_plan(sched.generate(2, 8, v, 1), smap)
    whole = {r: RankPlan(p.actions, [[replace(op, group=0) for op in b] for b in p.batches]) for r, p in plans.items()}
    costs = Costs(cal.costs().compute)
    return predict(whole, smap, costs, True, "nccl").bubble, predict(plans, smap, costs, True, "gloo").bubble


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gating"))
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    got = {(n, t): [] for n in CONFIGS for t in ("old", "new")}
    pred = {}
    for rep in range(a.repeats):
        for name, args in CONFIGS.items():
            for tag, tree in (("old", a.old), ("new", ROOT)):
                job = a.out / f"r{rep}" / f"{tag}_{name}"
                got[name, tag].append(run(tree, job, args))
                if tag == "new" and rep == 0:
                    pred[name] = predicted(job, name, 2 if "interleaved" in name else 1)
    print("| schedule | bubble old / new (median of repeats) | tokens/s old / new (median, range) | "
          "clock at the run's op times: one Work per batch / groups |")
    print("|---|---|---|---|")
    for name in CONFIGS:
        old, new = got[name, "old"], got[name, "new"]
        b = [statistics.median(r["bubble_fraction"] for r in x) for x in (old, new)]
        t = [[r["tokens_per_s"] for r in x] for x in (old, new)]
        print(f"| {name} | {b[0]:.3f} / {b[1]:.3f} | {statistics.median(t[0]):,.0f} ({min(t[0]):,.0f}-{max(t[0]):,.0f})"
              f" / {statistics.median(t[1]):,.0f} ({min(t[1]):,.0f}-{max(t[1]):,.0f}) | "
              f"{pred[name][0]:.3f} / {pred[name][1]:.3f} |")


if __name__ == "__main__":
    main()
