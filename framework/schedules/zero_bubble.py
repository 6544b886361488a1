"""Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024, arXiv 2401.10241), one chunk per rank.

The backward is split into I (the stage input's gradient, sent at once) and W (the weight
gradients, which nothing downstream waits for), so W can fill 1F1B's bubble.
- zbh1: 1F1B's warm-up and activation memory (p micro-batches on rank 0); rank r defers
  its first r W's, filling the cool-down. Paper, Table 2: idle (p-1)(T_F+T_B-T_W) per rank,
  its T_B our T_I (`zbh1_idle`; here floored by the flush's fill, (p-1)T_F: `flushed_idle`).
- zbh2: up to 2p-1 micro-batches alive, more forwards in the warm-up; built by the paper's
  greedy rule in unit time (at each free moment: I if its gradient is there, else F if
  the memory limit allows, else the oldest pending W). Paper: idle (p-1)(T_F+T_B-2T_W)
  (`zbh2_idle`), floored likewise; the order is the same for any times (built once, in unit time).
Both flush: one synchronous update per step. Their declared bubble is that closed form for
m >= p (ZB-H1) or 2p-1 (ZB-H2), where it equals the schedule model; below, the schedule model.
"""

from __future__ import annotations

from collections import deque

from framework.schedules.base import (CLOSED_FORM, SCHEDULE_MODEL, Action, Op, OpTimes, Schedule,
                                                      StageMap, register)


def zbh1(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """Warm-up, steady F-I(-W), cool-down I-W, then the deferred W's; W in I's order."""
    out = {}
    for r in range(pp):
        w = min(pp - 1 - r, m)
        acts = [Action(Op.F, j) for j in range(w)]
        i_done = w_done = 0
        for k in range(m):  # the k-th backward input, with a forward before it while any is left
            if k + w < m:
                acts.append(Action(Op.F, k + w))
            acts.append(Action(Op.I, k))
            i_done += 1
            if k >= r:  # rank r defers its first r W's
                acts.append(Action(Op.W, w_done))
                w_done += 1
        acts += [Action(Op.W, j) for j in range(w_done, m)]
        out[r] = acts
    return out


def greedy(pp: int, m: int, limit: int, times=OpTimes(), comm: float = 0.0,
           fill_rule: bool = False) -> dict[int, list[Action]]:
    """One chunk per rank: each rank, when free, runs I if its gradient has arrived, else F
    if its activation has arrived and fewer than `limit` micro-batches are alive, else its
    oldest pending W, else waits for the first message. Decisions are committed in global
    time order, so a rank decides knowing every message that has arrived by then.
    `times`: one OpTimes, or one per rank; `comm`: seconds from a send to its arrival.
    `fill_rule` (the paper's automatic scheduler, zb_auto.py): an idle rank whose next I or
    F is already on its way and due in less than T_W waits for it instead of starting a W,
    unless waiting would make its idle time so far the largest of all ranks."""
    per_rank = list(times) if isinstance(times, (list, tuple)) else [times] * pp
    idle = [0.0] * pp
    free = [0.0] * pp
    lists = {r: [] for r in range(pp)}
    f_next, i_next, alive = [0] * pp, [0] * pp, [0] * pp
    pending: list[deque] = [deque() for _ in range(pp)]
    act_at = {(0, j): 0.0 for j in range(m)}  # (rank, mb) -> when its input is there
    grad_at: dict = {}  # (rank, mb) -> when the gradient of its output is there
    left = 3 * pp * m
    while left:
        best = None
        for r in range(pp):
            options = []
            if i_next[r] < f_next[r] and (r, i_next[r]) in grad_at:
                options.append((max(free[r], grad_at[r, i_next[r]]), 0, Op.I))
            if f_next[r] < m and alive[r] < limit and (r, f_next[r]) in act_at:
                options.append((max(free[r], act_at[r, f_next[r]]), 1, Op.F))
            if pending[r]:
                options.append((free[r], 2, Op.W))
            now = [o for o in options if o[0] <= free[r]]
            if fill_rule and [o[2] for o in now] == [Op.W]:
                due = [o for o in options if o[2] is not Op.W]
                soonest = min((o[0] for o in due), default=None)
                if due and soonest - free[r] < per_rank[r].W and idle[r] + soonest - free[r] <= max(idle):
                    now = []  # wait for it: a W here would delay it more than the gap
                    options = due
            pick = min(now or options, key=lambda o: (o[1], o[0]) if now else (o[0], o[1]), default=None)
            if pick is not None and (best is None or (pick[0], r) < (best[0][0], best[1])):
                best = (pick, r)
        (start, _, op), r = best
        times = per_rank[r]
        idle[r] += start - free[r]
        if op is Op.F:
            j = f_next[r]
            f_next[r] += 1
            alive[r] += 1
            end = start + times.F
            if r + 1 < pp:
                act_at[r + 1, j] = end + comm
            else:
                grad_at[r, j] = end  # the last stage starts its backward from its loss
        elif op is Op.I:
            j = i_next[r]
            i_next[r] += 1
            pending[r].append(j)
            end = start + times.I
            if r > 0:
                grad_at[r - 1, j] = end + comm
        else:
            j = pending[r].popleft()
            alive[r] -= 1
            end = start + times.W
        lists[r].append(Action(op, j))
        free[r] = end
        left -= 1
    return lists


def zbh2(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    return greedy(pp, m, 2 * pp - 1)


def simulated(generate, placement: str = "loop"):
    """The schedule model's bubble: the idle share of the schedule's own dependency graph run
    on the unit-time clock with the given op times and no communication cost. A simulation,
    not a formula: a schedule using it declares `bubble_source=modelled` (SCHEDULE_MODEL)."""
    def bubble(p: int, m: int, v: int = 1, times: OpTimes = OpTimes(), steps: int = 1) -> float:
        from framework.schedules.clock import simulated_bubble  # simulate imports this package's base
        return simulated_bubble(generate(p, m, v, steps), StageMap(p, v, placement), times) if p > 1 else 0.0
    return bubble


def zbh1_idle(p: int, t: OpTimes) -> float:
    """ZB-H1's bubble time per pipeline, Qi et al. (ICLR 2024, arXiv 2401.10241), Table 2:
    (p-1)(T_F + T_B - T_W), the paper's T_B being the backward for the input (here T_I)."""
    return (p - 1) * (t.F + t.I - t.W)


def zbh2_idle(p: int, t: OpTimes) -> float:
    """ZB-H2's, ibid.: (p-1)(T_F + T_B - 2T_W) (zero at T_F = T_B = T_W)."""
    return (p - 1) * (t.F + t.I - 2 * t.W)


def flushed_idle(p: int, t: OpTimes, paper) -> float:
    """Idle time per rank of a flushing step: the paper's form (`zbh1_idle`, `zbh2_idle`),
    floored by (p-1) T_F: the last rank cannot start before p-1 forwards, and the paper goes
    below that only by starting the next iteration before the optimizer step (its
    post-validation), which a flush forbids. The floor binds when T_I < k T_W (k = 1, 2)."""
    return max(paper(p, t), (p - 1) * t.F)


def _closed_form(paper, min_m, generate):
    """(bubble, bubble_source): the closed form where it equals the schedule's dependency
    graph (m >= min_m(p), tests/test_bubble_forms.py), the schedule model below that."""
    graph = simulated(generate)

    def source(p: int, m: int, v: int = 1) -> str:
        return CLOSED_FORM if p == 1 or m >= min_m(p) else SCHEDULE_MODEL

    def bubble(p: int, m: int, v: int = 1, times: OpTimes = OpTimes(), steps: int = 1) -> float:
        if p == 1:
            return 0.0
        if source(p, m, v) == SCHEDULE_MODEL:
            return graph(p, m, v, times, steps)
        idle = flushed_idle(p, times, paper)
        return idle / (m * (times.F + times.I + times.W) + idle)
    return bubble, source


_ZBH1, _ZBH2 = _closed_form(zbh1_idle, lambda p: p, zbh1), _closed_form(zbh2_idle, lambda p: 2 * p - 1, zbh2)
register(Schedule(
    name="zbh1", generate=zbh1, ops=frozenset({Op.F, Op.I, Op.W}),
    doc="ZB-H1: 1F1B's memory, W fills the cool-down; idle (p-1)max(T_F+T_I-T_W, T_F)",
    bubble=_ZBH1[0], bubble_source=_ZBH1[1], memory_bound=lambda pp, m, v, r: min(pp, m),
    bubble_formula="idle (p-1)max(T_F+T_I-T_W, T_F) for m >= p (below, the schedule model): (p-1)(T_F+T_B-T_W) "
                   "of Qi et al., arXiv 2401.10241, Table 2 (T_B: its input backward), floored by the flush's fill"))
register(Schedule(
    name="zbh2", generate=zbh2, ops=frozenset({Op.F, Op.I, Op.W}),
    doc="ZB-H2: 2p-1 micro-batches alive, W fills warm-up and cool-down; idle (p-1)max(T_F+T_I-2T_W, T_F)",
    bubble=_ZBH2[0], bubble_source=_ZBH2[1], memory_bound=lambda pp, m, v, r: min(2 * pp - 1, m),
    bubble_formula="idle (p-1)max(T_F+T_I-2T_W, T_F) for m >= 2p-1 (below, the schedule model): "
                   "(p-1)(T_F+T_B-2T_W) of Qi et al., arXiv 2401.10241, Table 2, floored by the flush's fill"))
