"""Checkpoints (framework/checkpoint/): a run cut off by a real rank fault and resumed
with trainer.resume=auto equals the uninterrupted run bit for bit (fp32, same layout); a
checkpoint resumed under another layout continues the single-process run to the fp64
equivalence tolerance, the data stream included; SIGTERM saves one; bad resumes are
rejected before any rank starts."""

import json
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from framework.config import ConfigError
from framework.launch.job import run_job
from framework.launch.diagnosis import RankFailure

from .conftest import FP64, ROOT, TINY, assert_same_training, compose, final_params, read_metrics, run_local
from .run_py import start_run_py


def _base(data_cache, steps: int) -> list[str]:
    return [*TINY, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", f"trainer.steps={steps}",
            "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3"]


def _fail(job: Path, *overrides: str) -> None:
    """A run that a rank fault ends (debug.fail_rank=1 at debug.fail_step)."""
    with pytest.raises(RankFailure):
        run_local(job, *overrides)
    assert json.loads((job / "summary.json").read_text())["status"] == "failed"


# ---- same layout: bit for bit (fp32) ----
# Bitwise is right here: the resumed run restores every state bit for bit and then runs the
# same kernels in the same order (same layout, same ranks, same reduction order) as the
# uninterrupted run did. Across layouts the order changes: those resumes are compared in fp64.
# pp 2 runs with dropout: its masks come from each rank's global generator, which only the
# checkpoint's `rng/rank<r>` puts back where step 2 left it (without it, step 3 would draw
# step 1's masks again: torch.manual_seed(trainer.seed) runs before the load).

SAME = {"dp2": ["parallelism=dp2", "schedule.microbatches=2"],
        "pp2_flush": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4", "model.dropout=0.1"],
        "tp2": ["parallelism=tp2", "schedule.microbatches=4"],
        "zero3": ["parallelism=zero3", "schedule.microbatches=2"]}


@pytest.mark.parametrize("layout", SAME)
def test_resume_after_a_rank_fault_is_bit_exact(tmp_path, data_cache, layout):
    """4 steps, a checkpoint every 2 (kept: the newest 2); rank 1 fails at the start of step
    4, after step_2 was saved and step 3 ran (its work is lost); resume=auto goes on from step_2."""
    args = [*_base(data_cache, 4), *SAME[layout], "trainer.checkpoint_interval=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_local(whole, *args, "trainer.checkpoint_interval=1")  # checkpoints do not change training
    _fail(cut, *args, "debug.fail_rank=1", "debug.fail_step=4")
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_2"]
    summary = run_local(cut, *args, "trainer.resume=auto")
    assert summary["resumed_from"] == str(cut / "checkpoints" / "step_2") and summary["first_step"] == 3

    ref, got = read_metrics(whole), read_metrics(cut)
    assert [m["step"] for m in got] == [1, 2, 3, 4]  # the saving run's rows, then the resumed run's
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]  # bit for bit
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    a, b = final_params(whole), final_params(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.h.0.mlp.c_fc.weight"], final_params_of_step(cut, 2)), "it trained on"

    # keep_checkpoints=2 bounded the uninterrupted run's four; each is complete
    kept = sorted((whole / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step_3", "step_4"]
    for p in kept:
        meta = json.loads((p / "meta.json").read_text())
        assert (p / "COMPLETE").exists() and meta["step"] == int(p.name[5:]) and meta["layout"]["zero"] == (
            3 if layout == "zero3" else 0)
        assert len((p / "metrics.jsonl").read_text().splitlines()) == meta["step"]


def final_params_of_step(job: Path, step: int) -> torch.Tensor:
    """One parameter as a checkpoint holds it (read back with DCP, no process group)."""
    import torch.distributed.checkpoint as dcp

    key = "model/transformer.h.0.mlp.c_fc.weight"
    md = dcp.FileSystemReader(str(job / "checkpoints" / f"step_{step}")).read_metadata().state_dict_metadata
    out = {key: torch.empty(md[key].size, dtype=md[key].properties.dtype)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(job / "checkpoints" / f"step_{step}"), no_dist=True)
    return out[key]


# An asynchronous pipeline's resume (a refill at the checkpoint's step) is proved equal to a
# fresh asynchronous run from that checkpoint in tests/test_pipeline_async.py.


# ---- another layout: the single-process run's values (fp64) ----

LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "tp2": ["parallelism=tp2", "schedule.microbatches=4"],
           "pp2": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4"],
           "pp4": ["parallelism=pp4", "schedule=flush", "schedule.microbatches=4"],
           "zero3": ["parallelism=zero3", "schedule.microbatches=2"],
           "zero1": ["parallelism=zero1", "schedule.microbatches=2"],
           "3d": ["parallelism=3d_2x2x2", "schedule=flush", "schedule.microbatches=2"],
           "cp2": ["parallelism=single", "parallelism.cp=2", "schedule.microbatches=4"],
           "cp2_pp2": ["parallelism=pp2", "parallelism.cp=2", "schedule=flush", "schedule.microbatches=4"]}
# Each chain: the first layout runs until a fault at the start of step 3 (checkpoint step_2);
# each next one resumes the previous one's newest checkpoint, saves every 2 steps and (but
# the last) fails at the start of step 5. dp2 -> tp2 -> pp2 covers two of the pairs in one chain;
# cp2 -> dp2 -> cp2_pp2 takes a context-parallel run to cp 1 and back.
CHAINS = [("dp2", "tp2", "pp2"), ("pp2", "pp4"), ("zero3", "zero1"), ("3d", "dp2"), ("cp2", "dp2", "cp2_pp2")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    job = tmp_path_factory.mktemp("ckpt_single")
    run_local(job, *_base(data_cache, 6), "model.n_layer=4", FP64, *LAYOUTS["single"])
    return read_metrics(job), final_params(job)


@pytest.mark.parametrize("chain", CHAINS, ids=["->".join(c) for c in CHAINS])
def test_resume_under_another_layout_continues_the_run(tmp_path, data_cache, reference, chain):
    args = [*_base(data_cache, 6), "model.n_layer=4", FP64, "trainer.checkpoint_interval=2"]
    previous = None
    for i, layout in enumerate(chain):
        job = tmp_path / f"{i}_{layout}"
        resume = [f"trainer.resume={previous}"] if previous else []
        if i < len(chain) - 1:
            _fail(job, *args, *LAYOUTS[layout], *resume, "debug.fail_rank=1", f"debug.fail_step={2 * (i + 1) + 1}")
            previous = job / "checkpoints" / f"step_{2 * (i + 1)}"
            assert (previous / "COMPLETE").exists()
        else:
            summary = run_local(job, *args, *LAYOUTS[layout], *resume)
            assert summary["first_step"] == 2 * i + 1 and summary["world_size"] == compose(*LAYOUTS[layout]).world_size
    metrics, params = read_metrics(job), final_params(job)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert_same_training(metrics, params, *reference)


# ---- a checkpoint written before the flat update buffers ----

PRE46 = ROOT / "tests" / "data" / "pre46_bf16"  # its README: the commit and the overrides that wrote it


@pytest.mark.parametrize("impl", ["for-loop", "auto"])
def test_a_checkpoint_written_before_the_flat_buffers_resumes(tmp_path, impl):
    """bf16-mixed masters saved per tensor by the code before issue 46 load into today's one
    flat buffer: step 3 (the loaded weights' forward and backward) equals the old run's bit
    for bit under any implementation; step 4 (after one update) too under the per-tensor
    AdamW the old code ran on CPU, and within 1e-5 under fused AdamW (another kernel)."""
    args = [*TINY, "data=synthetic", "trainer.steps=4", "trainer.warmup_steps=1", "optimizer.lr=3e-3",
            "trainer.precision=bf16-mixed", "parallelism=single", "schedule.microbatches=2",
            f"optimizer.implementation={impl}", f"trainer.resume={PRE46 / 'step_2'}"]
    summary = run_local(tmp_path / "job", *args)
    assert summary["first_step"] == 3
    old = {m["step"]: m for m in json.loads((PRE46 / "metrics.json").read_text())}
    got = {m["step"]: m for m in read_metrics(tmp_path / "job")}
    assert (got[3]["loss"], got[3]["grad_norm"]) == (old[3]["loss"], old[3]["grad_norm"])
    if impl == "for-loop":
        assert (got[4]["loss"], got[4]["grad_norm"]) == (old[4]["loss"], old[4]["grad_norm"])
    else:
        assert got[4]["loss"] == pytest.approx(old[4]["loss"], rel=1e-5)
    assert got[4]["loss"] != got[3]["loss"]  # it stepped


# ---- SIGTERM saves a checkpoint; rejections ----

def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path, data_cache):
    """A scheduler's SIGTERM to the launcher mid-run: the ranks agree on a step boundary,
    save checkpoints/step_<k>, the job exits 143 (interrupted); resume=auto finishes it."""
    job = tmp_path / "job"
    args = [*_base(data_cache, 400), "parallelism=dp2", "schedule.microbatches=2", "trainer.log_interval=1",
            "trainer.checkpoint_interval=1000", f"hydra.run.dir={job}"]
    proc = start_run_py(args, merge_stderr=True)  # python run.py, stderr into stdout
    partial = job / "metrics.jsonl.partial"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (partial.exists() and len(partial.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    saved = [p for p in (job / "checkpoints").iterdir()]
    assert len(saved) == 1 and (saved[0] / "COMPLETE").exists(), out
    k = int(saved[0].name[5:])
    assert k >= 2 and f"checkpoint saved after step {k}" in out
    assert json.loads((job / "summary.json").read_text())["status"] == "interrupted"
    assert len((saved[0] / "metrics.jsonl").read_text().splitlines()) == k  # every step up to it

    summary = run_local(job, *args[:-1], "trainer.resume=auto", f"trainer.steps={k + 2}")
    assert summary["first_step"] == k + 1 and [m["step"] for m in read_metrics(job)] == list(range(1, k + 3))


def _reject(job: Path, overrides: list[str], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        run_job(compose(*overrides), str(job))
    assert str(e.value).startswith(f"{key}=") and problem in str(e.value) and "Fix: " in str(e.value), str(e.value)


def test_bad_resumes_are_rejected_before_launch(tmp_path, data_cache):
    job = tmp_path / "job"
    args = [*_base(data_cache, 2), "trainer.checkpoint_interval=2", "trainer.save_checkpoint=false"]
    run_local(job, *args)
    ckpt = job / "checkpoints" / "step_2"
    _reject(tmp_path / "a", [*args, f"trainer.resume={tmp_path / 'nowhere'}"], "trainer.resume",
            "no such checkpoint directory")
    _reject(tmp_path / "b", [*args, f"trainer.resume={ckpt}"], "trainer.steps", "already at step 2")
    _reject(tmp_path / "c", [*args, "trainer.steps=4", "model.n_layer=3", f"trainer.resume={ckpt}"], "model.n_layer",
            "saved with model.n_layer=2")
    _reject(tmp_path / "d", [*args, "trainer.steps=4", FP64, f"trainer.resume={ckpt}"], "trainer.precision",
            "saved in fp32, whose weights and optimizer states are torch.float32")
    (ckpt / "COMPLETE").unlink()
    _reject(tmp_path / "e", [*args, "trainer.steps=4", f"trainer.resume={ckpt}"], "trainer.resume",
            "incomplete checkpoint")
    # auto without a complete checkpoint starts at step 1, and sets the stale one aside (the
    # job must look unfinished: with its summary.json completed, auto would say it is done)
    (job / "summary.json").unlink()
    summary = run_local(job, *args, "trainer.resume=auto", "trainer.steps=1")
    assert summary["first_step"] == 1 and not (job / "checkpoints").exists()
    assert any((p / "checkpoints" / "step_2").exists() for p in (job / ".previous").iterdir())
    assert os.path.exists(job / "summary.json")
