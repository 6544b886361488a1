"""Pipeline bubble: the analytic share of idle time for a schedule.

Convention: bubble = idle / step time per pipeline rank. For p stages, m micro-batches
and v model chunks per rank, with forward+backward of one micro-batch on one stage as the
time unit: gpipe and flush idle (p-1) units out of (m+p-1); interleaved (p-1)/(v·m+p-1)
(Narayanan et al., 2021). The asynchronous schedules (1f1b, 2bw) never flush: only the
run's start-up and drain idle, (p-1)/(N+p-1) for N micro-batches in all. One stage has no
pipeline, so no bubble. The measured counterpart (1 - busy / window per rank) is in
framework/parallel/pipeline/runner.py.
"""

from __future__ import annotations


def analytic_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, steps: int = 1) -> float:
    """Idle share per step (flushing schedules) or over the whole run (asynchronous ones)."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "flush"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule in ("1f1b", "2bw"):
        # Never flushed: the pipeline fills once and drains once over all steps * m micro-batches.
        return (p - 1) / (steps * m + p - 1)
    raise ValueError(f"no analytic bubble for schedule {schedule!r}")
