"""ZeRO-Offload priced on a profile's host side (framework/sim/cost/offload.py): by hand on a
made-up profile, through a planned layout against the built model's own parameter count, the
dry run's host-memory line, and ZeRO-Infinity's capacity tiers against its papers' claims."""

from __future__ import annotations

import pytest

from framework.config import ConfigError
from framework.sim.cost.hardware import Profile
from framework.sim.cost.offload import largest_params, offload_step_s

from .conftest import compose

HOST = Profile(name="hand", peak_tflops={"bf16": 100.0}, memory_GBps=1000.0, kernel_us=0.0, host_link_GBps=10.0,
               host_adamw_GBps=32.0, host_us={"optimizer_tensor": 5.0}, memory_gib=32.0, gpus_per_node=16,
               host_memory_gib=1536.0, nvme_gib=28610.0)


def test_the_offloaded_update_on_a_hand_computed_profile():
    # 1e9 16-bit parameters in 100 tensors: 2 GB down and 2 GB up at 10 GB/s = 0.4 s; the host's
    # 10 accesses of 4 bytes per parameter (the gradient's fp32 copy written, scaled, read; the
    # master, m and v read and written) at 32 GB/s = 1.25 s; 100 tensors x 5 us = 0.5 ms
    assert offload_step_s(HOST, 1e9, 2, 100) == pytest.approx(1.6505, rel=1e-12)
    # fp64 verification: 8-byte parameters and states: 16 GB over the link, 80 GB on the host
    assert offload_step_s(HOST, 1e9, 8, 0) == pytest.approx(1.6 + 2.5, rel=1e-12)
    with pytest.raises(ConfigError, match="hardware.host_link_GBps=None: profile bare has no host side"):
        offload_step_s(Profile(name="bare", peak_tflops={}, memory_GBps=1.0, kernel_us=0.0), 1e9, 2, 0)


def test_a_planned_offload_layout_prices_its_update_from_the_models_own_parameters():
    """GPT-2 124M, ZeRO 2 over dp 2 on h100-sxm: the optimizer time is the hand formula on
    half the built model's parameters (transformers' own count), its tensors each copied."""
    from framework.models import meta_hf_model
    from framework.sim.cost.plan import plan

    args = ["hardware=h100-sxm", "model=gpt2", "model.vocab_size=50304", "parallelism=dp2", "parallelism.zero=2",
            "trainer.precision=bf16-mixed"]
    run = compose(*args)
    hf = meta_hf_model(run.model, 50304, "bf16-mixed")
    params, tensors = sum(p.numel() for p in hf.parameters()), len(list(hf.parameters()))
    shard = params / 2
    by_hand = 2 * shard * 2 / 51.2e9 + shard * 10 * 4 / 38.4e9 + tensors * 6.499e-6
    rep = plan([*args, "parallelism.offload_optimizer=true"])
    assert rep["optimizer_s"] == pytest.approx(by_hand, rel=1e-9)
    assert rep["optimizer_s"] > 20 * plan(args)["optimizer_s"]  # the device's step is ~1 ms
    # the NVMe tier: m and v (8 bytes per sharded parameter) of the job's 2 ranks through the
    # node's drives (h100-sxm's 55.2 GB/s read, 32.8 write), both ways each step
    nvme = plan([*args, "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
                 "parallelism.nvme_path=/tmp/offload"])
    drives = 2 * shard * 8
    assert nvme["optimizer_s"] == pytest.approx(by_hand + drives / 55.2e9 + drives / 32.8e9, rel=1e-9)
    # the masters stay in host memory (4 bytes per sharded parameter), m and v on the drives
    assert nvme["host_state_bytes_per_node"] == pytest.approx(2 * 4 * shard, rel=1e-3)
    assert nvme["nvme_state_bytes_per_node"] == pytest.approx(2 * 8 * shard, rel=1e-3) and nvme["fits_nvme"] is True
    # ZeRO 3 with offload_params: each rank's 16-bit slice (2 bytes per sharded parameter) on the
    # drives too; the GPUs keep only the gradients' shard between steps
    z3 = plan([*args, "parallelism.zero=3", "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
               "parallelism.nvme_path=/tmp/offload", "parallelism.offload_params=true"])
    assert z3["nvme_state_bytes_per_node"] == pytest.approx(2 * (8 + 2) * shard, rel=1e-3)
    assert z3["model_state_bytes_max"] == pytest.approx(2 * shard, rel=1e-3)
    # their traffic: the 2 ranks' slices (2 bytes each) written after the update; the reads
    # (before each forward and backward gather of each micro-batch) hide under GPT-2's passes
    slices, m = 2 * shard * 2, run.schedule.microbatches
    assert m > 1 and z3["optimizer_s"] == pytest.approx(nvme["optimizer_s"] + slices / 32.8e9, rel=1e-9)
    assert 2 * m * slices / 55.2e9 < z3["pipeline_s"] and "nvme_params" not in z3["comm_s"]
    # drives a thousand times slower than the passes: the reads past the passes are exposed
    slow = plan([*args, "parallelism.zero=3", "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
                 "parallelism.nvme_path=/tmp/offload", "parallelism.offload_params=true", "hardware.nvme_read_GBps=0.001"])
    exposed = 2 * m * slices / 1e6 - slow["pipeline_s"]
    assert exposed > 1 and slow["comm_s"]["nvme_params"] == pytest.approx(exposed, rel=1e-9)
    assert slow["step_s"] - z3["step_s"] == pytest.approx(exposed + (2 * shard * 8 + 0) * (1 / 1e6 - 1 / 55.2e9),
                                                          rel=1e-6)
    # memory: the GPUs keep the 16-bit parameters (2 bytes each, whole under ZeRO 2) and their
    # gradients' shard (2 bytes per sharded parameter); masters and states (12 bytes per sharded
    # parameter) are the host's, per node 2 ranks'. Padding: under 1e-3.
    assert rep["model_state_bytes_max"] == pytest.approx(2 * params + 2 * shard, rel=1e-3)
    assert rep["host_state_bytes_per_node"] == pytest.approx(2 * 12 * shard, rel=1e-3) and rep["fits_host"] is True


def test_zero_infinity_capacity_tiers_beside_the_papers_claims():
    """A DGX-2 as ZeRO-Infinity ran on (16 V100 32 GB, 1.5 TB of host memory, 8 x 3.84 TB of
    NVMe): the NVMe tier holds the trillion parameters the paper fine-tunes on one node; GPU
    memory alone about 34 billion."""
    gib = 2 ** 30
    assert largest_params(HOST, "none") == pytest.approx(16 * 32 * gib / 16)
    assert largest_params(HOST, "cpu") == pytest.approx(min(16 * 32 * gib / 4, 1536 * gib / 12))
    assert largest_params(HOST, "infinity-cpu") == pytest.approx(1536 * gib / 16)
    assert largest_params(HOST, "infinity-nvme") == pytest.approx(28610 * gib / 16)
    assert largest_params(HOST, "infinity-nvme") > 1e12 > largest_params(HOST, "infinity-cpu")
    with pytest.raises(ValueError, match="one of none, cpu, infinity-cpu, infinity-nvme"):
        largest_params(HOST, "disk")


def test_the_nvme_tier_adds_the_drives_reads_and_writes_shared_by_the_nodes_gpus():
    # 1e9 parameters per rank, 16 GPUs on the node's drives: m and v (8 bytes per parameter)
    # of 16 ranks = 128 GB read at 64 GB/s (2 s) and written at 32 GB/s (4 s), beside the 1.6505 s
    from dataclasses import replace

    drives = replace(HOST, nvme_read_GBps=64.0, nvme_write_GBps=32.0)
    assert offload_step_s(drives, 1e9, 2, 100, nvme_ranks=16) == pytest.approx(1.6505 + 2.0 + 4.0, rel=1e-12)
    with pytest.raises(ConfigError, match="hardware.nvme_read_GBps=None: profile hand has no NVMe rates"):
        offload_step_s(HOST, 1e9, 2, 100, nvme_ranks=16)


def test_pa_cpu_prices_each_checkpoint_slice_down_in_forward_and_up_in_backward():
    """GPT-2 124M at tp 2 with full recomputation, 2 micro-batches of 4 x 1024 tokens on
    h100-sxm: Pa+cpu's step is Pa's plus, per micro-batch and block, one bf16 slice of the
    block input (768 x 4096 / 2 elements) over the 51.2 GB/s host link each way."""
    from framework.sim.cost.plan import plan

    args = ["hardware=h100-sxm", "model=gpt2", "model.vocab_size=50304", "parallelism=tp2", "trainer.recompute=full",
            "trainer.precision=bf16-mixed", "trainer.micro_batch_size=4", "data.seq_len=1024",
            "schedule.microbatches=2", "trainer.partition_activations=true"]
    pa, cpu = plan(args), plan([*args, "trainer.cpu_checkpointing=true"])
    assert cpu["step_s"] - pa["step_s"] == pytest.approx(2 * 2 * 12 * (768 * 4096 // 2) * 2 / 51.2e9, rel=1e-9)
    assert pa["activation_peak_bytes_max"] - cpu["activation_peak_bytes_max"] == 12 * (768 * 4096 // 2) * 2
