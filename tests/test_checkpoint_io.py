"""Sharded checkpoints (framework/checkpoint/): the box geometry, what a ZeRO-3 rank holds while
it saves and loads, one lineage per job, a stop at the last step, and a full disk told as such.
(Resume equality, same layout bit for bit and across layouts in fp64: tests/test_checkpoint.py.)"""

import json
import math
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from framework.train import flight
from framework.checkpoint.shards import _tp_runs, flat_boxes
from framework.config import ConfigError
from framework.launch.job import run_job
from framework.launch.diagnosis import RankFailure

from .conftest import TINY, compose, final_params, read_metrics, run_cli, run_local
from .run_py import start_run_py
from .test_checkpoint import _base


def test_flat_ranges_become_contiguous_boxes_of_the_tensor():
    """Any flat range of any shape: the boxes cover exactly its elements, in order, each a
    contiguous view (what a ZeRO slice holds of a parameter, in global offsets)."""
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        t = torch.arange(n).view(shape)
        got = []
        for offs, sizes in flat_boxes(shape, a, b):
            view = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
            assert view.is_contiguous()
            got += view.reshape(-1).tolist()
        assert got == list(range(a, b)), (shape, a, b)
    # GPT-2's fused c_attn at tp 2, rank 1 (q, k, v columns 2-3, 6-7, 10-11 of 12): three runs;
    # the vocab padding row (>= 10) of a tp shard is never stored
    assert _tp_runs(torch.tensor([2, 3, 6, 7, 10, 11]), 0, 6, 12) == [(0, 2, 2), (2, 6, 2), (4, 10, 2)]
    assert _tp_runs(torch.tensor([8, 9, 10, 11]), 0, 4, 10) == [(0, 8, 2)]


# ---- ZeRO-3: each rank writes and reads only its own part ----

SMALLISH = ["model.n_layer=4", "model.n_embd=128", "model.n_head=4", "data.seq_len=32", "logger=none",
            "data=synthetic", "data.vocab_size=1000", "trainer.micro_batch_size=1", "metrics.skip_first=0",
            "metrics.peak_tflops=1.0", "parallelism=zero3", "parallelism.dp=4", "schedule.microbatches=1",
            "trainer.checkpoint_interval=1"]


def test_a_zero3_rank_saves_and_loads_only_its_part(tmp_path, data_cache):
    """dp 4, ZeRO-3, real ranks: every element is written exactly once over the ranks (the
    boxes' bytes sum to the whole state: fp32 parameters and AdamW's two states), each rank's
    boxes are a quarter, staged as such (asynchronous), and a resume reads a quarter per rank.
    What a save or load holds in memory is counted in `test_a_zero3_save_and_load_allocate_a_part`
    (resident memory moves with the machine's load: measured in experiments/checkpoint_memory)."""
    save_job, load_job = tmp_path / "save", tmp_path / "load"
    summary = run_local(save_job, *SMALLISH, f"data.cache_dir={data_cache}", "trainer.steps=1")
    whole = summary["model_params"] * 4 * 3  # fp32 parameters, exp_avg, exp_avg_sq
    saves = [r["checkpoint_save"] for r in summary["ranks"]]
    assert sum(s["rank_bytes"] for s in saves) == whole
    assert all(abs(s["rank_bytes"] - whole / 4) < 0.01 * whole for s in saves)
    assert all(s["staged_bytes"] == s["rank_bytes"] and s["write_s"] > 0 for s in saves)  # asynchronous
    assert all(s["peak_rss_bytes"] >= s["rss_before_bytes"] > 0 for s in saves)  # reported (the bound: below)

    summary = run_local(load_job, *SMALLISH, f"data.cache_dir={data_cache}", "trainer.steps=2",
                        f"trainer.resume={save_job / 'checkpoints' / 'step_1'}")
    loads = [r["checkpoint_load"] for r in summary["ranks"]]
    assert sum(ld["rank_bytes"] for ld in loads) == whole and all(ld["step"] == 1 for ld in loads)
    assert all(abs(ld["rank_bytes"] - whole / 4) < 0.01 * whole for ld in loads)


def _count_rank(rank: int, world: int, run, info, job: str) -> dict:
    """One step, a save, then a fresh model and optimizer that load it back, counting the
    bytes of tensors the save and the load each allocate and hold at once
    (tests/live_bytes.py: this thread's torch ops; checkpoint_async=false keeps DCP's write
    in it)."""
    import os

    from framework import checkpoint
    from framework.checkpoint.shards import rank_parts
    from framework.topology import ParallelContext, ParallelDims
    from framework.train.trainer import Batches, build_runner, train_step

    from .live_bytes import LiveBytes

    torch.set_num_threads(1)
    p = run.parallelism
    ctx = ParallelContext.create(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp), rank, torch.device("cpu"))
    runner, full = build_runner(run, info, ctx)
    train_step(0, runner, Batches(run, info, ctx), run, ctx)
    saver = checkpoint.Saver(run, ctx, job, None)
    parts, _ = rank_parts(runner, full, ctx, writers_only=True)
    box = max(v.numel() * v.element_size() for part in parts.values() for _, v in part.boxes)
    with LiveBytes() as saving:
        path = saver.save(runner, full, 1, info.vocab_size, None)
        saver.wait()
    runner, full = build_runner(run, info, ctx)  # a fresh rank state to load into
    with LiveBytes() as loading:
        loaded = checkpoint.load(path, runner, full, ctx, run)
    assert os.path.samefile(path, os.path.join(job, "checkpoints", "step_1"))
    return {"save_peak": saving.peak, "load_peak": loading.peak, "rank_bytes": saver.last["rank_bytes"],
            "loaded_bytes": loaded["rank_bytes"], "box": box}


def test_a_zero3_save_and_load_allocate_a_part(tmp_path, data_cache):
    """dp 4, ZeRO-3, on 4 gloo ranks in this test (no RSS: counted). A synchronous save
    allocates at most the rank's part plus one box (DCP copies boxes that are views into
    ZeRO's flat buffers before it serialises them), and a load at most the rank's part plus
    the largest box stored (it allocates AdamW's states, reads the parameters in place, and
    DCP reads one stored box at a time): about a quarter of the whole state, where a gather
    would hold all of it."""
    import torch.distributed.checkpoint as dcp

    from framework.data import prepare
    from framework.launch.job import run_info

    from .distributed import run_ranks

    run = compose(*SMALLISH, f"data.cache_dir={data_cache}", "trainer.checkpoint_async=false")
    prepare(run)
    ranks = run_ranks(_count_rank, 4, run, run_info(run, "cpu"), str(tmp_path), timeout=300)
    whole = sum(r["rank_bytes"] for r in ranks)
    md = dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step_1")).read_metadata().state_dict_metadata
    stored = max(math.prod(c.sizes) * m.properties.dtype.itemsize for m in md.values() if hasattr(m, "chunks")
                 for c in m.chunks)
    for r in ranks:
        assert r["save_peak"] <= r["rank_bytes"] + r["box"] < 0.3 * whole, (r, whole)
        assert r["load_peak"] <= r["loaded_bytes"] + stored < 0.3 * whole, (r, stored, whole)


# ---- one lineage; a finished job; a stop at the last step ----

def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, data_cache):
    job = tmp_path / "job"
    args = [*_base(data_cache, 4), "trainer.checkpoint_interval=2", "trainer.save_checkpoint=false"]
    run_local(job, *args)
    first = (job / "checkpoints" / "step_4" / "meta.json").read_text()
    summary = run_local(job, *args, f"trainer.resume={job / 'checkpoints' / 'step_2'}")
    assert summary["first_step"] == 3
    kept = job / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == ["step_2", "step_4"]
    meta = json.loads((kept / "step_4" / "meta.json").read_text())
    assert meta["resumed_from"] == str(kept / "step_2")  # the new step_4, continuing step_2
    aside = [p for p in (job / ".previous").glob("*/checkpoints/step_4")]
    assert len(aside) == 1 and (aside[0] / "meta.json").read_text() == first  # the abandoned one, kept

    # resume=auto on the finished job: told so, nothing runs, nothing is set aside
    before = sorted(p.name for p in (job / ".previous").iterdir())
    out = run_cli([*args, "trainer.resume=auto", f"hydra.run.dir={job}"], timeout=120)
    assert out.returncode == 0 and "finished already (4 of trainer.steps=4 steps" in out.stdout, out.stdout + out.stderr
    assert sorted(p.name for p in (job / ".previous").iterdir()) == before
    assert [m["step"] for m in read_metrics(job)] == [1, 2, 3, 4]
    # another config in that directory is not "the job, finished": the usual checks apply
    with pytest.raises(ConfigError, match="already at step 4"):
        run_job(compose(*args, "trainer.resume=auto", "optimizer.lr=1e-3"), str(job))


def test_a_stop_at_the_last_step_finishes_the_job(tmp_path, data_cache):
    """SIGTERM reaches the launcher during the last step: the ranks agree on it after that
    step, which is the last, so the job completes (exit 0, summary completed), not 143.
    The last step is made long on purpose (pp rank 0 sleeps 0.5 s in each of its 4 forward and
    backward computes: at least 2 s after both ranks noted it) so that the signal, sent within
    10 ms of the note, lands inside it on a loaded machine too: the window is injected, not
    hoped for."""
    job = tmp_path / "job"
    steps = 3
    args = [*_base(data_cache, steps), "parallelism=pp2", "schedule.microbatches=2", "trainer.log_interval=1",
            "trainer.checkpoint_interval=100", "debug.stage_delay_ms=500", "debug.delay_pp_rank=0",
            f"hydra.run.dir={job}"]
    proc = start_run_py(args, merge_stderr=True)  # python run.py, stderr into stdout
    def in_last_step(r: int) -> bool:  # its flight recorder: the last step started (step 2's agreement done)
        f = flight.read(str(job), r)
        return f is not None and any(n.text == f"step {steps}" for n in f.notes)

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (in_last_step(0) and in_last_step(1)):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM at the last step: finishing the job normally" in out, out
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "completed" and [m["step"] for m in read_metrics(job)] == [1, 2, 3]


# ---- a full disk ----

def test_a_full_disk_is_told_and_the_earlier_checkpoint_resumes(tmp_path, data_cache):
    """dp 2, a checkpoint every 2 steps, the checkpoints directory limited to 2.5 checkpoints
    (debug.checkpoint_disk_bytes): the third save fails with ENOSPC; the job says which
    checkpoint and why; step_4 is intact; resume=auto (room again) finishes bit for bit."""
    args = [*_base(data_cache, 6), "parallelism=dp2", "schedule.microbatches=2", "trainer.checkpoint_interval=2",
            "trainer.keep_checkpoints=null"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_local(whole, *args)
    size = sum(f.stat().st_size for f in (whole / "checkpoints" / "step_2").rglob("*") if f.is_file())
    with pytest.raises(RankFailure) as e:
        run_local(cut, *args, f"debug.checkpoint_disk_bytes={int(2.5 * size)}")
    reason = json.loads((cut / "summary.json").read_text())["reason"]
    assert f"checkpoint {cut / 'checkpoints' / 'step_6'}: writing failed: No space left on device" in reason, reason
    assert "No space left on device" in (cut / "error.txt").read_text() and "step_6" in e.value.reason
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_2", "step_4"]  # step_6 removed

    summary = run_local(cut, *args, "trainer.resume=auto")
    assert summary["first_step"] == 5
    # bitwise: the same layout resumes every state and runs the same kernels in the same order
    ref, got = read_metrics(whole), read_metrics(cut)
    assert [m["loss"] for m in got] == [m["loss"] for m in ref] and len(got) == 6
    a, b = final_params(whole), final_params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tp_only_run_is_saved_once(tmp_path, data_cache):
    """tp 2 (no ZeRO): each tp rank writes its runs of the sharded weights, only tp rank 0 the
    replicated ones (layer norms, row-parallel biases): the boxes' bytes are the whole once."""
    summary = run_local(tmp_path / "job", *TINY, f"data.cache_dir={data_cache}", "data=synthetic",
                        "parallelism=tp2", "trainer.steps=1", "trainer.checkpoint_interval=1")
    whole = summary["model_params"] * 4 * 3
    assert sum(r["checkpoint_save"]["rank_bytes"] for r in summary["ranks"]) == whole
    assert Path(tmp_path / "job" / "checkpoints" / "step_1" / "COMPLETE").exists()


def test_zero_offload_resumes_bit_exact(tmp_path, data_cache):
    """ZeRO-2 with the optimizer on the host: its states are saved from and loaded into the
    host copies; cut by a fault after step_2, resume=auto equals the uninterrupted run."""
    args = [*_base(data_cache, 4), "parallelism=zero2", "parallelism.offload_optimizer=true",
            "schedule.microbatches=2", "trainer.checkpoint_interval=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_local(whole, *args)
    with pytest.raises(RankFailure):
        run_local(cut, *args, "debug.fail_rank=1", "debug.fail_step=4")
    summary = run_local(cut, *args, "trainer.resume=auto")
    assert summary["first_step"] == 3
    # bitwise: the same layout resumes every state and runs the same kernels in the same order
    assert [m["loss"] for m in read_metrics(cut)] == [m["loss"] for m in read_metrics(whole)]
    a, b = final_params(whole), final_params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
