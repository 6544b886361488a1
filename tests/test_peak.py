"""The MFU denominator: datasheet table, cached CPU probe, resolution order, and that a
sweep's jobs on one machine report the same peak (framework/metrics/peak.py)."""

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from framework.launch import job
from framework.report.sinks import RunLogger
from framework.report.records import RunInfo
from framework.metrics import peak
from framework.metrics.peak import PENDING, accelerator, peak_dtype, resolve_peak, resolve_rank_peak, table_peak

from .conftest import TINY, compose, read_metrics, run_cli, run_local

TINY_PROBED = [a for a in TINY if not a.startswith("metrics.peak_tflops")]
SHORT = ["data=synthetic", "data.num_samples=64", "trainer.steps=2", "trainer.warmup_steps=1", "parallelism=single",
         "schedule.microbatches=1"]


@pytest.mark.parametrize("name,row,bf16,tf32", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 494.5),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312.0, 156.0),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0, 156.0),
    ("NVIDIA H200", "H200 SXM", 989.5, 494.5),
    ("NVIDIA B200", "B200 SXM", 2250.0, 1125.0),
    ("NVIDIA L4", "L4", 121.0, 60.0),  # not L40S: whole tokens, not substrings
    ("NVIDIA L40S", "L40S", 362.05, 183.0),
    ("NVIDIA A10", "A10", 125.0, 62.5),  # not A100
])
def test_table_lookup_by_device_name(name, row, bf16, tf32):
    assert accelerator(name) == row
    assert table_peak(name, "bf16") == bf16 * 1e12 and table_peak(name, "tf32") == tf32 * 1e12
    assert table_peak(name, "fp16") == bf16 * 1e12  # each datasheet prints one figure for FP16 and BF16


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB", "NVIDIA L40"])
def test_unknown_gpus_are_not_guessed(name):
    assert table_peak(name, "bf16") is None


def test_fp32_uses_the_tf32_peak_only_when_tf32_matmuls_are_allowed():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_dtype("fp32") == "fp32" and peak_dtype("bf16") == "bf16" and peak_dtype("bf16-mixed") == "bf16"
        assert peak_dtype("fp16-mixed") == "fp16"
        torch.set_float32_matmul_precision("high")
        assert peak_dtype("fp32") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.fixture
def fake_probe(tmp_path, monkeypatch):
    """A probe that counts its calls and returns a new number each time, cached under tmp."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def probe(device, dtype):
        calls.append(dtype)
        return 1e9 * len(calls)

    monkeypatch.setattr(peak, "probe_peak_flops", probe)
    return calls


def test_the_probe_runs_once_per_key_and_is_cached(fake_probe, tmp_path):
    cpu = torch.device("cpu")
    assert peak.cached_probe(cpu, torch.float32) == peak.cached_probe(cpu, torch.float32) == 1e9
    assert fake_probe == [torch.float32]  # the second call read the cache
    assert peak.cached_probe(cpu, torch.bfloat16) == 2e9  # another dtype: another key
    cache = json.loads((tmp_path / "framework" / "peak_flops.json").read_text())
    assert sorted(cache.values()) == [1e9, 2e9] and all(f"torch {torch.__version__}" in k for k in cache)
    assert not list((tmp_path / "framework").glob("*.tmp"))


def test_resolution_order(fake_probe):
    cpu = torch.device("cpu")
    assert resolve_peak(compose("metrics.peak_tflops=2.5"), cpu) == (2.5e12, "config")
    assert resolve_peak(compose("trainer.precision=fp64", "metrics.peak_tflops=2.5"), cpu) == (None, "none")
    assert resolve_peak(compose(), cpu) == (1e9, "probe")


def test_the_launcher_leaves_a_cuda_peak_to_the_ranks(fake_probe, monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("the launching process touched CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_cuda)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    run = compose(*TINY_PROBED, *SHORT, "trainer.precision=bf16")
    info = job.run_info(run, "cuda")
    assert (info.peak_flops_per_rank, info.peak_source) == (None, PENDING) and not fake_probe
    assert "each rank looks up" in job.startup_banner(run, info, "cuda")
    assert not torch.cuda.is_initialized()

    # In a rank: the table, by its GPU's name (no GPU needed to look it up).
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    ranked = resolve_rank_peak(run, info, torch.device("cuda", 0))
    assert (ranked.peak_flops_per_rank, ranked.peak_source) == (989.5e12, "table")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Unknown 9000")
    with pytest.warns(UserWarning, match="no datasheet peak"):
        ranked = resolve_rank_peak(run, info, torch.device("cuda", 0))
    assert (ranked.peak_flops_per_rank, ranked.peak_source) == (1e9, "probe")
    resolved = RunInfo(**{**vars(info), "peak_flops_per_rank": 1.0, "peak_source": "config"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_rank_peak(run, resolved, torch.device("cuda", 0)) is resolved


def test_two_jobs_of_a_sweep_report_the_same_probed_peak(tmp_path):
    r = run_cli(["-m", "optimizer.lr=1e-3,3e-4", *TINY_PROBED, *SHORT, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads((tmp_path / "sweep" / j / "summary.json").read_text()) for j in ("0", "1"))
    assert a["peak_source"] == b["peak_source"] == "probe"
    assert a["peak_tflops_per_rank"] == b["peak_tflops_per_rank"] > 0
    assert a["mfu_above_one"] is b["mfu_above_one"] is False
    cache = json.loads((tmp_path / "cache" / "framework" / "peak_flops.json").read_text())
    # probed once for both jobs; the summary divides the cached FLOP/s by 1e12 (multiplying
    # back missed by an ulp for some probed values: 66512539589.49194 against ...491936)
    assert [v / 1e12 for v in cache.values()] == [a["peak_tflops_per_rank"]]


def test_mfu_above_one_is_reported_loudly(capsys):
    info = RunInfo(None, 256, 64, flops_per_token=1e6, peak_flops_per_rank=1e9, peak_source="table",
                   bubble_fraction_analytic=0.0)
    logger = SimpleNamespace(info=info, run=SimpleNamespace(world_size=2))
    assert RunLogger._mfu(logger, 3, tokens_per_s=1000, dropped=0.0) == (5e-4, 0.5)  # 1e9 FLOP/s over 2 ranks of 1e9
    assert capsys.readouterr().err == ""
    assert RunLogger._mfu(logger, 7, tokens_per_s=3000, dropped=0.0)[1] == 1.5
    assert "WARNING: step 7: mfu 1.500 > 1 against a peak of 0.001 TFLOP/s per rank (table)" in capsys.readouterr().err


def test_mfu_counts_only_the_expert_assignments_a_step_executed():
    """A MoE step that dropped half its assignments is credited half the routed experts' FLOPs:
    1e6 per token of which 4e5 are the experts', so 8e5 executed."""
    info = RunInfo(None, 256, 64, flops_per_token=1e6, peak_flops_per_rank=1e9, peak_source="table",
                   bubble_fraction_analytic=0.0, expert_flops_per_token=4e5)
    logger = SimpleNamespace(info=info, run=SimpleNamespace(world_size=2))
    tflops, achieved = RunLogger._mfu(logger, 3, tokens_per_s=1000, dropped=0.5)
    assert math.isclose(tflops, 4e-4, rel_tol=1e-12) and math.isclose(achieved, 0.4, rel_tol=1e-12)
    assert RunLogger._mfu(logger, 3, tokens_per_s=1000, dropped=0.0) == (5e-4, 0.5)


def test_fp64_reports_no_mfu(tmp_path, capfd):
    summary = run_local(tmp_path, *TINY_PROBED, *SHORT, "trainer.precision=fp64")
    assert summary["peak_source"] == "none" and summary["peak_tflops_per_rank"] is None
    assert summary["mfu"] is None and summary["tflops"] is None and summary["mfu_above_one"] is False
    assert all(m["mfu"] is None and m["tflops"] is None for m in read_metrics(tmp_path))
    assert "mfu n/a" in capfd.readouterr().out
