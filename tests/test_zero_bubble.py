"""Zero-bubble schedules reproduce the single process in fp64 (the split backward's bitwise
unit tests are in tests/test_split_backward.py).

Every new schedule (zbh1, zbh2, interleaved-zb, zbv, dualpipev, zb-auto) runs GPT-2 (tied
embedding: in a V both copies sit on pp rank 0, in a loop they are summed between the
first and last stage) and Llama (untied) against one process accumulating the same global
batch of 8 sequences: per-step losses, gradient norms and final parameters agree to rtol
1e-9 (conftest.FP64_TOL). Compositions, each covered by two schedules: dp (zbh1, zbv),
tp + sequence parallelism (interleaved-zb, dualpipev), ZeRO-1 (zbh1, interleaved-zb; and
zbv, with both uses of the tied embedding in rank 0's two chunks), NCCL's coalesced p2p
emulated on gloo (zbh2, zbv).
"""

import pytest
import torch

from .conftest import FP64, TINY, assert_same_training, final_params, read_metrics, run_local

EIGHT_BLOCKS = ["model.n_layer=8", "model.n_embd=32", "model.n_head=2"]
NCCL = "debug.coalesced_p2p=true"
SP = ["parallelism.sequence_parallel=true"]
LAYOUTS = {
    "zbh1_pp2": ["parallelism=pp2", "schedule=zbh1", "schedule.microbatches=4"],
    "zbh2_pp4_nccl": ["parallelism=pp4", "schedule=zbh2", "schedule.microbatches=4", NCCL],
    "interleaved_zb_pp2": ["parallelism=pp2", "schedule=interleaved-zb", "schedule.microbatches=4"],
    "zbv_pp2_nccl": ["parallelism=pp2", "schedule=zbv", "schedule.microbatches=4", NCCL],
    "dualpipev_pp2": ["parallelism=pp2", "schedule=dualpipev", "schedule.microbatches=4"],
    "zbh1_dp2_pp2_zero1": ["parallelism=dp2_pp2", "schedule=zbh1", "schedule.microbatches=2", "parallelism.zero=1"],
    "zbv_dp2_pp2": ["parallelism=dp2_pp2", "schedule=zbv", "schedule.microbatches=2"],
    "interleaved_zb_dp2_pp2_zero1": ["parallelism=dp2_pp2", "schedule=interleaved-zb", "schedule.microbatches=2",
                                     "parallelism.zero=1"],
    # a V puts both uses of GPT-2's tied embedding on pp rank 0, in two chunks' ZeRO buffers
    "zbv_dp2_pp2_zero1": ["parallelism=dp2_pp2", "schedule=zbv", "schedule.microbatches=2", "parallelism.zero=1"],
    "interleaved_zb_tp2_pp2_sp": ["parallelism=tp2_pp2", "schedule=interleaved-zb", "schedule.microbatches=4", *SP],
    "dualpipev_tp2_pp2_sp": ["parallelism=tp2_pp2", "schedule=dualpipev", "schedule.microbatches=4", *SP],
    "zb_auto_pp2": ["parallelism=pp2", "schedule=zb-auto", "schedule.microbatches=4"],
    # built from given (uneven) times, a p2p cost and a memory limit below ZB-H2's
    "zb_auto_pp4_limit3_nccl": ["parallelism=pp4", "schedule=zb-auto", "schedule.microbatches=4",
                                "schedule.memory_limit_microbatches=3",
                                "schedule.op_times={F:[1.0,1.0,2.0,1.0],I:1.5,W:0.5,comm:0.2}", NCCL],
}
SINGLE = ["parallelism=single", "schedule=flush", "schedule.microbatches=4"]


def _common(data_cache, *model):
    return [*TINY, *EIGHT_BLOCKS, *model, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}",
            "trainer.steps=3", "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3", FP64]


def _job(path, *args):
    summary = run_local(path, *args)
    return summary, read_metrics(path), final_params(path)


@pytest.fixture(scope="module")
def gpt2_single(tmp_path_factory, data_cache):
    return _job(tmp_path_factory.mktemp("single"), *_common(data_cache), *SINGLE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_bubble_gpt2_reproduces_the_single_process(gpt2_single, layout, tmp_path, data_cache):
    _, ref_metrics, ref_params = gpt2_single
    summary, metrics, params = _job(tmp_path, *_common(data_cache), *LAYOUTS[layout])
    assert summary["global_batch"] == 8 and summary["schedule"] == LAYOUTS[layout][1].split("=")[1]
    assert_same_training(metrics, params, ref_metrics, ref_params)
    # still one tied weight: in a loop final_model.pt holds the first stage's copy under the
    # embedding's name and the last stage's under the head's (each compared above); a V, one copy
    assert torch.equal(params["transformer.wte.weight"], params["lm_head.weight"])
    # the analytic bubble is the schedule's, for this run's measured op times: I and W were measured
    assert summary["op_time_s"]["I"] > 0 and summary["op_time_s"]["W"] > 0 and summary["op_time_s"]["F"] > 0
    assert 0 < summary["bubble_fraction_analytic"] < 1
    # ZB-H1's closed form holds from m = p; every other layout here is a simulation of the
    # schedule's graph (ZB-H2's form needs m >= 2p-1), reported as the schedule model's
    closed = layout in ("zbh1_pp2", "zbh1_dp2_pp2_zero1")
    assert summary["bubble_analytic_source"] == ("closed form" if closed else "schedule model")


LLAMA = ["model=llama-tiny", "model.n_kv_head=1", "model.n_inner=64"]


@pytest.mark.parametrize("name,pp,m", [("zbh1", 2, 4), ("zbh2", 2, 4), ("interleaved-zb", 2, 4), ("zbv", 2, 4),
                                       ("dualpipev", 2, 4)])
def test_zero_bubble_llama_reproduces_the_single_process(name, pp, m, tmp_path, data_cache, tmp_path_factory,
                                                         llama_single):
    _, ref_metrics, ref_params = llama_single
    _, metrics, params = _job(tmp_path, *_common(data_cache, *LLAMA), f"parallelism=pp{pp}", f"schedule={name}",
                              f"schedule.microbatches={m}")
    assert_same_training(metrics, params, ref_metrics, ref_params)


@pytest.fixture(scope="module")
def llama_single(tmp_path_factory, data_cache):
    return _job(tmp_path_factory.mktemp("llama_single"), *_common(data_cache, *LLAMA), *SINGLE)


def test_a_csv_torch_dumped_runs_and_equals_the_single_process(gpt2_single, tmp_path, data_cache):
    """torch 2.13's ScheduleZBVZeroBubble written with `_dump_csv` (compute only) runs here as
    `schedule=csv` and trains as the single process does (that it reads as our zbv's lists:
    tests/test_csv_schedules.py)."""
    import logging
    from unittest import mock

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, 2, None, 4
    path = tmp_path / "torch_zbv.csv"
    logging.disable(logging.WARNING)
    try:
        ScheduleZBVZeroBubble([stage, stage], 4)._dump_csv(str(path), format="compute_only")
    finally:
        logging.disable(logging.NOTSET)
    _, ref_metrics, ref_params = gpt2_single
    summary, metrics, params = _job(tmp_path / "run", *_common(data_cache), "parallelism=pp2", "schedule=csv",
                                    f"schedule.csv={path}")
    assert (summary["schedule"], summary["microbatches"], summary["virtual_stages"]) == ("csv", 4, 2)
    assert_same_training(metrics, params, ref_metrics, ref_params)
