"""Schedules as data: every generator's lists are proved valid over the whole grid (under
gloo's rules, and the executor's batches under NCCL's: `check` runs both), the checker
catches broken lists, and the grid and bubble agree with the papers' formulas."""

import pytest

from framework.metrics.bubble import analytic_bubble
from framework.parallel.pipeline.check import ScheduleError, check, grid, simulate, simulated_bubble
from framework.parallel.pipeline.schedules import Action, build_schedule, interleaved_check, version_of


def _cases():
    for name in ("gpipe", "flush", "interleaved", "1f1b", "2bw"):
        for p in range(1, 9):
            for m in range(1, 17):
                for v in range(1, 5) if name == "interleaved" else (1,):
                    if name == "interleaved" and interleaved_check(p, m, v):
                        continue
                    if name == "2bw" and m < p:
                        continue
                    yield name, p, m, v


@pytest.mark.parametrize("name", ["gpipe", "flush", "interleaved", "1f1b", "2bw"])
def test_checker_proves_every_schedule_on_the_grid(name):
    n = 0
    for case in (c for c in _cases() if c[0] == name):
        lists = check(*case, steps=2)
        n += 1
        p, m, v = case[1:]
        per_rank = 2 * m * v if name in ("gpipe", "flush", "interleaved") else 2 * 2 * m
        assert all(sum(a.op in "FB" for a in acts) == per_rank for acts in lists.values())
    assert n >= 8 * 16 // (4 if name == "interleaved" else 2)


def test_actions_print_as_in_the_papers():
    assert [str(a) for a in (Action("F", 3), Action("B", 3), Action("F", 3, 1), Action("U", 7))] == ["F3", "B3", "1F3", "U7"]


def test_flush_shape_warmup_steady_cooldown():
    lists = build_schedule("flush", 4, 6)
    assert [str(a) for a in lists[0]] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert [str(a) for a in lists[3]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_grid_of_gpipe_and_flush():
    assert grid(build_schedule("gpipe", 2, 3), 2) == (
        "rank 0: F0 F1 F2 .. .. B0 B1 B2\n"
        "rank 1: .. F0 F1 F2 B0 B1 B2 ..")
    assert grid(build_schedule("flush", 2, 3), 2).splitlines()[0] == "rank 0: F0 F1 .. B0 F2 B1 .. B2"


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("flush", 4, 8, 1), ("flush", 2, 3, 1),
                                       ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 4)])
def test_simulated_idle_share_equals_the_analytic_bubble(name, p, m, v):
    # backward costs twice a forward, as usual; the formula holds for any fixed ratio
    assert simulated_bubble(build_schedule(name, p, m, v), p, v, backward_cost=2) == pytest.approx(
        analytic_bubble(name, p, m, v))


def test_async_bubble_is_the_start_up_share():
    p, m, steps = 4, 4, 5
    lists = build_schedule("1f1b", p, m, steps=steps)
    assert simulated_bubble(lists, p, 1, backward_cost=1) == pytest.approx(
        analytic_bubble("1f1b", p, m, 1, steps), abs=0.03)


def test_checker_rejects_broken_lists(monkeypatch):
    import framework.parallel.pipeline.check as chk

    def patched(mutate):
        def build(name, p, m, v=1, steps=1):
            lists = build_schedule(name, p, m, v, steps)
            mutate(lists)
            return lists
        monkeypatch.setattr(chk, "build_schedule", build)

    patched(lambda L: L[1].insert(0, L[1].pop(L[1].index(Action("B", 0)))))  # backward first
    with pytest.raises(ScheduleError, match="before its forward"):
        chk.check("flush", 2, 2)
    patched(lambda L: L[0].remove(Action("B", 1)))
    with pytest.raises(ScheduleError, match="missing"):
        chk.check("flush", 2, 2)
    patched(lambda L: L.__setitem__(0, [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]))
    with pytest.raises(ScheduleError, match="deadlock"):  # rank 0 waits for B0's gradient before sending F1
        chk.check("gpipe", 2, 2)
    patched(lambda L: L.__setitem__(1, [Action("F", 1), Action("F", 0), Action("B", 1), Action("B", 0)]))
    with pytest.raises(ScheduleError, match="out of send order"):
        chk.check("gpipe", 2, 2)


def test_interleaved_needs_a_multiple_of_pp():
    assert "multiple of pp" in interleaved_check(4, 6, 2)
    with pytest.raises(ValueError, match="multiple of pp"):
        build_schedule("interleaved", 4, 6, 2)


def test_weight_versions_follow_the_documented_rules():
    # 1f1b: stage s runs p-s-1 micro-batches ahead of its updates
    assert [version_of("1f1b", j, 0, 3, 4) for j in range(5)] == [0, 0, 0, 1, 2]
    assert [version_of("1f1b", j, 2, 3, 4) for j in range(3)] == [0, 1, 2]
    # 2bw: step t (m = 2 micro-batches) runs on W(t-1)
    assert [version_of("2bw", j, s, 3, 2) for s in (0, 2) for j in range(6)] == [0, 0, 0, 0, 1, 1] * 2


def test_2bw_with_fewer_microbatches_than_stages_needs_a_third_version():
    with pytest.raises(ScheduleError, match="weight version"):
        check("2bw", 4, 2, steps=3)


def test_simulation_runs_async_ranks_together():
    timeline = simulate(build_schedule("1f1b", 2, 2, steps=2), 2, 1)
    assert [str(a) for _, _, a in timeline[1]] == ["F0", "B0", "U0", "F1", "B1", "U1", "F2", "B2", "U2", "F3", "B3", "U3"]
