"""The optimizer's own copy of the parameters it steps: fp32 master weights, ZeRO-Offload's host copy.

`MasterOptimizer` wraps the configured optimizer around copies of the tensors a runner
gives it (whole parameters, a pipeline chunk's, tp shards, or ZeRO's flat slices: the
master is then 1/N of the model, as in Megatron's distributed optimizer):
- mixed precision (`bf16-mixed`, `fp16-mixed`): the copies are fp32 (`master_dtype`) on the
  parameters' device; the model's 16-bit parameters are a rounding of them after every step.
- ZeRO-Offload: the copies (in the master dtype, else the parameters') and the optimizer
  states live in host memory, pinned on CUDA; the update runs there (Ren et al., 2021).

A step: each 16-bit gradient is copied into an fp32 gradient of its master, multiplied by
`grad_factor` (the loss scaler's 1/scale times the clip coefficient, framework/train/update.py),
the inner optimizer steps the masters, their gradients are freed (held for the step only)
and the parameters are overwritten with the masters' values (rounded to 16 bits).

The checkpoint stores the masters (framework/checkpoint): they are the weights, the 16-bit
parameters only their rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.train.optim import build_optimizer
from framework.precision import Policy


class MasterOptimizer:
    def __init__(self, spec: dict, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.params = params
        pin = device.type == "cpu" and params[0].device.type == "cuda"
        self.master = [nn.Parameter(p.detach().to(device=device, dtype=dtype, copy=True)) for p in params]
        if pin:
            self.master = [nn.Parameter(m.data.pin_memory()) for m in self.master]
        self.inner = build_optimizer(spec, self.master)

    # Read through, not copied: torch's load_state_dict replaces the inner optimizer's
    # param_groups and state objects (a copy would leave the lr schedule setting stale groups).
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, grad_factor: Optional[torch.Tensor] = None) -> None:
        if grad_factor is not None:  # once, not per tensor (offload: one device-to-host copy)
            grad_factor = grad_factor.to(self.master[0].device)
        held = [(p, m) for p, m in zip(self.params, self.master, strict=True) if p.grad is not None]
        for m in self.master:
            m.grad = None
        grads = [torch.empty_like(m) for _, m in held]  # fp32, transient: held for the step only
        if grads:
            # the copies and the scaling are multi-tensor ops; only the transient gradients'
            # allocation (and offload's device-to-host copies) is one op per tensor
            _copy(grads, [p.grad for p, _ in held])
            if grad_factor is not None:
                torch._foreach_mul_(grads, grad_factor)
        for (_, m), g in zip(held, grads, strict=True):
            m.grad = g
        self.inner.step()
        for m in self.master:
            m.grad = None  # held for the step only: the master's gradients are transient
        self.copy_to_params()

    def copy_to_params(self) -> None:
        with torch.no_grad():
            _copy(self.params, self.master, non_blocking=True)  # no .data: a detach per tensor

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """dst[i] <- src[i] (casting): one multi-tensor copy on one device; across devices
    (ZeRO-Offload) a copy per tensor, non-blocking only host-to-device (a device-to-host copy
    the host optimizer reads next must have landed)."""
    if dst and dst[0].device == src[0].device:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=non_blocking)


def build(spec: dict, params: list[nn.Parameter], policy: Policy, offload: bool = False):
    """The optimizer a runner steps: plain, or a MasterOptimizer when the policy keeps master
    weights or the states are offloaded."""
    if policy.master_dtype is None and not offload:
        return build_optimizer(spec, params)
    device = torch.device("cpu") if offload else params[0].device
    return MasterOptimizer(spec, params, policy.state_dtype, device)


def master_of(optimizer) -> dict[int, torch.Tensor]:
    """id(parameter) -> its master copy ({} for a plain optimizer)."""
    if not isinstance(optimizer, MasterOptimizer):
        return {}
    return {id(p): m for p, m in zip(optimizer.params, optimizer.master, strict=True)}
