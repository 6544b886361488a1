"""ZeRO-Infinity's NVMe tier for the optimizer's states (parallelism.offload_device=nvme,
framework/optim/swap.py): ZeRO 3 over dp 2 with the states on the drive trains as
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
from framework.optim.param_swap import ParamSwap
from framework.optim.swap import OffloadTarget, StateSwap

from .conftest import FP64, assert_same_training, final_params, read_metrics, run_local
from .test_checkpoint import _base

LAYOUT = ["parallelism=dp2", "parallelism.zero=3", "schedule.microbatches=2", FP64]


def _digest(folder) -> dict:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_nvme_offload_trains_as_in_memory_zero3_resumes_and_tells_a_full_drive(tmp_path, data_cache):
    swap = tmp_path / "nvme"
    nvme = ["parallelism.offload_optimizer=true", "parallelism.offload_device=nvme", f"parallelism.nvme_path={swap}",
            "parallelism.offload_params=true"]
    args = [*_base(data_cache, 4), *LAYOUT, "trainer.checkpoint_interval=2"]
    memory, whole, cut = tmp_path / "memory", tmp_path / "whole", tmp_path / "cut"
    run_local(memory, *args)
    run_local(whole, *args, *nvme)
    assert_same_training(read_metrics(whole), final_params(whole), read_metrics(memory), final_params(memory))
    assert list(swap.iterdir()) == []  # unlinked once made: nothing outlives the run
    on_drive, in_memory = (json.loads((j / "summary.json").read_text()) for j in (whole, memory))
    # between steps no rank holds a parameter slice or m and v in memory, as the formula says
    assert [r["params_bytes"] for r in on_drive["ranks"]] == [0, 0], on_drive["ranks"]
    assert min(r["params_bytes"] for r in in_memory["ranks"]) > 0
    assert on_drive["model_state_bytes_max"] == on_drive["model_state_formula_bytes_max"]
    # the states' tier alone (the parameter slices in memory): the same training, its own bytes
    states = tmp_path / "states"
    run_local(states, *args, *nvme[:-1])
    assert_same_training(read_metrics(states), final_params(states), read_metrics(memory), final_params(memory))
    alone = json.loads((states / "summary.json").read_text())
    assert alone["model_state_bytes_max"] == alone["model_state_formula_bytes_max"] > on_drive["model_state_bytes_max"]
    assert alone["layout"].endswith("-offload-nvme")
    assert on_drive["layout"].endswith("-offload-nvme-params")

    with pytest.raises(RankFailure):
        run_local(cut, *args, *nvme, "debug.fail_rank=1", "debug.fail_step=4")
    saved = _digest(cut / "checkpoints")
    # the resumed run's reservation meets a drive with 1 kB of room: told, nothing written
    with pytest.raises(RankFailure) as e:
        run_local(cut, *args, *nvme, "trainer.resume=auto", "debug.offload_disk_bytes=1000")
    reason = json.loads((cut / "summary.json").read_text())["reason"]
    assert "No space left on device for the parameters offloaded to NVMe" in reason, reason
    assert f"parallelism.nvme_path={swap}" in e.value.reason and "1000 free" in e.value.reason
    assert _digest(cut / "checkpoints") == saved and list(swap.iterdir()) == []

    summary = run_local(cut, *args, *nvme, "trainer.resume=auto")
    assert summary["first_step"] == 3
    # bitwise: the same layout resumes every state and runs the same kernels in the same order
    assert [m["loss"] for m in read_metrics(cut)] == [m["loss"] for m in read_metrics(whole)]
    a, b = final_params(whole), final_params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _units(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64)) for n in sizes]


def _pooled(tmp_path, sizes, disk_bytes=None):
    units = _units(sizes)
    inner = torch.optim.AdamW(units, lr=0.1, foreach=True)
    return units, inner, StateSwap(OffloadTarget("nvme", str(tmp_path / "nvme"), disk_bytes), units)


def _step(units, grads, step) -> None:
    for u, g in zip(units, grads):
        u.grad = g.clone()
    step()
    for u in units:
        u.grad = None


def test_the_pool_steps_unit_by_unit_as_in_memory_adamw_one_unit_ahead_in_bounded_memory(tmp_path):
    """In process: AdamW stepped through the pool equals in-memory AdamW bit for bit over four
    steps (the first makes the states unit by unit, a checkpoint-like load puts them back in
    memory before the fourth); between steps every state is a view of the file, which is
    unlinked; the I/O is read k+1 before unit k steps, write k after; the host memory held for
    the states is the same with 2 units as with 8 while the file grows 4x; one byte too little
    room is ENOSPC before anything is written; a step that fails leaves no state in a buffer; a
    state of a kind the layout lacks is refused."""
    sizes = [1000, 300, 7]
    units, inner, swap = _pooled(tmp_path, sizes)
    ref = _units(sizes)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, foreach=True)
    g = torch.Generator().manual_seed(1)
    log = []
    submit = swap.io.submit
    swap.io.submit = lambda fn, u, *a: (log.append((fn.__name__, next(i for i, v in enumerate(units) if v is u))),
                                        submit(fn, u, *a))[1]
    inner_step = inner.step
    inner.step = lambda: (log.append(("step", next(i for i, u in enumerate(units) if u.grad is not None))),
                          inner_step())[1]
    for step in range(4):
        if step == 3:  # a checkpoint's load: the states read into fresh host tensors
            sd = inner.state_dict()
            sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
            inner.load_state_dict(sd)
            assert not any(swap._on_drive(u, inner.state[u]) for u in units)
        grads = [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]
        log.clear()
        _step(units, grads, lambda: swap.step(inner))
        _step(ref, grads, ref_opt.step)
        assert all(torch.equal(a, b) for a, b in zip(units, ref)), step
        assert all(torch.equal(inner.state[a][k], ref_opt.state[b][k]) for a, b in zip(units, ref)
                   for k in ("exp_avg", "exp_avg_sq"))
        assert all(swap._on_drive(u, inner.state[u]) for u in units)
        if step == 1:  # the steady state: unit k+1 comes off the drive while unit k steps
            assert log == [("_read", 0), ("_read", 1), ("step", 0), ("_write", 0), ("_read", 2), ("step", 1),
                           ("_write", 1), ("step", 2), ("_write", 2)], log
    region = [2 * -(-n * 8 // 4096) * 4096 for n in sizes]  # m and v, each on its own pages
    assert swap.bytes == sum(region) and list((tmp_path / "nvme").iterdir()) == []
    assert swap.host_peak_bytes >= 3 * max(region)

    peaks = {}
    for depth in (2, 8):
        us, opt, pool = _pooled(tmp_path / str(depth), [512] * depth)
        for _ in range(2):
            _step(us, [torch.ones(512, dtype=torch.float64)] * depth, lambda: pool.step(opt))
        peaks[depth] = (pool.host_peak_bytes, pool.bytes)
    assert peaks[2][0] == peaks[8][0] < peaks[8][1] == 4 * peaks[2][1], peaks

    units, inner, swap = _pooled(tmp_path / "small", sizes, disk_bytes=sum(region) - 1)
    with pytest.raises(OSError) as e:
        _step(units, [torch.ones(n, dtype=torch.float64) for n in sizes], lambda: swap.step(inner))
    assert e.value.errno == errno.ENOSPC and f"{sum(region)} bytes needed, {sum(region) - 1} free" in str(e.value)
    assert not (tmp_path / "small" / "nvme").exists() or list((tmp_path / "small" / "nvme").iterdir()) == []
    units, inner, swap = _pooled(tmp_path / "resize", sizes)
    _step(units, [torch.ones(n, dtype=torch.float64) for n in sizes], lambda: swap.step(inner))
    # a step that fails on unit 1 leaves no state a view of a pool buffer (the next reads overwrite them)
    real = inner.step

    def failing():
        if units[1].grad is not None:
            raise RuntimeError("boom")
        real()
    inner.step = failing
    with pytest.raises(RuntimeError, match="boom"):
        _step(units, [torch.ones(n, dtype=torch.float64) for n in sizes], lambda: swap.step(inner))
    held = [v for u in units for v in inner.state[u].values() if v.dim()]
    assert not any(b.data_ptr() <= v.data_ptr() < b.data_ptr() + b.numel() for v in held for b in swap.buffers)
    inner.step = real
    inner.state[units[1]]["momentum"] = torch.zeros(300)  # a state the drive's layout has no place for
    with pytest.raises(RuntimeError, match="states of a 300-element unit are .*'momentum': .300, torch.float32"):
        _step(units, [torch.ones(n, dtype=torch.float64) for n in sizes], lambda: swap.step(inner))


def test_parameter_slices_live_on_the_drive_and_the_next_one_is_read_ahead(tmp_path):
    """In process, ZeRO 3's use of ParamSwap: after `store` no slice holds storage; a step's
    fetches (forward 0..5, backward 5..0, each released once gathered) read back the values
    stored; from the second step on every fetch but two finds its slice already read ahead on
    the I/O thread (the step's first, and the backward's first: the slice the forward's last
    fetch held then), and at most two slices are in memory at once, an evaluation's forwards
    before the second step (training=False) changing neither."""
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g, dtype=torch.float64) for n in (300, 40, 513, 7, 300, 64)]
    slices = [torch.nn.Parameter(torch.zeros(m.numel(), dtype=torch.float32)) for m in masters]
    swap = ParamSwap(OffloadTarget("nvme", str(tmp_path), params=True), slices)
    ahead = []
    submit = swap.io.submit
    swap.io.submit = lambda fn, t: (ahead.append(fn.__name__), submit(fn, t))[1]
    order = [*range(6), *reversed(range(6))]
    for step in range(3):
        swap.store(lambda i, t: t.detach().copy_(masters[i] * (step + 1)))
        assert swap.resident == 0 and all(t.untyped_storage().nbytes() == 0 for t in slices)
        assert list(tmp_path.iterdir()) == []
        for _ in range(2 if step == 1 else 0):  # an evaluation's forwards: read, no guess, no read ahead
            for i in range(6):
                swap.fetch(slices[i], training=False)
                swap.release(slices[i])
        ahead.clear()
        for i in order:
            swap.fetch(slices[i])
            assert torch.equal(slices[i].detach(), (masters[i] * (step + 1)).float()), (step, i)
            swap.release(slices[i])
        assert ahead.count("_read") == (0 if step == 0 else len(order) - 2), (step, ahead)
    assert swap.resident_peak == 2 and swap.bytes == sum(-(-m.numel() * 4 // 4096) * 4096 for m in masters)


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
