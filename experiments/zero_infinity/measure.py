"""ZeRO-R's Pa and ZeRO-Offload / ZeRO-Infinity's tiers on this machine: memory per rank and
step time against model size, each beside what the framework's models predict.

1. Pa: GPT-2 shapes (4 blocks, h 256 / 512, 4 heads per 64 wide), tp 2, recompute=full, fp32,
   micro-batch 4 x 256 tokens: the measured activation peak per rank with Pa off / on / +cpu,
   the activation model's prediction (framework/sim/cost/activations.py), and the ZeRO paper's
   term for the checkpoints alone (blocks x b s h x 4 bytes / MP with Pa, x 1 without).
2. Offload: the same shapes at dp 2, ZeRO 2, with the optimizer in device memory (none), host
   memory (cpu) or a file under /tmp (nvme: the drive behind /tmp here), and at ZeRO 3 with the
   parameter slices on the drive too (nvme+params): median step and optimizer seconds, the
   model states in memory per rank, the peak RSS of the fullest rank, and the cost model's
   optimizer seconds on conf/hardware/cpu-local.yaml (none, cpu; it has no drive rates for nvme).
Each job runs `python run.py` once (REPEATS passes interleaved: the spread is between them).

    python experiments/zero_infinity/measure.py [out_dir]
    python experiments/zero_infinity/measure.py --offload out_dir   # section 2 again, section 1 kept
    python experiments/zero_infinity/measure.py --reprice out_dir   # the predictions again, seconds
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
REPEATS = 2
COMMON = ["model=gpt2-tiny", "model.n_layer=4", "data=synthetic", "data.vocab_size=256", "data.seq_len=256",
          "logger=none", "trainer.steps=8", "trainer.micro_batch_size=4", "metrics.skip_first=3",
          "trainer.log_interval=8", "schedule.microbatches=2", "trainer.cpu_threads_per_rank=1"]
SIZES = {256: ["model.n_embd=256", "model.n_head=4"], 512: ["model.n_embd=512", "model.n_head=8"]}
PA = {"off": [], "on": ["trainer.partition_activations=true"],
      "+cpu": ["trainer.partition_activations=true", "trainer.cpu_checkpointing=true"]}
OFFLOAD = {"none": [], "cpu": ["parallelism.offload_optimizer=true"],
           "nvme": ["parallelism.offload_optimizer=true", "parallelism.offload_device=nvme"],
           "nvme+params": ["parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
                           "parallelism.offload_params=true"]}
ZERO = {"nvme+params": 3}  # parameter offload needs ZeRO 3; the other tiers run at ZeRO 2


def offload_args(name: str) -> list[str]:
    return ["parallelism=dp2", f"parallelism.zero={ZERO.get(name, 2)}", *OFFLOAD[name]]


def run(job: Path, args: list[str]) -> dict:
    cmd = [sys.executable, "run.py", *COMMON, *args, f"hydra.run.dir={job}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=900)
    return json.loads((job / "summary.json").read_text())


def predicted(job: Path) -> tuple[float, float]:
    """(activation peak bytes, optimizer seconds on cpu-local) of a finished job."""
    from framework.config import read_config
    from framework.sim.cost.activations import peak_bytes
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import job_of, price
    from omegaconf import OmegaConf

    run_cfg = read_config(str(job / "config.yaml"))
    j = job_of(run_cfg, 256)
    acts = max(peak_bytes(j.shape, j.lay, j.pp, j.microbatches, j.schedule, j.virtual_stages))
    hw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / "cpu-local.yaml"))
    try:
        opt = price(Profile.from_dict(hw), j).optimizer_s
    except Exception:  # nvme: no drive rates in the profile
        opt = float("nan")
    return acts, opt


def main(out: Path, offload_only: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows_pa, rows_off = [], []
    if offload_only:
        rows_pa = json.loads((out / "results.json").read_text())["pa"]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(REPEATS):
            for h, size in SIZES.items():
                for name, extra in ({} if offload_only else PA).items():
                    job = Path(tmp) / f"pa_{h}_{name}_{rep}"
                    s = run(job, [*size, "parallelism=tp2", "trainer.recompute=full", *extra])
                    acts, _ = predicted(job)
                    rows_pa.append({"h": h, "pa": name, "rep": rep, "measured": s["activation_peak_bytes_max"],
                                    "model": acts, "step_s": s["step_time_s"]})
                for name in OFFLOAD:
                    job = Path(tmp) / f"off_{h}_{name}_{rep}"
                    nvme = [f"parallelism.nvme_path={tmp}/nvme"] if name.startswith("nvme") else []
                    s = run(job, [*size, *offload_args(name), *nvme])
                    _, opt = predicted(job)
                    rss = max(r["rss_peak_bytes"] for r in s["ranks"])
                    rows_off.append({"h": h, "offload": name, "rep": rep, "step_s": s["step_time_s"],
                                     "optimizer_s": s["optimizer_s"], "predicted_optimizer_s": opt,
                                     "model_state_bytes": s["model_state_bytes_max"], "rss_peak": rss,
                                     "params": s["model_params"]})
    (out / "results.json").write_text(json.dumps({"pa": rows_pa, "offload": rows_off}, indent=1))
    print(table(rows_pa, rows_off))


def table(rows_pa: list[dict], rows_off: list[dict]) -> str:
    lines = ["| h | Pa | activation peak per rank, measured (B) | the activation model (B) | the paper's checkpoint "
             "term (B) | step s (passes) |", "|---|---|---|---|---|---|"]
    for h in SIZES:
        for name in PA:
            rs = [r for r in rows_pa if r["h"] == h and r["pa"] == name]
            ckpt = 4 * 4 * 256 * h * 4 // (1 if name == "off" else 2) if name != "+cpu" else 0
            lines.append(f"| {h} | {name} | {rs[0]['measured']:,} | {rs[0]['model']:,.0f} | {ckpt:,} | "
                         + " / ".join(f"{r['step_s']:.3f}" for r in rs) + " |")
    lines += ["", "| h | params | offload | step s (passes) | optimizer s (passes) | cost model's optimizer s "
              "(cpu-local) | model states in memory per rank (B) | peak RSS, fullest rank (MiB) |",
              "|---|---|---|---|---|---|---|---|"]
    for h in SIZES:
        for name in OFFLOAD:
            rs = [r for r in rows_off if r["h"] == h and r["offload"] == name]
            lines.append(f"| {h} | {rs[0]['params']:,} | {name} | " + " / ".join(f"{r['step_s']:.3f}" for r in rs)
                         + " | " + " / ".join(f"{r['optimizer_s']:.4f}" for r in rs)
                         + f" | {_seconds(rs[0]['predicted_optimizer_s'])} | {rs[0]['model_state_bytes']:,} | "
                         + " / ".join(f"{r['rss_peak'] / 2 ** 20:.0f}" for r in rs) + " |")
    return "\n".join(lines)


def _seconds(x: float) -> str:
    return "-" if x != x else f"{x:.4f}"  # NaN: not priced


def reprice(out: Path) -> None:
    """`--reprice DIR`: the cost model's optimizer seconds of DIR's offload jobs again (their
    overrides composed as a dry run, priced on cpu-local), the table printed from the runs'
    measurements: after a change to the cost model, without running the jobs again."""
    from framework.sim.cost.plan import plan

    res = json.loads((out / "results.json").read_text())
    for r in res["offload"]:
        nvme = ["parallelism.nvme_path=/tmp/offload"] if r["offload"].startswith("nvme") else []
        args = [*COMMON, *SIZES[r["h"]], *offload_args(r["offload"]), *nvme, "hardware=cpu-local"]
        try:
            r["predicted_optimizer_s"] = plan(args)["optimizer_s"]
        except Exception:  # nvme: no drive rates in the profile
            r["predicted_optimizer_s"] = float("nan")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(table(res["pa"], res["offload"]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reprice"]:
        reprice(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--offload"]:
        main(Path(sys.argv[2]), offload_only=True)
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "experiments" / "zero_infinity" / "cpu_2026-11-29")
