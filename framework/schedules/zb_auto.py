"""zb-auto: the zero-bubble paper's automatic scheduler (Qi et al., ICLR 2024, section 3.1),
its heuristic, on one chunk per rank.

Built from measured op times (T_F, T_I, T_W per pipeline rank), the p2p cost and an
activation-memory limit (`schedule.memory_limit_microbatches`, default p: ZB-H1's memory;
2p-1 gives ZB-H2's): in global time order each free rank runs I if its gradient has
arrived, else F within the memory limit (so the warm-up runs as many forwards as the limit
allows), else a pending W to fill the gap; a gap shorter than T_W is left idle unless it
would make the rank's idle time the largest of all (`zero_bubble.greedy`, fill_rule). Of
that heuristic (with and without the gap rule) and ZB-H1's order (when the limit allows
it), the step that is shortest on the calibrated clock, with the p2p cost, is taken.
Times come from `schedule.op_times` ({F, I, W} seconds, one value or a list per pipeline
rank, and comm), which the launching process fills from `sim.from=<job dir>` (that job's
calibration.json); without either every op costs 1 and comm 0. Every rank builds the same
lists from the resolved config, and like every schedule they are proved by the checker
before launch. An exact solver (the paper's ILP) is not implemented.
"""

from __future__ import annotations

from dataclasses import replace

from framework.schedules.base import AUTO, Op, OpTimes, Schedule, StageMap, modelled, register
from framework.schedules.zero_bubble import greedy, simulated, zbh1


def _times(op_times, pp: int) -> tuple[list[OpTimes], float]:
    if not op_times:
        return [OpTimes()] * pp, 0.0

    def at(key: str, r: int) -> float:
        x = op_times[key]
        return float(x[r] if isinstance(x, (list, tuple)) else x)
    return [OpTimes(at("F", r), at("I", r), at("W", r)) for r in range(pp)], float(op_times.get("comm", 0.0))


def _makespan(lists, pp: int, times: list[OpTimes], comm: float) -> float:
    """The step's length on the calibrated clock (the executor's real batches, gloo's rules)."""
    from framework.schedules.p2p import comm_plan  # p2p and simulate import this package's base
    from framework.schedules.clock import Costs, predict

    smap = StageMap(pp, 1, "loop")
    compute = {(r, 0, op): getattr(times[r], op) for r in range(pp) for op in "FIW"}
    return predict(comm_plan(lists, smap), smap, Costs(compute, alpha_s=comm)).pipeline_s


def build(limit=None, op_times=None):
    """(generate, memory bound) for a memory limit (None: p) and op times (None: units).
    Candidates: the heuristic with and without its gap rule, and ZB-H1's hand-built order
    where the limit allows its memory; the shortest step on the clock wins (ties: the first),
    since the greedy alone at ZB-H1's memory (limit p) is 2 units longer than ZB-H1 at
    pp 4-8 in unit time (tests/test_zb_auto.py)."""
    def generate(pp: int, m: int, v: int = 1, steps: int = 1):
        times, comm = _times(op_times, pp)
        lim = limit or pp
        candidates = [greedy(pp, m, lim, times, comm, fill_rule=True), greedy(pp, m, lim, times, comm)]
        if lim >= min(pp, m):
            candidates.append(zbh1(pp, m))
        return min(candidates, key=lambda lists: _makespan(lists, pp, times, comm))

    return generate, (lambda pp, m, v, r: min(limit or pp, m))


def configure(cfg) -> Schedule:
    """The schedule a run's config asks for (its limit and times)."""
    limit, op_times = getattr(cfg, "memory_limit_microbatches", None), getattr(cfg, "op_times", None)
    if limit is None and not op_times:
        return ZB_AUTO
    generate, bound = build(limit, op_times)
    return replace(ZB_AUTO, generate=generate, memory_bound=bound, bubble=simulated(generate), configure=None)


_generate, _bound = build()
ZB_AUTO = register(Schedule(
    name=AUTO, generate=_generate, ops=frozenset({Op.F, Op.I, Op.W}),
    doc="zero-bubble automatic (heuristic): from measured T_F/T_I/T_W, p2p cost and schedule.memory_limit_microbatches",
    bubble=simulated(_generate), bubble_source=modelled, memory_bound=_bound, configure=configure))
