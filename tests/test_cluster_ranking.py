"""What the cluster path prints and writes is true (framework/sim/cost/, framework/sim/sweep.py):
the memory line's parts add up to its total, a layout run.py refuses is refused before it is
priced, the plot names every candidate apart, and a predict-then-run sweep's own prediction
is not taken for an earlier run's files. In process; the cluster sweep itself is
tests/test_cost_model.py's test_a_simulated_search_ranks_layouts_for_a_cluster."""

from __future__ import annotations

import json
import re

import pytest

from framework.config import ConfigError

from .conftest import compose

TINY = ["model=llama-tiny", "model.n_layer=8", "model.n_embd=256", "model.n_head=8", "model.n_kv_head=4",
        "model.n_inner=688", "model.max_positions=1024", "model.vocab_size=32000", "data=synthetic",
        "data.seq_len=1024", "logger=none", "trainer.micro_batch_size=2", "trainer.precision=bf16-mixed",
        "hardware=h100-sxm", "hardware.gpus=64"]


def memory_parts(line: str) -> tuple[float, list[float]]:
    """The total of a printed memory line and every number named inside it after the total."""
    m = re.search(r"memory ([\d.]+) of [\d.]+ GiB per GPU(.*)", line)
    assert m, line
    named = re.sub(r" on pp rank \d+", "", m.group(2))  # which rank, not a part
    return float(m.group(1)), [float(x) for x in re.findall(r"[a-z]+ ([\d.]+)", named)]


def shape(width: int, ffn: int, heads: int, seq: int) -> list[str]:
    return ["model=llama-tiny", "model.n_layer=10", f"model.n_embd={width}", f"model.n_head={heads}",
            "model.n_kv_head=8", f"model.n_inner={ffn}", f"model.max_positions={seq}", "model.vocab_size=128256", "data=synthetic",
            f"data.seq_len={seq}", "logger=none", "trainer.micro_batch_size=1", "trainer.precision=bf16-mixed",
            "hardware=h100-sxm", "hardware.gpus=64"]


# 10 blocks over pp 4: the first rank holds 3 blocks and the most states, the last 2 blocks,
# the head and the most activations; the wide model's recomputed block is over a GiB
@pytest.mark.parametrize("layout", [
    [*shape(1024, 2752, 8, 4096), "parallelism.pp=4", "parallelism.dp=2", "schedule=flush", "schedule.microbatches=8"],
    [*shape(4096, 11008, 32, 8192), "parallelism.pp=4", "parallelism.dp=2", "schedule=flush", "schedule.microbatches=8",
     "trainer.recompute=full"],
    [*shape(4096, 11008, 32, 8192), "parallelism.tp=2", "parallelism.pp=2", "parallelism.sequence_parallel=true",
     "schedule=interleaved", "schedule.virtual_stages=2", "schedule.microbatches=4", "trainer.recompute=full",
     "parallelism.zero=1"],
], ids=["pp4_two_fullest_ranks", "pp4_recompute", "tp2_pp2_interleaved_recompute"])
def test_the_memory_lines_parts_add_up_to_its_total(layout):
    """The cost model's line (dry run, python -m framework.simulate hardware=...): the
    fullest rank's model states, saved activations and, under recomputation, the recomputed
    block's transient, each named; their sum is the printed total (each to 0.1 GiB). Before:
    the largest states and the largest activations, of two ranks, and no transient."""
    from framework.sim.cost.plan import plan
    from framework.sim.cost.describe import describe

    rep = plan(layout)
    total, parts = memory_parts(describe(rep).splitlines()[0])
    assert total == pytest.approx(rep["memory_per_gpu_bytes"] / 2 ** 30, abs=0.051)
    assert sum(parts) == pytest.approx(total, abs=1e-9), (total, parts)  # as printed: the tenths add up
    assert sum(rep["memory_parts_bytes"].values()) == pytest.approx(rep["memory_per_gpu_bytes"], rel=1e-12)
    if "trainer.recompute=full" in layout:
        assert rep["recompute_transient_bytes"] > 0.5 * 2 ** 30 and len(parts) == 3


def test_the_dry_runs_per_rank_activations_name_the_recomputed_block(tmp_path, capsys):
    """The plan's per-rank line: under recomputation its activations are the saved tensors
    plus one block's recomputed set, both named, adding up."""
    from framework.launch.job import run_job

    run = compose(*TINY, "parallelism.pp=2", "parallelism.dp=2", "schedule=flush", "schedule.microbatches=4",
                  "trainer.recompute=full", "dry_run=true")
    run_job(run, str(tmp_path))
    lines = [x for x in capsys.readouterr().out.splitlines() if "per rank est.:" in x]
    assert len(lines) == 2
    for line in lines:
        act, saved, extra = map(float, re.search(r"activations ([\d.]+) MiB \(saved ([\d.]+) \+ one block's "
                                                 r"recomputed set ([\d.]+)\)", line).groups())
        assert extra > 0 and saved + extra == pytest.approx(act, abs=0.11)
    mem = json.loads((tmp_path / "plan.json").read_text())["memory_estimate_per_rank"]
    assert all(m["recompute_transient_bytes"] > 0 for m in mem)


def test_a_layout_run_py_refuses_is_refused_before_it_is_priced():
    """tp 3 does not divide 8 heads: the dry run's check on the meta model refuses it; the
    cluster path (python -m framework.simulate hardware=..., and a simulate sweep's pricing)
    raises the same error instead of pricing it."""
    from framework.models import meta_hf_model
    from framework.sim.cost.plan import plan
    from framework.sim.sweep import cluster_prediction
    from framework.validate import validate_model

    for bad, words in ((["parallelism.tp=3"], "model.n_head=8 does not divide over tp=3"),
                       (["parallelism.tp=8", "model.n_kv_head=2"], "model.n_kv_head=2 does not divide over tp=8")):
        run = compose(*TINY, *bad)
        with pytest.raises(ConfigError) as dry:
            validate_model(run, meta_hf_model(run.model, 32000))
        with pytest.raises(ConfigError) as cluster:
            plan([*TINY, *bad])
        assert str(cluster.value) == str(dry.value) and words in str(dry.value)
        with pytest.raises(ConfigError) as swept:
            cluster_prediction(run, 32000)
        assert str(swept.value) == str(dry.value)


def _row(rank: int, schedule: str, fits: bool, mfu: float, memory: float, job: str) -> dict:
    return {"predicted_rank": rank, "fits": fits, "mfu": mfu, "memory_per_gpu_bytes": memory * 2 ** 30,
            "memory_bytes": 80 * 2 ** 30, "hardware": "h100-sxm", "job_dir": f"/sweep/{job}",
            "layout": {"dp": 8, "tp": 8, "pp": 8, "cp": 1, "ep": 1, "zero": 1, "sequence_parallel": True,
                       "schedule": schedule, "microbatches": 32, "virtual_stages": 2 if schedule == "interleaved"
                       else 1, "micro_batch_size": 1, "seq_len": 8192, "recompute": False}}


def test_every_point_of_the_cluster_plot_is_labelled_apart(tmp_path):
    """Two layouts alike but for the schedule got the same label, and the highest-MFU point,
    out of memory and so ranked last, none: now each point carries its rank and the list
    beside the axes names each rank's layout, schedule included, every label different."""
    from framework.sim.sweep import cluster_plot, point_labels

    rows = [_row(1, "interleaved", True, 0.50, 60, "7"), _row(2, "flush", True, 0.48, 46, "6"),
            _row(3, "flush", False, 0.55, 95, "3")]
    rows[0]["layout"]["virtual_stages"] = 1  # #1 and #2 differ in the schedule only: the pair
    rows[2]["layout"]["zero"] = 0
    assert point_labels(rows) == ["#1 interleaved tp8 pp8 dp8 z1", "#2 flush tp8 pp8 dp8 z1", "#3 flush tp8 pp8 dp8 z0"]
    rows.append(_row(4, "flush", False, 0.40, 99, "4"))
    rows[3]["layout"]["seq_len"] = 4096  # any other key that differs is named
    assert point_labels(rows)[2:] == ["#3 flush tp8 pp8 dp8 z0 s8192", "#4 flush tp8 pp8 dp8 z1 s4096"]
    rows.append(_row(5, "flush", False, 0.60, 99, "9"))  # alike in every layout key: the job names them apart
    rows[4]["layout"]["seq_len"] = 4096
    labels = point_labels(rows)
    assert labels[3:] == ["#4 flush tp8 pp8 dp8 z1 s4096 (job 4)", "#5 flush tp8 pp8 dp8 z1 s4096 (job 9)"]
    assert len({lab.split(" ", 1)[1] for lab in labels}) == len(rows)  # unique without the rank too
    drawn = cluster_plot(rows, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert sorted(drawn["points"]) == [f"#{r['predicted_rank']}" for r in rows]  # every point, once
    assert all(lab in drawn["key"] for lab in labels)
    assert "#5" in drawn["points"]  # the best MFU, out of memory and so ranked last


def test_a_predicted_jobs_own_files_are_not_an_earlier_runs(tmp_path, monkeypatch, capsys):
    """search.mode=simulate's second phase runs the top candidate in the directory where the
    first wrote its prediction.json, config.yaml and run.log: those are this job's, so they
    stay (no `.previous/`, no "held an earlier run's files"); an earlier run's summary.json
    there is still set aside. The real run_job, its launch stopped at the start."""
    import framework.launch.job as job_module
    from framework.config import to_yaml
    from framework.sim.sweep import PREDICTION, finish

    job = tmp_path / "0"
    job.mkdir()
    run = compose("model=llama-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data=synthetic",
                  "data.seq_len=32", "logger=none", "trainer.micro_batch_size=2", "parallelism=pp2",
                  "schedule=flush", "schedule.microbatches=2", "trainer.steps=2")
    (job / "config.yaml").write_text(to_yaml(run))
    prediction = {"status": "simulated", "schedule": "flush", "pp": 2, "microbatches": 2,
                  "predicted_tokens_per_s": 1000.0, "predicted_step_time_s": 0.1, "predicted_bubble_fraction": 0.3}
    (job / PREDICTION).write_text(json.dumps(prediction))
    (job / "run.log").write_text("the prediction phase's console\n")
    (job / "summary.json").write_text(json.dumps({"status": "completed"}))  # an earlier run's

    def launch_local(run, job_dir, info):
        assert (job / PREDICTION).exists() and (job / "config.yaml").exists()
        raise RuntimeError("launch stopped by the test")

    monkeypatch.setattr(job_module, "launch_local", launch_local)
    rows = finish(str(tmp_path), job_module.run_job)
    out = capsys.readouterr().out
    assert rows[0]["measured_status"] == "failed: RuntimeError: launch stopped by the test"
    assert "an earlier run's files" in out and "(summary.json)" in out  # only the earlier run's summary
    assert json.loads((job / PREDICTION).read_text()) == prediction
    assert (job / "run.log").read_text().startswith("the prediction phase's console")
    moved = list((job / ".previous").glob("*/*"))
    assert [p.name for p in moved] == ["summary.json"]
