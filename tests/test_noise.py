"""How much a run's numbers can be trusted (framework/metrics/noise.py): the step-time
spread and the machine's load, flagged past documented thresholds in summary.json, the
console and the sweep report. In process on hand-made rows; one run beside two busy loops
(a CPU hog, as a noisy neighbour) is flagged everywhere."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from framework.metrics import noise
from framework.report.closing import summary_lines

from .conftest import TINY, run_local


def test_spread_percentiles_cv_and_the_flag_from_the_rows():
    """Step times 1..10 s: p10 1.9, p50 5.5, p90 9.1 (linear interpolation, numpy's default),
    cv = pstdev / mean = 2.8723 / 5.5; the median load over the steps that have one."""
    rows = [{"step_time_s": float(t), "other_cpu_share": 0.2 if t < 4 else None} for t in range(1, 11)]
    s = noise.summary(rows)
    assert (s["step_time_p10_s"], s["step_time_p50_s"], s["step_time_p90_s"]) == pytest.approx((1.9, 5.5, 9.1))
    assert s["step_time_cv"] == pytest.approx(2.8722813 / 5.5)
    assert s["other_cpu_share"] == pytest.approx(0.2)
    assert s["noisy"] == "spread: cv 0.52 > 0.10; load: other processes used 20% of the CPUs > 10%"
    quiet = noise.summary([{"step_time_s": 1.0, "other_cpu_share": 0.01}, {"step_time_s": 1.02}])
    assert quiet["noisy"] == "" and quiet["step_time_cv"] == pytest.approx(0.01 / 1.01)
    noise.with_gpu(quiet, 2)
    assert quiet["gpu_other_processes"] == 2 and quiet["noisy"] == "gpu: 2 other process(es) on rank 0's GPU"


def test_other_load_is_the_node_less_this_jobs_ranks_on_it():
    """Rank 0's node was busy 3.0 CPU-s in a 1 s step on 4 CPUs; its two ranks used 1.2 and
    0.6 (a rank on another node, 0.9, is not subtracted): (3.0 - 1.8) / 4 = 0.3."""
    ranks = [SimpleNamespace(host="a", cpus=4, cpu_s=1.2, node_busy_s=3.0),
             SimpleNamespace(host="a", cpus=4, cpu_s=0.6, node_busy_s=None),
             SimpleNamespace(host="b", cpus=4, cpu_s=0.9, node_busy_s=None)]
    assert noise.other_cpu_share(ranks, 1.0) == pytest.approx(0.3)
    ranks[0].node_busy_s = 0.5  # a clock's rounding never gives a negative load
    assert noise.other_cpu_share(ranks, 1.0) == 0.0
    ranks[0].node_busy_s = None  # not on Linux
    assert noise.other_cpu_share(ranks, 1.0) is None


def test_a_run_beside_busy_loops_is_flagged_in_the_summary_the_console_and_the_report(tmp_path, capsys):
    """A sweep of two jobs, the second run beside two busy loops (a noisy neighbour): that
    one is flagged in its summary, its console lines and the sweep's report. (The first is
    not asserted quiet: the machine running the tests may be busy itself.)"""
    args = [*TINY, "parallelism=single", "data=synthetic", "trainer.steps=6", "metrics.skip_first=1"]
    run_local(tmp_path / "sweep" / "0", *args)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        summary = run_local(tmp_path / "sweep" / "1", *args)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert summary["other_cpu_share"] > noise.OTHER_LOAD
    assert "load: other processes used" in summary["noisy"]
    assert summary["step_time_p10_s"] <= summary["step_time_p50_s"] <= summary["step_time_p90_s"]
    lines = summary_lines(summary).splitlines()
    assert any(line.startswith("spread of the step time: p10 / p50 / p90") for line in lines)
    assert any(line.startswith("WARNING: noisy measurement (") for line in lines)
    from framework.report.compare import main

    capsys.readouterr()
    assert main([str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert f"measured with noise ({summary['noisy']})" in out and "WARNING: job 1 (" in out
    # the two jobs are one configuration run twice: its repeats line, and no winner named
    assert "  1. defaults: " in out and "(2 repeats: " in out and "best by" not in out, out
    assert "| noisy | reason |" in (tmp_path / "sweep" / "report.md").read_text()
