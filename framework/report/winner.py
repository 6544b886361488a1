"""Which job of a sweep wins, and by how much: the best completed job by the sweep's
objective (`best`), unless the objective is a speed and a job was measured with noise
(`best_line` then ranks and says why it names none), and each job's speed-up against a
baseline (`report.baseline=<job>`). A sweep with repeats names a configuration instead
(framework/report/repeats.py `verdict`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from framework.commands import reject
from framework.report.fairness import same_loss

# Objectives a larger value of which is better (RunConfig.objective's choices in framework/config/ has them all).
MAXIMISED = ("tokens_per_s", "mfu")
SPEED = ("tokens_per_s", "mfu", "step_time_s")  # objectives a noisy measurement makes untrustworthy


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def objective_of(sweep: Path, job: str) -> Optional[str]:
    try:
        return (yaml.safe_load((sweep / job / "config.yaml").read_text()) or {}).get("objective")
    except (OSError, yaml.YAMLError):
        return None


def best(sweep: Path, rows: list[dict]) -> Optional[tuple[dict, str]]:
    """The best completed job by the sweep's objective (all jobs share it), and the objective."""
    done = [r for r in rows if r.get("status") == "completed"]
    objectives = {objective_of(sweep, r["job"]) for r in done}
    if len(objectives) != 1 or None in objectives:
        return None
    key = objectives.pop()
    if key == "loss" and same_loss(done):  # every layout trains the same model: what differs is speed
        key = "tokens_per_s"
    scored = [r for r in done if isinstance(r.get(key), (int, float))]
    if not scored:
        return None
    pick = max if key in MAXIMISED else min
    return pick(scored, key=lambda r: r[key]), key


def best_line(done: list[dict], row: dict, key: str) -> str:
    """The best job, unless the objective is a speed and a job was measured with noise: then
    the ranking, and why no winner is named."""
    noisy = [r for r in done if r.get("noisy")]
    if key not in SPEED or not noisy:
        return f"best by {key}: job {row['job']} ({row['overrides'] or 'defaults'}): {key} = {_fmt(row[key])}"
    ranked = sorted((r for r in done if isinstance(r.get(key), (int, float))), key=lambda r: r[key],
                    reverse=key in MAXIMISED)
    order = ", ".join(f"job {r['job']} {_fmt(r[key])}" for r in ranked)
    return (f"no winner named by {key}: {len(noisy)} of {len(done)} jobs were measured with noise (the warnings "
            f"above), so their speeds do not compare; ranked: {order}. Fix: rerun on a quiet machine, with "
            "sweep.repeats=3")


def baseline(rows: list[dict], job: str, key: str = "report.baseline") -> list[str]:
    """report.baseline=<job>: each completed job's tokens/s over the baseline's (the rows get
    a `speedup` column); the line above the table."""
    base = next((r for r in rows if r["job"] == job), None)
    if base is None or not isinstance(base.get("tokens_per_s"), (int, float)) or base["status"] != "completed":
        have = ", ".join(r["job"] for r in rows if r.get("status") == "completed")
        reject(key, job, f"is no completed job of this sweep (completed: {have or 'none'})",
               "give the number of a completed job")
    parts = []
    for r in rows:
        if r.get("status") == "completed" and isinstance(r.get("tokens_per_s"), (int, float)):
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r is not base:
                parts.append(f"job {r['job']} {r['speedup']:.2f}x ({r['speedup'] - 1:+.1%})")
    return [f"speed-up against job {job} ({base['overrides'] or 'defaults'}), tokens/s over its: " + ", ".join(parts)]
