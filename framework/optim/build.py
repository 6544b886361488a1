"""Optimizer construction from the `optimizer` group and the learning-rate schedule.

`optimizer.implementation` picks torch's kernel (torchtitan's names): `fused` (one kernel for
every tensor: `fused=True`), `foreach` (multi-tensor ops: `foreach=True`), `for-loop` (a
kernel per tensor: `foreach=False`), or `auto` (the default): fused where the class has it,
else foreach where it has that, else the class's own default. The ops an update dispatches
then do not grow with the number of parameter tensors (fused; foreach on CUDA: on CPU
torch's foreach Adam reads each tensor's step count back to the host). A `fused` or
`foreach` key set by hand is passed as it is under `auto` (validation refuses both it and
a non-auto implementation).
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any
from collections.abc import Iterable

import torch

from framework.config import RunConfig


def build_optimizer(spec: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """`_target_` is a class path; every other key is a constructor argument.

    Resolved here rather than with hydra.utils.instantiate so workers need no Hydra and
    `betas` arrives as a tuple.
    """
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k not in ("_target_", IMPL)}
    cls = optimizer_class(spec)
    kwargs.update(implementation_kwargs(cls, spec.get(IMPL, "auto"), kwargs))
    return cls(params, **kwargs)


IMPL = "implementation"  # the one key of the optimizer group that is not a constructor argument
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def optimizer_class(spec: dict[str, Any]) -> type:
    module, _, name = spec["_target_"].rpartition(".")
    return getattr(importlib.import_module(module), name)


def implementation_kwargs(cls: type, impl: str, given: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments `optimizer.implementation` adds (module docstring)."""
    try:
        accepted = set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        accepted = set()
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for-loop":
        return {"foreach": False} if "foreach" in accepted else {}
    if "fused" in given or "foreach" in given:  # auto: the user's own choice stands
        return {}
    if "fused" in accepted:
        return {"fused": True}
    return {"foreach": True} if "foreach" in accepted else {}


def lr_at(step: int, run: RunConfig) -> float:
    """Linear warm-up over trainer.warmup_steps, then cosine to min_lr_ratio * lr at the last step."""
    base, t = float(run.optimizer["lr"]), run.trainer
    if step < t.warmup_steps:
        return base * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = base * t.min_lr_ratio
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
