"""Predicted (the cost model, from the bench's H200 profile alone) against measured (real
single-GPU bf16-mixed jobs on the same H200 kind), per job: step, and the measured
forward + backward and optimizer times beside the model's.

Usage (repository root, CPU is enough): python experiments/cluster_model/predict_h200.py
Reads experiments/cluster_model/h200_2026-11-26b/h200.yaml (python -m framework.sim.bench on
the lent H200) and the jobs' metrics.jsonl (medians over the steps after the first 3).
"""
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from framework.config import ModelConfig  # noqa: E402
from framework.sim.cost.price import Job, price  # noqa: E402
from framework.sim.cost.hardware import Profile  # noqa: E402
from framework.sim.cost.shapes import Layout, ModelShape  # noqa: E402

HERE = Path(__file__).parent
GPT2 = ModelConfig(name="gpt2", arch="gpt2", n_layer=12, n_embd=768, n_head=12, max_positions=1024)
MEDIUM = ModelConfig(name="gpt2-medium", arch="gpt2", n_layer=24, n_embd=1024, n_head=16, max_positions=1024)
LLAMA = ModelConfig(name="llama-1b", arch="llama", n_layer=16, n_embd=2048, n_head=16, n_kv_head=8, n_inner=5632,
                    max_positions=2048, tie_embeddings=False)
# (label, model, micro-batch, sequence, recompute, metrics file); 4 micro-batches per step, vocabulary 50,304
JOBS = [("GPT-2 124M, mb 8, s 1024", GPT2, 8, 1024, False, "h200_2026-11-26/metrics_gpt2_mb8_acfalse.jsonl"),
        ("GPT-2 124M, mb 16, s 1024", GPT2, 16, 1024, False, "h200_2026-11-26b/metrics_gpt2_mb16.jsonl"),
        ("GPT-2 124M, mb 8, s 512", GPT2, 8, 512, False, "h200_2026-11-26b/metrics_gpt2_s512_mb8.jsonl"),
        ("GPT-2 355M, mb 8, s 1024", MEDIUM, 8, 1024, False, "h200_2026-11-26/metrics_gpt2-medium_mb8_acfalse.jsonl"),
        ("GPT-2 355M, mb 8, s 1024, recompute", MEDIUM, 8, 1024, True,
         "h200_2026-11-26/metrics_gpt2-medium_mb8_actrue.jsonl"),
        ("Llama 1B, mb 2, s 2048", LLAMA, 2, 2048, False, "h200_2026-11-26b/metrics_llama1b_s2048_mb2.jsonl"),
        ("Llama 1B, mb 2, s 2048, recompute", LLAMA, 2, 2048, True,
         "h200_2026-11-26b/metrics_llama1b_s2048_mb2_ac.jsonl")]


def median(rows, key):
    return statistics.median(r[key] for r in rows[3:])


def main():
    prof = Profile.from_dict(yaml.safe_load((HERE / "h200_2026-11-26b/h200.yaml").read_text()))
    print("| job | step measured | step predicted | error | fwd+bwd measured / predicted | optimizer measured / predicted |")
    print("|---|---|---|---|---|---|")
    errors = []
    for label, m, mb, seq, ac, path in JOBS:
        rows = [json.loads(line) for line in (HERE / path).read_text().splitlines()]
        r = price(prof, Job(ModelShape.of(m, 50304), Layout(mb, seq, recompute=ac), microbatches=4))
        step, fb, opt = median(rows, "step_time_s"), median(rows, "fwd_bwd_s"), median(rows, "optimizer_s")
        errors.append(r.step_s / step - 1)
        print(f"| {label} | {step * 1e3:.1f} ms | {r.step_s * 1e3:.1f} ms | {errors[-1]:+.1%} | "
              f"{fb * 1e3:.1f} / {r.pipeline_s * 1e3:.1f} ms | {opt * 1e3:.1f} / {r.optimizer_s * 1e3:.1f} ms |")
    print(f"\nmedian |error| {statistics.median(abs(e) for e in errors):.1%}, max {max(abs(e) for e in errors):.1%}")


if __name__ == "__main__":
    main()
