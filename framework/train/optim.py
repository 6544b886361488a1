"""Optimizer construction from the `optimizer` group and the learning-rate schedule."""

from __future__ import annotations

import importlib
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
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "_target_"}
    module, _, name = spec["_target_"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(params, **kwargs)


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
