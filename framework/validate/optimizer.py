"""The optimizer: its class, its learning rate, and every keyword argument, checked by
building it and stepping it on a dummy parameter (torch's own checks, plus values they let
through, such as a nan momentum)."""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any, Optional

from framework.config import ConfigError, RunConfig
from framework.commands import first_line
from framework.validate.common import number


def check_optimizer(run: RunConfig) -> None:
    o = run.optimizer
    target = o.get("_target_")
    try:
        module, _, name = str(target).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError("optimizer._target_", target, "cannot be imported",
                          "use a class path such as torch.optim.AdamW") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("optimizer._target_", target, "is not a torch.optim.Optimizer", "use torch.optim.AdamW")
    number("optimizer.lr", o.get("lr"), lambda x: x > 0, "must be a finite positive number",
            "e.g. optimizer.lr=3e-4")
    _implementation(o, cls)
    _optimizer_arguments(o, cls)
    _optimizer_values(o, cls)


def _implementation(spec: dict[str, Any], cls: type) -> None:
    """optimizer.implementation (framework/optim/build.py): one of the names, a kernel the
    class has, and not beside torch's own `fused` / `foreach` keys."""
    from framework.optim.build import IMPL, IMPLEMENTATIONS

    impl = spec.get(IMPL, "auto")
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"optimizer.{IMPL}", impl, "is not an implementation",
                          f"use one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "auto":
        return
    both = [k for k in ("fused", "foreach") if k in spec]
    if both:
        raise ConfigError(f"optimizer.{both[0]}", spec[both[0]], f"is set beside optimizer.{IMPL}={impl}",
                          f"set one of them (remove this one with ~optimizer.{both[0]})")
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return
    kernel = {"fused": "fused", "foreach": "foreach"}.get(impl)
    if kernel and kernel not in accepted and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        raise ConfigError(f"optimizer.{IMPL}", impl, f"{spec['_target_']} has no {kernel} kernel",
                          f"use optimizer.{IMPL}=auto (or for-loop)")


def _optimizer_arguments(spec: dict[str, Any], cls: type) -> None:
    """Every key but _target_ is a constructor argument (framework.optim.build.build_optimizer)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return
    from framework.optim.build import IMPL

    if any(p.kind == p.VAR_KEYWORD for p in params):
        return  # takes **kwargs: any name may be right
    accepted = [p.name for p in params if p.name != "params" and p.kind != p.VAR_POSITIONAL]
    for key, value in spec.items():
        if key not in ("_target_", IMPL) and key not in accepted:
            raise ConfigError(f"optimizer.{key}", value, f"not an argument of {spec['_target_']}",
                              f"use one of {', '.join(accepted)} (remove it with ~optimizer.{key})")


def _optimizer_values(spec: dict[str, Any], cls: type) -> None:
    """Build the optimizer on one dummy parameter and take two steps with a zero gradient:
    torch's own argument checks run, and so do the values they let through (nan momentum,
    weight decay or eps=0 leave the parameter non-finite). The culprit is found by trying
    the arguments one at a time beside lr."""
    from framework.optim.build import IMPL

    problem = _optimizer_trial(spec)
    if problem is None:
        return
    for key, value in spec.items():
        if key not in ("_target_", "lr"):
            alone = _optimizer_trial({"_target_": spec["_target_"], "lr": spec["lr"], key: value,
                                      **({} if key == IMPL else {IMPL: spec.get(IMPL, "auto")})})
            if alone is not None:
                raise ConfigError(f"optimizer.{key}", value, f"{spec['_target_']} rejects it ({alone})",
                                  f"use a value it accepts (its default: {_default(cls, key)})")
    raise ConfigError("optimizer._target_", spec["_target_"], f"rejects these arguments together "
                      f"({', '.join(k for k in spec if k != '_target_')}): {problem}",
                      "change the optimizer's arguments (see its documentation)")


def _optimizer_trial(spec: dict[str, Any]) -> Optional[str]:
    """None when the optimizer builds and steps cleanly, else torch's message."""
    import torch

    from framework.optim.build import build_optimizer

    param = torch.nn.Parameter(torch.ones(1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = build_optimizer(spec, [param])
            for _ in range(2):  # a momentum buffer is only mixed with the gradient from step 2
                param.grad = torch.zeros_like(param)
                opt.step(lambda: torch.zeros(()))  # closure: optimizers such as LBFGS require one
    except ValueError as e:  # torch's own argument checks: "Invalid beta parameter at index 1: 1.5"
        return first_line(e)
    except Exception as e:  # noqa: BLE001 - anything else (a 1-tuple of betas: IndexError) is the arguments' too
        return f"{type(e).__name__}: {first_line(e)}"
    if not torch.isfinite(param).all():
        return "leaves a parameter non-finite after two steps with a zero gradient"
    return None


def _default(cls: type, key: str) -> Any:
    try:
        default = inspect.signature(cls).parameters[key].default
    except (TypeError, ValueError, KeyError):
        return "see its documentation"
    return "none" if default is inspect.Parameter.empty else repr(default)
