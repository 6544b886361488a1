"""Synchronous pipelines reproduce the single process; memory, timeline and errors.

gpipe, flush and interleaved at pp = 2 and 4 (interleaved with 2 chunks per rank), with
and without dp, on the same global batch (8 sequences) as one process accumulating 4
micro-batches: in fp64, per-step losses, gradient norms and final parameters agree to rtol
1e-9 (conftest.py); the fp32 run (gpipe pp4) tracks the fp64 single process's losses to
1e-5. GPT-2 ties its input and output embeddings, so every GPT-2 run also proves the tied
weight's gradients are summed between the first and last stage.
"""

import json

import pytest
import torch

from .conftest import (FP64, TINY, assert_config_error, assert_same_losses_fp32, assert_same_training, final_params,
                       read_metrics, run_cli, run_local)

FP32 = "gpipe_pp4"  # the family's one fp32 run: loss level only
NCCL = "debug.coalesced_p2p=true"
EIGHT_BLOCKS = ["model.n_layer=8", "model.n_embd=32", "model.n_head=2"]
LAYOUTS = {
    "single": ["parallelism=single", "schedule=flush", "schedule.microbatches=4"],
    "gpipe_pp2": ["parallelism=pp2", "schedule=gpipe", "schedule.microbatches=4"],
    "flush_pp2": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4"],
    "interleaved_pp2": ["parallelism=pp2", "schedule=interleaved", "schedule.microbatches=4"],
    "flush_pp4": ["parallelism=pp4", "schedule=flush", "schedule.microbatches=4"],
    "gpipe_pp4": ["parallelism=pp4", "schedule=gpipe", "schedule.microbatches=4"],
    # NCCL's return shape on gloo: one merged Work per batch, tags all 0 (in-order matching)
    "interleaved_pp4_nccl": ["parallelism=pp4", "schedule=interleaved", "schedule.microbatches=4", NCCL],
    "flush_dp2_pp2_nccl": ["parallelism=dp2_pp2", "schedule=flush", "schedule.microbatches=2", NCCL],
    "interleaved_dp2_pp2_nccl": ["parallelism=dp2_pp2", "schedule=interleaved", "schedule.microbatches=2", NCCL],
    "gpipe_dp2_pp2_params": ["parallelism=dp2_pp2", "schedule=gpipe", "schedule.microbatches=2",
                             "parallelism.partition=parameters"],
}


def _common(data_cache):
    return [*TINY, *EIGHT_BLOCKS, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}",
            "trainer.steps=4", "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = {}
    for name, args in LAYOUTS.items():
        job = tmp_path_factory.mktemp(name)
        precision = [] if name == FP32 else [FP64]
        out[name] = (run_local(job, *_common(data_cache), *args, *precision), read_metrics(job), final_params(job), job)
    return out


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "single"])
def test_sync_pipeline_reproduces_the_single_process(runs, layout):
    ref_summary, ref_metrics, ref_params, _ = runs["single"]
    summary, metrics, params, _ = runs[layout]
    assert summary["global_batch"] == ref_summary["global_batch"] == 8 and summary["pp"] in (2, 4)
    if layout == FP32:
        assert_same_losses_fp32(metrics, ref_metrics)
    else:
        assert_same_training(metrics, params, ref_metrics, ref_params)
    # the tied embedding is still one weight: final_model.pt holds the first stage's copy under
    # the embedding's name and the last stage's under the head's (framework/report/export.py),
    # each compared with the single process's one tensor above, and the two equal
    assert torch.equal(params["transformer.wte.weight"], params["lm_head.weight"])


def test_llama_untied_pipeline_matches_too(tmp_path, data_cache):
    args = [*_common(data_cache), "model=llama-tiny", "model.n_kv_head=1", "model.n_inner=64", "model.n_layer=4", FP64]
    run_local(tmp_path / "single", *args, *LAYOUTS["single"])
    run_local(tmp_path / "pp", *args, "parallelism=pp2", "schedule=interleaved", "schedule.microbatches=2",
              "trainer.micro_batch_size=4")
    assert_same_training(read_metrics(tmp_path / "pp"), final_params(tmp_path / "pp"),
                         read_metrics(tmp_path / "single"), final_params(tmp_path / "single"))


def test_bubble_fields_and_timeline_files(runs):
    summary, metrics, _, job = runs["flush_pp2"]
    assert summary["bubble_fraction_analytic"] == pytest.approx(1 / 5)
    assert 0 < summary["bubble_fraction"] < 1 and summary["bubble_fraction"] <= summary["bubble_fraction_max"] < 1
    assert len(metrics[0]["rank_bubble_fraction"]) == 2 and all(0 < b < 1 for b in metrics[0]["rank_bubble_fraction"])
    assert [r["bubble_fraction"] for r in summary["ranks"]] and summary["ranks"][1]["pp"] == 1
    trace = json.loads((job / "trace.json").read_text())["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X" and e["cat"] in "FB"]
    assert len(slices) == 4 * 2 * 2 * 4  # steps x ranks x (F + B) x micro-batches
    assert {e["name"] for e in slices if e["tid"] == 1} == {f"{op}{j}" for op in "FB" for j in range(4)}
    assert all(e["dur"] >= 0 for e in trace if e["ph"] == "X")
    assert (job / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["timeline_step"] in range(1, 5)
    interleaved = json.loads((runs["interleaved_pp2"][3] / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "1F0" for e in interleaved)
    assert runs["interleaved_pp2"][0]["bubble_fraction_analytic"] == pytest.approx(1 / 9)


def test_gpipe_holds_about_m_over_p_times_the_activations_of_flush_on_stage_0(tmp_path):
    args = [*TINY, "model.n_layer=2", "data=synthetic", "data.num_samples=64", "trainer.steps=2",
            "parallelism=pp2", "schedule.microbatches=8", "trainer.micro_batch_size=2"]
    peaks = {}
    for sched in ("gpipe", "flush"):
        s = run_local(tmp_path / sched, *args, f"schedule={sched}")
        peaks[sched] = s["ranks"][0]["activation_peak_bytes"]
    assert peaks["gpipe"] / peaks["flush"] == pytest.approx(8 / 2, rel=0.05)  # m / p: 8 alive vs 2


BAD = [
    (["parallelism=pp4", "schedule=interleaved", "schedule.microbatches=6"], "schedule.microbatches=6", "multiple of pp"),
    (["parallelism=pp4", "model.n_layer=2"], "parallelism.pp=4", "a stage would hold no block"),
    (["parallelism=pp2", "schedule=interleaved", "schedule.virtual_stages=3"], "parallelism.pp=2", "a stage would hold no block"),
    (["parallelism=pp2", "schedule=gpipe", "schedule.virtual_stages=2"], "schedule.virtual_stages=2", "interleaved"),
    (["parallelism=dp2_pp2", "schedule=1f1b", "model.tie_embeddings=false"], "parallelism.dp=2", "asynchronous"),
    (["parallelism=pp2", "schedule=1f1b"], "model.tie_embeddings=True", "tied embedding"),  # gpt2-tiny is tied
    (["parallelism=pp4", "schedule=2bw", "model.tie_embeddings=false", "schedule.microbatches=2"],
     "schedule.microbatches=2", "microbatches >= pp=4"),
    (["parallelism=pp2", "parallelism.partition=[1,2]"], "parallelism.partition=[1, 2]", "summing to model.n_layer"),
    (["parallelism=pp2", "parallelism.partition=fastest"], "parallelism.partition='fastest'", "unknown partition"),
    (["parallelism=pp2", 'parallelism.partition="type:("'], "parallelism.partition='type:('", "bad regular expression"),
]


@pytest.mark.parametrize("overrides,head,problem", BAD, ids=[b[1] for b in BAD])
def test_bad_pipeline_combinations_fail_before_launch(overrides, head, problem):
    assert_config_error(overrides, head, problem)


def test_partition_by_type_with_no_match_fails_before_launch(tmp_path):
    r = run_cli(["parallelism=pp2", "parallelism.partition=type:Mamba", "data=synthetic", "logger=none",
                 f"hydra.run.dir={tmp_path}"])
    assert r.returncode != 0 and "config error: parallelism.partition='type:Mamba': no block type matches" in r.stderr
    assert not (tmp_path / "config.yaml").exists()


def test_dry_run_prints_the_schedule_grid(tmp_path):
    r = run_cli(["dry_run=true", "parallelism=pp2", "schedule=gpipe", "schedule.microbatches=3",
                 f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert "rank 0: F0 F1 F2 .. .. B0 B1 B2" in r.stdout and "analytic bubble 0.250" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schedule_grid"].splitlines()[1] == "rank 1: .. F0 F1 F2 B0 B1 B2 .."


def test_a_long_run_keeps_the_action_records_of_a_bounded_set_of_steps(tmp_path):
    """Nothing per step for the whole run: rank 0 keeps the actions of at most
    metrics.trace_steps + 1 steps (spread over the run, with the first measured one), so
    trace.json, the W&B table and the timeline cost the same for 6 steps as for 36."""
    from framework.metrics.timeline import kept_steps

    args = [*TINY, "data=synthetic", "data.num_samples=256", "parallelism=pp2", "schedule=zbh1",
            "schedule.microbatches=2", "metrics.trace_steps=3", "metrics.skip_first=1", "trainer.log_interval=6"]
    traces = {}
    for steps in (6, 36):
        summary = run_local(tmp_path / str(steps), *args, f"trainer.steps={steps}")
        events = json.loads((tmp_path / str(steps) / "trace.json").read_text())["traceEvents"]
        kept = {e["args"]["step"] for e in events if e["ph"] == "X"}
        assert kept == kept_steps(1, steps, 2, 3) and len(kept) == 4 and {1, 2, steps} <= kept
        assert summary["timeline_step"] in kept and set(summary["op_time_s"]) == {"F", "I", "W"}
        # the communication lane (pid 1): the tied embedding's sum over the pipeline's ends, per kept step
        assert sorted((e["args"]["step"], e["tid"]) for e in events if e.get("pid") == 1 and e["ph"] == "X") == \
            sorted((k, r) for k in kept for r in (0, 1))
        traces[steps] = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["cat"] != "wait"], (
            tmp_path / str(steps) / "trace.json").stat().st_size
    assert len(traces[6][0]) == len(traces[36][0]) == 4 * 2 * 3 * 2  # steps x ranks x (F, I, W) x micro-batches
    assert traces[36][1] < 1.2 * traces[6][1]  # the same records; only the digits of the times differ
