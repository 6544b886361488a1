"""Asynchronous schedules at constant start-up (framework/schedules/tiling.py): the
plan of a never-flushed run is a proved template, tiled. Tiled and directly built plans
agree op for op (actions and p2p batches, every rank, every step), and building a
10,000-step run's plan does the work a 10-step one does (counted, not timed)."""

import pytest

from framework.schedules.p2p import comm_plan
from framework.schedules import get
from framework.schedules.tiling import TiledPlan, _segments, fill_segments


def _cases():
    for name in ("1f1b", "2bw"):
        for p in (2, 3, 4, 5):
            for m in (1, 2, 3, 4, 6):
                if get(name).why_not(p, m, 1) is None:
                    yield name, p, m


@pytest.mark.parametrize("name,p,m", list(_cases()))
def test_the_tiled_plan_is_the_direct_plan(name, p, m):
    sched = get(name)
    smap = sched.stage_map(p, 1)
    t = 2 * fill_segments(p, m) + 2
    for steps in (t - 1, t, t + 1, t + 3):
        tiled = TiledPlan(sched, smap, m, steps)
        direct = {r: _segments(plan, m) for r, plan in comm_plan(sched.generate(p, m, 1, steps), smap).items()}
        for r in range(p):
            assert len(direct[r]) == steps
            assert [tiled.segment(r, k) for k in range(steps)] == direct[r], (steps, r)


def test_start_up_does_not_grow_with_the_run(monkeypatch):
    """The work, counted (not timed: a wall-time ratio flakes on a shared machine): building
    a 10,000-step run's plan and looking up its last step plans, proves and shifts exactly
    what a 10-step run's does. Counted where the cost is: the actions the unit-time lockstep
    (`comm_plan`) and NCCL's proof (`nccl_simulate`) run, and the segments shifted; a plan
    that built or proved the whole run, or tiled every step ahead, would count 1,000x more."""
    import framework.schedules.tiling as tiling

    sched, p, m = get("1f1b"), 4, 4
    counts: dict = {}

    def counting(name, fn, size):
        def wrapped(*args, **kwargs):
            counts[name] = counts.get(name, 0) + size(*args, **kwargs)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(tiling, "comm_plan", counting("comm_plan", tiling.comm_plan,
                                                      lambda lists, smap: sum(map(len, lists.values()))))
    monkeypatch.setattr(tiling, "nccl_simulate", counting("nccl_simulate", tiling.nccl_simulate,
                                                          lambda plans, smap: sum(len(x.actions) for x in plans.values())))
    monkeypatch.setattr(tiling.Segment, "shifted", counting("shifted", tiling.Segment.shifted, lambda seg, by: 1))

    def build(steps: int) -> dict:
        counts.clear()
        plan = TiledPlan(sched, sched.stage_map(p, 1), m, steps)
        assert plan.segment(0, steps - 1).actions  # the drain, shifted once
        return dict(counts)

    short, long = build(10), build(10_000)
    assert short == long and short["comm_plan"] == short["nccl_simulate"] > 0, (short, long)
    template = sum(map(len, sched.generate(p, m, 1, 2 * fill_segments(p, m) + 2).values()))
    assert short["comm_plan"] == template, (short, template)  # the template run's actions, once
