"""Whether a sweep's jobs can be compared, said above the report's table: the same work per
step (global batch, tokens per step), the same model (every `model.*` key of config.yaml,
the parameter count), micro-batches that keep a MoE aux loss the same, the same CPU threads
per rank, and no job measured
with noise (framework/metrics/noise.py); when every job reaches the same loss, the layouts
differ in speed alone (`same_loss`)."""

from __future__ import annotations

import json
from typing import Optional

from framework.metrics.noise import warnings as noise_warnings


def fairness_warnings(rows: list[dict]) -> list[str]:
    """The completed jobs must do the same work per step, on the same model, for their
    numbers to compare. One warning per key that differs, with every job's value (a
    simulate sweep's predicted-only candidates are compared in the work per step too)."""
    done = [r for r in rows if r.get("status") == "completed"]
    out = []
    for key in ("global_batch", "tokens_per_step"):
        ranked = done + [r for r in rows if r.get("status") == "predicted only"]
        values = sorted({r.get(key) for r in ranked if r.get(key) is not None})
        if len(values) > 1:
            jobs = ", ".join(f"job {r['job']}: {r.get(key)}" for r in ranked if r.get(key) is not None)
            out.append(f"WARNING: the jobs differ in {key} ({jobs}): their throughput and loss are not comparable. "
                       "Fix: set trainer.global_batch_size, so each layout derives schedule.microbatches")
    return out + model_warnings(done) + micro_batch_warnings(done) + thread_warnings(done) + noise_warnings(done)


def thread_warnings(done: list[dict]) -> list[str]:
    """CPU jobs compare only at the same intra-op threads per rank (a sweep gives each job
    one, framework/device.py share_cores_in_a_sweep): a 1-rank job with two threads against
    a 2-rank job with one each differs in threading as well as in layout."""
    cpu = [r for r in done if r.get("cpu_threads_per_rank") is not None]
    if len({r["cpu_threads_per_rank"] for r in cpu}) <= 1:
        return []
    jobs = ", ".join(f"job {r['job']}: {r['cpu_threads_per_rank']} x {r.get('world_size')} ranks" for r in cpu)
    return [f"WARNING: the jobs ran different CPU threads per rank ({jobs}): their speeds differ in threading as "
            "well as in layout. Fix: set trainer.cpu_threads_per_rank once for the sweep (a -m sweep gives every "
            "job 1 unless it is set)"]


def micro_batch_warnings(done: list[dict]) -> list[str]:
    """What a MoE model computes per micro-batch changes with trainer.micro_batch_size, which
    trainer.global_batch_size derives per layout: the Switch `aux` loss (f_e and P_e over a
    micro-batch's tokens). Capacity does not: it is per sequence (framework/models/moe_routing.py)."""
    def per_micro_batch(r):
        moe = (r.get("model_config") or {}).get("moe") or {}
        return any(isinstance(a, dict) and a.get("type") == "aux" for a in moe.get("aux_losses") or [])
    moe = [r for r in done if per_micro_batch(r)]
    if len({r.get("micro_batch_size") for r in moe}) <= 1:
        return []
    jobs = ", ".join(f"job {r['job']}: {r.get('micro_batch_size')}" for r in moe)
    return [f"WARNING: the jobs differ in trainer.micro_batch_size ({jobs}) and their MoE model has an `aux` "
            "loss, which is computed per micro-batch: they train with different balancing losses. Fix: set "
            "trainer.micro_batch_size once for the sweep, or use seq_aux (per sequence) instead of aux"]


ABSENT = "(not set)"  # a key one job's config.yaml lacks (written by another version)


def model_warnings(done: list[dict]) -> list[str]:
    """The jobs must train one model: every key of config.yaml's `model` group (rows'
    `model_config`) and the parameter count (`model_params`) the same. A layout search
    changes only the layout (conf/schedule presets set only schedule keys)."""
    out = []
    configs = [r for r in done if isinstance(r.get("model_config"), dict)]
    for key in dict.fromkeys(k for r in configs for k in r["model_config"]):  # config order
        values = [r["model_config"].get(key, ABSENT) for r in configs]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            jobs = ", ".join(f"job {r['job']}: {v}" for r, v in zip(configs, values, strict=True))
            out.append(f"WARNING: the jobs differ in model.{key} ({jobs}): they train different models, so their "
                       f"throughput and loss are not comparable. Fix: set model.{key} once for the whole sweep "
                       "(a layout comparison changes only the layout)")
    if len({r.get("model_params") for r in done if r.get("model_params") is not None}) > 1:
        jobs = ", ".join(f"job {r['job']}: {r.get('model_params')}" for r in done)
        out.append(f"WARNING: the jobs differ in model_params ({jobs}): they train models of different sizes, so "
                   "their throughput and loss are not comparable. Fix: give every job the same model.* keys and "
                   "vocabulary (model.vocab_size, else the data's tokenizer)")
    return out


LOSS_RTOL = 1e-4  # layouts of one training differ in the order of sums only: far less than this


def same_loss(done: list[dict]) -> Optional[tuple[float, float]]:
    """(the losses' mean, their largest relative difference from it) when two or more jobs
    agree within LOSS_RTOL, else None."""
    losses = [r["loss"] for r in done if isinstance(r.get("loss"), (int, float))]
    if len(losses) < 2 or len(losses) < len(done):
        return None
    mean = sum(losses) / len(losses)
    spread = max(abs(x - mean) for x in losses) / abs(mean) if mean else max(abs(x) for x in losses)
    return (mean, spread) if spread <= LOSS_RTOL else None
