"""Dynamic loss scaling for fp16-mixed: Megatron's `DynamicGradScaler` / DeepSpeed's `DynamicLossScaler`.

fp16's smallest normal number is 6e-5: gradients of a language model's loss fall below it.
The loss is multiplied by `scale` before backward, so every gradient is `scale` times too
large (exact: the scale is a power of two), and the master step multiplies by 1 / scale.
After each step's gradients are reduced, the global gradient norm (already all-reduced
over dp, tp and pp: framework/parallel/grads.py) tells overflow on every rank alike: an inf
or nan anywhere makes it non-finite. Then:
- overflow: no optimizer step, no lr step, no copy back; the growth window restarts; the
  hysteresis counter drops by one, and once it reaches 0 every overflow multiplies the
  scale by `backoff_factor` (not below `min_scale`). An overflow that would back off from
  `min_scale` stops the run (`LossScaleError`): the gradients are not finite however small
  the scale.
- `growth_interval` clean steps in a row: the scale grows by `growth_factor` and the
  hysteresis counter is re-armed (Megatron's rule; the counter is not re-armed by a single
  clean step, DeepSpeed's default `consecutive_hysteresis=False` alike).
"""

from __future__ import annotations


class LossScaleError(RuntimeError):
    """The gradients overflow at the minimum loss scale."""


class LossScaler:
    def __init__(self, cfg):
        self.cfg = cfg
        self.scale = float(cfg.initial)
        self.growth_tracker = 0
        self.hysteresis_tracker = int(cfg.hysteresis)

    def update(self, overflow: bool, step: int) -> None:
        """After step `step` (1-based): `overflow` is the same on every rank."""
        c = self.cfg
        if not overflow:
            self.growth_tracker += 1
            if self.growth_tracker == c.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = int(c.hysteresis)
                self.scale *= c.growth_factor
            return
        self.growth_tracker = 0
        self.hysteresis_tracker -= 1
        if self.hysteresis_tracker <= 0:
            if self.scale <= c.min_scale:
                raise LossScaleError(
                    f"step {step}: the gradients overflow (inf or nan) at the minimum loss scale "
                    f"precision.loss_scale.min_scale={c.min_scale:g}: the run diverged, and a smaller scale would not "
                    f"help. Fix: lower optimizer.lr (or raise trainer.warmup_steps), or train in "
                    f"trainer.precision=bf16-mixed (fp32's range)")
            self.scale = max(self.scale * c.backoff_factor, c.min_scale)

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["growth_tracker"])
        self.hysteresis_tracker = int(sd["hysteresis_tracker"])
