"""The precision policy: the ONE place `trainer.precision` becomes dtypes.

Every other module asks the policy (`policy_of(run)`), never compares the mode's string:
model materialisation (`param_dtype`), autocast (`autocast_context`), the pipeline's p2p
buffers (`comm_dtype`), the memory formulas and message sizes (`param_bytes`), the MFU
peak's datasheet column (`peak_column`) and the checkpoint's compatibility check.

| mode | parameters, gradients, optimizer states | compute | p2p messages |
|---|---|---|---|
| `fp32` | fp32 | fp32 (tf32 where torch allows it) | fp32 |
| `bf16-autocast` (alias `bf16`) | fp32 | bf16 matmuls under `torch.autocast` | fp32 |
| `fp64` | fp64 (verification: equivalence tests compare layouts at rtol 1e-9) | fp64 | fp64 |

`bf16` is kept as an alias of `bf16-autocast` (the name it had before the modes with 16-bit
parameters were planned): autocast over fp32 parameters, so its memory is fp32's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Policy:
    mode: str  # the canonical name (an alias resolved)
    param_dtype: torch.dtype  # parameters, their gradients and the optimizer's states
    compute_dtype: Optional[torch.dtype]  # autocast's dtype; None: compute in param_dtype
    comm_dtype: torch.dtype  # pipeline activations and their gradients between stages
    peak_column: Optional[str]  # the datasheet column MFU divides by: "bf16" | "fp32" (tf32 by torch's
    # matmul setting, framework/metrics/peak.py) | None (fp64: no MFU)

    @property
    def param_bytes(self) -> int:
        return torch.empty((), dtype=self.param_dtype).element_size()

    @property
    def comm_bytes(self) -> int:
        return torch.empty((), dtype=self.comm_dtype).element_size()

    def autocast_context(self, device: torch.device):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


MODES = {
    "fp32": Policy("fp32", torch.float32, None, torch.float32, "fp32"),
    "bf16-autocast": Policy("bf16-autocast", torch.float32, torch.bfloat16, torch.float32, "bf16"),
    "fp64": Policy("fp64", torch.float64, None, torch.float64, None),
}
ALIASES = {"bf16": "bf16-autocast"}
PRECISIONS = (*MODES, *ALIASES)  # what trainer.precision accepts


def policy_of(precision) -> Policy:
    """The policy of a mode name, or of a RunConfig (its trainer.precision)."""
    name = precision if isinstance(precision, str) else precision.trainer.precision
    return MODES[ALIASES.get(name, name)]


def autocast_context(run, device: torch.device):
    """The forward's autocast (trainer and evaluation): bf16-autocast only."""
    return policy_of(run).autocast_context(device)
