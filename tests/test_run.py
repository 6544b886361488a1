"""End to end through `python run.py`: the main job, W&B read-back, sweeps and the report,
submitit_local, the dry run at 1024 ranks, torchrun, and a crashing rank."""

import glob
import csv
import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from framework.report.compare import main as report_main

from . import wandb_reader
from .conftest import ROOT, TINY, run_cli, run_local

SMOKE = ["experiment=smoke", "metrics.skip_first=0"]
SUMMARY_KEYS = {"loss", "tokens_per_s", "step_time_s", "mfu", "bubble_fraction", "bubble_fraction_analytic",
                "memory_peak_bytes", "world_size", "ranks"}


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """`python run.py` as the README's first command runs it (plus where to write), its
    `__main__` in a fork of the rank server (tests/run_py.py; test_repeats and the gpu check
    script start run.py in a fresh interpreter)."""
    job = tmp_path_factory.mktemp("main_job")
    r = run_cli([f"hydra.run.dir={job}"], timeout=600, unset=("WANDB_API_KEY",))  # logger auto -> offline
    assert r.returncode == 0, r.stderr[-3000:]
    return job, r


def test_main_job_writes_config_metrics_and_summary(main_job):
    job, r = main_job
    summary = json.loads((job / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    cfg = yaml.safe_load((job / "config.yaml").read_text())
    assert cfg["parallelism"]["pp"] == 2 and cfg["model"]["name"] == "gpt2-tiny" and "${" not in (job / "config.yaml").read_text()
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, cfg["trainer"]["steps"] + 1))  # 1-based
    assert summary["loss"] == metrics[-1]["loss"] < metrics[0]["loss"] - 1.0  # it learns pycode
    assert summary["world_size"] == 2 and [x["pp"] for x in summary["ranks"]] == [0, 1]  # a 2-stage pipeline
    for rank in summary["ranks"]:
        assert rank["params_bytes"] == rank["grads_bytes"] > 0 and rank["optimizer_bytes"] > 2 * rank["params_bytes"]
        assert rank["activation_peak_bytes"] > 0 and rank["rss_peak_bytes"] >= rank["model_state_bytes"]
    assert summary["schedule"] == "flush" and summary["bubble_fraction_analytic"] == 0.2
    # a closed form, (p-1)/(m+p-1), so the console says "analytic"; before launch too (run_info.json)
    assert summary["bubble_analytic_source"] == json.loads((job / "run_info.json").read_text())[
        "bubble_analytic_source"] == "closed form"
    assert 0 < summary["bubble_fraction"] < 1
    assert (job / "timeline.png").exists() and (job / "trace.json").exists()
    assert summary["memory_peak_bytes"] == max(x["memory_peak_bytes"] for x in summary["ranks"])
    assert not list(job.glob("*.partial")) and not list(job.glob("*.tmp"))
    assert "loss" in r.stdout and "tokens/s" in r.stdout and "rank 1" in r.stdout
    # a pipeline's console shows its bubble: every step line, and the summary with the op times
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps and all(re.search(r" \| bubble 0\.\d\d \(analytic 0\.20\)", line) for line in steps), steps
    assert re.search(r"^bubble 0\.\d{3} measured \(max rank 0\.\d{3}\) \| 0\.200 analytic \(flush at the measured "
                     r"op times: T_F [\d.]+ ms, T_B [\d.]+ ms\)$", r.stdout, re.M), r.stdout[-2000:]


def test_the_console_shows_the_first_step_and_run_log_holds_it(main_job):
    """Progress from the first step (not only after log_interval = 5), with elapsed and ETA;
    run.log holds the whole console: the launcher's banner and summary, rank 0's lines."""
    job, r = main_job
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps[0].startswith("step    1/40 | loss ") and steps[1].startswith("step    5/40 | ")
    assert len(steps) == 1 + 40 // 5 and all(" | elapsed " in s and " | ETA " in s for s in steps)
    first = json.loads((job / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and f"loss {first['loss']:.4f}" in steps[0]  # one numbering: the same step 1
    log = (job / "run.log").read_text().splitlines()
    banner = next(i for i, x in enumerate(log) if x.startswith("world 2 = dp 1 x tp 1 x pp 2 on cpu"))  # launcher's
    assert [x for x in log[banner:] if x.startswith("step ")] == steps  # rank 0's lines, after the banner
    assert any(x.startswith("loss ") and "tokens/s" in x for x in log) and log[-3].startswith("  rank 1 ")
    assert log[-2].startswith("    model states ") and "B measured | " in log[-2]  # measured, formula, paper
    assert log[-1] == f"results in {job}: summary.json, metrics.jsonl, run.log, trace.json, timeline.png"


def test_wandb_offline_run_reads_back(main_job):
    job, _ = main_job
    files = glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history = wandb_reader.history(files[0])
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [h["loss"] for h in history] == [m["loss"] for m in metrics]
    assert {"tokens_per_s", "mfu", "bubble_fraction", "grad_norm", "lr"} <= history[0].keys()
    summary, config = wandb_reader.summary_and_config(files[0])
    assert summary["tokens_per_s"] == json.loads((job / "summary.json").read_text())["tokens_per_s"]
    # the simulator's replay beside the measurement: at log intervals in the history, and in the summary
    logged = [(h["step"], h["predicted_step_time_s"]) for h in history if "predicted_step_time_s" in h]
    assert logged == [(m["step"], m["predicted_step_time_s"]) for m in metrics if "predicted_step_time_s" in m]
    assert len(logged) >= 2 and all(t > 0 for _, t in logged)
    assert summary["predicted_bubble_fraction"] == json.loads((job / "summary.json").read_text())["predicted_bubble_fraction"]
    assert config["parallelism"]["pp"] == 2
    assert wandb_reader.run_meta(files[0])["name"] == "default"


def test_wandb_config_is_flat_for_comparison_and_sync_finds_the_run(main_job):
    job, _ = main_job
    files = glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))
    summary = json.loads((job / "summary.json").read_text())
    _, config = wandb_reader.summary_and_config(files[0])
    flat = ("dp", "tp", "pp", "zero", "schedule", "microbatches", "virtual_stages", "global_batch", "tokens_per_step",
            "world_size")
    assert {k: config[k] for k in flat} == {k: summary[k] for k in flat}
    assert config["layout"] == "dp1-tp1-pp2-z0-flush-m4" and config["model_name"] == "gpt2-tiny"
    metrics = wandb_reader.metric_definitions(files[0])
    assert metrics["*"]["step_metric"] == "step" and metrics["step"]["hidden"]  # every chart against our step
    assert metrics["tokens_per_s"]["none"] and metrics["loss"]["none"]  # summary.json's medians, not W&B's last
    assert [h["step"] for h in wandb_reader.history(files[0])] == list(range(1, 41))
    # The README's upload command, as a dry run: the offline run is found at that path.
    runs = glob.glob(str(job / "wandb" / "offline-run-*"))
    r = subprocess.run([str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run", *runs], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Would sync 1 run(s)" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_sweep_over_layouts_keeps_tokens_per_step_and_the_report_compares_it(layout_sweep):
    """trainer.global_batch_size: each layout derives its micro-batches (micro_batch_size 2
    fixed), so every job trains on 16 sequences per step; each job is its own W&B run, all
    in one group; the report has the global batch and tokens per step and no warning."""
    tmp_path, _ = layout_sweep
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1", "2"]
    summaries = [json.loads((j / "summary.json").read_text()) for j in jobs]
    assert [(s["dp"], s["pp"], s["microbatches"]) for s in summaries] == [(1, 1, 8), (2, 1, 4), (1, 2, 8)]
    assert [s["global_batch"] for s in summaries] == [16] * 3 and [s["tokens_per_step"] for s in summaries] == [512] * 3
    metas = [wandb_reader.run_meta(glob.glob(str(j / "wandb" / "*" / "run-*.wandb"))[0]) for j in jobs]
    assert len({m["name"] for m in metas}) == 3 and len({m["group"] for m in metas}) == 1  # own runs, one group
    assert metas[0]["group"] == "smoke" and metas[1]["name"].startswith("parallelism=dp2 trainer.global_batch_size=16")
    assert report_main([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text().splitlines()
    assert not any("differ in" in x for x in md)  # no fairness warning
    # the layouts train the same model to the same loss (the order of sums aside): ranked by speed
    assert any(x.startswith("every job reaches the same loss (") for x in md)
    # a winner by speed only when no job was flagged noisy (a short run on a busy machine often is)
    verdict = "no winner named by tokens_per_s: " if any(s["noisy"] for s in summaries) else "best by tokens_per_s: job "
    assert any(x.startswith(verdict) for x in md), md
    table = md[md.index(next(x for x in md if x.startswith("| job"))):]
    assert len(table) == 2 + 3 and "| global_batch | tokens_per_step |" in table[0]
    rows = (tmp_path / "report.csv").read_text().splitlines()
    assert len(rows) == 4 and "parallelism=pp2 trainer.global_batch_size=16" in rows[3] and ",completed," in rows[3]
    last = next(csv.DictReader(io.StringIO("\n".join([rows[0], rows[3]]))))
    assert (last["global_batch"], last["tokens_per_step"]) == ("16", "512")


def test_submitit_local_launcher(tmp_path):
    r = run_cli(["-m", "hydra/launcher=submitit_local", *SMOKE, f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    assert list((tmp_path / ".submitit").glob("*/*_result.pkl"))


def test_dry_run_plans_1024_ranks_without_starting_any(tmp_path):
    r = run_cli(["dry_run=true", "model=gpt2-medium", "parallelism.pp=4", "parallelism.dp=32", "parallelism.tp=8",
                 "schedule.microbatches=8", f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == 1024 and plan["dims"] == {"pp": 4, "dp": 32, "cp": 1, "tp": 8, "ep": 1}
    assert plan["groups"]["tp"][1] == list(range(8, 16)) and plan["groups"]["pp"][0] == [0, 256, 512, 768]
    assert [s["blocks"] for s in plan["stages"]] == [[0, 5], [6, 11], [12, 17], [18, 23]]
    assert plan["stages"][0]["embedding"] and plan["stages"][3]["head"]
    assert plan["bubble_fraction_analytic"] == pytest.approx(3 / 11)
    mem = plan["memory_estimate_per_rank"][1]
    assert mem["optimizer_bytes"] == 2 * mem["params_bytes"] == 2 * mem["grads_bytes"] > 0
    assert "pp stage 0" in r.stdout and "rank" not in " ".join(os.listdir(tmp_path))
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "config.yaml").exists()


def test_external_launcher_then_torchrun(tmp_path):
    r = run_cli(["launcher=external", *SMOKE, f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 0 and "-m framework.worker" in r.stdout
    assert not (tmp_path / "summary.json").exists()
    t = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "framework.worker", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 2


def _processes_with(marker: str) -> list[int]:
    found = []
    for env in glob.glob("/proc/[0-9]*/environ"):
        try:
            if marker.encode() in Path(env).read_bytes():
                found.append(int(env.split("/")[2]))
        except OSError:
            pass
    return found


def test_a_crashing_rank_ends_the_job_with_its_traceback(tmp_path):
    marker = f"FRAMEWORK_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    # Rank 1 dies at step 4 while the other ranks wait for it in the gradient all-reduce.
    r = run_cli(["parallelism=dp4", *SMOKE, "trainer.steps=50", "debug.fail_rank=1", "debug.fail_step=4",
                 f"hydra.run.dir={tmp_path}"], timeout=120, env={key: value})
    ended = time.time()
    assert r.returncode != 0
    assert "rank 1 failed" in r.stderr and "InjectedFault: injected fault on rank 1 at step 4" in r.stderr
    fault_time = float(re.search(r"unix time ([0-9.]+)", r.stderr).group(1))
    assert 0 < ended - fault_time < 30  # the whole job is gone within 30 s of the fault (a liveness bound)
    assert _processes_with(marker) == []  # no orphan rank left behind
    assert "InjectedFault" in (tmp_path / "error.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_local_launch_names_elastics_events_without_reading_the_stack(tmp_path, monkeypatch):
    """Elastic's rendezvous named each event after its caller with inspect.stack(), which reads
    the source of every frame: 0.3-0.5 s of the launcher's CPU per launch under pytest, about half
    of a short job's (experiments/launch_overhead). framework/launch/local.py reads the same
    name from the frame."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    calls = []
    real = inspect.stack
    monkeypatch.setattr(inspect, "stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_local(tmp_path / "job", *TINY, "data=synthetic", "trainer.steps=1", "parallelism=single")
    assert calls == []

    def _record():  # elastic's shape: the event's name is the method that called _record
        return dynamic_rendezvous.get_method_name()

    def next_rendezvous():
        return _record()

    assert next_rendezvous() == "next_rendezvous"
