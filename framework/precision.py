"""The precision policy's compute side: under which autocast a forward runs. Below trainer
and evaluate, which both use it."""

from __future__ import annotations

import contextlib

import torch

from .config import RunConfig


def autocast_context(run: RunConfig, device: torch.device):
    """bf16 only; fp32 and fp64 (verification) compute in the parameters' dtype."""
    if run.trainer.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
