"""The cost model's `hardware` group: what its rules cannot say (docs/cost_model.md).

The profile's tables have the shapes the model reads (framework/sim/cost/hardware.py
`check_tables`), it has a peak for the run's dtype, and the layout fits the cluster."""

from __future__ import annotations

from framework.config import ConfigError, RunConfig


def check_hardware(run: RunConfig) -> None:
    hw = run.hardware
    if hw.name == "none":
        return
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import dtype_of

    Profile.of(hw)
    dtype = dtype_of(run)
    if dtype not in hw.peak_tflops:
        raise ConfigError("hardware.peak_tflops", dict(hw.peak_tflops), f"has no {dtype} peak, the dtype of "
                          f"trainer.precision={run.trainer.precision}", f"add hardware.peak_tflops.{dtype}, or pick "
                          "another trainer.precision")
    if run.precision.fp8 != "none" and "fp8" not in hw.peak_tflops:
        raise ConfigError("hardware.peak_tflops", dict(hw.peak_tflops), f"has no fp8 peak, and precision.fp8="
                          f"{run.precision.fp8} prices the blocks' linears at it", "add hardware.peak_tflops.fp8 (a "
                          "GPU with FP8 matrix units: H100, H200), or precision.fp8=none")
    if run.world_size > hw.gpus:
        raise ConfigError("hardware.gpus", hw.gpus, f"is fewer than the layout's {run.world_size} ranks "
                          f"(dp {run.parallelism.dp} x tp {run.parallelism.tp} x pp {run.parallelism.pp})",
                          f"set hardware.gpus={run.world_size} or more, or a smaller layout")
