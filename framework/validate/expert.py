"""Expert parallelism's keys (`parallelism.ep`, framework/parallel/expert_parallel.py), checked
before any rank starts: what it needs and what it does not compose with, each with the fix."""

from __future__ import annotations

from ..config import ConfigError, RunConfig
from ..parallel.pipeline.schedules import never_flushes
from .common import positive


def check_expert_parallel(run: RunConfig) -> None:
    p, m = run.parallelism, run.model
    positive("parallelism.ep", p.ep)
    if m.arch == "qwen3_moe" and p.tp > 1 and p.zero and p.zero_impl == "fsdp2":
        raise ConfigError("parallelism.zero_impl", p.zero_impl, "Qwen3's per-head q / k norms are partial over tp "
                          "and their gradients are summed over tp on plain tensors, not FSDP2's DTensors",
                          "use parallelism.zero_impl=ours with model.arch=qwen3_moe and tp > 1")
    if p.ep == 1:
        return
    if m.arch != "qwen3_moe":
        raise ConfigError("parallelism.ep", p.ep, f"splits routed experts, and model.arch={m.arch} has none",
                          "use parallelism.ep=1, or a MoE model (e.g. model=moe-tiny)")
    if p.dp is not None and p.dp % p.ep:
        raise ConfigError("parallelism.ep", p.ep, f"is carved out of dp and must divide parallelism.dp={p.dp}",
                          f"use a divisor of dp, e.g. parallelism.ep={_divisor(p.dp, p.ep)}")
    if m.moe.experts % p.ep:
        raise ConfigError("parallelism.ep", p.ep, f"must divide model.moe.experts={m.moe.experts} "
                          "(each ep rank holds experts / ep of every MoE layer)",
                          f"use parallelism.ep={_divisor(m.moe.experts, p.ep)} or more experts")
    if p.zero and p.zero_impl == "fsdp2":
        raise ConfigError("parallelism.zero_impl", p.zero_impl, "FSDP2 shards every parameter over dp; "
                          "expert parallel experts must be sharded over their replicas (expert dp)",
                          "use parallelism.zero_impl=ours with parallelism.ep > 1")
    if p.pp > 1 and never_flushes(run.schedule):
        raise ConfigError("schedule.name", run.schedule.name, "asynchronous schedules update each stage alone "
                          "with dp = 1, and ep > 1 needs dp > 1", "use a flushing schedule with parallelism.ep > 1")


def _divisor(n: int, near: int) -> int:
    return max(d for d in range(1, max(1, min(n, near)) + 1) if n % d == 0)
