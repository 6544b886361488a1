"""ZeRO-R's constant-size buffers (CB, parallelism.bucket_mb): our ZeRO's reduce-scatters go
through one buffer of the configured size, so the transient they hold is that buffer whatever
the model's size (measured: zero_transient_peak_bytes_max), where without CB it is each unit's
widened gradient and grows with the model; and the pieces sum exactly what one reduce-scatter
sums (fp64 equal)."""

from __future__ import annotations

import pytest

from framework.config import ConfigError

from .conftest import FP64, TINY, assert_same_training, final_params, read_metrics, run_local

BASE = [*[a for a in TINY if not a.startswith("model.n_embd")], "data=synthetic", "data.vocab_size=256",
        "trainer.steps=2", "parallelism=dp2", "schedule.microbatches=2", "trainer.save_checkpoint=true"]
BUCKET = "parallelism.bucket_mb=0.001"  # 1,048 bytes: 262 fp32 elements, 131 of each rank's slice a piece


def test_the_reduction_transient_is_the_buckets_whatever_the_models_size(tmp_path):
    peak = {}
    for width, cb in ((32, True), (64, True), (64, False)):
        s = run_local(tmp_path / f"w{width}{'_cb' if cb else ''}", *BASE, f"model.n_embd={width}",
                      "parallelism.zero=1", "trainer.precision=bf16-mixed", *([BUCKET] if cb else []))
        peak[width, cb] = s["zero_transient_peak_bytes_max"]
    assert peak[32, True] == peak[64, True] == 2 * 131 * 4  # dp ranks x a piece of each slice x fp32
    # without CB: a 64-wide block's widened gradient, its 12 h^2 weights (and biases) in fp32
    assert peak[64, False] > 12 * 64 * 64 * 4 > 100 * peak[64, True]


def test_reductions_in_constant_buffers_train_as_whole_ones_in_fp64(tmp_path):
    args = [*BASE, "model.n_embd=32", "parallelism.zero=2", FP64]
    run_local(tmp_path / "whole", *args)
    run_local(tmp_path / "cb", *args, BUCKET)
    assert_same_training(read_metrics(tmp_path / "cb"), final_params(tmp_path / "cb"),
                         read_metrics(tmp_path / "whole"), final_params(tmp_path / "whole"))


@pytest.mark.parametrize("args,problem", [
    (["parallelism=dp2", "parallelism.zero=2", "parallelism.overlap_grad_reduce=true"], "holds its buffer until the wait"),
    (["parallelism=dp2", "parallelism.zero=2", "parallelism.zero_impl=fsdp2"], "fully_shard sizes its own"),
], ids=["overlap", "fsdp2"])
def test_constant_buffers_are_refused_where_no_buffer_stays_one_size(args, problem, tmp_path):
    from .prelaunch import prelaunch

    with pytest.raises(ConfigError) as e:
        prelaunch(["data=synthetic", "logger=none", "launcher=external", "metrics.peak_tflops=1", *args], BUCKET,
                  str(tmp_path / "job"))
    assert e.value.key == "parallelism.bucket_mb" and problem in str(e.value), str(e.value)
