"""Overlaps keep the single process's training (fp64, rtol 1e-9: losses, gradient norms,
final parameters) and show in the step-time breakdown: the exposed wait, and the share of
the dp time the overlap hid (`comm_hidden_dp`, above a floor a synchronous wait misses).

`parallelism.overlap_grad_reduce`: a pipeline rank issues each chunk's dp all-reduce after
the chunk's last backward (in the cooldown) and waits for them after the flush. GPT-2 (tied
embedding) with 8 blocks at dp 2 x pp 2: flush (one chunk: the reduction starts at the last
backward), interleaved (v 2: chunk 1 finishes first), zbh1 (split backward: the last W ends
a chunk) and zbv (a V: both uses of the tied embedding on rank 0, in two chunks, so it is
reduced after the step, not with either chunk), and with NCCL's coalesced p2p emulated.
With our ZeRO at pp 1 (dp 2, 2 micro-batches): each unit's reduce-scatter issued as its
gradients complete (stage 1: in the last micro-batch; 2 and 3: every micro-batch), waited
for at the micro-batch's end; ZeRO 1 in a pipeline (interleaved, and zbv whose V holds the
tied embedding twice on rank 0): each chunk's unit after its last backward.

`parallelism.overlap_param_gather` (ZeRO 3): the next unit's all-gather issued as a unit
starts, forward and backward: ours (alone, and with the reduce-scatters overlapped too) and
FSDP2's explicit prefetch.
"""

import pytest

from .conftest import FP64, TINY, assert_same_training, final_params, read_metrics, run_local

EIGHT_BLOCKS = ["model.n_layer=8", "model.n_embd=32", "model.n_head=2"]
ON = "parallelism.overlap_grad_reduce=true"
GATHER = "parallelism.overlap_param_gather=true"
LAYOUTS = {
    "flush": ["parallelism=dp2_pp2", "schedule=flush", "schedule.microbatches=2", ON],
    "interleaved": ["parallelism=dp2_pp2", "schedule=interleaved", "schedule.virtual_stages=2",
                    "schedule.microbatches=2", ON],
    "zbh1_nccl": ["parallelism=dp2_pp2", "schedule=zbh1", "schedule.microbatches=2", ON,
                  "debug.coalesced_p2p=true"],
    "zbv": ["parallelism=dp2_pp2", "schedule=zbv", "schedule.microbatches=2", ON],
    "zero1": ["parallelism=zero1", "schedule.microbatches=2", ON],
    # ZeRO 1 in a pipeline: each chunk's unit reduce-scattered after its last backward; the
    # tied embedding (its own unit) after the flush and the embedding group's sum
    "zero1_pp_interleaved": ["parallelism=dp2_pp2", "parallelism.zero=1", "schedule=interleaved",
                             "schedule.virtual_stages=2", "schedule.microbatches=2", ON],
    "zero1_pp_zbv": ["parallelism=dp2_pp2", "parallelism.zero=1", "schedule=zbv", "schedule.microbatches=2", ON],
    "zero2": ["parallelism=zero2", "schedule.microbatches=2", ON],
    "zero3_both": ["parallelism=zero3", "schedule.microbatches=2", ON, GATHER],
    "zero3_prefetch": ["parallelism=zero3", "schedule.microbatches=2", GATHER],
    "fsdp2_prefetch": ["parallelism=zero3", "parallelism.zero_impl=fsdp2", "schedule.microbatches=2", GATHER],
}
SINGLE = ["parallelism=single", "schedule=flush", "schedule.microbatches=4"]
# What each overlap hid (`comm_hidden_dp`, the summary's median over the 3 steps: a call's
# time in flight before its wait, framework/comm/comm_timer.py), above a floor far from
# both ends. Observed on 2 CPU cores: ZeRO's reduce-scatters and the interleaved / V
# pipelines ~0.4-0.85, the stage-3 prefetch ~0.25-0.4, the one-chunk pipelines (flush, zbh1:
# only the other stage's cooldown to hide under) ~0.15-0.4; each issue waited for at once
# reads ~0. FSDP2's collectives are not seen (None: no floor).
HIDDEN_FLOOR = {"flush": 0.05, "zbh1_nccl": 0.05, "zero3_prefetch": 0.1, "fsdp2_prefetch": None}


def _common(data_cache):
    return [*TINY, *EIGHT_BLOCKS, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}",
            "trainer.steps=3", "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3", FP64]


def _job(path, *args):
    return run_local(path, *args), read_metrics(path), final_params(path)


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    return _job(tmp_path_factory.mktemp("single"), *_common(data_cache), *SINGLE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_overlap_reproduces_the_single_process(single, layout, tmp_path, data_cache):
    _, ref_metrics, ref_params = single
    summary, metrics, params = _job(tmp_path, *_common(data_cache), *LAYOUTS[layout])
    assert summary["global_batch"] == 8 and summary["dp"] == 2
    assert summary["pp"] == (2 if "parallelism=dp2_pp2" in LAYOUTS[layout] else 1)
    assert_same_training(metrics, params, ref_metrics, ref_params)
    # what is left to wait for is the exposed dp time, measured every step (FSDP2's own
    # collectives are not seen: framework/comm/comm_timer.py)
    assert "fsdp" in layout or all(r["time_comm_dp_s"] > 0 for r in metrics)
    # beside the exposed time, the whole: overlapped calls add their time in flight before the wait
    assert all(r["comm_total_dp_s"] >= r["time_comm_dp_s"] and 0 <= r["comm_hidden_dp"] < 1 for r in metrics)
    assert "fsdp" in layout or all(r["comm_total_dp_s"] > 0 for r in metrics)
    floor = HIDDEN_FLOOR.get(layout, 0.2)
    assert floor is None or summary["comm_hidden_dp"] > floor, [r["comm_hidden_dp"] for r in metrics]
