"""Mixture-of-Experts keys (`model.moe.*`: the experts and their routing, framework/models/
moe_routing.py) and expert parallelism's (`parallelism.ep`, framework/parallel/
expert_parallel.py), checked before any rank starts, each failure with the fix."""

from __future__ import annotations

import math

from framework.config import ConfigError, RunConfig
from framework.schedules import never_flushes
from framework.models.moe_routing import AUX_LOSSES, DROP_POLICIES, SCORES
from framework.validate.common import number, positive


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
    if p.dp is not None and p.replicas % p.ep:
        raise ConfigError("parallelism.ep", p.ep, f"is carved out of dp and must divide parallelism.dp={p.dp}"
                          + (f" x parallelism.cp={p.cp} (the replicas)" if p.cp > 1 else ""),
                          f"use a divisor of it, e.g. parallelism.ep={_divisor(p.replicas, p.ep)}")
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


def _async_bias(run: RunConfig) -> None:
    """PipeDream's weight stashing keeps a micro-batch's weights from forward to backward, not
    the expert biases, which move every step: a recomputed forward (activation checkpointing)
    or any reader of the bias in backward would route with a newer one."""
    p, e = run.parallelism, run.model.moe
    if e.bias_update_rate > 0 and p.pp > 1 and never_flushes(run.schedule):
        raise ConfigError("model.moe.bias_update_rate", e.bias_update_rate,
                          f"schedule={run.schedule.name} is asynchronous: a micro-batch's forward and backward fall "
                          "in different steps, and its stashed weights do not include the expert biases",
                          "use a flushing schedule, or model.moe.bias_update_rate=0 (aux losses work with 1f1b / 2bw)")


def _divisor(n: int, near: int) -> int:
    return max(d for d in range(1, max(1, min(n, near)) + 1) if n % d == 0)


def check_moe(run: RunConfig) -> None:
    e = run.model.moe
    positive("model.moe.experts", e.experts)
    if not 1 <= e.top_k <= e.experts:
        raise ConfigError("model.moe.top_k", e.top_k, f"must lie in [1, model.moe.experts={e.experts}]",
                          "e.g. model.moe.top_k=2")
    if e.expert_inner is not None:
        positive("model.moe.expert_inner", e.expert_inner)
    _moe_routing(e)
    _experts_impl(run)
    _async_bias(run)


def _moe_routing(e) -> None:
    """The routing keys (framework/models/moe_routing.py); an inf capacity is dropless, so allowed."""
    for key, value, allowed in (("score", e.score, SCORES), ("drop_policy", e.drop_policy, DROP_POLICIES)):
        if value not in allowed:
            raise ConfigError(f"model.moe.{key}", value, f"must be {' or '.join(allowed)}",
                              f"e.g. model.moe.{key}={allowed[0]} (docs/moe.md, Routing and balancing)")
    if e.capacity_factor is not None and e.capacity_factor != math.inf:
        number("model.moe.capacity_factor", e.capacity_factor, lambda x: x > 0, "must be a number > 0, inf or null",
               "e.g. model.moe.capacity_factor=1.25; null (or inf) routes every token (dropless)")
    seen = set()
    for i, a in enumerate(e.aux_losses):
        key = f"model.moe.aux_losses[{i}]"
        if set(a) != {"type", "coeff"} or a["type"] not in AUX_LOSSES or a["type"] in seen:
            raise ConfigError(key, a, f"needs keys type and coeff, type one of {', '.join(AUX_LOSSES)}, each "
                              "type once", "e.g. model.moe.aux_losses=[{type:aux,coeff:0.01},{type:z,coeff:0.001}]")
        seen.add(a["type"])
        number(f"{key}.coeff", a["coeff"], lambda x: x >= 0, "must be a finite number >= 0", "e.g. coeff: 0.01")
    number("model.moe.bias_update_rate", e.bias_update_rate, lambda x: x >= 0, "must be a finite number >= 0",
           "e.g. model.moe.bias_update_rate=0.001 (DeepSeek-V3); 0 turns the bias balancing off")


def _experts_impl(run: RunConfig) -> None:
    """grouped runs torch._grouped_mm: fp32 / bf16 / fp16 only, rows 16-byte aligned."""
    import torch

    from framework.precision import policy_of

    e = run.model.moe
    if e.experts_impl not in ("auto", "loop", "grouped"):
        raise ConfigError("model.moe.experts_impl", e.experts_impl, "must be auto, loop or grouped",
                          "e.g. model.moe.experts_impl=auto (grouped GEMM on CUDA where it can, else the loop)")
    if e.experts_impl != "grouped":
        return
    if not hasattr(torch, "_grouped_mm"):
        raise ConfigError("model.moe.experts_impl", "grouped", f"torch {torch.__version__} has no _grouped_mm",
                          "use model.moe.experts_impl=loop")
    dtype = policy_of(run).param_dtype
    if dtype == torch.float64:
        raise ConfigError("model.moe.experts_impl", "grouped", "torch._grouped_mm has no fp64 kernel",
                          "use model.moe.experts_impl=loop with trainer.precision=fp64")
    per_row = 16 // (torch.finfo(dtype).bits // 8)
    for key, width in (("model.n_embd", run.model.n_embd), ("model.moe.expert_inner", e.expert_inner or run.model.n_embd)):
        if width % per_row:
            raise ConfigError(key, width, f"torch._grouped_mm needs 16-byte-aligned rows: a multiple of {per_row} "
                              f"in {dtype}", "use model.moe.experts_impl=loop, or a width that is a multiple of "
                              f"{per_row}")
