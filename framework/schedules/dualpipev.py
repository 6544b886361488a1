"""DualPipeV (DeepSeek-V3's DualPipe, arXiv 2412.19437, folded into a V; torch 2.13's
ScheduleDualPipeV): two chunks per rank in a V (rank r holds stages r and 2p-1-r). Its
steady state pairs the forward of one chunk with the backward of the other; DualPipe
overlaps each pair's computation with the other's communication on a GPU. Here the pair
runs one after the other (F, then B), or with `parallelism.overlap_dualpipe` side by side
(`pairs=True`: the executor's `_pair`, p2p.py's `_pair`). The start and the end split the backward into
I and W to fill the ramps. Needs microbatches >= 2p (the number of stages).

Bubble. DeepSeek-V3's Table 2 gives DualPipe (PP/2-1)(F&B+B-3W), B the full backward and
F&B one overlapped forward-backward pair; the DualPipe repository gives DualPipeV the same
with PP the number of stages (2p here): `paper_idle`, (p-1)(F&B+B-3W) per rank. It is the
idle time of these lists when each pair runs as one unit (it starts once both its inputs
are there, and both results leave at its end), with F&B = T_F + T_B and T_I >= max(T_F, T_W)
(tests/test_bubble_forms.py). The pair is not overlapped here: F runs, its activation
leaves, then B, so the ramps wait less and the schedule model idles less than that form
(T_F = T_I = T_W: p-1 units against 2(p-1)). The declared bubble is the schedule model's.
"""

from __future__ import annotations

from collections import deque

from framework.schedules.base import Action, Op, OpTimes, Schedule, Violation, modelled, register
from framework.schedules.zero_bubble import simulated


def _rank(pp: int, m: int, r: int) -> list[Action]:
    acts: list[Action] = []
    f, b = [0, 0], [0, 0]  # forwards / backwards (B or I) issued per chunk
    weights: deque = deque()  # (chunk, micro-batch) of I's whose W is pending

    def forward(c: int) -> None:
        acts.append(Action(Op.F, f[c], c))
        f[c] += 1

    def backward(c: int, split: bool) -> None:
        acts.append(Action(Op.I if split else Op.B, b[c], c))
        if split:
            weights.append((c, b[c]))
        b[c] += 1

    def weight() -> None:
        if weights:
            c, j = weights.popleft()
            acts.append(Action(Op.W, j, c))

    for _ in range((pp - r - 1) * 2):  # 1: chunk 0 forwards
        forward(0)
    for _ in range(r + 1):  # 2: both chunks' forwards
        forward(0)
        forward(1)
    for _ in range(pp - r - 1):  # 3: I, W, F on chunk 1 (zero bubble)
        backward(1, True)
        weight()
        forward(1)
    for i in range(m - 2 * pp + r + 1):  # 4: main: F0 B1, F1 B0 (overlapped pairs, run in turn)
        forward(0)
        backward(1, False)
        forward(1)
        backward(0, False)
    for _ in range(pp - r - 1):  # 5: B1, then F1 B0
        backward(1, False)
        forward(1)
        backward(0, False)
    split = False
    for i in range(r + 1):  # 6: B1 B0, splitting the second half
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - r - 1):  # 7: W, B0
        weight()
        backward(0, split)
    for _ in range(r + 1):  # 8: the remaining W's
        weight()
    return acts


def dualpipev(pp: int, m: int, v: int = 2, steps: int = 1) -> dict[int, list[Action]]:
    return {r: _rank(pp, m, r) for r in range(pp)}


def paper_idle(p: int, t: OpTimes, f_and_b: float | None = None) -> float:
    """(PP/2 - 1)(F&B + B - 3W) with PP = 2p stages: DeepSeek-V3 (arXiv 2412.19437) Table 2,
    in chunk times, B = T_I + T_W the full backward; `f_and_b` the overlapped pair's time,
    by default T_F + T_B (no overlap, as the pairs run here)."""
    fb = t.F + t.B if f_and_b is None else f_and_b
    return (p - 1) * (fb + t.B - 3 * t.W)


def _check(pp: int, m: int, v: int) -> Violation | None:
    if m < 2 * pp:
        return Violation("schedule.microbatches", f"dualpipev needs at least as many micro-batches as stages "
                         f"(2 * pp = {2 * pp})", f"use schedule.microbatches >= {2 * pp}")
    return None


register(Schedule(
    name="dualpipev", generate=dualpipev, ops=frozenset({Op.F, Op.B, Op.I, Op.W}), placement="v", chunks=2,
    preset_chunks=2, constraint=_check,
    doc="DualPipeV's order: 2 chunks per rank in a V; the steady state's forward/backward pairs of the two "
        "chunks run one after the other, or side by side with parallelism.overlap_dualpipe (DualPipe's overlap)",
    pairs=True,
    bubble=simulated(dualpipev, "v"), bubble_source=modelled, memory_bound=lambda pp, m, v, r: 2 * pp + 1))
