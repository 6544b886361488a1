"""The update after a step's gradients are reduced, the same for every runner and layout.

`Update` owns what precision adds around the optimizer (framework/precision.py decides):
- the loss's multiplier before backward (`loss_weight`): the loss scale in fp16-mixed
  (framework/train/loss_scale.py), and inf on one rank holding the head at `debug.inf_grad_step`
  unless `debug.inf_grad_rank` is set (the inf gradient then reaches every rank through the
  reductions that follow);
- the learning rate of the update's index: steps skipped on overflow do not advance the
  schedule (Megatron and DeepSpeed skip the lr scheduler's step alike);
- `apply(params, norm)`: `norm` is the global gradient norm (`clip_grad_norm(..., max_norm=0)`).
  The overflow flag is NOT read from it: that norm is reduced over tp, pp and ZeRO's dp but
  not over DDP's replicas (nor ep's edp peers), so an inf held by one replica would be seen
  by that replica alone, and it alone would skip. The flag is this rank's own gradients'
  (`nonfinite`: one fused read) OR-ed over the whole world (a MAX all-reduce of one byte):
  every rank skips alike whatever the layout reduced. Megatron reduces its found_inf over the
  model-parallel group only, trusting dp replicas to hold equal gradients; the world costs
  the same one scalar and trusts nothing. `debug.inf_grad_rank` tests exactly that: one inf
  on one rank after every reduction, just before the flag. Overflow: nothing is stepped.
  Otherwise the clip coefficient
  of the unscaled norm, and either the optimizer steps the gradients clipped in place (no
  master copy: fp32, bf16-autocast, fp64, exactly as before mixed precision existed) or the
  master optimizer steps fp32 copies multiplied by clip / scale (framework/optim/master.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from framework.train.loss_scale import LossScaler
from framework.optim.master import MasterOptimizer
from framework.optim.build import lr_at, set_lr
from framework.parallel.grads import clip_coefficient, inject_inf, nonfinite, scale_grads
from framework.device import to_host
from framework.precision import policy_of


class Update:
    def __init__(self, run, optimizer, injects: bool, rank: int = 0):
        """`injects`: this rank computes a loss and is the one debug.inf_grad_step makes inf
        (the runner knows where the head is: with V placement it is on pp rank 0). `rank`:
        the global rank (debug.inf_grad_rank names one)."""
        self.run, self.optimizer = run, optimizer
        self.policy = policy_of(run)
        self.scaler: Optional[LossScaler] = LossScaler(run.precision.loss_scale) if self.policy.loss_scaling else None
        self.injects = injects
        self.rank = rank
        self.overflow = False  # the last applied step's, agreed by every rank
        self.local_overflow: Optional[torch.Tensor] = None  # ... and this rank's own part of it (tests read it)
        self.skipped_steps = 0  # overflowed steps over the whole run (a checkpoint carries it)
        self.step_scale: Optional[float] = None  # the scale the last step's backward ran at

    def lr_index(self, step: int) -> int:
        """The schedule's index of step `step` (0-based): steps skipped so far do not count."""
        return step - self.skipped_steps

    def set_lr(self, step: int) -> float:
        lr = lr_at(self.lr_index(step), self.run)
        set_lr(self.optimizer, lr)
        return lr

    def loss_weight(self, step: int) -> Optional[float]:
        """What the loss is multiplied by before backward at step `step` (0-based); None: 1."""
        d = self.run.debug
        if self.injects and d.inf_grad_step == step + 1 and d.inf_grad_rank is None:
            return math.inf
        return self.scaler.scale if self.scaler else None

    def apply(self, params: list, norm: torch.Tensor, step: int) -> torch.Tensor:
        """Step the optimizer (or skip, on overflow) and return the unscaled global norm
        (non-finite on an overflowed step)."""
        scale = self.scaler.scale if self.scaler else None
        self.step_scale = scale
        if self.scaler is not None:
            self.overflow = self.overflowed(params, norm, step)
            self.scaler.update(self.overflow, step + 1)
            if self.overflow:
                self.skipped_steps += 1
                return norm
            norm = norm / scale  # exact: a power of two (framework/validate/precision.py)
        coef = clip_coefficient(norm, self.run.trainer.grad_clip)
        if isinstance(self.optimizer, MasterOptimizer):
            factor = coef if scale is None else (1.0 / scale if coef is None else coef / scale)
            self.optimizer.step(None if factor is None else torch.as_tensor(factor))
        else:
            if coef is not None:
                scale_grads(params, coef)
            self.optimizer.step()
        return norm

    def overflowed(self, params: list, norm: torch.Tensor, step: int) -> bool:
        """Any rank's gradients non-finite (or the norm: a finite fp32 gradient's square can
        overflow): the same answer on every rank."""
        d = self.run.debug
        if d.inf_grad_rank == self.rank and d.inf_grad_step == step + 1:
            inject_inf(params)  # after every reduction: no collective carries it to a peer
        flag = nonfinite(params) | ~torch.isfinite(norm)
        self.local_overflow = flag.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(torch.uint8)  # gloo reduces no bool
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the default group: every rank
        return bool(to_host(flag, "overflow flag"))  # the one read the skip needs

    def step_fields(self) -> dict:
        """The loss scaler's StepResult fields (framework/report/records.py)."""
        return {"loss_scale": self.step_scale, "overflow": self.overflow, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint carries (framework/checkpoint): the skipped steps (the lr
        schedule's offset) in every mode, the scaler's state in fp16-mixed."""
        out = {"update/skipped_steps": float(self.skipped_steps)}
        if self.scaler is not None:
            out.update({f"scaler/{k}": float(v) for k, v in self.scaler.state_dict().items()})
        return out

    def load_state_dict(self, sd: dict[str, float]) -> None:
        """From a checkpoint of any mode: a scaler absent from it (another mode saved it)
        starts at precision.loss_scale.initial."""
        self.skipped_steps = int(sd.get("update/skipped_steps", 0))
        scaler = {k.split("/", 1)[1]: v for k, v in sd.items() if k.startswith("scaler/")}
        if self.scaler is not None and scaler:
            self.scaler.load_state_dict(scaler)
