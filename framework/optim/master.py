"""The optimizer's own copy of the parameters it steps: fp32 master weights, ZeRO-Offload's host copy.

`MasterOptimizer` wraps the configured optimizer around copies of the tensors a runner
gives it (whole parameters, a pipeline chunk's, tp shards, or ZeRO's flat slices: the
master is then 1/N of the model, as in Megatron's distributed optimizer):
- mixed precision (`bf16-mixed`, `fp16-mixed`): the copies are fp32 (`master_dtype`) on the
  parameters' device; the model's 16-bit parameters are a rounding of them after every step.
- ZeRO-Offload: the copies (in the master dtype, else the parameters') and the optimizer
  states live in host memory, pinned on CUDA; the update runs there (Ren et al., 2021).
  With `parallelism.offload_device=nvme` the states live in a file on the drive instead,
  stepped unit by unit through a pool of host buffers (framework/optim/swap.py).

The masters live in one flat buffer (`flat`, each master a view of it, in the parameters'
order): one allocation, and the copy back is one op. Their gradients are views of a second
flat buffer (`grad_flat`) whose storage exists for the step only (resized to 0 after it, as
FSDP2 frees its unsharded parameters): the views keep their shapes, so a step allocates one
buffer instead of a tensor per parameter.

A step: the 16-bit gradients are copied into the fp32 gradient views (one multi-tensor copy,
casting), multiplied by `grad_factor` (the loss scaler's 1/scale times the clip
coefficient, framework/train/update.py; one multi-tensor op), the inner optimizer steps the
masters (framework/optim/build.py: fused where the class has it), the gradient storage is
released and the parameters are overwritten with the masters' values (one multi-tensor
copy, rounded to 16 bits). The dispatched ops do not grow with the number of tensors
(tests/test_update_ops.py); the Python bookkeeping (which parameters hold a gradient, each
master's `.grad`) is a loop over the tensors, as torch's own optimizers' is.

The checkpoint stores the masters (framework/checkpoint): they are the weights, the 16-bit
parameters only their rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.optim.build import build_optimizer
from framework.optim.param_swap import ParamSwap
from framework.optim.swap import OffloadTarget, StateSwap
from framework.precision import Policy


class MasterOptimizer:
    def __init__(self, spec: dict, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device,
                 offload: Optional[OffloadTarget] = None):
        self.params = params
        pin = device.type == "cpu" and params[0].device.type == "cuda"
        total = sum(p.numel() for p in params)
        self.flat = torch.empty(total, dtype=dtype, device=device, pin_memory=pin)
        self.master = [nn.Parameter(v) for v in flat_views(self.flat, params)]  # aliases of `flat`
        with torch.no_grad():
            _copy(self.master, [p.detach() for p in params])
        # unpinned on the host (a pinned block per step would cost a cudaHostAlloc)
        self.grad_flat = torch.empty(total, dtype=dtype, device=device)
        self._grads = flat_views(self.grad_flat, params)
        self._grad_bytes = self.grad_flat.untyped_storage().nbytes()
        self.grad_flat.untyped_storage().resize_(0)  # held for the step only
        self.inner = build_optimizer(spec, self.master)
        # ZeRO-Infinity's NVMe tier: the states on the drive, stepped unit by unit (swap.py)
        self.swap = StateSwap(offload, self.master) if offload is not None and offload.device == "nvme" else None
        # and with offload_params, ZeRO 3's parameter slices (param_swap.py): on the drive from here on
        self.param_swap = ParamSwap(offload, params) if offload is not None and offload.params else None
        if self.param_swap is not None:
            self.copy_to_params()

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
        held = [i for i, p in enumerate(self.params) if p.grad is not None]
        storage = self.grad_flat.untyped_storage()
        storage.resize_(self._grad_bytes)  # one allocation; the views see it
        try:
            grads = [self._grads[i] for i in held]
            if grads:  # multi-tensor ops (offload: a device-to-host copy per tensor)
                _copy(grads, [self.params[i].grad for i in held])
                if grad_factor is not None:
                    torch._foreach_mul_(grads, grad_factor)
            for m in self.master:
                m.grad = None
            for i, g in zip(held, grads, strict=True):
                self.master[i].grad = g
            if self.swap is None:
                self.inner.step()
            else:
                self.swap.step(self.inner)
        finally:
            for m in self.master:
                m.grad = None
            storage.resize_(0)  # CUDA: back to the caching allocator, ordered on this stream
        self.copy_to_params()

    def copy_to_params(self) -> None:
        with torch.no_grad():
            if self.param_swap is not None:  # each slice filled, written to the drive and dropped
                self.param_swap.store(lambda i, t: t.detach().copy_(self.master[i]))
            else:
                _copy(self.params, self.master, non_blocking=True)  # no .data: a detach per tensor

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None


def flat_views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into tensors shaped as `like`, in order (views: built once, not per step).
    Also ZeRO's and the pipeline's gradient buffers (framework/parallel/zero_unit.py, grads.py)."""
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """dst[i] <- src[i] (casting): one multi-tensor copy on one device; across devices
    (ZeRO-Offload) a copy per tensor, non-blocking only host-to-device (a device-to-host copy
    the host optimizer reads next must have landed)."""
    if dst and dst[0].device == src[0].device:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=non_blocking)


def build(spec: dict, params: list[nn.Parameter], policy: Policy, offload: Optional[OffloadTarget] = None):
    """The optimizer a runner steps: plain, or a MasterOptimizer when the policy keeps master
    weights or the states are offloaded (to host memory, or their states to NVMe)."""
    if policy.master_dtype is None and offload is None:
        return build_optimizer(spec, params)
    device = torch.device("cpu") if offload is not None else params[0].device
    return MasterOptimizer(spec, params, policy.state_dtype, device, offload)


def master_of(optimizer) -> dict[int, torch.Tensor]:
    """id(parameter) -> its master copy ({} for a plain optimizer)."""
    if not isinstance(optimizer, MasterOptimizer):
        return {}
    return {id(p): m for p, m in zip(optimizer.params, optimizer.master, strict=True)}
