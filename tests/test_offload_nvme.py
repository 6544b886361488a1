"""ZeRO-Infinity's NVMe tier for the optimizer's states (parallelism.offload_device=nvme,
framework/optim/swap.py): ZeRO 3 over dp 2 with the states in a file-backed map trains as
in-memory ZeRO 3 in fp64; cut by a fault, it resumes from its checkpoint bit for bit; a drive
without room for the states is told at the reservation, and the checkpoint it resumes from is
left as it was; no swap file outlives its run."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest
import torch

from framework.launch.diagnosis import RankFailure
from framework.optim.swap import OffloadTarget, StateSwap

from .conftest import FP64, assert_same_training, final_params, read_metrics, run_local
from .test_checkpoint import _base

LAYOUT = ["parallelism=dp2", "parallelism.zero=3", "schedule.microbatches=2", FP64]


def _digest(folder) -> dict:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_nvme_offload_trains_as_in_memory_zero3_resumes_and_tells_a_full_drive(tmp_path, data_cache):
    swap = tmp_path / "nvme"
    nvme = ["parallelism.offload_optimizer=true", "parallelism.offload_device=nvme", f"parallelism.nvme_path={swap}"]
    args = [*_base(data_cache, 4), *LAYOUT, "trainer.checkpoint_interval=2"]
    memory, whole, cut = tmp_path / "memory", tmp_path / "whole", tmp_path / "cut"
    run_local(memory, *args)
    run_local(whole, *args, *nvme)
    assert_same_training(read_metrics(whole), final_params(whole), read_metrics(memory), final_params(memory))
    assert list(swap.iterdir()) == []  # unlinked once mapped: nothing outlives the run

    with pytest.raises(RankFailure):
        run_local(cut, *args, *nvme, "debug.fail_rank=1", "debug.fail_step=4")
    saved = _digest(cut / "checkpoints")
    # the resumed run's reservation meets a drive with 1 kB of room: told, nothing written
    with pytest.raises(RankFailure) as e:
        run_local(cut, *args, *nvme, "trainer.resume=auto", "debug.offload_disk_bytes=1000")
    reason = json.loads((cut / "summary.json").read_text())["reason"]
    assert "No space left on device for the optimizer states offloaded to NVMe" in reason, reason
    assert f"parallelism.nvme_path={swap}" in e.value.reason and "1000 free" in e.value.reason
    assert _digest(cut / "checkpoints") == saved and list(swap.iterdir()) == []

    summary = run_local(cut, *args, *nvme, "trainer.resume=auto")
    assert summary["first_step"] == 3
    # bitwise: the same layout resumes every state and runs the same kernels in the same order
    assert [m["loss"] for m in read_metrics(cut)] == [m["loss"] for m in read_metrics(whole)]
    a, b = final_params(whole), final_params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_states_move_into_the_map_and_a_load_refills_the_same_places(tmp_path):
    """In process: AdamW's m and v leave host memory for views of the file's map after the
    first step; states a checkpoint's load put in memory go back to the same offsets; the
    reservation is the aligned bytes of every state, and one byte less room is ENOSPC."""
    params = [torch.nn.Parameter(torch.randn(100, dtype=torch.float64)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    need = 2 * (-(-800 // 64) * 64) + 2 * (-(-28 // 64) * 64)
    with pytest.raises(OSError) as e:
        StateSwap(OffloadTarget("nvme", str(tmp_path / "small"), need - 1)).adopt(opt.state)
    assert e.value.errno == errno.ENOSPC and f"{need} bytes needed, {need - 1} free" in str(e.value)
    swap = StateSwap(OffloadTarget("nvme", str(tmp_path / "nvme"), need + 128))  # room for a later 5-element parameter's
    before = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    swap.adopt(opt.state)
    assert swap.bytes == need and list((tmp_path / "nvme").iterdir()) == []
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            assert torch.equal(v, before[i, k]) and swap._holds(v) == (v.dim() > 0)
    places = {(i, k): v.data_ptr() for i, p in enumerate(params) for k, v in opt.state[p].items() if v.dim()}
    sd = opt.state_dict()  # a checkpoint's load: the states read into fresh host tensors
    sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    opt.load_state_dict(sd)
    assert not any(swap._holds(v) for p in params for v in opt.state[p].values())
    opt.step()
    swap.adopt(opt.state)
    assert {(i, k): v.data_ptr() for i, p in enumerate(params) for k, v in opt.state[p].items() if v.dim()} == places
    # a parameter whose first gradient comes later: its states get a file of their own then
    late = torch.nn.Parameter(torch.randn(5))
    opt.add_param_group({"params": [late]})
    late.grad = torch.ones_like(late)
    opt.step()
    swap.adopt(opt.state)
    assert len(swap.maps) == 2 and all(swap._holds(v) for v in opt.state[late].values() if v.dim())
    opt.state[late]["exp_avg"] = torch.zeros(6)  # a state that changed size has no place
    with pytest.raises(RuntimeError, match="'exp_avg' is 24 bytes now, its place on the drive 20"):
        swap.adopt(opt.state)


@pytest.mark.parametrize("args,key,problem", [
    (["parallelism.offload_device=nvme"], "parallelism.offload_device",
     "acts only with parallelism.offload_optimizer=true"),
    (["parallelism=dp2", "parallelism.zero=2", "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme"],
     "parallelism.nvme_path", "which directory is not said"),
    (["parallelism=dp2", "parallelism.zero=2", "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
      "parallelism.nvme_path=/proc/offload"], "parallelism.nvme_path", "cannot be created"),
], ids=["without_offload", "no_path", "unwritable"])
def test_nvme_offload_keys_are_checked_before_any_rank_starts(args, key, problem, tmp_path):
    from framework.config import ConfigError

    from .prelaunch import prelaunch

    with pytest.raises(ConfigError) as e:
        prelaunch(["data=synthetic", "logger=none", "launcher=external", "metrics.peak_tflops=1", *args[:-1]],
                  args[-1], str(tmp_path / "job"))
    assert e.value.key == key and problem in str(e.value) and "Fix: " in str(e.value), str(e.value)
