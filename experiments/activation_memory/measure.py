"""Activation bytes per transformer layer, measured, beside this framework's activation model and
Korthikanti et al. 2022's formulas (arXiv 2205.05198, Table 2), extended with / cp.

Usage (repository root): python experiments/activation_memory/measure.py [--out DIR] [--precision bf16-mixed]

Every row is two real runs (`python run.py ...`, one step, one micro-batch of b sequences of s
tokens, GPT-2 shapes h = 64, a = 4 heads, t = tp): with 3 and with 2 layers; the difference of
their measured `activation_peak_bytes_max` (the ActivationTracker: every tensor autograd saves,
each storage once, parameters excluded; metrics/memory.py) is one layer's bytes on the fullest
rank. Beside it:
- model: framework/sim/cost/activations.py's block term for the same layout (what
  `dry_run=true` prints), and its error;
- Korthikanti: per layer, in bytes, with 16-bit activations and 1-byte dropout masks,
  no recomputation  s b h (10 + 24 / t + 5 a s / (h t))    (tp, no SP)
                    s b h / t (34 + 5 a s / h)             (tp + SP)
  selective         s b h (10 + 24 / t)  /  34 s b h / t    (no SP / SP)
  full              2 s b h  (2 s b h / t with SP)
  each divided by cp (a cp rank holds s / cp of the queries; its 5 a s / h term keeps the whole
  s of the keys), and the measured / Korthikanti ratio.
Printed: the markdown table README.md holds.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

H, HEADS, SEQ, BATCH = 64, 4, 64, 2
MODEL = ["model=gpt2-tiny", f"model.n_embd={H}", f"model.n_head={HEADS}", f"data.seq_len={SEQ}",
         f"trainer.micro_batch_size={BATCH}", "schedule.microbatches=1", "data=synthetic", "logger=none",
         "trainer.steps=1", "metrics.skip_first=0"]
LAYOUTS = {"tp1": ["parallelism=single"], "tp2": ["parallelism=tp2"],
           "tp2_sp": ["parallelism=tp2", "parallelism.sequence_parallel=true"],
           "cp2": ["parallelism=single", "parallelism.cp=2"],
           "tp2_sp_cp2": ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.cp=2"]}
MODES = ("none", "selective", "full")


def korthikanti(mode: str, tp: int, sp: bool, cp: int) -> float:
    s, b, h, a, t = SEQ, BATCH, H, HEADS, tp
    scores = 5 * a * s / h  # the attention matrix and its dropout mask, per s b h
    if mode == "full":
        per = 2 * s * b * h / (t if sp else 1)
    elif mode == "selective":
        per = 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)
    elif sp:
        per = s * b * h / t * (34 + scores)
    else:
        per = s * b * h * (10 + 24 / t + scores / t)
    return per / cp


def peak(out: Path, name: str, layers: int, args: list[str]) -> int:
    job = out / f"{name}_L{layers}"
    cmd = [sys.executable, "run.py", *MODEL, f"model.n_layer={layers}", *args, f"hydra.run.dir={job}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name}: {r.stderr[-2000:]}")
    return json.loads((job / "summary.json").read_text())["activation_peak_bytes_max"]


def model_bytes(args: list[str]) -> float:
    from hydra import compose, initialize_config_dir

    from framework.config import load_config
    from framework.sim.cost.activations import block_bytes
    from framework.sim.cost.price import job_of

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        run = load_config(compose("config", overrides=[*MODEL, "model.n_layer=3", *args]))
    job = job_of(run, 256)
    if job.lay.recompute:
        tn = job.lay.tokens // (job.lay.tp if job.lay.sp else 1)  # a cp rank's tokens
        return job.shape.hidden * tn * job.lay.act_bytes
    return block_bytes(job.shape, job.lay)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/activation_memory")
    ap.add_argument("--precision", default="bf16-mixed")
    o = ap.parse_args()
    out = Path(o.out)
    print(f"| layout | recompute | measured B / layer | model | error | Korthikanti (16-bit) | measured / K. |")
    print("|---|---|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        for mode in MODES:
            args = [*layout, f"trainer.recompute={mode}", f"trainer.precision={o.precision}"]
            tag = f"{name}_{mode}"
            measured = peak(out, tag, 3, args) - peak(out, tag, 2, args)
            modelled = model_bytes(args)
            tp = 2 if "tp2" in name else 1
            k = korthikanti(mode, tp, "sp" in name, 2 if "cp2" in name else 1)
            print(f"| {name} | {mode} | {measured:,} | {modelled:,.0f} | {modelled / measured - 1:+.1%} | {k:,.0f} | "
                  f"{measured / k:.2f} |", flush=True)


if __name__ == "__main__":
    main()
