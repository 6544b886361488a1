"""trainer.precision and the precision.* keys (framework/precision.py): what each mode composes with."""

from __future__ import annotations

import math

from framework.config import ConfigError, RunConfig
from framework.schedules import never_flushes
from framework.precision import PRECISIONS, REDUCE_DTYPES, policy_of
from framework.validate.common import choice, number, positive


def check_precision(run: RunConfig) -> None:
    choice("trainer.precision", run.trainer.precision, PRECISIONS)
    reduce = run.precision.reduce_dtype
    if reduce not in REDUCE_DTYPES:
        raise ConfigError("precision.reduce_dtype", reduce, "unknown reduce dtype",
                          "use null (the mode's: fp32 in bf16-mixed / fp16-mixed), fp32, or param (the parameters' "
                          "dtype)")
    policy = policy_of(run.trainer.precision)
    if reduce == "fp32" and policy.param_bytes > 4:
        raise ConfigError("precision.reduce_dtype", reduce, f"trainer.precision={run.trainer.precision} verifies "
                          "layouts in fp64; an fp32 reduction would round every gradient",
                          "leave precision.reduce_dtype null with fp64")
    if policy.loss_scaling:
        _loss_scale(run)
        if run.parallelism.pp > 1 and never_flushes(run.schedule):
            raise ConfigError("trainer.precision", run.trainer.precision,
                              f"loss scaling skips an overflowed step on every rank alike, but {run.schedule.name} "
                              "never flushes: each stage updates on its own, so the ranks cannot agree on a skip "
                              "without a collective that would flush the pipeline",
                              "use bf16-mixed with asynchronous schedules, or a flushing schedule (flush, "
                              "interleaved, zbh1, ...) with fp16-mixed")
    k = run.debug.inf_grad_step
    if k is not None:
        if not policy.loss_scaling:
            raise ConfigError("debug.inf_grad_step", k, f"an inf gradient is skipped only by fp16-mixed's loss "
                              f"scaler; under trainer.precision={run.trainer.precision} it would corrupt the weights",
                              "set trainer.precision=fp16-mixed, or debug.inf_grad_step=null")
        positive("debug.inf_grad_step", k)
    _inf_grad_rank(run)
    _fp8(run)


def _inf_grad_rank(run: RunConfig) -> None:
    r = run.debug.inf_grad_rank
    if r is None:
        return
    if run.debug.inf_grad_step is None:
        raise ConfigError("debug.inf_grad_rank", r, "names the rank that injects an inf gradient, and "
                          "debug.inf_grad_step (the step it does so at) is null", "set debug.inf_grad_step=<k> too")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < run.world_size:
        raise ConfigError("debug.inf_grad_rank", r, f"no such rank in world size {run.world_size}",
                          f"a global rank in 0..{run.world_size - 1}")


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _loss_scale(run: RunConfig) -> None:
    """Every scale the scaler can reach is a power of two, so scaling the loss and unscaling
    the gradients are exact (a skipped step then equals a run without its batch, bit for bit)."""
    c = run.precision.loss_scale
    pre = "precision.loss_scale."
    two = "a power of two (scaling by it is exact)"
    number(pre + "initial", c.initial, _power_of_two, f"must be {two}", "e.g. 65536 (2**16)")
    number(pre + "min_scale", c.min_scale, lambda x: _power_of_two(x) and x <= c.initial,
           f"must be {two}, at most precision.loss_scale.initial={c.initial:g}", "e.g. 1")
    number(pre + "growth_factor", c.growth_factor, lambda x: x >= 1 and _power_of_two(x),
           f"must be >= 1 and {two} (1: the scale never grows)", "e.g. 2")
    number(pre + "backoff_factor", c.backoff_factor, lambda x: x < 1 and _power_of_two(x),
           f"must be below 1 and {two}", "e.g. 0.5")
    positive(pre + "growth_interval", c.growth_interval)
    positive(pre + "hysteresis", c.hysteresis)


FP8_OVER = ("bf16-autocast", "bf16", "bf16-mixed")  # FP8 linears run beside bf16 (torchtitan's setting)


def _fp8(run: RunConfig) -> None:
    """precision.fp8 (framework/models/fp8.py): which modes, schedules, devices, models and
    wrappers it runs with. The widths are checked on the meta model (check_fp8_widths)."""
    import importlib.util

    c, mode, off = run.precision, run.trainer.precision, "or precision.fp8=none"
    if c.fp8 == "none":
        return
    if mode not in FP8_OVER:
        why = {"fp64": "verifies layouts at rtol 1e-9 and FP8 rounds every GEMM operand to 3 mantissa bits",
               "fp16-mixed": "its loss scaling is not proved with FP8's own dynamic scales",
               "fp32": "the linears outside FP8 would run in fp32 and MFU would mix two peaks"}[mode]
        raise ConfigError("precision.fp8", c.fp8, f"with trainer.precision={mode}: {why}; FP8 runs beside bf16, as "
                          "torchtitan trains it", f"use trainer.precision=bf16-mixed (or bf16-autocast), {off}")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("precision.fp8", c.fp8, "runs through torchao's float8 training, which is not installed",
                          f"pip install -e '.[fp8]' (torchao), {off}")
    if run.model.arch == "qwen3_moe":
        raise ConfigError("precision.fp8", c.fp8, "with a MoE model: the experts' grouped GEMMs have no FP8 path "
                          "here (torchao's MoE training is another API)", f"use a dense model, {off}")
    if run.parallelism.pp > 1:
        from framework.schedules.base import REGISTRY

        sched = REGISTRY.get(run.schedule.name)
        if sched is not None and sched.splits_backward:
            raise ConfigError("precision.fp8", c.fp8, f"with schedule {run.schedule.name}, which splits each backward "
                              "into I and W: torchao's FP8 matmul computes both gradients in either call, so every "
                              "linear's backward would run twice", f"use a schedule without I / W (flush, "
                              f"interleaved, ...), {off}")
    _fp8_device(run)
    if c.fp8_all_gather:
        _fp8_all_gather(run)


def _fp8_device(run: RunConfig) -> None:
    """FP8 GEMMs need FP8 tensor cores (or emulation) and, on them, multiples of 16 per side."""
    import torch

    c = run.precision
    if run.dry_run or run.launcher == "external":  # the ranks' device is not this host's
        return
    cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
    if not cuda:
        if c.fp8_emulate is False:
            raise ConfigError("precision.fp8_emulate", False, "this device has no FP8 matrix units (no CUDA): the "
                              "GEMMs can only be emulated (the same casts, an fp32 matmul)",
                              "set precision.fp8_emulate=null or true (emulation: the numerics, not the speed)")
        return
    if c.fp8_emulate or not torch.cuda.is_available():
        return
    from framework.models.fp8 import ALIGN, FP8_MIN_CAPABILITY

    cap = torch.cuda.get_device_capability()
    if cap < FP8_MIN_CAPABILITY:
        raise ConfigError("precision.fp8", c.fp8, f"this GPU (compute capability {cap[0]}.{cap[1]}) has no FP8 "
                          "tensor cores (8.9+: Ada, Hopper, Blackwell)", "set precision.fp8_emulate=true "
                          "(numerics only), or precision.fp8=none")
    tokens = run.trainer.micro_batch_size * run.data.seq_len // run.parallelism.cp
    if tokens % ALIGN:
        raise ConfigError("precision.fp8", c.fp8, f"a micro-batch's {tokens} tokens per rank (micro_batch_size x "
                          f"seq_len / cp) are the weight gradient's reduced dimension, and FP8 GEMMs take "
                          f"multiples of {ALIGN}", f"use micro_batch_size x seq_len / cp a multiple of {ALIGN}, or "
                          "precision.fp8=none")


def _fp8_all_gather(run: RunConfig) -> None:
    c, p, t = run.precision, run.parallelism, run.trainer
    if c.fp8 != "tensorwise":
        raise ConfigError("precision.fp8_all_gather", True, f"with precision.fp8={c.fp8}: FSDP2 gathers a weight "
                          "cast with one scale for the whole tensor; rowwise scales differ per row of the GEMM "
                          "(torchao's rule)", "use precision.fp8=tensorwise, or precision.fp8_all_gather=false")
    if p.zero_impl != "fsdp2" or p.zero < 2 or p.dp < 2:
        raise ConfigError("precision.fp8_all_gather", True, "gathers FSDP2's weight shards in FP8, and this "
                          f"layout has no FSDP2 gather (dp {p.dp}, zero {p.zero}, zero_impl {p.zero_impl})",
                          "set parallelism.zero_impl=fsdp2 with zero 2 or 3 and dp > 1, or "
                          "precision.fp8_all_gather=false")
    if t.save_checkpoint or t.checkpoint_interval > 0:
        raise ConfigError("precision.fp8_all_gather", True, "with checkpoints or the final model: the weights FSDP2 "
                          "gathers are FP8 (an export would hold e4m3 roundings of the masters) and the shards are "
                          "torchao's wrapper tensors, which the checkpoint writer does not take yet",
                          "set precision.fp8_all_gather=false (FP8 GEMMs still run), or trainer.save_checkpoint=false "
                          "and trainer.checkpoint_interval=0")


def check_fp8_widths(run: RunConfig, hf_model, plan: dict) -> None:
    """Every linear FP8 converts multiplies widths torch's FP8 GEMM (`_scaled_mm`) takes:
    this rank's in and out features multiples of 16 (its tp shard's). `hf_model`: the meta
    model, whose linears outside the blocks are the LM head alone (never converted)."""
    from framework.models.fp8 import ALIGN, linears, widths
    from framework.comm.tensor_parallel import style_of

    tp = run.parallelism.tp
    for name, module, _ in linears(hf_model):
        if name.endswith("lm_head"):
            continue
        fan_in, fan_out = widths(module)
        style = style_of(plan, name) if tp > 1 else None
        if style and style.startswith("colwise"):
            fan_out //= tp
        elif style == "rowwise":
            fan_in //= tp
        if fan_in % ALIGN or fan_out % ALIGN:
            raise ConfigError("precision.fp8", run.precision.fp8, f"{name} multiplies {fan_in} x {fan_out} features on "
                              f"each rank (tp {tp}); FP8 GEMMs take multiples of {ALIGN}",
                              f"use model widths (n_embd, n_inner, heads x head size) whose shards are multiples of "
                              f"{ALIGN}, or precision.fp8=none")
