"""ZB-V (Qi et al., arXiv 2401.10241, section 6; torch 2.13's ScheduleZBVZeroBubble): two
chunks per rank in a V, rank r holding stages r and 2p-1-r, so a micro-batch goes down
the ranks on chunk 0 and back up on chunk 1 and the last stage sits beside the first.
Zero bubble at p micro-batches of activation memory (2p chunk-sized ones) when
T_F = T_I = T_W.
"""

from __future__ import annotations

from framework.schedules.base import Action, Op, Schedule, modelled, register
from framework.schedules.zero_bubble import simulated


def _rank(pp: int, m: int, r: int) -> list[Action]:
    n = max(2 * pp - 1, m)  # as torch: enough micro-batches to fill the V, the extra dropped below
    acts: list[Action] = []
    f, i, w = [0, 0], [0, 0], [0, 0]

    def add(op: Op, c: int, counter: list[int]) -> None:
        acts.append(Action(op, counter[c], c))
        counter[c] += 1

    for _ in range(2 * (pp - r) - 1):  # warm-up: chunk 0 forwards down the V
        add(Op.F, 0, f)
    for _ in range(r):
        add(Op.F, 1, f)
        add(Op.F, 0, f)
    for _ in range(pp - r):  # the turn: chunk 1's first backwards
        add(Op.F, 1, f)
        add(Op.I, 1, i)
        add(Op.W, 1, w)
    while f[1] < f[0] or f[0] < n:  # steady
        if f[0] < n:
            add(Op.F, 0, f)
        add(Op.I, 0, i)
        add(Op.W, 0, w)
        add(Op.F, 1, f)
        add(Op.I, 1, i)
        add(Op.W, 1, w)
    for _ in range(r):  # cool-down: input gradients first, weights after
        add(Op.I, 0, i)
        add(Op.I, 1, i)
    for _ in range(pp - r):
        add(Op.I, 0, i)
        add(Op.W, 0, w)
    while w[1] < i[1]:
        add(Op.W, 1, w)
    while w[0] < i[0]:
        add(Op.W, 0, w)
    return [a for a in acts if a.microbatch < m]


def zbv(pp: int, m: int, v: int = 2, steps: int = 1) -> dict[int, list[Action]]:
    return {r: _rank(pp, m, r) for r in range(pp)}


register(Schedule(
    name="zbv", generate=zbv, ops=frozenset({Op.F, Op.I, Op.W}), placement="v", chunks=2, preset_chunks=2,
    doc="ZB-V: 2 chunks per rank in a V, split backward; zero bubble at p micro-batches when T_F=T_I=T_W",
    bubble=simulated(zbv, "v"), bubble_source=modelled, memory_bound=lambda pp, m, v, r: min(2 * pp, 2 * m)))
