"""Memory accounting per rank: exact tensor bytes plus process / allocator statistics.

- Model states (parameters, gradients, optimizer states): bytes of the tensors themselves,
  each storage counted once (tied weights, DDP's bucket views of gradients).
- Saved activations: `ActivationTracker` wraps each micro-batch's forward in
  `torch.autograd.graph.saved_tensors_hooks`. The hook sees every tensor autograd saves,
  weights included, so parameter storages are excluded and the rest deduplicated by
  storage. Storages are keyed by address, so the parameters are learnt (`set_params`) only
  once a rank's parameters are final: pipeline stages have freed what they do not own and
  ZeRO has moved them into flat buffers. A key taken earlier could name freed memory that
  a later activation reuses, which would be skipped as a weight (measured 4.5 % low on a
  pipeline stage). A micro-batch's saved tensors live from its forward until its
  backward; the peak is the largest sum over micro-batches alive at once (1 for gradient
  accumulation, more for pipeline schedules). Only the innermost saved-tensor hook runs,
  so with activation checkpointing this counts what checkpointing keeps, which is the point.
- Peak RSS from getrusage (whole process, includes the Python runtime and libraries);
  on CUDA also the caching allocator's max allocated / reserved.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from typing import Optional

import torch
from torch import nn


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (s.device.type, s.data_ptr()), s.nbytes()


def _storage_keys(t: torch.Tensor) -> list:
    """(key, bytes) of the storages holding `t`: its own, or a wrapper subclass's inner
    tensors' (torchao's FP8 tensors: data and scale), which have no storage of their own."""
    try:
        return [_storage_key(t)]
    except (RuntimeError, NotImplementedError):
        if not hasattr(t, "__tensor_flatten__"):
            raise
        return [k for name in t.__tensor_flatten__()[0] for k in _storage_keys(getattr(t, name))]


def _weight_keys(tensors) -> set:
    """Storage keys of weights that hold memory now. A freed storage (ZeRO-3's resized-away
    buffer, a pipeline stage's dropped parameter) has no address worth remembering."""
    return {key for t in tensors for key, nbytes in _storage_keys(t) if nbytes > 0}


def tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        seen.update(_storage_keys(t))
    return sum(seen.values())


def memory_summary(ranks: list[dict]) -> dict:
    """summary.json's memory keys: the largest rank's value of each."""
    keys = ("weight_version_bytes", "p2p_buffer_peak_bytes", "model_state_bytes", "model_state_formula_bytes",
            "model_state_formula_bf16_bytes", "model_state_formula_paper_bytes", "zero_transient_peak_bytes",
            "activation_peak_bytes", "master_bytes")
    out = {f"{k}_max": max(r[k] for r in ranks) for k in keys}
    out["memory_peak_bytes"] = max(r["memory_peak_bytes"] for r in ranks)
    if "compile_s" in ranks[0]:  # trainer.compile: the slowest rank's compile seconds (not a memory key, gathered here)
        out["compile_s"] = max(r["compile_s"] for r in ranks)
    return out


def master_bytes(optimizer) -> int:
    """The optimizer's own copy of the parameters (framework/optim/master.py), 0 when it has none."""
    return tensor_bytes(getattr(optimizer, "master", []))


def held_states(optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in memory: all of them, but those ZeRO-Infinity's NVMe tier
    keeps on the drive (views of its file, framework/optim/swap.py), as an offloaded
    parameter slice counts 0 bytes (its storage dropped)."""
    swap = getattr(optimizer, "swap", None)
    return [v for st in optimizer.state.values() for v in st.values()
            if isinstance(v, torch.Tensor) and not (swap is not None and swap.holds(v))]


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    opt_tensors = held_states(optimizer)
    return {
        "params_bytes": tensor_bytes(params),
        "grads_bytes": tensor_bytes(p.grad for p in params),
        "optimizer_bytes": tensor_bytes(opt_tensors),
    }


class ActivationTracker:
    """Peak bytes of tensors saved for backward, over micro-batches alive at once.

    A saved tensor is a weight, not an activation, when its storage key is in one of two
    sets: `_param_keys`, this rank's parameters as `set_params` last saw them, and
    `_extra_keys`, weights that come and go (ZeRO-3's gathered units, the weight snapshots
    of asynchronous schedules) through `exclude` / `include_again`. Every key must name
    live memory: storages are keyed by address, and a freed address is soon an activation's."""

    def __init__(self, model: Optional[nn.Module] = None):
        self._param_keys: set = set()
        self._extra_keys: set = set()
        self._live: dict[object, dict] = {}
        self.peak_bytes = 0
        # off: forward() installs no hook (metrics.activations=sampled turns it off between
        # the steps it records: a Python call per saved tensor is not free)
        self.enabled = True
        self.steps_recorded = 0  # steps run with it on (the trainer counts them)
        if model is not None:
            self.set_params(model.parameters())

    def set_params(self, tensors) -> None:
        """REPLACES the parameter storages; call once the rank's parameters are final (the
        runners do, after building stages and ZeRO). `exclude`'s weights are kept."""
        self._param_keys = _weight_keys(tensors)

    @contextlib.contextmanager
    def forward(self, microbatch_id):
        if not self.enabled:
            yield
            return
        saved = self._live.setdefault(microbatch_id, {})

        def pack(t: torch.Tensor):
            try:
                key, nbytes = _storage_key(t)
            except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses with no storage
                return t
            if key not in self._param_keys and key not in self._extra_keys:
                saved[key] = nbytes
            # The graph keeps what pack returns. `t` itself, when it is the op's output, points
            # back at the node holding it: a cycle through C++ that Python's collector cannot
            # see, freed only when a backward releases the graph. A split backward keeps the
            # graph (retain_graph) past I and W, so it leaked every micro-batch; a detached
            # alias shares the storage (same bytes, same key) without the reference.
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def exclude(self, tensors) -> None:
        """More weights (e.g. the weight snapshots of asynchronous schedules): not activations.
        Whoever frees them later must call `include_again` first."""
        self._extra_keys.update(_weight_keys(tensors))

    def include_again(self, tensors) -> None:
        """Those weights are about to be freed: their storage may come back as an activation.
        Forgotten from both sets, so no stale key outlives the memory it named."""
        keys = _weight_keys(tensors)
        self._extra_keys.difference_update(keys)
        self._param_keys.difference_update(keys)

    def live_bytes(self) -> int:
        keys = {}
        for saved in list(self._live.values()):  # a copy: a pair's B thread may pop meanwhile
            keys.update(saved)
        return sum(keys.values())

    def backward_done(self, microbatch_id) -> None:
        self._live.pop(microbatch_id, None)


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc; elsewhere the peak so far, an upper bound)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def fragmentation_bytes(device: torch.device) -> Optional[int]:
    """CUDA: what the caching allocator holds but no tensor uses, reserved minus allocated
    (ZeRO-R's memory fragmentation, MD), now; the allocator's own counters, no device sync.
    None elsewhere (a CPU run has no caching allocator to ask)."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fragmentation_row(per_rank: list) -> dict:
    """metrics.jsonl's `fragmentation_bytes` (the most over ranks) and each rank's; {} off CUDA."""
    if per_rank[0] is None:
        return {}
    return {"fragmentation_bytes": max(per_rank), "rank_fragmentation_bytes": per_rank}


def device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}


class RssSampler:
    """The highest resident memory of this process over a window (a save, a load), sampled
    every `interval_s` from /proc by a thread: getrusage's peak cannot be reset, and resetting
    /proc's VmHWM would corrupt the run's rss_peak_bytes. A spike shorter than the interval
    can be missed; the window's start and end are sampled exactly."""

    def __init__(self, interval_s: float = 0.02):
        import threading

        self.interval_s, self.peak = interval_s, current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, current_rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())
        return self.peak
