"""The per-rank peak FLOP/s that MFU divides by, and where it came from.

Resolution (first match wins), reported as `peak_source`:
  none    trainer.precision=fp64: a verification mode, no tensor-core peak exists, no MFU
  config  metrics.peak_tflops
  table   device cuda: the accelerator's DENSE datasheet peak (below), looked up inside
          each rank, so the launching process never creates a CUDA context
  probe   device cpu, or a GPU missing from the table: the best sustained matmul of
          framework.metrics.flops.probe_peak_flops, measured once per (machine, device,
          thread count, dtype, torch version) and cached in
          $XDG_CACHE_HOME/framework/peak_flops.json (default ~/.cache/framework), so every
          job of a sweep on one machine divides by the same number

The dtype column (framework/precision.py's `peak_column`): bf16-autocast and bf16-mixed use
the BF16 tensor-core peak, fp16-mixed the FP16 one. fp32 runs use the TF32 peak
only when fp32 matmuls may run on TF32 tensor cores in the rank
(torch.get_float32_matmul_precision() != "highest"); by default PyTorch keeps them in
full fp32, and the framework does not change that, so fp32 runs use the plain FP32 peak.

Datasheet figures are the DENSE ones: NVIDIA prints tensor-core peaks "with sparsity"
(2:4 structured), twice the dense rate; the values here are halved where needed.
  A100 (SXM4 and PCIe, 40/80 GB)  https://www.nvidia.com/en-us/data-center/a100/
  H100 SXM / PCIe / NVL           https://www.nvidia.com/en-us/data-center/h100/
  H200 SXM / NVL                  https://www.nvidia.com/en-us/data-center/h200/
  B200 (HGX B200, per GPU)        https://www.nvidia.com/en-us/data-center/hgx/
  L4                              https://www.nvidia.com/en-us/data-center/l4/
  L40S                            https://www.nvidia.com/en-us/data-center/l40s/
  A10                             https://www.nvidia.com/en-us/data-center/products/a10-gpu/
The matching follows torchtitan's `get_peak_flops` (torchtitan/tools/utils.py): the name
from torch.cuda.get_device_name, the form factor from "PCIe" / "NVL" in it, SXM otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import socket
import warnings
from typing import Optional

import torch

from framework.metrics.flops import probe_peak_flops
from framework.precision import policy_of

PENDING = "pending"  # source while a CUDA run's ranks have yet to look the peak up

# Dense TFLOP/s per GPU: (bf16 tensor core, fp16 tensor core, tf32 tensor core, fp32 CUDA cores). The
# datasheets print the same bf16 and fp16 tensor-core figure for every GPU listed.
DENSE_TFLOPS: dict[str, tuple[float, float, float, float]] = {
    "A100 SXM": (312.0, 312.0, 156.0, 19.5),
    "A100 PCIe": (312.0, 312.0, 156.0, 19.5),
    "H100 SXM": (989.5, 989.5, 494.5, 67.0),
    "H100 PCIe": (756.5, 756.5, 378.0, 51.0),
    "H100 NVL": (835.5, 835.5, 417.5, 60.0),
    "H200 SXM": (989.5, 989.5, 494.5, 67.0),
    "H200 NVL": (835.5, 835.5, 417.5, 60.0),
    "B200 SXM": (2250.0, 2250.0, 1125.0, 75.0),  # HGX B200: 36 / 18 PFLOPS with sparsity over 8 GPUs
    "L40S": (362.05, 362.05, 183.0, 91.6),
    "L4": (121.0, 121.0, 60.0, 30.3),
    "A10": (125.0, 125.0, 62.5, 31.2),
}
DTYPE_COLUMN = {"bf16": 0, "fp16": 1, "tf32": 2, "fp32": 3}
# Whole name tokens, not substrings: "A10" is in "A100" and "L4" in "L40S".
MODELS = ("A100", "H100", "H200", "B200", "L40S", "L4", "A10")


def accelerator(device_name: str) -> Optional[str]:
    """The table row for a torch.cuda.get_device_name string, or None when unknown.

    "NVIDIA H100 80GB HBM3" -> "H100 SXM", "NVIDIA A100-PCIE-40GB" -> "A100 PCIe".
    """
    tokens = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    model = next((m for m in MODELS if m in tokens), None)
    if model is None:
        return None
    form = "PCIe" if "PCIE" in tokens else "NVL" if "NVL" in tokens else "SXM"
    for row in (f"{model} {form}", model):
        if row in DENSE_TFLOPS:
            return row
    return None


def table_peak(device_name: str, dtype: str) -> Optional[float]:
    """Dense datasheet FLOP/s of the named GPU for dtype "bf16" | "fp16" | "tf32" | "fp32"."""
    row = accelerator(device_name)
    return None if row is None else DENSE_TFLOPS[row][DTYPE_COLUMN[dtype]] * 1e12


def peak_dtype(precision: str) -> str:
    """Which datasheet column a run's matmuls use (see the module docstring)."""
    column = policy_of(precision).peak_column
    if column in ("bf16", "fp16"):
        return column
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def fixed_peak(run) -> Optional[tuple[Optional[float], str]]:
    """The peak that needs no device: none for fp64, or the configured one; else None."""
    if policy_of(run).peak_column is None:  # fp64
        return None, "none"
    if run.metrics.peak_tflops:
        return run.metrics.peak_tflops * 1e12, "config"
    return None


def device_peak(precision: str, device: torch.device) -> tuple[float, str]:
    """The datasheet peak of a known GPU, else the cached probe of this device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, peak_dtype(precision))
        if peak is not None:
            return peak, "table"
        warnings.warn(f"no datasheet peak for GPU {name!r} (framework/metrics/peak.py): MFU divides by a "
                      "measured matmul peak instead; set metrics.peak_tflops to compare with other machines",
                      stacklevel=2)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(policy_of(precision).peak_column, torch.float32)
    peak = cached_probe(device, dtype)
    if dtype != torch.float32:
        fp32 = cached_probe(device, torch.float32)
        if peak < NO_MATRIX_UNIT * fp32:  # e.g. fp16 on a CPU: emulated, so MFU against it means nothing
            return None, no_matrix_unit_source(dtype, peak, fp32, device)
    return peak, "probe"


# A probed low-precision peak under this share of the same device's fp32 one: the device has
# no matrix unit for that dtype (a CPU's fp16 runs emulated, ~0.001 TFLOP/s against fp32's
# ~0.09 on this project's machine), so an MFU against it would read hundreds of percent.
NO_MATRIX_UNIT = 0.25
NO_UNIT = "no matrix unit"


def no_matrix_unit_source(dtype, peak: float, fp32: float, device) -> str:
    """peak_source for such a run: MFU is n/a, and the banner says why (once)."""
    name = str(dtype).removeprefix("torch.")
    return (f"{NO_UNIT}: {name} matmuls run at {peak / 1e12:.3f} TFLOP/s on this {device.type}, under "
            f"{NO_MATRIX_UNIT:.0%} of fp32's {fp32 / 1e12:.3f}; MFU n/a")


def resolve_peak(run, device: torch.device) -> tuple[Optional[float], str]:
    """Peak FLOP/s per rank and its source, on the device the rank trains on."""
    return fixed_peak(run) or device_peak(run.trainer.precision, device)


def resolve_rank_peak(run, info, device: torch.device, announce: bool = False):
    """In a rank: the RunInfo with its pending (CUDA) peak looked up on this rank's GPU.

    The launching process resolves config, fp64 and CPU peaks itself; only "pending" is
    left to the ranks. Each rank resolves its own; the logging rank's is the one reported.
    """
    if info.peak_source != PENDING:
        return info
    peak, source = resolve_peak(run, device)
    if announce:
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        print(f"WARNING: no MFU ({source}: {what})" if peak is None else f"peak {peak / 1e12:.1f} TFLOP/s per rank "
              f"({source}: {what}, {peak_dtype(run.trainer.precision)})", flush=True)
    return dataclasses.replace(info, peak_flops_per_rank=peak, peak_source=source)


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "framework", "peak_flops.json")


def probe_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a probe's result depends on: machine, device model, threads, dtype, torch."""
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = platform.processor() or platform.machine()
    return (f"{socket.gethostname()} | {device.type}: {hardware} | threads {torch.get_num_threads()} | "
            f"{str(dtype).removeprefix('torch.')} | torch {torch.__version__}")


def cached_probe(device: torch.device, dtype: torch.dtype) -> float:
    """probe_peak_flops, run once per probe_key and remembered in cache_path()."""
    path, key = cache_path(), probe_key(device, dtype)
    cache = _read_cache(path)
    if key not in cache:
        value = probe_peak_flops(device, dtype)
        cache = _read_cache(path)  # another job may have probed meanwhile: keep its value
        if key not in cache:
            cache[key] = value
            _write_atomic(path, cache)
        cache = _read_cache(path)  # two jobs that probed at once: both use what the file kept
        return cache.get(key, value)
    return cache[key]


def _read_cache(path: str) -> dict:
    """The cached probes; a file that is unreadable, not JSON or not an object of positive
    finite numbers counts as empty (probed again and rewritten), never as a result."""
    try:
        with open(path, "rb") as f:
            cache = json.loads(f.read(1 << 20))  # a few hundred bytes per key; more is not this file
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(cache, dict):
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0}


def _write_atomic(path: str, data: dict) -> None:
    """tmp + os.replace: a concurrent reader sees the old file or the new one, never half."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
