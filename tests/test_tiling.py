"""Asynchronous schedules at constant start-up (framework/parallel/pipeline/tiling.py): the
plan of a never-flushed run is a proved template, tiled. Tiled and directly built plans
agree op for op (actions and p2p batches, every rank, every step), and building a
10,000-step run's plan costs what a 10-step one does."""

import time

import pytest

from framework.parallel.pipeline.p2p import comm_plan
from framework.parallel.pipeline.schedules import get
from framework.parallel.pipeline.tiling import TiledPlan, _segments, fill_segments


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


def test_start_up_does_not_grow_with_the_run():
    """The work: the same template (actions built and proved) for 10 and 10,000 steps; the
    time: within 20 % (best of 3, so a busy machine does not decide it)."""
    sched, p, m = get("1f1b"), 4, 4
    work = [sum(len(s.actions) for s in TiledPlan(sched, sched.stage_map(p, 1), m, n).segments[0])
            for n in (10, 10_000)]
    assert work[0] == work[1] > 0

    def build(steps: int) -> float:
        t0 = time.perf_counter()
        plan = TiledPlan(sched, sched.stage_map(p, 1), m, steps)
        plan.segment(0, steps - 1)
        return time.perf_counter() - t0

    build(10)
    short, long = min(build(10) for _ in range(3)), min(build(10_000) for _ in range(3))
    assert long < 1.2 * short + 0.01, (short, long)  # within 20 % (plus 10 ms of timer noise)
