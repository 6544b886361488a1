"""trainer.precision and the precision.* keys (framework/precision.py): what each mode composes with."""

from __future__ import annotations

import math

from framework.config import ConfigError, RunConfig
from framework.parallel.pipeline.schedules import never_flushes
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
