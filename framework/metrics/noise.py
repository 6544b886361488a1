"""How much a run's numbers can be trusted: its step-time spread and the machine's load.

Per step, each rank records its own CPU time (`time.process_time`: every thread of the
process, gloo's included) and rank 0 the busy CPU time of its whole node (/proc/stat: all
CPUs, user + nice + system + irq + softirq + steal), with the node's CPU count. The row's
`other_cpu_share` is what the rest of the node used: (node busy - the CPU time of this
job's ranks on rank 0's node) / (step time x CPUs), clamped to [0, 1]; the job's launcher
and data workers count as other. Multi-node runs see rank 0's node only. Not on Linux: None.
On CUDA the node's CPUs are read the same way; other processes on rank 0's GPU are counted
where pynvml answers (`gpu_other_processes`, None where it cannot be known).

summary.json (over the measured steps; metrics.md):
  step_time_p10_s, step_time_p50_s, step_time_p90_s   the slowest rank's step time's percentiles
  step_time_cv        standard deviation / mean of those step times
  other_cpu_share     median over the steps of the row's share
  noisy               "" or the reasons, e.g. "spread: cv 0.41 > 0.10; load: other processes
                      used 48% of the CPUs > 10%"
The thresholds (`SPREAD_CV`, `OTHER_LOAD`): on this project's 2-vCPU machine quiet runs show
a cv of 0.02-0.05; one rank beside a busy loop shows other_cpu_share about 0.5.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Optional

SPREAD_CV = 0.10  # step-time cv above this: the steps were not alike
OTHER_LOAD = 0.10  # other processes' share of the node's CPU time above this


def node_busy_s() -> Optional[float]:
    """Busy CPU seconds of the whole node since boot (all CPUs), None where unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuClock:
    """A rank's CPU marks around a step: `start()` then `take()` -> StepRecord fields."""

    def __init__(self, with_node: bool):
        self.with_node, self.host = with_node, socket.gethostname()
        self.cpus = os.cpu_count() or 1
        self._cpu = self._node = None

    def start(self) -> None:
        self._cpu, self._node = time.process_time(), node_busy_s() if self.with_node else None

    def take(self) -> dict:
        node = node_busy_s() if self.with_node and self._node is not None else None
        return {"cpu_s": time.process_time() - self._cpu, "host": self.host, "cpus": self.cpus,
                "node_busy_s": None if node is None else node - self._node}


def other_cpu_share(per_rank: list, step_time_s: float) -> Optional[float]:
    """The row's share of rank 0's node used by other processes (module docstring)."""
    r0 = per_rank[0]
    if r0.node_busy_s is None or step_time_s <= 0:
        return None
    mine = sum(r.cpu_s for r in per_rank if r.host == r0.host)
    return min(1.0, max(0.0, (r0.node_busy_s - mine) / (step_time_s * r0.cpus)))


def summary(rows: list[dict]) -> dict:
    """summary.json's spread and load keys over the measured steps' rows, and the flag."""
    times = sorted(r["step_time_s"] for r in rows)
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if len(times) > 1 and mean > 0 else 0.0
    loads = [r["other_cpu_share"] for r in rows if r.get("other_cpu_share") is not None]
    load = statistics.median(loads) if loads else None
    why = []
    if cv > SPREAD_CV:
        why.append(f"spread: cv {cv:.2f} > {SPREAD_CV:.2f}")
    if load is not None and load > OTHER_LOAD:
        why.append(f"load: other processes used {load:.0%} of the CPUs > {OTHER_LOAD:.0%}")
    return {"step_time_p10_s": _percentile(times, 0.1), "step_time_p50_s": statistics.median(times),
            "step_time_p90_s": _percentile(times, 0.9), "step_time_cv": cv, "other_cpu_share": load,
            "noisy": "; ".join(why)}


def with_gpu(summary_: dict, others: Optional[int]) -> None:
    """summary.json's `gpu_other_processes` (None: unknown), a reason in `noisy` when > 0."""
    summary_["gpu_other_processes"] = others
    if others:
        why = f"gpu: {others} other process(es) on rank 0's GPU"
        summary_["noisy"] = f"{summary_['noisy']}; {why}" if summary_["noisy"] else why


def line(summary_: dict) -> list[str]:
    """The console's spread and load line, and a warning when the run is flagged."""
    ms = [summary_[f"step_time_p{q}_s"] * 1e3 for q in (10, 50, 90)]
    load = summary_.get("other_cpu_share")
    out = [f"spread of the step time: p10 / p50 / p90 {ms[0]:.1f} / {ms[1]:.1f} / {ms[2]:.1f} ms (cv {summary_['step_time_cv']:.0%})"
           f" | other processes used {'n/a' if load is None else format(load, '.0%')} of the CPUs"]
    if summary_.get("noisy"):
        out.append(f"WARNING: noisy measurement ({summary_['noisy']}): compare this run's speed only side by side "
                   "with repeats, or rerun it on a quiet machine")
    return out


def warnings(done: list[dict]) -> list[str]:
    """The sweep report's lines: each completed job whose measurement was flagged."""
    return [f"WARNING: job {r['job']} ({r.get('overrides') or 'defaults'}) measured with noise ({r['noisy']}): "
            "its speed does not compare with the others'. Fix: rerun it on a quiet machine"
            + ("" if "sweep.repeats=" in (r.get("overrides") or "") else ", or run the sweep with sweep.repeats=3")
            for r in done if r.get("noisy")]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    x = q * (len(sorted_values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def gpu_other_processes(device, own_pids: set) -> Optional[int]:
    """Processes on rank 0's GPU that are not this job's ranks (pynvml), None where unknown."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:  # no pynvml, no driver access: unknown, never a failed run
        return None
    return len(pids - own_pids)


def median_or_none(values: list) -> Optional[float]:
    """None when the metric is undefined for the run (tflops / mfu under fp64)."""
    return None if None in values else statistics.median(values)
