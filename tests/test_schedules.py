"""Schedules as data: every registered generator's lists are proved valid over the whole
grid (under gloo's rules, and the executor's batches under NCCL's: `check` runs both), the
checker catches broken lists (one hand-made list per rule), the zero-bubble orders equal
torch 2.13's, and the grid and bubble agree with the papers' formulas."""

import logging

import pytest

from framework.metrics.bubble import analytic_bubble
from framework.schedules.check import ScheduleError, alive_peak, check, prove
from framework.schedules import Action, Op, OpTimes, StageMap, build_schedule, get, names
from framework.schedules.pipedream import version_1f1b, version_2bw
from framework.schedules.clock import grid, simulate, simulated_bubble


def _chunks(s):
    return [s.chunks] if s.chunks else ([1] if s.max_chunks == 1 else range(s.min_chunks, 5))


def _cases(name):
    s = get(name)
    for p in range(1, 9):
        for m in range(1, 17):
            for v in _chunks(s):
                if s.why_not(p, m, v) is None:
                    yield p, m, v


@pytest.mark.parametrize("name", names())
def test_checker_proves_every_schedule_on_the_grid(name):
    n = 0
    s = get(name)
    for p, m, v in _cases(name):
        lists = check(name, p, m, v, steps=2)
        n += 1
        per_rank = (2 if s.flushes else 4) * m * v  # F and a backward (B, or I + W counted once)
        assert all(sum(a.op in (Op.F, Op.B, Op.I) for a in acts) == per_rank for acts in lists.values())
        assert all(alive_peak(lists[r]) <= s.memory_bound(p, m if s.flushes else 2 * m, v, r) for r in lists)
    assert n >= 40  # every schedule runs on much of pp 2..8 x m 1..16 (dualpipev only at m >= 2p: 49)


@pytest.mark.parametrize("name,why", [("interleaved", "multiple of pp"), ("zbv", "exactly 2 chunks"),
                                      ("dualpipev", "as many micro-batches as stages")])
def test_where_a_schedule_does_not_run_it_says_why(name, why):
    s = get(name)
    bad = [(p, m, v) for p in range(2, 9) for m in range(1, 17) for v in (1, 2, 3) if s.why_not(p, m, v)]
    assert bad and any(why in s.why_not(*c).reason for c in bad)
    assert all(s.why_not(*c).fix for c in bad)


def test_actions_print_as_in_the_papers():
    assert [str(a) for a in (Action("F", 3), Action("B", 3), Action("F", 3, 1), Action("U", 7), Action(Op.I, 2, 1),
                             Action(Op.W, 0))] == ["F3", "B3", "1F3", "U7", "1I2", "W0"]


def test_flush_shape_warmup_steady_cooldown():
    lists = build_schedule("flush", 4, 6)
    assert [str(a) for a in lists[0]] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert [str(a) for a in lists[3]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_grid_of_gpipe_and_flush():
    assert grid(build_schedule("gpipe", 2, 3), StageMap(2)) == (
        "rank 0: F0 F1 F2 .. .. B0 B1 B2\n"
        "rank 1: .. F0 F1 F2 B0 B1 B2 ..")
    assert grid(build_schedule("flush", 2, 3), StageMap(2)).splitlines()[0] == "rank 0: F0 F1 .. B0 F2 B1 .. B2"


def test_v_placement_turns_at_the_last_rank():
    smap = StageMap(4, 2, "v")
    assert [smap.stage(r, 0) for r in range(4)] == [0, 1, 2, 3] and [smap.stage(r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert [smap.rank(g) for g in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("flush", 4, 8, 1), ("flush", 2, 3, 1),
                                       ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 4)])
def test_simulated_idle_share_equals_the_analytic_bubble(name, p, m, v):
    # backward costs twice a forward, as usual; the formula holds for any fixed ratio
    assert simulated_bubble(build_schedule(name, p, m, v), StageMap(p, v), OpTimes(1, 1, 1)) == pytest.approx(
        analytic_bubble(name, p, m, v))


TIMES = [OpTimes(1, 1, 1), OpTimes(1, 1, 0.5), OpTimes(1, 1.5, 0.5), OpTimes(1, 1, 2), OpTimes(2, 2, 1),
         OpTimes(1, 1, 0.25), OpTimes(1, 3, 1)]


@pytest.mark.parametrize("name,k,min_m", [("zbh1", 1, lambda p: p), ("zbh2", 2, lambda p: 2 * p - 1)])
def test_zero_bubble_idle_equals_the_papers_table_2_floored_by_the_fill(name, k, min_m):
    """Paper (Table 2): ZB-H1 idles (p-1)(T_F + T_I - T_W) per rank, ZB-H2 (p-1)(T_F + T_I - 2T_W),
    1F1B (p-1)(T_F + T_I + T_W); in a flushing step never less than the fill (p-1)T_F. Checked
    on each schedule's own dependency graph run with those times (simulate.py), and the
    declared bubble is that closed form."""
    n = 0
    for t in TIMES:
        for p in range(2, 9):
            for m in range(min_m(p), 17):
                timeline = simulate(build_schedule(name, p, m), StageMap(p), t)
                end = max(e for r in timeline for _, e, _ in timeline[r])
                busy = m * (t.F + t.I + t.W)
                assert end - busy == pytest.approx((p - 1) * max(t.F + t.I - k * t.W, t.F)), (t, p, m)
                assert analytic_bubble(name, p, m, times=t) == pytest.approx(1 - busy / end)
                n += 1
    flush = simulate(build_schedule("flush", 4, 8), StageMap(4), TIMES[2])
    assert max(e for r in flush for _, e, _ in flush[r]) - 8 * TIMES[2].B - 8 == pytest.approx(3 * (1 + TIMES[2].B))
    assert n > 200


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zbh2_beats_zbh1_when_w_is_short_and_zbv_halves_the_fill(p, m):
    t = OpTimes(1, 1.5, 0.5)
    h1, h2 = (simulated_bubble(build_schedule(n, p, m), StageMap(p), t) for n in ("zbh1", "zbh2"))
    assert h2 < h1 < analytic_bubble("flush", p, m)
    # ZB-V: a chunk is half a stage, so its fill is (p-1) half-forwards; at T_F = T_I = T_W nothing else idles
    zbv = simulate(build_schedule("zbv", p, m, 2), StageMap(p, 2, "v"), OpTimes(0.5, 0.5, 0.5))
    assert max(e for r in zbv for _, e, _ in zbv[r]) - 3 * m == pytest.approx((p - 1) * 0.5)


def _torch_order(schedule, p, m, v):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    out = {}
    for r, acts in enumerate(get_schedule_ops(schedule, p, m, v)):
        # DualPipeV's overlapped pairs run here one after the other, in their order
        out[r] = [f"{s.stage_index}{s.computation_type.value}{s.microbatch_index}"
                  for a in acts if a is not None for s in (a.sub_actions or (a,))]
    return out


@pytest.mark.parametrize("name,torch_name", [("interleaved-zb", "InterleavedZeroBubble"), ("zbv", "ZBVZeroBubble"),
                                             ("dualpipev", "DualPipeV")])
def test_action_orders_equal_torch_2_13(name, torch_name):
    logging.disable(logging.WARNING)  # torch warns about bubbles it pads
    n = 0
    try:
        for p in range(2, 7):
            for m in range(1, 13):
                for v in ([2] if get(name).chunks else [2, 3]):
                    if get(name).why_not(p, m, v):
                        continue
                    smap = get(name).stage_map(p, v)
                    ours = {r: [f"{smap.stage(r, a.chunk)}{a.op.value}{a.microbatch}" for a in acts]
                            for r, acts in build_schedule(name, p, m, v).items()}
                    assert ours == _torch_order(torch_name, p, m, v), (p, m, v)
                    n += 1
    finally:
        logging.disable(logging.NOTSET)
    assert n >= 20


def test_async_bubble_is_the_start_up_share():
    p, m, steps = 4, 4, 5
    lists = build_schedule("1f1b", p, m, steps=steps)
    assert simulated_bubble(lists, StageMap(p), {"F": 1, "B": 1, "U": 0}) == pytest.approx(
        analytic_bubble("1f1b", p, m, 1, steps), abs=0.03)


def _prove(name, lists, p, m, v=1):
    prove(get(name), lists, p, m, v)


def test_checker_rejects_broken_lists():
    base = build_schedule("flush", 2, 2)
    moved = {0: base[0], 1: [base[1][1], base[1][0], *base[1][2:]]}  # B0 before F0 on rank 1
    with pytest.raises(ScheduleError, match="before its forward"):
        _prove("flush", moved, 2, 2)
    with pytest.raises(ScheduleError, match="missing"):
        _prove("flush", {0: [a for a in base[0] if str(a) != "B1"], 1: base[1]}, 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):  # rank 0 waits for B0's gradient before sending F1
        _prove("gpipe", {0: [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                         1: build_schedule("gpipe", 2, 2)[1]}, 2, 2)
    with pytest.raises(ScheduleError, match="out of send order"):
        _prove("gpipe", {0: build_schedule("gpipe", 2, 2)[0],
                         1: [Action("F", 1), Action("F", 0), Action("B", 1), Action("B", 0)]}, 2, 2)


def test_checker_enforces_the_split_backward_rules():
    good = build_schedule("zbh1", 2, 2)
    _prove("zbh1", good, 2, 2)

    def swap(rank, a, b):
        acts = list(good[rank])
        i, j = acts.index(a), acts.index(b)
        acts[i], acts[j] = acts[j], acts[i]
        return {**good, rank: acts}

    with pytest.raises(ScheduleError, match="W after its I"):
        _prove("zbh1", swap(1, Action(Op.I, 0), Action(Op.W, 0)), 2, 2)
    with pytest.raises(ScheduleError, match="has no W"):
        _prove("zbh1", {**good, 0: [a for a in good[0] if str(a) != "W1"]}, 2, 2)
    with pytest.raises(ScheduleError, match="does not declare"):  # a fused B in a schedule of F, I, W only
        _prove("zbh1", {**good, 0: [Action(Op.B, 1) if str(a) == "I1" else a for a in good[0]
                                    if str(a) != "W1"]}, 2, 2)
    dual = build_schedule("dualpipev", 2, 4, 2)
    split = next(a for a in dual[0] if a.op is Op.I)
    with pytest.raises(ScheduleError, match="runs both B and I"):
        _prove("dualpipev", {**dual, 0: dual[0] + [Action(Op.B, split.microbatch, split.chunk)]}, 2, 4, 2)


def test_checker_enforces_the_declared_activation_memory_bound():
    """ZB-H1 declares 1F1B's memory (p micro-batches alive); GPipe's order holds m."""
    p, m = 2, 4
    gpipe_like = {r: [Action(Op.F, j) for j in range(m)] + [a for j in range(m) for a in (Action(Op.I, j), Action(Op.W, j))]
                  for r in range(p)}
    with pytest.raises(ScheduleError, match="holds 4 .* declared bound 2"):
        _prove("zbh1", gpipe_like, p, m)
    with pytest.raises(ScheduleError, match="holds 4 .* declared bound 3"):  # ZB-H2: 2p - 1
        _prove("zbh2", gpipe_like, p, m)
    _prove("zbh2", build_schedule("zbh2", p, m), p, m)


def test_weight_versions_follow_the_documented_rules():
    # 1f1b: stage s runs p-s-1 micro-batches ahead of its updates
    assert [version_1f1b(j, 0, 3, 4) for j in range(5)] == [0, 0, 0, 1, 2]
    assert [version_1f1b(j, 2, 3, 4) for j in range(3)] == [0, 1, 2]
    # 2bw: step t (m = 2 micro-batches) runs on W(t-1)
    assert [version_2bw(j, s, 3, 2) for s in (0, 2) for j in range(6)] == [0, 0, 0, 0, 1, 1] * 2


def test_2bw_with_fewer_microbatches_than_stages_needs_a_third_version():
    lists = get("2bw").generate(4, 2, 1, 3)
    with pytest.raises(ScheduleError, match="weight version"):
        prove(get("2bw"), lists, 4, 2, 1, steps=3)


def test_simulation_runs_async_ranks_together():
    timeline = simulate(build_schedule("1f1b", 2, 2, steps=2), StageMap(2))
    assert [str(a) for _, _, a in timeline[1]] == ["F0", "B0", "U0", "F1", "B1", "U1", "F2", "B2", "U2", "F3", "B3", "U3"]
