"""trainer.compile's numbers (framework/models/compile.py compiles the blocks): frames
torch.compile compiled per step (`compiles`: 0 after the first step, or a recompilation
inside a measured one), per run (`compiles_warmup`, `compiles_measured`) and its compile
seconds (`compile_s`); docs/metrics.md."""

from __future__ import annotations


def compiled_frames() -> tuple[int, float]:
    """(frames dynamo has compiled so far, seconds spent compiling) in this process: torch's
    own wall time of whole frame and backward compiles (its finer timers nest inside these,
    so summing them would count a compile several times)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return int(counters["frames"]["ok"]), calculate_time_spent().get("total_wall_time", 0.0)


def step_row(per_rank: list) -> dict:
    """metrics.jsonl's `compiles`: the most any rank compiled in the step ({} when off)."""
    return {"compiles": max(r.compiles for r in per_rank)} if per_rank[0].compiles is not None else {}


def summary(rows: list[dict], measured: list[dict]) -> dict:
    """summary.json's frames compiled in the warm-up steps and in the measured ones."""
    if "compiles" not in rows[-1]:
        return {}
    return {"compiles_warmup": sum(r["compiles"] for r in rows[:len(rows) - len(measured)]),
            "compiles_measured": sum(r["compiles"] for r in measured)}
