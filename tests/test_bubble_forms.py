"""The schedule's bubble: a closed form where a paper gives one that holds here, else the
schedule model (its own lists on the unit-time clock, framework/schedules/clock.py), and every
report says which; a run's `predicted_*` is a replay of its own durations, and reads so.

The closed forms are tested against the schedule model's idle time per rank (the step's
end minus a rank's compute), within the conditions they hold in (docs/schedules.md):
- ZB-H1 / ZB-H2, Qi et al. (arXiv 2401.10241) Table 2: (p-1)(T_F+T_B-kT_W), the paper's T_B
  being our T_I, k = 1 / 2, for m >= p / 2p-1 and T_I >= k T_W; outside the latter a
  flushing step idles (p-1)T_F (the fill), which the paper passes only by starting the next
  iteration before the optimizer step.
- DualPipe(V), DeepSeek-V3 (arXiv 2412.19437) Table 2: (PP/2-1)(F&B+B-3W), PP = 2p stages,
  B the full backward: the idle time of dualpipev's lists when each forward-backward pair
  runs as one unit (F&B = T_F + T_B, no overlap) and T_I >= max(T_F, T_W). Here the pair
  runs F, then B, so the schedule model idles less; dualpipev's declared bubble is that model.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from framework.metrics.bubble import analytic_label, analytic_source
from framework.schedules.messages import needs, produces
from framework.schedules import (CLOSED_FORM, SCHEDULE_MODEL, Op, OpTimes, StageMap,
                                                   build_schedule, get, names)
from framework.schedules.dualpipev import paper_idle as dualpipe_idle
from framework.schedules.zero_bubble import zbh1_idle, zbh2_idle
from framework.schedules.clock import simulate, simulated_bubble

TIMES = [OpTimes(1, 1, 1), OpTimes(1, 1, 0.5), OpTimes(1, 1.5, 0.5), OpTimes(1, 2, 1), OpTimes(2, 2, 1),
         OpTimes(1, 3, 1), OpTimes(0.5, 1, 0.25), OpTimes(1, 1, 2), OpTimes(2, 1, 1), OpTimes(1, 0.5, 1)]


def _idle(timeline: dict, busy: float) -> list[float]:
    """Each rank's idle time in the step: the last rank's end minus the rank's compute."""
    end = max(e for r in timeline for _, e, _ in timeline[r])
    return [end - sum(e - s for s, e, _ in timeline[r]) for r in timeline] if busy is None else [end - busy]


def _model_idle(name: str, p: int, m: int, v: int, t: OpTimes) -> list[float]:
    s = get(name)
    return _idle(simulate(build_schedule(name, p, m, v), s.stage_map(p, v), t), None)


def _valid(name: str):
    s = get(name)
    for p in (2, 3, 4):
        for m in (1, p - 1, p, 2 * p, 2 * p + 1, 3 * p):
            v = s.preset_chunks
            if m >= 1 and s.why_not(p, m, v) is None:
                yield p, m, v


@pytest.mark.parametrize("name", names())
def test_each_schedule_says_where_its_bubble_comes_from_and_a_closed_form_equals_its_model(name, monkeypatch):
    """A bubble labelled closed form is a formula (named, with its paper) that never runs the
    clock and equals the schedule model at any op times; one labelled schedule model runs it."""
    s = get(name)
    cases = list(_valid(name))
    assert cases
    for p, m, v in cases:
        source = analytic_source(s, p, m, v)
        assert source in (CLOSED_FORM, SCHEDULE_MODEL)
        for t in TIMES[:6]:
            for steps in ((1, 3) if not s.flushes else (1,)):
                model = simulated_bubble(s.generate(p, m, v, steps), s.stage_map(p, v), t)
                assert s.bubble(p, m, v, t, steps) == pytest.approx(model), (p, m, v, t, steps)
                if source == SCHEDULE_MODEL and t in TIMES[:3]:  # the model met itself above: an outside clock
                    clock = _pair_clock(s.generate(p, m, v, steps), s.stage_map(p, v), t, None)
                    assert model == pytest.approx(_idle_share(clock)), (p, m, v, t, steps)
        calls = []
        monkeypatch.setattr("framework.schedules.clock.simulated_bubble", lambda *a, **k: calls.append(a) or 0.5)
        s.bubble(p, m, v, OpTimes(), 1)
        monkeypatch.undo()
        assert bool(calls) == (source == SCHEDULE_MODEL), (p, m, v, source)
        assert bool(s.bubble_formula) or source == SCHEDULE_MODEL
    if name in ("interleaved-zb", "zbv", "dualpipev", "zb-auto"):  # no closed form: a simulation, so labelled
        assert {analytic_source(s, p, m, v) for p, m, v in cases} == {SCHEDULE_MODEL} and not s.bubble_formula
    if name in ("zbh1", "zbh2"):  # the closed form from the m where it holds, the model below
        assert analytic_source(s, 4, 2 if name == "zbh1" else 6) == SCHEDULE_MODEL
        assert analytic_source(s, 4, 4 if name == "zbh1" else 7) == CLOSED_FORM
    assert analytic_source(s, 1, 4) == CLOSED_FORM  # pp = 1: no pipeline, 0 by definition


@pytest.mark.parametrize("name,paper,k,min_m", [("zbh1", zbh1_idle, 1, lambda p: p),
                                                ("zbh2", zbh2_idle, 2, lambda p: 2 * p - 1)])
def test_zero_bubble_papers_idle_time_equals_the_schedule_model_where_it_holds(name, paper, k, min_m):
    """(p-1)(T_F + T_I - k T_W) per rank for m >= min_m(p) and T_I >= k T_W; below that the
    flush's fill (p-1)T_F is the idle time, above the paper's value."""
    inside = outside = 0
    for t in TIMES:
        for p in range(2, 8):
            for m in (min_m(p), min_m(p) + 1, 2 * min_m(p), 16):
                idle = _model_idle(name, p, m, 1, t)
                assert max(idle) - min(idle) == pytest.approx(0), (t, p, m)  # every rank idles alike
                if t.I >= k * t.W:
                    assert idle[0] == pytest.approx(paper(p, t)), (t, p, m)
                    inside += 1
                else:
                    assert idle[0] == pytest.approx((p - 1) * t.F) and paper(p, t) < idle[0], (t, p, m)
                    outside += 1
    assert inside > 60 and outside > 10


def _pair_clock(lists: dict, smap: StageMap, t: OpTimes, f_and_b: float | None) -> dict:
    """DualPipe's execution of the same lists: a forward followed by a full backward of the
    other chunk is one overlapped unit of f_and_b seconds, started once both its inputs have
    arrived and sending both results at its end; otherwise the rules of clock.simulate.
    f_and_b None: no pairs, each op alone (the schedule model, written apart from clock.py)."""
    units = {}
    for r, acts in lists.items():
        units[r], i = [], 0
        while i < len(acts):
            pair = (f_and_b is not None and acts[i].op is Op.F and i + 1 < len(acts) and acts[i + 1].op is Op.B
                    and acts[i + 1].chunk != acts[i].chunk)
            units[r].append(tuple(acts[i:i + 1 + pair]))
            i += 1 + pair
    pos, clock, arrived = dict.fromkeys(units, 0), dict.fromkeys(units, 0.0), {}
    timeline = {r: [] for r in units}
    left = sum(len(u) for u in units.values())
    while left:
        moved = False
        for r, us in units.items():
            while pos[r] < len(us):
                unit = us[pos[r]]
                wait = [n for n in (needs(a, r, smap) for a in unit) if n is not None]
                if any(n not in arrived for n in wait):
                    break
                start = max([clock[r]] + [arrived[n] for n in wait])
                op = unit[0].op
                clock[r] = start + (f_and_b if len(unit) == 2 else 0.0 if op is Op.U else getattr(t, op.value))
                timeline[r].append((start, clock[r], unit))
                for a in unit:
                    if (out := produces(a, r, smap)) is not None:
                        arrived[out] = clock[r]
                pos[r], left, moved = pos[r] + 1, left - 1, True
        assert moved, "deadlock"
    return timeline


def _idle_share(timeline: dict) -> float:
    """The bubble: each rank's idle share of the step (0 to the last end), averaged."""
    end = max(e for r in timeline for _, e, _ in timeline[r])
    return sum(1 - sum(e - s for s, e, _ in timeline[r]) / end for r in timeline) / len(timeline)


def test_the_schedule_model_gives_hand_derived_bubbles():
    """Two schedule-model bubbles worked by hand at T_F = T_I = T_W = 1, p 2, m 2.
    zb-auto (v 1): rank 0 F0 0-1, F1 1-2; rank 1 F0 1-2, I0 2-3, F1 3-4, I1 4-5, W0 5-6,
    W1 6-7; rank 0 I0 3-4 (rank 1's I0 ends at 3), W0 4-5, I1 5-6, W1 6-7: step 7, each
    rank busy 6, bubble 1/7. zbv (v 2, stages 0 and 3 on rank 0, 1 and 2 on rank 1): rank 0
    F0 0-1, F1 1-2, 1F0 3-4, 1I0 4-5, 1W0 5-6, 1F1 6-7 (stage 2's F1 ends at 5 on rank 1),
    1I1 7-8, 1W1 8-9, I0 9-10 (rank 1's I0 ends at 8), W0 10-11, I1 12-13, W1 13-14;
    rank 1 F0 1-2, 1F0 2-3, F1 3-4, 1F1 4-5, 1I0 5-6, 1W0 6-7, I0 7-8, W0 8-9, 1I1 9-10,
    1W1 10-11, I1 11-12, W1 12-13: step 14, busy 12 each, bubble 2/14."""
    assert get("zb-auto").bubble(2, 2, 1, OpTimes(), 1) == pytest.approx(1 / 7)
    assert get("zbv").bubble(2, 2, 2, OpTimes(), 1) == pytest.approx(2 / 14)


def test_dualpipes_formula_is_its_paired_execution_and_the_schedule_model_idles_less():
    """(p-1)(F&B + B - 3W) equals the idle time of dualpipev's lists run as DualPipe runs them
    (pairs as one unit, F&B = T_F + T_B) when T_I >= max(T_F, T_W), for every m >= 2p. The
    schedule model (the lists as this executor runs them: F, its activation sent, then B)
    idles less in every such case; dualpipev's declared bubble is that model's."""
    n = 0
    for t in TIMES:
        for p in range(2, 7):
            for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
                lists, smap = build_schedule("dualpipev", p, m, 2), StageMap(p, 2, "v")
                paired = _idle(_pair_clock(lists, smap, t, t.F + t.B), 2 * m * (t.F + t.B))
                model = _model_idle("dualpipev", p, m, 2, t)
                assert max(model) - min(model) == pytest.approx(0)
                if t.I >= max(t.F, t.W):
                    assert paired[0] == pytest.approx(dualpipe_idle(p, t)), (t, p, m)
                    assert model[0] < dualpipe_idle(p, t) - 1e-9, (t, p, m)
                    n += 1
    assert n > 80
    # T_F = T_I = T_W: the model idles p-1 units, the paper's form (no overlap) 2(p-1)
    for p in range(2, 7):
        assert _model_idle("dualpipev", p, 3 * p, 2, OpTimes())[0] == p - 1 == dualpipe_idle(p, OpTimes()) / 2
    # outside the condition (here T_W > T_I) the paired execution idles more than the form
    t = OpTimes(1, 1, 2)
    lists = build_schedule("dualpipev", 4, 8, 2)
    assert _idle(_pair_clock(lists, StageMap(4, 2, "v"), t, t.F + t.B), 16 * t.B)[0] > dualpipe_idle(4, t)
    s = get("dualpipev")
    assert s.bubble_source(4, 8, 2) == SCHEDULE_MODEL and s.bubble(4, 8, 2, OpTimes(1, 2, 1)) == pytest.approx(
        simulated_bubble(build_schedule("dualpipev", 4, 8, 2), StageMap(4, 2, "v"), OpTimes(1, 2, 1)))


def test_the_console_and_the_dry_run_say_schedule_model_where_the_bubble_is_simulated():
    from framework.report.closing import summary_lines
    from framework.launch.plan import render_plan

    assert analytic_label(CLOSED_FORM) == "analytic" and analytic_label(SCHEDULE_MODEL) == "schedule model"
    summary = {"loss_first": 5.0, "loss": 3.0, "tokens_per_s": 1000.0, "step_time_s": 0.1, "mfu": None,
               "measured_steps": 3, "steps": 5, "first_step": 1, "pp": 2, "op_time_s": {"F": 0.01},
               "bubble_fraction": 0.2, "bubble_fraction_max": 0.25, "bubble_fraction_analytic": 0.1,
               "schedule": "zbv", "bubble_analytic_source": SCHEDULE_MODEL, "ranks": []}
    assert "| 0.100 schedule model (zbv at the measured op times: T_F 10.00 ms)" in summary_lines(summary)
    summary.update(schedule="flush", bubble_analytic_source=CLOSED_FORM)
    assert "| 0.100 analytic (flush at" in summary_lines(summary)
    plan = {"world_size": 2, "dims": {"pp": 2, "dp": 1, "tp": 1}, "layout": "", "groups": {}, "stages": [],
            "memory_estimate_per_rank": [], "schedule": {"name": "zbv", "microbatches": 4, "virtual_stages": 2},
            "bubble_fraction_analytic": 0.125, "bubble_analytic_source": SCHEDULE_MODEL, "schedule_grid": "",
            "global_batch": 4, "tokens_per_step": 64}
    assert "schedule model bubble 0.125 at T_F = T_I = T_W" in render_plan(plan)


def test_the_timeline_and_the_dashboard_call_a_runs_own_simulation_a_replay(tmp_path, monkeypatch):
    from framework.metrics import timeline
    from framework.report.dashboard import Job, bubble_figure, table_html, timeline_figure

    records = [[("F0", 0.0, 0.0, 1.0), ("B0", 2.0, 2.0, 4.0)], [("F0", 1.0, 1.0, 2.0), ("B0", 2.0, 2.0, 3.0)]]
    titles = []
    monkeypatch.setattr(timeline, "render_timeline", lambda recs, path, title, pred, predicted_title, comm: titles.extend(
        [title, predicted_title]))
    monkeypatch.setattr("framework.metrics.replay.timeline_records", lambda prediction: records)
    run = SimpleNamespace(schedule=SimpleNamespace(name="zbv", microbatches=1, virtual_stages=2),
                          parallelism=SimpleNamespace(pp=2))
    summary = {"step_time_s": 0.004, "bubble_fraction": 0.3, "predicted_step_time_s": 0.0041,
               "predicted_step_time_error": 0.025, "predicted_bubble_fraction": 0.28,
               "bubble_analytic_source": SCHEDULE_MODEL, "bubble_fraction_analytic": 0.25,
               "predicted_bubble_error": -0.02, "timeline_step": 1, "pp": 2}
    timeline.write_run_timeline(run, str(tmp_path), {1: records},
                                [{"step": 1, "step_time_s": 0.004, "bubble_fraction": 0.3,
                                  "bubble_fraction_analytic": 0.25}], summary, object(), None)
    assert "measured 0.300, schedule model 0.250" in titles[0]
    assert titles[1].startswith("replay of this run (the simulator at its own mean durations): step 4.1 ms")
    assert "predict" not in titles[1]

    job = Job({"job": "0", "status": "completed"}, "0: zbv", summary, [], tmp_path)
    flush = Job({"job": "1", "status": "completed"}, "1: flush", {**summary, "bubble_analytic_source": CLOSED_FORM})
    fig = bubble_figure([job, flush])
    assert [d.name for d in fig.data] == ["measured", "replay (simulator, the run's own durations)",
                                          "schedule's: closed form or schedule model"]
    assert list(fig.data[2].text) == ["25.0% (schedule model)", "25.0%"]
    assert "predict" not in fig.layout.title.text
    fig = timeline_figure(job)
    assert "schedule model 25.0%, replay 28.0% (step time +2.5% vs measured)" in fig.layout.title.text.replace("<br>", " ")
    assert {"rank 0", "rank 1", "replay rank 0", "replay rank 1"} == set(fig.layout.yaxis.categoryarray)
    assert list(fig.layout.yaxis.categoryarray)[-1] == "replay rank 1"  # the replay's rows under the measured
    table = table_html([job.row, flush.row], [job, flush])
    assert "25.0% (schedule model)" in table and "bubble (the schedule&#x27;s: closed form, or schedule model)" in table
    assert json.loads((tmp_path / "predicted_trace.json").read_text())["traceEvents"]  # the file keeps its name


def test_the_simulate_cli_calls_the_jobs_own_layout_a_replay_and_others_predictions():
    from framework.sim.cli import describe

    result = {"schedule": "flush", "pp": 2, "microbatches": 4, "virtual_stages": 1, "source": "outputs/a",
              "rescaled": False, "replay": True, "predicted_step_time_s": 0.1, "predicted_tokens_per_s": 1e4,
              "predicted_bubble_fraction": 0.2, "predicted_rank_bubble_fraction": [], "predicted_activation_peak_bytes": []}
    assert describe(result).startswith("flush pp=2 m=4 v=1 (replay of outputs/a): step 100.0 ms")
    assert "(predicted from outputs/a): " in describe({**result, "replay": False, "microbatches": 8})
    assert "(predicted from outputs/a, rescaled): " in describe({**result, "replay": False, "rescaled": True})
