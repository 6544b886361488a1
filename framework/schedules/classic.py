"""The flushing classics: GPipe (Huang et al., 2019), PipeDream-Flush / Megatron's 1F1B
(Narayanan et al., ICML 2021) and interleaved 1F1B (Narayanan et al., SC 2021).

One step's list per rank; the executor repeats it every step and ends each step with one
synchronous update (not an action). Chunk c of rank r is stage c*pp + r (loop placement).
"""

from __future__ import annotations

from framework.schedules.base import Action, Op, Schedule, Violation, register


def _flat(p: int, m: int, v: int, times=None, steps: int = 1) -> float:
    """(p-1) of (m+p-1) units idle per rank, for any ratio of T_F to T_B."""
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def gpipe(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    return {r: [Action(Op.F, j) for j in range(m)] + [Action(Op.B, j) for j in range(m)] for r in range(pp)}


def flush_warmup(pp: int, rank: int, m: int) -> int:
    """Forwards before the first backward: what is in flight below this stage."""
    return min(pp - rank - 1, m)


def flush(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """Warm-up, steady 1F1B, cool-down; one update per step."""
    out = {}
    for r in range(pp):
        w = flush_warmup(pp, r, m)
        warmup = [Action(Op.F, j) for j in range(w)]
        steady = [a for j in range(m - w) for a in (Action(Op.F, j + w), Action(Op.B, j))]
        cooldown = [Action(Op.B, j) for j in range(m - w, m)]
        out[r] = warmup + steady + cooldown
    return out


def _interleaved_action(k: int, pp: int, v: int, op: Op) -> Action:
    """The k-th forward (or backward) on a rank: micro-batch groups of pp cycle through chunks."""
    group, within = divmod(k, pp * v)
    chunk = within // pp
    if op is Op.B:
        chunk = v - 1 - chunk  # backward visits the chunks in reverse
    return Action(op, group * pp + k % pp, chunk)


def interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    """Megatron-LM's warm-up count: two per hop to the last rank, plus the extra chunks."""
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def interleaved(pp: int, m: int, v: int, steps: int = 1) -> dict[int, list[Action]]:
    """v chunks per rank, warm-up deepened by the extra chunks."""
    total = m * v
    out = {}
    for r in range(pp):
        w = interleaved_warmup(pp, r, m, v)
        warmup = [_interleaved_action(k, pp, v, Op.F) for k in range(w)]
        steady = [a for k in range(total - w)
                  for a in (_interleaved_action(k + w, pp, v, Op.F), _interleaved_action(k, pp, v, Op.B))]
        cooldown = [_interleaved_action(k, pp, v, Op.B) for k in range(total - w, total)]
        out[r] = warmup + steady + cooldown
    return out


def interleaved_check(pp: int, m: int, v: int) -> Violation | None:
    if m % pp:
        return Violation("schedule.microbatches",
                         f"interleaved 1F1B sends micro-batches through the {v} chunks in groups of pp={pp}; "
                         f"microbatches={m} must be a multiple of pp",
                         f"use a multiple of {pp}, e.g. schedule.microbatches={pp * max(1, m // pp)}")
    return None


register(Schedule(
    name="gpipe", generate=gpipe, ops=frozenset({Op.F, Op.B}), single_stage=True,
    doc="GPipe: all forwards, then all backwards, one update per step",
    bubble=_flat, bubble_formula="(p-1)/(m+p-1) (Huang et al. 2019)", memory_bound=lambda pp, m, v, r: m))
register(Schedule(
    name="flush", generate=flush, ops=frozenset({Op.F, Op.B}), single_stage=True,
    doc="PipeDream-Flush (Megatron's 1F1B): warm-up, steady 1F1B, cool-down, one update per step",
    bubble=_flat, bubble_formula="(p-1)/(m+p-1) (Narayanan et al. 2021)", memory_bound=lambda pp, m, v, r: min(pp - r, m)))
register(Schedule(
    name="interleaved", generate=interleaved, ops=frozenset({Op.F, Op.B}), max_chunks=None, preset_chunks=2,
    doc="Megatron's interleaved 1F1B: v chunks per rank, bubble (p-1)/(v*m+p-1)",
    bubble=lambda p, m, v, times=None, steps=1: (p - 1) / (v * m + p - 1) if p > 1 else 0.0,
    bubble_formula="(p-1)/(v*m+p-1) (Narayanan et al., SC 2021)",
    memory_bound=lambda pp, m, v, r: min(interleaved_warmup(pp, r, m, v) + 1, m * v),
    constraint=interleaved_check))
