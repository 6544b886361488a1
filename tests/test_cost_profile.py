"""The cost model's inputs measured against the framework: the parameters per pipeline rank
it places (shapes only) against the dry-run planner's count of the real tensors, and the
bench's hardware profile of this machine (GEMM, memory-bound ops, host path, the gloo link)
loaded and priced with."""

import re

import pytest

from .conftest import compose


@pytest.mark.parametrize("layout", [
    ["model=gpt2-tiny", "parallelism.tp=2", "parallelism.pp=2", "schedule=interleaved", "schedule.virtual_stages=2"],
    ["model=gpt2-tiny", "parallelism.pp=2", "schedule=zbv"],  # a V: the tied table's two uses on one rank
    ["model=llama-tiny", "parallelism.tp=2", "parallelism.pp=4", "parallelism.dp=1"],
    ["model=moe-tiny", "parallelism.dp=4", "parallelism.ep=2", "parallelism.pp=2", "parallelism.tp=2",
     "parallelism.sequence_parallel=true", "parallelism.zero=1"],
])
def test_the_cost_models_parameters_per_rank_equal_the_dry_run_planners(layout, tmp_path):
    """traffic.rank_units (shapes only, any size) against the dry-run plan, which counts the
    meta model's real parameters per pipeline rank (tp shards, padded vocabulary, experts)."""
    import json

    from framework.launch.job import run_job
    from framework.sim.cost.price import job_of, rank_params
    from framework.sim.cost.traffic import rank_units
    from framework.validate import validate

    run = compose(*layout, "data=synthetic", "logger=none", "trainer.micro_batch_size=2", "dry_run=true")
    validate(run)
    run_job(run, str(tmp_path))
    memory = json.loads((tmp_path / "plan.json").read_text())["memory_estimate_per_rank"]
    job = job_of(run, run.data.vocab_size)
    assert len(memory) == run.parallelism.pp
    for row in memory:
        assert rank_params(job, row["pp_rank"]) == row["psi"], row
        assert sum(u.experts for u in rank_units(job, row["pp_rank"])) == row["expert_psi"], row


def test_the_bench_writes_a_profile_the_cost_model_prices_with(tmp_path):
    """`python -m framework.sim.bench --quick --links 2` on this CPU: a profile the hardware
    group loads (its tables checked), with the gloo link between two local ranks measured,
    that prices a job; and its bad arguments get the one-line error."""
    import subprocess
    import sys

    import yaml

    from framework.config import HardwareConfig
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import Job, price
    from framework.sim.cost.shapes import Layout, ModelShape

    out = tmp_path / "here.yaml"
    r = subprocess.run([sys.executable, "-m", "framework.sim.bench", "--device", "cpu", "--quick", "--threads", "1",
                        "--links", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    raw = yaml.safe_load(out.read_text())
    assert raw["name"] == "here" and raw["gpus_per_node"] == 2 and raw["host_overlaps"] is False
    link = raw["links"]["intra"]
    assert link == raw["links"]["inter"] and link["alpha_us"] > 0 and link["GBps"] > 0
    assert "1 threads" in raw["source"]
    for kind in ("all_reduce_s", "reduce_scatter_s", "all_gather_s"):  # the framework's three, each measured
        assert link[kind]["ranks"] == 2 and [r[0] for r in link[kind]["rows"]] == [8, *(4 << k for k in (10, 13, 15, 17, 19, 21))]
    # the closing line reads the file's own numbers (it printed "fp32 0.0" for a file's 0.0336)
    said = re.fullmatch(r"wrote \S+: GEMM best fp32 (\S+), fp64 (\S+) TFLOP/s, copy (\S+) GB/s, kernel (\S+) us",
                        r.stdout.strip().splitlines()[-1])
    assert said, r.stdout
    assert [float(x) for x in said.groups()] == [raw["peak_tflops"]["fp32"], raw["peak_tflops"]["fp64"],
                                                 raw["memory_GBps"], raw["kernel_us"]]
    # every measured number is a real one: no difference of noisy times clamped or rounded to 0
    numbers = [float(x) for rows in raw["gemm_tflops"].values() for x in rows.split()]
    numbers += list(_leaves({k: raw[k] for k in ("memory_GBps", "kernel_us", "memory_bound_GBps", "host_us",
                                                 "attention_tflops", "links")}))
    assert len(numbers) > 100 and min(numbers) > 0, raw
    host = raw["host_us"]  # a block's backward is no cheaper than a tenth of its forward (it was 5 us of 917)
    assert all(host[a]["B"] > host[a]["F"] / 10 for a in ("gpt2", "llama")), host
    prof = Profile.of(HardwareConfig(**{k: v for k, v in raw.items() if k in HardwareConfig.__dataclass_fields__}))
    shape = ModelShape("gpt2", 2, 64, 2, 2, 256, 256, True, positions=64)
    one, two = (price(prof, Job(shape, Layout(2, 32, dtype="fp32"), dp=dp, microbatches=2)) for dp in (1, 2))
    assert 0 < one.step_s < two.step_s  # the second replica adds its gradient all-reduce over the link
    bad = subprocess.run([sys.executable, "-m", "framework.sim.bench", "--links", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--links" in bad.stderr and "Traceback" not in bad.stderr


def _leaves(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    else:
        yield float(x)


def test_a_single_device_profile_without_links_prices_a_one_gpu_job():
    """A bench profile of one GPU has no links: a job with no group to reduce over needs none
    (predict_h200.py's jobs). (A hardware group without both links is refused when loaded.)"""
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import Job, price
    from framework.sim.cost.shapes import Layout, ModelShape

    prof = Profile.from_dict({"name": "one", "peak_tflops": {"bf16": 100.0}, "memory_GBps": 1000.0, "kernel_us": 5.0})
    shape = ModelShape("gpt2", 2, 64, 2, 2, 256, 256, True, positions=64)
    assert price(prof, Job(shape, Layout(2, 32), microbatches=2)).step_s > 0
