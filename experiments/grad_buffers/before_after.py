"""ZeRO 2-3 step time and memory before and after gradients live in the reduction's buffer
(issue 46, item 1: no flatten copy per step), two checkouts side by side.

Usage (repository root):
    git worktree add /tmp/before46 93a24b0      # the tree before the change
    .venv/bin/python experiments/grad_buffers/before_after.py --before /tmp/before46 --after . --pairs 3

Each pair runs one layout in the `before` checkout and then in `after` (the order swapped
every other pair, so a drift of the machine falls on both), as `python run.py <overrides>`
with the same interpreter; measured: summary.json's median step time (steps after
metrics.skip_first) and the rank's peak resident memory. Printed: one JSON line per run, and
per layout the median over pairs of after / before step time with its range, and both
checkouts' median step time and peak RSS. The layouts are cpu_accuracy.py's ZeRO runs (world
2, fp32, synthetic data) and ZeRO 2 at the middle width.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.cluster_model.cpu_accuracy import COMMON, WIDTHS  # noqa: E402

LAYOUTS = {
    "w384_dp2_zero2": WIDTHS["w384"] + ["parallelism=dp2", "parallelism.zero=2"],
    "w384_dp2_zero3": WIDTHS["w384"] + ["parallelism=dp2", "parallelism.zero=3"],
    "w768_dp2_zero3": WIDTHS["w768"] + ["parallelism=dp2", "parallelism.zero=3"],
}


def measure(tree: Path, overrides: list[str], job: Path) -> dict:
    cmd = [sys.executable, str(tree / "run.py"), *COMMON, *overrides, f"hydra.run.dir={job}"]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{job} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    s = json.loads((job / "summary.json").read_text())
    return {"step_time_s": s["step_time_s"], "rss_peak_bytes": max(r["rss_peak_bytes"] for r in s["ranks"]),
            "zero_transient_peak_bytes": s.get("zero_transient_peak_bytes_max")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a checkout of the tree before the change")
    ap.add_argument("--after", default=str(ROOT))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--only", default=",".join(LAYOUTS))
    ap.add_argument("--out", default="/tmp/grad_buffers")
    a = ap.parse_args()
    trees = {"before": Path(a.before).resolve(), "after": Path(a.after).resolve()}
    got = {name: {"before": [], "after": []} for name in a.only.split(",")}
    for k in range(a.pairs):
        for name in got:
            for side in (("before", "after") if k % 2 == 0 else ("after", "before")):
                m = measure(trees[side], LAYOUTS[name], Path(a.out) / f"{name}_{side}_{k}")
                got[name][side].append(m)
                print(json.dumps({"layout": name, "side": side, "pair": k, **m}), flush=True)
    print("\n| layout | after / before step time, median of pairs (range) | before: step, peak RSS | "
          "after: step, peak RSS | ZeRO transient peak (before / after) |")
    print("|---|---|---|---|---|")
    for name, sides in got.items():
        b, f = sides["before"], sides["after"]
        ratios = sorted(x["step_time_s"] / y["step_time_s"] for x, y in zip(f, b))

        def med(rows, key):
            return statistics.median(r[key] for r in rows)
        print(f"| {name} | {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) | "
              f"{1e3 * med(b, 'step_time_s'):.1f} ms, {med(b, 'rss_peak_bytes') / 2**20:.0f} MiB | "
              f"{1e3 * med(f, 'step_time_s'):.1f} ms, {med(f, 'rss_peak_bytes') / 2**20:.0f} MiB | "
              f"{b[0]['zero_transient_peak_bytes'] / 2**20:.1f} / {f[0]['zero_transient_peak_bytes'] / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
