"""Peak RSS and wall time per rank of a checkpoint save and load: sharded boxes against the old gather.

Runs `python run.py model=gpt2-medium model.vocab_size=50257` (354.8M parameters; with AdamW
the model's state is 4.26 GB in fp32: parameters, exp_avg, exp_avg_sq) at ZeRO-3 dp 4, tp 4
and pp 4 (flush). Per layout:
- save: one step, then a checkpoint (trainer.checkpoint_interval=1);
- load: a second job resuming that checkpoint for one more step.
Each rank reports in summary.json (`ranks[i].checkpoint_save` / `checkpoint_load`, this
code): resident memory just before, its sampled peak (every 5 ms) during the save (staging
to the end of the background write) or the load, wall times, and the bytes of its boxes.

`--gather <worktree>` runs the same jobs on a checkout of the code before issue 20 (commit
acbb1e3: a save gathers each stage on its dp-0 / tp-0 rank, a load reads full tensors on
every rank); a `sitecustomize.py` put on PYTHONPATH wraps its `checkpoint.save` / `load` with
the same sampler and writes `ckpt_io/rank<r>.json` into the job directory.

    python experiments/checkpoint_memory/measure.py [--gather <worktree of acbb1e3>] [--only zero3,tp4,pp4] out_dir
    python experiments/checkpoint_memory/measure.py --table <sharded out_dir> <gather out_dir>

The table's "added" columns are the sampled peak minus the resident memory just before: what
the save or load cost the rank on top of what it held. Wall times: save = staging to the
marker (this code: `write_s`; the step waited `step_wait_s` of it), load = the whole load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=gpt2-medium", "model.vocab_size=50257", "model.max_positions=64", "data=synthetic",
          "data.vocab_size=50257", "data.seq_len=32", "data.num_samples=64", "logger=none",
          "trainer.micro_batch_size=1", "metrics.skip_first=0", "metrics.peak_tflops=1.0", "trainer.warmup_steps=1",
          "trainer.checkpoint_interval=1", "trainer.keep_checkpoints=null", "trainer.hang_timeout_s=1200"]
LAYOUTS = {"zero3": ["parallelism=zero3", "parallelism.dp=4", "schedule.microbatches=1"],
           "tp4": ["parallelism=tp4", "schedule.microbatches=1"],
           "pp4": ["parallelism=pp4", "schedule=flush", "schedule.microbatches=4"]}

SHIM = '''
import json, os, threading, time
def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
class _Sampler:
    def __init__(self):
        self.peak, self.stop_ = _rss(), threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while not self.stop_.wait(0.005):
            self.peak = max(self.peak, _rss())
    def stop(self):
        self.stop_.set(); self.t.join(); return max(self.peak, _rss())
def _wrap(kind, fn, job_dir_of):
    def inner(*a, **k):
        t0, rss0, s = time.time(), _rss(), _Sampler()
        out = fn(*a, **k)
        rec = {"rss_before_bytes": rss0, "peak_rss_bytes": s.stop(), "wall_s": time.time() - t0}
        d = os.path.join(job_dir_of(a), "ckpt_io"); os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{kind}_rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(rec, f)
        return out
    return inner
if os.environ.get("CKPT_SHIM") == "1":
    import framework.checkpoint as c
    c.save = _wrap("save", c.save, lambda a: a[4])
    c.load = _wrap("load", c.load, lambda a: os.path.dirname(os.path.dirname(a[0])) + "/load_job")
'''


def run(code: Path, job: Path, layout: str, extra: list[str], env: dict) -> float:
    cmd = [sys.executable, str(code / "run.py"), *COMMON, *LAYOUTS[layout], *extra, f"hydra.run.dir={job}"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return time.time() - t0


def sharded(layout: str, out: Path) -> list[dict]:
    save, load = out / f"{layout}_sharded_save", out / f"{layout}_sharded_load"
    run(ROOT, save, layout, ["trainer.steps=1"], dict(os.environ))
    run(ROOT, load, layout, ["trainer.steps=2", "trainer.checkpoint_interval=0",
                             f"trainer.resume={save / 'checkpoints' / 'step_1'}"], dict(os.environ))
    s, ld = (json.loads((j / "summary.json").read_text())["ranks"] for j in (save, load))
    return [{"rank": a["rank"], "save": a["checkpoint_save"], "load": b["checkpoint_load"]} for a, b in zip(s, ld)]


def gathered(layout: str, out: Path, code: Path) -> list[dict]:
    shim = out / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    env = {**os.environ, "PYTHONPATH": f"{shim}:{code}", "CKPT_SHIM": "1"}
    save, load = out / f"{layout}_gather_save", out / f"{layout}_gather_save" / "load_job"
    run(code, save, layout, ["trainer.steps=1"], env)
    run(code, load, layout, ["trainer.steps=2", "trainer.checkpoint_interval=0",
                             f"trainer.resume={save / 'checkpoints' / 'step_1'}"], env)
    rows = []
    for r in range(4):
        rows.append({"rank": r, "save": json.loads((save / "ckpt_io" / f"save_rank{r}.json").read_text()),
                     "load": json.loads((load / "ckpt_io" / f"load_rank{r}.json").read_text())})
    return rows


def table(sharded: Path, gather: Path) -> str:
    new, old = (json.loads((d / "results.json").read_text()) for d in (sharded, gather))
    mib = 2 ** 20
    lines = ["| layout | rank | its part (MiB) | save: added RSS, gather / sharded (MiB) | save wall, gather / sharded "
             "(s) | step waited, sharded (s) | load: added RSS, gather / sharded (MiB) | load wall, gather / sharded (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        n, o = new.get(f"{layout}/sharded"), old.get(f"{layout}/gather")
        if n is None or o is None:
            continue
        for a, b in zip(n, o):
            ns, nl, os_, ol = a["save"], a["load"], b["save"], b["load"]
            lines.append(f"| {layout} | {a['rank']} | {ns['rank_bytes'] / mib:.0f} "
                         f"| {(os_['peak_rss_bytes'] - os_['rss_before_bytes']) / mib:.0f} / "
                         f"{(ns['peak_rss_bytes'] - ns['rss_before_bytes']) / mib:.0f} "
                         f"| {os_['wall_s']:.1f} / {ns['write_s']:.1f} | {ns['step_wait_s']:.1f} "
                         f"| {(ol['peak_rss_bytes'] - ol['rss_before_bytes']) / mib:.0f} / "
                         f"{(nl['peak_rss_bytes'] - nl['rss_before_bytes']) / mib:.0f} "
                         f"| {ol['wall_s']:.1f} / {nl['load_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        print(table(Path(sys.argv[2]), Path(sys.argv[3])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gather", type=Path, default=None)
    ap.add_argument("--only", default=",".join(LAYOUTS))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = a.out / "results.json"
    done = json.loads(results.read_text()) if results.exists() else {}
    for layout in a.only.split(","):
        key = f"{layout}/{'gather' if a.gather else 'sharded'}"
        done[key] = gathered(layout, a.out, a.gather) if a.gather else sharded(layout, a.out)
        results.write_text(json.dumps(done, indent=1))
        print(key, json.dumps(done[key]), flush=True)


if __name__ == "__main__":
    main()
