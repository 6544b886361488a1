"""A device's hardware profile (conf/hardware/*.yaml) and the time of one op on it.

A profile is either measured (`python -m framework.sim.bench`: tables) or written from a
datasheet (efficiencies), or both; the keys (docs/cost_model.md):
- `peak_tflops[dtype]`: the datasheet peak (MFU's denominator).
- `gemm_tflops[dtype]`: measured [m, n, k, TFLOP/s] rows over a grid (a list of lists, or
  a text of one row per line, as the bench writes it). A GEMM's throughput
  is interpolated in log2(m), log2(n), log2(k) (trilinear, in log throughput) and clamped
  at the grid's edges; a grid point the bench left out (too large) takes the best of its
  smaller neighbours (a larger GEMM is never slower per FLOP). Without a table:
  `gemm_efficiency: {max, half_dim}`: peak x max x prod over m, n, k of d / (d + half_dim).
- `memory_GBps` (sustained copy), `memory_bound_GBps[op]` (per op, where measured),
  `kernel_us`: every kernel lasts at least this (launch or dispatch).
- `attention_tflops`: measured [s, head_dim, fwd, fwd+bwd TFLOP/s] rows (causal FLOPs),
  interpolated in log2(s) at the nearest head_dim; else `attention_efficiency` x peak.
- `links`: {intra, inter}: {alpha_us, GBps[, all_reduce_s, reduce_scatter_s, all_gather_s]},
  framework/sim/cost/collectives.py.
- `host_us`: per block and pass of each architecture ({F, B}) and per optimizer tensor, the
  launch / dispatch path (measured where compute is negligible); `host_overlaps`: true on a
  GPU (a pass takes the larger of host and kernel time), false on a CPU (they add).
- `gpus_per_node`, `gpus`, `memory_gib`: placement and the fit of memory.
- the host side: `host_link_GBps` (PCIe, one way per GPU), `host_adamw_GBps` (the host's
  optimizer step per GPU), `host_memory_gib`, `nvme_read_GBps`, `nvme_write_GBps`, `nvme_gib`
  (per node): ZeRO-Offload's price (price.py) and ZeRO-Infinity's capacities (capacity.py).
Every time is max(work / rate, kernel_us) per kernel: a roofline with a launch floor, no
overlap of kernels (what is not modelled: docs/cost_model.md).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional

from framework.sim.cost.ops import CostOp
from framework.validate.hardware import check_tables, gemm_rows

@dataclass
class Link:
    alpha_us: float  # per message (or per ring step)
    GBps: float  # per GPU, one direction: the bandwidth a ring's step moves at
    # measured (python -m framework.sim.bench --links N): {ranks, rows: [[bytes, seconds]]} of an
    # all-reduce over `ranks` local ranks; where given, collectives over that many ranks read
    # it (collectives.py) instead of alpha-beta; a reduce-scatter or an all-gather reads its
    # own curve where the bench measured one (bytes: the whole buffer)
    all_reduce_s: Optional[dict] = None
    reduce_scatter_s: Optional[dict] = None
    all_gather_s: Optional[dict] = None

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        return steps * self.alpha_us * 1e-6 + nbytes / (self.GBps * 1e9)


@dataclass
class Profile:
    name: str
    peak_tflops: dict
    memory_GBps: float
    kernel_us: float
    gpus_per_node: int = 8
    gpus: int = 8
    memory_gib: float = 80.0
    source: str = ""
    gemm_tflops: dict = field(default_factory=dict)
    gemm_efficiency: dict = field(default_factory=dict)
    memory_bound_GBps: dict = field(default_factory=dict)
    attention_tflops: list = field(default_factory=list)
    attention_efficiency: float = 0.5
    links: dict = field(default_factory=dict)  # "intra" | "inter" -> Link
    host_us: dict = field(default_factory=dict)  # arch -> {F, B} per block; optimizer_tensor
    host_overlaps: bool = True  # a GPU: the launch path runs ahead of the kernels
    # the host side (None: not in the profile): ZeRO-Offload's transfers and host step, and the
    # capacities ZeRO-Infinity plans with (capacity.py)
    host_link_GBps: Optional[float] = None  # GPU <-> host, one way, per GPU
    host_adamw_GBps: Optional[float] = None  # the host's optimizer step per GPU (bytes read + written / s)
    host_memory_gib: Optional[float] = None  # per node
    nvme_read_GBps: Optional[float] = None  # per node
    nvme_write_GBps: Optional[float] = None
    nvme_gib: Optional[float] = None

    def __post_init__(self):
        self._grids = {d: _Grid(gemm_rows(rows)) for d, rows in self.gemm_tflops.items() if rows}
        self.links = {k: v if isinstance(v, Link) else Link(**v) for k, v in self.links.items()}

    @staticmethod
    def from_dict(d: dict) -> Profile:
        known = set(Profile.__dataclass_fields__)
        return Profile(**{k: v for k, v in d.items() if k in known})

    @staticmethod
    def of(hw) -> Profile:
        """A run's `hardware` group (config.HardwareConfig), its tables' shapes checked: a
        ConfigError naming the key and the entry at fault."""
        check_tables(hw)
        return Profile.from_dict({k: getattr(hw, k) for k in Profile.__dataclass_fields__ if hasattr(hw, k)})

    def peak(self, dtype: str) -> float:
        """FLOP/s."""
        return self.peak_tflops[dtype] * 1e12

    def gemm_rate(self, m: float, n: float, k: float, dtype: str) -> float:
        """FLOP/s of one (m, n, k) GEMM. An fp8 GEMM with no fp8 table: the bf16 table's
        fraction of its peak at this shape, of the fp8 peak (until the bench measures one)."""
        if dtype in self._grids:
            return self._grids[dtype].rate(m, n, k) * 1e12
        if dtype == "fp8" and "bf16" in self._grids:
            return self._grids["bf16"].rate(m, n, k) * 1e12 * self.peak("fp8") / self.peak("bf16")
        eff = self.gemm_efficiency or {"max": 0.75, "half_dim": 128}
        half = eff["half_dim"]
        return self.peak(dtype) * eff["max"] * math.prod(d / (d + half) for d in (m, n, k))

    def attention_rate(self, s: float, d: float, backward: bool, dtype: str) -> float:
        rows = self.attention_tflops
        if not rows:
            return self.peak(dtype) * self.attention_efficiency
        near = min({r[1] for r in rows}, key=lambda x: abs(math.log2(x) - math.log2(max(d, 1))))
        # a row's fwd+bwd rate counts 3.5x the forward's FLOPs: the backward alone (2.5x) took
        # that time minus the forward's
        pts = sorted((r[0], 2.5 / (3.5 / r[3] - 1 / r[2]) if backward else r[2]) for r in rows if r[1] == near)
        return _interp1([p[0] for p in pts], [p[1] for p in pts], s) * 1e12

    def op_seconds(self, op: CostOp, dtype: str) -> float:
        floor = self.kernel_us * 1e-6
        if op.kind == "gemm":
            m, n, k = op.shape
            return op.count * max(op.flops / self.gemm_rate(m, n, k, op.dtype or dtype), floor)
        if op.kind == "attention":
            _, s, d = op.shape
            return max(op.flops / self.attention_rate(s, d, op.phase != "F", dtype), floor)
        if op.fused:  # one generated kernel: the copy rate (eager's per-op rates include its extra kernels)
            return op.count * max(op.bytes / (self.memory_GBps * 1e9), floor)
        table = self.memory_bound_GBps  # a backward's own rate where the bench measured one
        rate = table.get(f"{op.name}_backward" if op.phase != "F" else op.name, table.get(op.name, self.memory_GBps)) * 1e9
        return op.count * max(op.bytes / rate, floor)

    def seconds(self, ops: list[CostOp], dtype: str, phases: Optional[str] = None) -> float:
        return sum(self.op_seconds(o, dtype) for o in ops if phases is None or o.phase in phases)


def _interp1(xs: list, ys: list, x: float) -> float:
    """Linear in log2(x), clamped at the ends."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    f = (math.log2(x) - math.log2(xs[i])) / (math.log2(xs[i + 1]) - math.log2(xs[i]))
    return ys[i] + f * (ys[i + 1] - ys[i])


class _Grid:
    """A measured GEMM table: log throughput on the (m, n, k) grid, completed upward."""

    def __init__(self, rows: list):
        self.axes = [sorted({r[i] for r in rows}) for i in range(3)]
        got = {(r[0], r[1], r[2]): math.log(max(r[3], 1e-9)) for r in rows}
        self.val = {}
        for m in self.axes[0]:
            for n in self.axes[1]:
                for k in self.axes[2]:
                    if (m, n, k) in got:
                        self.val[(m, n, k)] = got[(m, n, k)]
                        continue
                    lower = [self.val.get(p) for p in self._below(m, n, k)]
                    lower = [v for v in lower if v is not None]
                    self.val[(m, n, k)] = max(lower) if lower else min(got.values())

    def _below(self, m, n, k):
        ax = self.axes
        for i, x in enumerate((m, n, k)):
            j = ax[i].index(x)
            if j:
                p = [m, n, k]
                p[i] = ax[i][j - 1]
                yield tuple(p)

    def rate(self, m: float, n: float, k: float) -> float:
        """TFLOP/s."""
        corners = []
        for i, x in enumerate((m, n, k)):
            ax = self.axes[i]
            x = min(max(x, ax[0]), ax[-1])
            j = min(bisect.bisect_right(ax, x) - 1, len(ax) - 2) if len(ax) > 1 else 0
            lo, hi = ax[j], ax[min(j + 1, len(ax) - 1)]
            f = 0.0 if hi == lo else (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            corners.append(((lo, 1 - f), (hi, f)))
        total = 0.0
        for a, wa in corners[0]:
            for b, wb in corners[1]:
                for c, wc in corners[2]:
                    total += wa * wb * wc * self.val[(a, b, c)]
        return math.exp(total)
