"""The simulator under expert parallelism (docs/simulator.md, "Expert parallelism";
framework/sim/alltoall.py): the all-to-all volume model against the bytes a real ep 2
job sent, its replay beside its measurement, the what-if to ep 1 with the all-to-all gone
(pp = 1 and a pipeline), the p2p fallback without an all-to-all calibration, and a layout
search that predicts ep instead of launching it (search.mode=simulate)."""

import json
import math
import statistics

import pytest

from framework.config import ConfigError
from framework.sim.alltoall import A2ACost, cost_of, layer_bytes, shift_stages, step_bytes
from framework.metrics.calibrate import Calibration

from .conftest import TINY, compose, read_metrics, run_cli, run_local

# top_k = E = 4: every token visits every expert, so exactly (ep - 1) / ep of its assignments
# leave the rank and the volume model's expectation is exact, not only on average.
MOE = [*TINY, "model=moe-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1",
       "model.moe.expert_inner=16", "model.moe.top_k=4", "data=synthetic", "data.seq_len=64",
       "trainer.micro_batch_size=2", "schedule.microbatches=2"]
SKIP_FIRST = 4
EP2 = [*MOE, "parallelism=dp2", "parallelism.ep=2", "trainer.steps=20", f"metrics.skip_first={SKIP_FIRST}"]
# By hand, per MoE layer and micro-batch on one rank (fp32, 4 bytes; N = 2 x 64 = 128 tokens,
# H = 32): dispatch sends the 2 of each token's 4 assignments whose experts live on the other
# rank, 256 rows x 32 x 4 B = 32768 B; combine sends back the 256 rows this rank's 2 experts
# got from the other rank, 32768 B; backward sends both again as gradients, 65536 B; the count
# exchange sends the other rank its E / ep = 2 counts as int64, 16 B. 131088 B x 2 layers x 2
# micro-batches = 524352 B per step.
BYTES_PER_LAYER_AND_MICROBATCH = 4 * 32768 + 16
EP2_STEP_BYTES = BYTES_PER_LAYER_AND_MICROBATCH * 2 * 2


@pytest.fixture(scope="module")
def ep_job(tmp_path_factory):
    job = tmp_path_factory.mktemp("ep2")
    return job, run_local(job, *EP2)


def test_the_volume_model_equals_the_bytes_the_job_sent(ep_job):
    job, _ = ep_job
    run = compose(*EP2)
    assert layer_bytes(run) == {"F": 2 * 32768 + 16, "B": 2 * 32768}
    assert step_bytes(run) == EP2_STEP_BYTES == 524352
    rows = read_metrics(job)
    assert {r["a2a_bytes"] for r in rows} == {EP2_STEP_BYTES}  # every step, the max over the 2 ranks
    cal = json.loads((job / "calibration.json").read_text())
    assert cal["a2a_bytes"] == EP2_STEP_BYTES and cal["a2a_s"] > 0 and cal["fwd_bwd_s"] > cal["a2a_s"]


def test_replay_and_the_what_if_to_ep1_drop_the_measured_all_to_all(ep_job, capsys):
    from framework.sim.cli import main, what_if

    job, summary = ep_job
    # Its own layout: fwd/bwd + the rest of the step. As test_simulator's replay bound (which says
    # why): within 6 % of the mean of the steps it was calibrated from, widened by the standard
    # error of that mean (against the median, it read 8.5 % once on a loaded machine).
    steps = [r["step_time_s"] for r in read_metrics(job) if r["step"] > SKIP_FIRST]
    mean = statistics.fmean(steps)
    error = summary["predicted_step_time_s"] / mean - 1
    assert abs(error) <= 0.06 + statistics.stdev(steps) / mean / math.sqrt(len(steps)), (error, steps, summary)
    same = what_if(str(job))
    assert same["predicted_step_time_s"] == pytest.approx(summary["predicted_step_time_s"])
    assert not same["rescaled"] and same["a2a_model"] == "measured"
    assert same["a2a_bytes_per_step"] == EP2_STEP_BYTES
    cal = json.loads((job / "calibration.json").read_text())
    assert same["a2a_s_per_step"] == pytest.approx(cal["a2a_s"], rel=1e-12)  # the model's bytes are the measured
    one = what_if(str(job), ["parallelism.ep=1"])
    # ep 1 sends nothing: the step loses exactly the all-to-all it measured (its bandwidth is
    # the job's bytes / seconds, and the model's bytes equal the job's)
    assert one["a2a_bytes_per_step"] == 0 and one["ep"] == 1 and one["rescaled"]
    assert one["predicted_step_time_s"] == pytest.approx(same["predicted_step_time_s"] - cal["a2a_s"], rel=1e-9)
    # twice the micro-batches: twice the fwd/bwd (all-to-all inside), the rest as measured
    more = what_if(str(job), ["schedule.microbatches=4"])
    rest = cal["outside_s"]["0"]
    assert more["predicted_step_time_s"] == pytest.approx(2 * cal["fwd_bwd_s"] + rest, rel=1e-9)
    assert main([str(job), "parallelism.ep=1"]) == 0
    out = capsys.readouterr().out
    assert "flush pp=1 ep=1 m=2" in out and "from the job's own all-to-all" in out
    assert main([str(job), "parallelism.ep=4"]) == 2
    assert "parallelism.ep=4: is carved out of dp and must divide parallelism.dp=2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="a pp = 1 job has no per-stage times"):
        what_if(str(job), ["parallelism.pp=2"])


def test_a_pipeline_ep_job_moves_each_stage_by_its_layers_all_to_all(tmp_path):
    """dp 2 x pp 2, ep 2: each pipeline rank holds 1 of the 2 MoE layers, so it sends half the
    pp = 1 job's bytes; ep 1 takes the all-to-all out of every stage's F and B."""
    from framework.sim.cli import what_if

    run_local(tmp_path, *MOE, "parallelism=dp2_pp2", "parallelism.ep=2", "trainer.steps=8", "metrics.skip_first=2")
    rows = read_metrics(tmp_path)
    assert {r["a2a_bytes"] for r in rows} == {BYTES_PER_LAYER_AND_MICROBATCH * 1 * 2}
    same, one = what_if(str(tmp_path)), what_if(str(tmp_path), ["parallelism.ep=1"])
    assert same["a2a_bytes_per_step"] == BYTES_PER_LAYER_AND_MICROBATCH * 2 and one["a2a_bytes_per_step"] == 0
    assert one["predicted_step_time_s"] < same["predicted_step_time_s"] and one["rescaled"] and not same["rescaled"]


def test_shift_stages_puts_the_all_to_all_in_f_and_the_backward_that_carries_it():
    """zbh1-like keys, pp 2: the split backward's all-to-all is in I, except on stage 0, whose I
    computes nothing (its W is the whole backward); U never changes. 2 layers on stage 0, 1 on 1."""
    cal = Calibration(compute={"0,0,F": 1.0, "0,0,I": 0.0, "0,0,W": 2.0, "0,0,U": 0.5,
                               "1,0,F": 1.0, "1,0,I": 1.0, "1,0,W": 1.0, "1,0,B": 2.0})
    new = shift_stages(cal, lambda r, c: r, [2, 1], {"F": -0.25, "B": -0.125})
    assert new.compute == {"0,0,F": 0.5, "0,0,I": 0.0, "0,0,W": 1.75, "0,0,U": 0.5,
                           "1,0,F": 0.75, "1,0,I": 0.875, "1,0,W": 1.0, "1,0,B": 1.875}
    assert shift_stages(cal, lambda r, c: r, [2, 1], {"F": -9.0, "B": 0.0}).compute["0,0,F"] == 0.0  # never < 0


def test_without_an_all_to_all_calibration_the_p2p_link_prices_it():
    """A pipeline MoE job with ep = 1 measured no all-to-all: alpha per call (3 in forward,
    2 in backward per layer and micro-batch), beta not separable (None). A pp = 1, ep = 1 job
    measured neither: an error that says so."""
    src = compose(*MOE, "parallelism=pp2")
    cost = cost_of(Calibration(alpha_s=1e-3), src, "job")
    assert not cost.measured and "no all-to-all calibration" in cost.describe()
    assert cost.layer_seconds(compose(*MOE, "parallelism=dp2_pp2", "parallelism.ep=2")) == {"F": 3e-3, "B": 2e-3}
    assert cost.layer_seconds(src) == {"F": 0.0, "B": 0.0}
    measured = cost_of(Calibration(a2a_bytes=1e6, a2a_s=0.5), compose(*EP2), "job")
    assert measured.measured and measured.seconds(3e6, 99) == 1.5  # bytes / (2 MB/s); calls folded in
    with pytest.raises(ConfigError, match="measured neither an all-to-all nor a p2p link"):
        cost_of(Calibration(), compose(*MOE, "parallelism=dp2"), "job")
    assert A2ACost(False, alpha_s=1e-3, beta_Bps=1e6).seconds(2e3, 2) == pytest.approx(4e-3)


def test_the_volume_follows_the_dtypes_and_sequence_parallelism():
    """bf16-autocast: dispatch sends the fp32 hidden states, combine the experts' bf16 outputs;
    sequence parallelism over tp 2 routes half the micro-batch's tokens on each rank."""
    fp32 = layer_bytes(compose(*EP2))["B"]
    assert layer_bytes(compose(*EP2, "trainer.precision=bf16-autocast"))["B"] == fp32 * (4 + 2) / (4 + 4)
    assert layer_bytes(compose(*EP2, "trainer.precision=fp64"))["B"] == 2 * fp32
    sp = compose(*EP2, "parallelism.tp=2", "parallelism.sequence_parallel=true")
    assert layer_bytes(sp)["B"] == fp32 / 2
    assert layer_bytes(compose(*MOE, "parallelism=dp2")) == {"F": 0.0, "B": 0.0}


def test_a_simulated_layout_search_over_ep_predicts_and_runs_only_the_best(ep_job, tmp_path):
    """hparams_search=layout on a MoE model adds parallelism.ep (framework/launch/search_space.py; the
    preset's other params cleared here): each trial is predicted from the ep 2 job, none runs
    until the search ends, then only the best one."""
    job, _ = ep_job
    r = run_cli(["-m", "hparams_search=layout", "hydra.sweeper.params=null", "hydra.sweeper.n_trials=3",
                 "parallelism.world_size=2", "parallelism.pp=1", "trainer.global_batch_size=8", *MOE, "trainer.steps=4",
                 "metrics.skip_first=1", "search.mode=simulate", f"sim.from={job}", "search.top_k=1",
                 f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "simulated_search.json").read_text())
    # the seeded sampler draws both of moe-tiny's choices on 2 ranks (gcd(4 experts, 2) = 2)
    assert len(rows) == 3 and {x["ep"] for x in rows} == {1, 2} and all(x["a2a_model"] == "measured" for x in rows)
    # ep 1 is predicted without the job's measured all-to-all, so it ranks first and only it runs
    assert [(x["ep"], x["launched"]) for x in rows] == [(1, True), (2, False), (2, False)]
    assert rows[0]["predicted_tokens_per_s"] == max(x["predicted_tokens_per_s"] for x in rows)
    assert rows[0]["measured_status"] == "completed" and "step_time_error" in rows[0]
    assert all(x["tokens_per_step"] == 8 * 64 for x in rows)  # the job's own batch: nothing but ep rescaled
