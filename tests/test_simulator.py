"""The simulator (docs/simulator.md): the clock against hand-computed timelines, the replay
bound on runs whose durations a stage delay makes known, predicted keys in every sink,
what-if from one job (CLI, dry run), search.mode=simulate, bounded calibration samples."""

import json
import math
import statistics

import pytest

from framework.config import ConfigError
from framework.metrics.calibrate import Sample
from framework.schedules.p2p import comm_plan
from framework.schedules import get
from framework.schedules.clock import Costs, predict

from .conftest import assert_config_error, read_metrics, run_cli, run_local


def job_config(job):
    from framework.config import read_config

    return read_config(str(job / "config.yaml"))


def _costs(p, f, b, **kw):
    return Costs({(r, 0, op): t for r in range(p) for op, t in (("F", f), ("B", b))}, **kw)


def test_the_clock_reproduces_a_hand_computed_flush():
    """flush, pp 2, m 2, T_F = 1, T_B = 2, latency 0.5 (gloo: a receive completes 0.5 after
    the send). Rank 0: F0 0-1, F1 1-2, B0 waits for rank 1's gradient (B0 ends 4.5, + 0.5)
    5-7, B1 8-10. Rank 1: F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5. Both windows
    0-10 (+ flush 0.25), busy 6."""
    s = get("flush")
    smap = s.stage_map(2, 1)
    sim = predict(comm_plan(s.generate(2, 2, 1, 1), smap), smap, _costs(2, 1.0, 2.0, alpha_s=0.5, flush_s=0.25))
    got = {r: [(str(t.action), t.compute_start, t.end) for t in sim.timeline[r]] for r in sim.timeline}
    assert got == {0: [("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 8, 10)],
                   1: [("F0", 1.5, 2.5), ("B0", 2.5, 4.5), ("F1", 4.5, 5.5), ("B1", 5.5, 7.5)]}
    assert sim.pipeline_s == 10.25 and sim.window_s == {0: 10.25, 1: 10.25}
    assert sim.bubble == pytest.approx(1 - 6 / 10.25)


def test_nccl_rules_charge_a_send_until_its_receive_runs():
    """gpipe pp 2 m 2, rank 1 slow (T_F 3): under NCCL's rules rank 0's batch holding the
    send of F1 cannot complete before rank 1 posts that receive, and the next batch waits
    behind it on the stream; gloo's buffered sends never wait. With no link cost both agree
    on unit times (the lockstep placement of p2p.py), and NCCL is never faster."""
    s = get("gpipe")
    smap = s.stage_map(2, 1)
    plans = comm_plan(s.generate(2, 2, 1, 1), smap)
    unit = _costs(2, 1.0, 1.0)
    assert predict(plans, smap, unit, rules="nccl").pipeline_s == predict(plans, smap, unit).pipeline_s == 6
    slow = Costs({(0, 0, "F"): 1.0, (0, 0, "B"): 1.0, (1, 0, "F"): 3.0, (1, 0, "B"): 1.0}, alpha_s=0.5)
    gloo, nccl = predict(plans, smap, slow).pipeline_s, predict(plans, smap, slow, rules="nccl").pipeline_s
    assert nccl >= gloo > 0


def test_a_bounded_sample_keeps_its_size_and_spans_the_run():
    s = Sample(limit=64)
    for i in range(100_000):
        s.add(float(i))
    assert len(s.values) < 64 and s.seen == 100_000
    assert s.values[0] == 0.0 and s.values[-1] > 90_000  # spread over the whole run, not its start
    assert s.median() == pytest.approx(50_000, rel=0.05) and s.mean() == pytest.approx(50_000, rel=0.05)


# --- runs with known durations: a 40 ms sleep inside every compute of pp rank 1 ---------------

SKIP_FIRST = 3  # warm-up steps: neither calibrated from nor in the summary's medians
DELAY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "data.seq_len=32", "logger=none",
         "trainer.micro_batch_size=2", "data=synthetic", "trainer.steps=9", f"metrics.skip_first={SKIP_FIRST}",
         "trainer.log_interval=3", "parallelism=pp2", "schedule.microbatches=4", "debug.stage_delay_ms=40",
         "debug.delay_pp_rank=1", "metrics.peak_tflops=1.0"]


@pytest.fixture(scope="module")
def delayed_flush(tmp_path_factory):
    job = tmp_path_factory.mktemp("flush_delay")
    return job, run_local(job, *DELAY, "schedule=flush")


@pytest.mark.parametrize("schedule", ["flush", "zbh1"])
def test_replay_meets_its_bound_on_controlled_runs(delayed_flush, schedule, tmp_path):
    """Replay (the run's own mean durations): step time within 6 % (the issue's max) of the
    mean of the steps it was calibrated from, widened by those steps' own spread; bubble
    within 2 points of their mean (widened the same way), per rank within 4; the keys reach
    summary.json, metrics.jsonl (at log
    intervals) and the files (calibration.json, predicted_trace.json).

    Why the mean, and the widening. The calibration averages each duration over the measured
    steps (calibrate.py: means, so that a step, a sum of them, is predicted in expectation),
    so the replay predicts those steps' mean; summary.json's error is against their median,
    which a few slow steps on a loaded machine leave behind (beside two CPU hogs, zbh1: +16.8 %
    against the median, -1.0 % against the mean; the flake of issue 29). What load still adds
    (a stall moves the critical path, which a replay of means cannot follow; the latency's
    median leaves a stalled message out) grows with the steps' spread, so the bound is 6 %
    plus the relative standard error of their mean: about 0.3 % on an idle machine (6.3 %),
    3-15 % beside the hogs, where the error against the mean reached 6.4 %. A mistake in the
    model (a wait or a delay counted twice, a stage's time lost) moves the replay by a whole
    delayed op or more, tens of percent. The bubble is a ratio of times from the same steps:
    within 0.4 points beside the hogs."""
    job, summary = delayed_flush if schedule == "flush" else (tmp_path, run_local(tmp_path, *DELAY, "schedule=zbh1"))
    steps = [r["step_time_s"] for r in read_metrics(job) if r["step"] > SKIP_FIRST]
    mean = statistics.fmean(steps)
    error = summary["predicted_step_time_s"] / mean - 1
    assert abs(error) <= 0.06 + statistics.stdev(steps) / mean / math.sqrt(len(steps)), (error, steps, summary)
    # The bubble likewise against the mean of the same steps, within 2 points plus twice the
    # standard error of that mean: beside two CPU hogs the flush run's per-step bubble spread
    # 0.485-0.527 and the replay was 2.4 points off the mean (a fixed 2-point bound failed);
    # a delayed op counted wrong moves it by ~10 points (40 ms of a ~370 ms step).
    bubbles = [r["bubble_fraction"] for r in read_metrics(job) if r["step"] > SKIP_FIRST]
    bubble_error = summary["predicted_bubble_fraction"] - statistics.fmean(bubbles)
    assert abs(bubble_error) <= 0.02 + 2 * statistics.stdev(bubbles) / math.sqrt(len(bubbles)), (bubble_error, bubbles)
    measured = [r["bubble_fraction"] for r in summary["ranks"]]
    assert all(abs(p - m) <= 0.04 for p, m in zip(summary["predicted_rank_bubble_fraction"], measured))
    # the errors are against the medians of the measured steps (docs/simulator.md), read from the rows
    assert summary["step_time_s"] == pytest.approx(statistics.median(steps), rel=1e-12)
    vs_median = summary["predicted_step_time_s"] / statistics.median(steps) - 1
    assert summary["predicted_step_time_error"] == pytest.approx(vs_median, rel=1e-9)
    vs_median = summary["predicted_bubble_fraction"] - statistics.median(bubbles)
    assert summary["predicted_bubble_error"] == pytest.approx(vs_median, rel=1e-9, abs=1e-12)
    cal = json.loads((job / "calibration.json").read_text())
    slow = "I" if schedule == "zbh1" else "B"
    assert cal["compute"][f"1,0,F"] >= 0.040 and cal["compute"][f"1,0,{slow}"] >= 0.040
    assert cal["compute"]["0,0,F"] < 0.040 and cal["steps"] == 6 and cal["latency_samples"] > 0
    rows = read_metrics(job)
    logged = [r for r in rows if "predicted_step_time_s" in r]
    assert [r["step"] for r in logged] == [1, 3, 6, 9]  # the first step and each log interval
    assert all(r["predicted_step_time_s"] > 0 and 0 < r["predicted_bubble_fraction"] < 1 for r in logged)
    trace = json.loads((job / "predicted_trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}


def test_what_if_replays_the_job_and_predicts_other_layouts(delayed_flush, tmp_path, capsys):
    from framework.sim.cli import main, what_if

    job, summary = delayed_flush
    same = what_if(str(job))
    assert same["predicted_step_time_s"] == pytest.approx(summary["predicted_step_time_s"]) and not same["rescaled"]
    more = what_if(str(job), ["schedule.microbatches=8"])
    four = what_if(str(job), ["parallelism.pp=4"])
    # twice the micro-batches: about twice the step (the slow stage's 80 ms per micro-batch dominates)
    assert 1.6 < more["predicted_step_time_s"] / same["predicted_step_time_s"] < 2.2
    # the replayed step cut as the measured one: the replay's own breakdown is the summary's,
    # and the parts (means over pp ranks) fit in the step (the slowest rank's); the delayed
    # stage 1 keeps stage 0 waiting, so twice the micro-batches add bubble
    parts = {k: v for k, v in same.items() if k.startswith("predicted_time_")}
    assert parts == pytest.approx({k: summary[k] for k in parts}) and len(parts) == 6
    assert sum(parts.values()) <= same["predicted_step_time_s"] * (1 + 1e-9)
    assert more["predicted_time_bubble_s"] > same["predicted_time_bubble_s"] > 0
    # pp 4 puts one block per stage: the delay still sits on pp rank 1 of the source only, so
    # the rescaled per-block time moves it onto every stage (documented: delays are per stage)
    assert len(four["predicted_rank_bubble_fraction"]) == 4
    # another schedule on the same stages keeps each stage's own times: gpipe's step is at
    # least m x the slow stage's (F + B), which pooling the stages would halve
    cal = json.loads((job / "calibration.json").read_text())["compute"]
    assert what_if(str(job), ["schedule=gpipe"])["predicted_step_time_s"] >= 4 * (cal["1,0,F"] + cal["1,0,B"])
    # zb-auto takes the job's times rescaled to the target pipeline, as a run with sim.from would
    from framework.sim.cli import auto_op_times, target_config

    times = auto_op_times(str(job), target_config(job_config(job), ["schedule=zb-auto", "parallelism.pp=4"]))
    assert [len(times[op]) for op in "FIW"] == [4, 4, 4] and times["comm"] > 0
    assert what_if(str(job), ["schedule=zb-auto", "parallelism.pp=4"])["pp"] == 4
    png = tmp_path / "zbh1.png"
    assert main([str(job), "schedule=zbh1", "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "zbh1" and out["rescaled"] and png.stat().st_size > 10_000
    assert main([str(job), "schedule=dualpipev", "schedule.microbatches=2"]) == 2
    assert "dualpipev needs at least" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a layout key"):
        what_if(str(job), ["optimizer.lr=1"])


def test_dry_run_with_sim_from_puts_the_prediction_in_the_plan(delayed_flush, tmp_path):
    job, _ = delayed_flush
    r = run_cli([*DELAY, "schedule=zbh1", "dry_run=true", f"sim.from={job}", f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["simulated"]["schedule"] == "zbh1" and plan["simulated"]["predicted_step_time_s"] > 0
    assert "zbh1 pp=2 m=4 v=1 (predicted from" in r.stdout


def test_search_mode_simulate_runs_only_the_best_candidate(delayed_flush, tmp_path):
    """3 candidates predicted, 1 launched: the one with the highest predicted tokens/s."""
    job, _ = delayed_flush
    r = run_cli(["-m", *DELAY, "schedule=flush,gpipe,zbh1", "search.mode=simulate", f"sim.from={job}",
                 "search.top_k=1", "trainer.steps=4", "metrics.skip_first=1", f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "simulated_search.json").read_text())
    assert len(rows) == 3 and [x["launched"] for x in rows] == [True, False, False]
    assert rows[0]["predicted_tokens_per_s"] == max(x["predicted_tokens_per_s"] for x in rows)
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["status"] == "completed"
    assert str(summaries[0].parent) == rows[0]["job_dir"] and rows[0]["measured_status"] == "completed"
    assert "step_time_error" in rows[0]
    # the report reads simulated_search.json: predicted and measured columns, no "incomplete"
    from framework.report.compare import collect, headline, markdown

    report = collect(tmp_path)
    assert sorted(r["status"] for r in report) == ["completed", "predicted only", "predicted only"]
    assert all(r["predicted_tokens_per_s"] > 0 and r["tokens_per_step"] for r in report)
    ran = next(r for r in report if r["status"] == "completed")
    assert ran["step_time_error"] == pytest.approx(rows[0]["step_time_error"]) and ran["predicted_rank"] == 1
    md = markdown(report)
    assert ("| predicted_rank | predicted_tokens_per_s_cluster | predicted_tokens_per_s_per_gpu | predicted_step_time_s "
            "| step_time_error |") in md
    assert ran["predicted_tokens_per_s_cluster"] == pytest.approx(2 * ran["predicted_tokens_per_s_per_gpu"])  # 2 ranks
    assert "incomplete" not in md
    assert headline(tmp_path, report)[0].startswith(f"search.mode=simulate: 3 candidates predicted from {job}, "
                                                    "whose own replay was ")


def test_simulator_keys_are_checked_before_launch(tmp_path):
    assert_config_error(["search.mode=guess"], "search.mode='guess'", "unknown name")
    assert_config_error(["search.mode=simulate"], "sim.from=None", "ranks candidates by a prediction")
    assert_config_error([f"sim.from={tmp_path}"], f"sim.from='{tmp_path}'", "has no calibration.json")
    assert_config_error(["schedule=flush", "schedule.memory_limit_microbatches=3"],
                        "schedule.memory_limit_microbatches=3", "builds its lists without it")
    assert_config_error(["schedule=zb-auto", "schedule.op_times={F:1.0,I:1.0}"],
                        "schedule.op_times={'F': 1.0, 'I': 1.0}", "needs keys F, I, W")
    assert_config_error(["schedule=zb-auto", "schedule.op_times={F:[1.0],I:1.0,W:1.0}"], "schedule.op_times.F=[1.0]",
                        "one time per pipeline rank")
