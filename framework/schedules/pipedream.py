"""Asynchronous PipeDream schedules: never flushed, so one list covers the whole run of
`steps` steps and micro-batch ids are global (step * m + j).

PipeDream 1F1B with weight stashing (Narayanan et al., SOSP 2019): every stage updates
after every micro-batch's backward. PipeDream-2BW (Narayanan et al., ICML 2021): gradients
accumulated over a step's m micro-batches, one update per step, two weight versions.
"""

from __future__ import annotations

from framework.schedules.base import Action, AsyncRule, Op, Schedule, Violation, register


def _async(pp: int, m: int, steps: int, update_after) -> dict[int, list[Action]]:
    """1F1B over the whole run, never flushed; `update_after(j)` says where a U goes."""
    n = m * steps
    out = {}
    for r in range(pp):
        w = min(pp - r - 1, n)
        acts = [Action(Op.F, j) for j in range(w)]
        for j in range(n):
            if j + w < n:
                acts.append(Action(Op.F, j + w))
            acts.append(Action(Op.B, j))
            if update_after(j):
                acts.append(Action(Op.U, j))
        out[r] = acts
    return out


def version_1f1b(j: int, stage: int, num_stages: int, m: int) -> int:
    """Stage s runs p-s-1 micro-batches ahead of its updates; weight stashing keeps the
    version for the backward."""
    return max(0, j - (num_stages - stage - 1))


def version_2bw(j: int, stage: int, num_stages: int, m: int) -> int:
    """Every micro-batch of step t uses the version from before step t-1's update,
    W(t+1) = W(t) - lr * grad(W(t-1)), on every stage alike."""
    return max(0, j // m - 1)


def _bubble(p: int, m: int, v: int = 1, times=None, steps: int = 1) -> float:
    """Never flushed: the pipeline fills once and drains once over all steps * m micro-batches."""
    return (p - 1) / (steps * m + p - 1) if p > 1 else 0.0


RUN_FORMULA = "(p-1)/(N+p-1) over the run, N = steps*m: one fill and one drain"
register(Schedule(
    name="1f1b", generate=lambda pp, m, v=1, steps=1: _async(pp, m, steps, lambda j: True),
    ops=frozenset({Op.F, Op.B, Op.U}), bubble=_bubble, bubble_formula=RUN_FORMULA, memory_bound=lambda pp, n, v, r: min(pp - r, n),
    doc="PipeDream 1F1B (asynchronous): an update after every micro-batch, weight stashing",
    asynchronous=AsyncRule(version_of=version_1f1b, updates_per_step=lambda m: m, microbatch_weight=lambda m: 1.0)))
register(Schedule(
    name="2bw", generate=lambda pp, m, v=1, steps=1: _async(pp, m, steps, lambda j: (j + 1) % m == 0),
    ops=frozenset({Op.F, Op.B, Op.U}), bubble=_bubble, bubble_formula=RUN_FORMULA, memory_bound=lambda pp, n, v, r: min(pp - r, n),
    doc="PipeDream-2BW (asynchronous): one update per step from two weight versions",
    asynchronous=AsyncRule(version_of=version_2bw, updates_per_step=lambda m: 1, microbatch_weight=lambda m: 1.0 / m),
    constraint=lambda pp, m, v: None if m >= pp else Violation(
        "schedule.microbatches", f"2bw keeps two weight versions only when microbatches >= pp={pp} (a stage must "
        "finish a step's backward before the step after next starts)", f"use schedule.microbatches >= {pp}")))
