"""The cost model's `hardware` group: what its rules cannot say (docs/cost_model.md).

The profile's tables have the shapes the model reads (`check_tables`, entry by entry: the
model, framework/sim/cost/hardware.py, reads them through it), it has a peak for the run's
dtype, and the layout fits the cluster."""

from __future__ import annotations

import math
from typing import Optional

from framework.config import ConfigError, RunConfig



def check_hardware(run: RunConfig) -> None:
    hw = run.hardware
    if hw.name == "none":
        return
    from framework.precision import policy_of

    check_tables(hw)
    dtype = policy_of(run).gemm_dtype
    if dtype not in hw.peak_tflops:
        raise ConfigError("hardware.peak_tflops", dict(hw.peak_tflops), f"has no {dtype} peak, the dtype of "
                          f"trainer.precision={run.trainer.precision}", f"add hardware.peak_tflops.{dtype}, or pick "
                          "another trainer.precision")
    if run.precision.fp8 != "none" and "fp8" not in hw.peak_tflops:
        raise ConfigError("hardware.peak_tflops", dict(hw.peak_tflops), f"has no fp8 peak, and precision.fp8="
                          f"{run.precision.fp8} prices the blocks' linears at it", "add hardware.peak_tflops.fp8 (a "
                          "GPU with FP8 matrix units: H100, H200), or precision.fp8=none")
    if run.world_size > hw.gpus:
        raise ConfigError("hardware.gpus", hw.gpus, f"is fewer than the layout's {run.world_size} ranks "
                          f"(dp {run.parallelism.dp} x tp {run.parallelism.tp} x pp {run.parallelism.pp})",
                          f"set hardware.gpus={run.world_size} or more, or a smaller layout")


DTYPES = ("fp8", "bf16", "fp16", "fp32", "tf32", "fp64")
CURVES = ("all_reduce_s", "reduce_scatter_s", "all_gather_s")  # a link's measured collectives
FIX = "see docs/cost_model.md (the profile's keys), or write it with python -m framework.sim.bench"


def _number(x, low: float = 0.0, strict: bool = True) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (x > low if strict else x >= low)


def gemm_rows(table) -> Optional[list]:
    """A GEMM table as rows: a list of [m, n, k, TFLOP/s], or the bench's text of one row per
    line (a YAML list of a thousand rows takes Hydra seconds to compose; one string does
    not); None when it is neither."""
    if isinstance(table, str):
        try:
            return [[float(x) for x in line.split()] for line in table.strip().splitlines() if line.strip()]
        except ValueError:
            return None
    return list(table) if isinstance(table, (list, tuple)) else None


def check_tables(hw) -> None:
    """The free-form keys of a hardware profile, entry by entry."""
    def bad(key: str, value, problem: str) -> ConfigError:
        return ConfigError(f"hardware.{key}", value, problem, FIX)

    if not hw.peak_tflops:
        raise bad("peak_tflops", {}, "is empty: the model needs the peak of the run's dtype")
    for key, table in (("peak_tflops", hw.peak_tflops), ("memory_bound_GBps", hw.memory_bound_GBps)):
        for name, x in table.items():
            if (key == "peak_tflops" and name not in DTYPES) or not _number(x):
                raise bad(f"{key}.{name}", x, f"is not a positive number{' for a dtype of ' + ', '.join(DTYPES) if key == 'peak_tflops' else ''}")
    for dtype, table in hw.gemm_tflops.items():
        rows = gemm_rows(table)
        if dtype not in DTYPES or not rows or not all(
                isinstance(r, (list, tuple)) and len(r) == 4 and all(_number(v) for v in r) for r in rows):
            raise bad(f"gemm_tflops.{dtype}", table if not isinstance(table, (list, str)) else f"{len(rows or [])} rows",
                      "is not [m, n, k, TFLOP/s] rows of positive numbers (a list of lists, or a text of one row per "
                      f"line) for a dtype of {', '.join(DTYPES)}")
    if hw.gemm_efficiency and (set(hw.gemm_efficiency) != {"max", "half_dim"} or not 0 < hw.gemm_efficiency["max"] <= 1
                               or not _number(hw.gemm_efficiency["half_dim"], strict=False)):
        raise bad("gemm_efficiency", dict(hw.gemm_efficiency), "is not {max: a fraction in (0, 1], half_dim: >= 0}")
    if not hw.gemm_tflops and not hw.gemm_efficiency:
        raise bad("gemm_efficiency", {}, "and hardware.gemm_tflops are both empty: nothing prices a GEMM")
    for row in hw.attention_tflops:
        if not isinstance(row, (list, tuple)) or len(row) != 4 or not all(_number(v) for v in row):
            raise bad("attention_tflops", row, "holds a row that is not [s, head_dim, fwd, fwd+bwd TFLOP/s] of positive numbers")
    for arch, v in hw.host_us.items():
        ok = _number(v, strict=False) if arch == "optimizer_tensor" else (
            isinstance(v, dict) and set(v) == {"F", "B"} and all(_number(x, strict=False) for x in v.values()))
        if not ok:
            raise bad(f"host_us.{arch}", v, "is not {F: us, B: us} per block (or, for optimizer_tensor, us) >= 0")
    for level in ("intra", "inter"):
        link = hw.links.get(level)
        if not isinstance(link, dict) or not {"alpha_us", "GBps"} <= set(link) <= {"alpha_us", "GBps", *CURVES} \
                or not _number(link["GBps"]) or not _number(link["alpha_us"], strict=False):
            raise bad(f"links.{level}", link, "is not {alpha_us: >= 0, GBps: > 0[, all_reduce_s, reduce_scatter_s, "
                      "all_gather_s: {ranks, rows}]}")
        for name in CURVES:
            curve = link.get(name)
            if curve is not None and not (isinstance(curve, dict) and set(curve) == {"ranks", "rows"}
                                          and isinstance(curve["ranks"], int) and curve["ranks"] >= 2
                                          and isinstance(curve["rows"], list) and len(curve["rows"]) >= 2
                                          and all(isinstance(r, list) and len(r) == 2 and _number(r[0])
                                                  and _number(r[1]) for r in curve["rows"])):
                raise bad(f"links.{level}.{name}", curve, "is not {ranks: >= 2, rows: [[bytes > 0, seconds > 0], ...]} "
                          "(two rows or more)")
    unknown = sorted(set(hw.links) - {"intra", "inter"})
    if unknown:
        raise bad("links", dict(hw.links), f"has unknown levels {unknown}: only intra (within a node) and inter")

