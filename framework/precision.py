"""The precision policy: the ONE place `trainer.precision` and `precision.*` become dtypes.

Every other module asks the policy (`policy_of(run)`), never compares the mode's string:
model materialisation (`param_dtype`), autocast (`autocast_context`), the pipeline's p2p
buffers (`comm_dtype`), gradient collectives (`reduce_dtype`), the optimizer's master
copy (`master_dtype`, framework/optim/master.py), the loss scaler (`loss_scaling`),
the memory formulas (`bytes_of`), the MFU peak's datasheet column (`peak_column`) and the
checkpoint's compatibility check.

| mode | parameters, gradients | master weights, optimizer states | compute | p2p messages |
|---|---|---|---|---|
| `fp32` | fp32 | (none), fp32 | fp32 (tf32 where torch allows it) | fp32 |
| `bf16-autocast` (alias `bf16`) | fp32 | (none), fp32 | bf16 matmuls under `torch.autocast` | fp32 |
| `bf16-mixed` | bf16 | fp32, fp32 | bf16 | bf16 |
| `fp16-mixed` | fp16 (the loss scaled dynamically) | fp32, fp32 | fp16 | fp16 |
| `fp64` | fp64 (verification: layouts compared at rtol 1e-9) | (none), fp64 | fp64 | fp64 |

`precision.fp8` (tensorwise | rowwise) runs the blocks' linears on FP8 operands beside
bf16-autocast or bf16-mixed (framework/models/fp8.py): dtypes as the mode's, MFU against the
bf16 peak (torchtitan's convention: FP8's own peak is twice that).

`bf16` is kept as an alias of `bf16-autocast` (the name it had before the modes with 16-bit
parameters existed): autocast over fp32 parameters, so its memory is fp32's.

Gradient collectives run in `precision.reduce_dtype`: null takes the mode's default (fp32
in the mixed modes, as torchtitan's FSDP2 `reduce_dtype` and Megatron's bf16 default: a sum
over N ranks in 16 bits loses log2(N) bits), `param` the parameters' own dtype (the ZeRO
paper's bf16 reduction). The reduction runs on a transient wide copy and is rounded back:
gradients are held in the parameters' dtype either way. They also accumulate over micro-batches in the
parameters' dtype: autograd writes `p.grad` in `p`'s dtype, and an fp32 main-grad buffer
beside each parameter (Megatron's `main_grad`) is not built (docs/precision.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

@dataclass(frozen=True)
class Policy:
    mode: str  # the canonical name (an alias resolved)
    param_dtype: torch.dtype  # the model's parameters and their gradients
    compute_dtype: Optional[torch.dtype]  # autocast's dtype; None: compute in param_dtype
    comm_dtype: torch.dtype  # pipeline activations and their gradients between stages
    peak_column: Optional[str]  # the datasheet column MFU divides by: "bf16" | "fp16" | "fp32" (tf32 by
    # torch's matmul setting, framework/metrics/peak.py) | None (fp64: no MFU)
    master_dtype: Optional[torch.dtype] = None  # the optimizer's own copy of the parameters; None: none
    reduce_dtype: Optional[torch.dtype] = None  # gradient all-reduce / reduce-scatter; None: param_dtype
    loss_scaling: bool = False  # dynamic loss scaling (fp16-mixed; keys precision.loss_scale.*)
    fp8: str = "none"  # precision.fp8: the blocks' linears on FP8 operands (framework/models/fp8.py)

    @property
    def param_bytes(self) -> int:
        return bytes_of(self.param_dtype)

    @property
    def comm_bytes(self) -> int:
        return bytes_of(self.comm_dtype)

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def state_dtype(self) -> torch.dtype:
        """The optimizer states' dtype: the master's, else the parameters'."""
        return self.master_dtype or self.param_dtype

    @property
    def gemm_dtype(self) -> str:
        """The cost model's GEMM-table dtype: the MFU column, fp64 for fp64 (precision.fp8
        prices only the blocks' linears at fp8, framework/sim/cost/ops.py)."""
        return self.peak_column or "fp64"

    @property
    def mixed(self) -> bool:
        return self.master_dtype is not None

    def autocast_context(self, device: torch.device):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


def bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
MODES = {
    "fp32": Policy("fp32", F32, None, F32, "fp32"),
    "bf16-autocast": Policy("bf16-autocast", F32, BF16, F32, "bf16"),
    "bf16-mixed": Policy("bf16-mixed", BF16, None, BF16, "bf16", master_dtype=F32, reduce_dtype=F32),
    "fp16-mixed": Policy("fp16-mixed", F16, None, F16, "fp16", master_dtype=F32, reduce_dtype=F32,
                         loss_scaling=True),
    "fp64": Policy("fp64", F64, None, F64, None),
}
ALIASES = {"bf16": "bf16-autocast"}
PRECISIONS = (*MODES, *ALIASES)  # what trainer.precision accepts
REDUCE_DTYPES = (None, "fp32", "param")  # what precision.reduce_dtype accepts


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def policy_of(precision) -> Policy:
    """The policy of a mode name (its defaults), or of a RunConfig (trainer.precision with
    the precision.* keys applied)."""
    if isinstance(precision, str):
        return MODES[canonical(precision)]
    base = MODES[canonical(precision.trainer.precision)]
    reduce = precision.precision.reduce_dtype
    if reduce == "param":
        base = replace(base, reduce_dtype=None)
    elif reduce == "fp32" and base.param_dtype != F64:
        base = replace(base, reduce_dtype=F32)
    fp8 = precision.precision.fp8
    if fp8 != "none":  # beside bf16 only (validated): MFU stays against the bf16 peak, as torchtitan reports it
        base = replace(base, fp8=fp8)
    return base


def autocast_context(run, device: torch.device):
    """The forward's autocast (trainer and evaluation): bf16-autocast only."""
    return policy_of(run).autocast_context(device)
