"""Checks on a model's shape that both validation (before launch, on the meta model) and
the model builders (on a rank) run: here, below both, so neither imports the other."""

from __future__ import annotations

from framework.config import ConfigError, ModelConfig

HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "qwen3_moe": "qwen3_moe"}  # model.arch -> transformers' model_type


def check_model_type(m: ModelConfig, found: str) -> None:
    """A pretrained checkpoint's model_type must be the architecture the run splits."""
    if found != HF_MODEL_TYPES[m.arch]:
        other = [a for a, t in HF_MODEL_TYPES.items() if t == found]
        raise ConfigError("model.pretrained", m.pretrained,
                          f"is a {found} model (config.json), not model.arch={m.arch}",
                          f"use model.arch={other[0]}" if other else
                          f"use a {' or '.join(HF_MODEL_TYPES)} checkpoint (the architectures this framework splits)")


def check_tp_sizes(sizes: dict[str, int], tp: int) -> None:
    """Heads, key-value heads and MLP width must split evenly over tp (before launch on the
    meta model, and again where a rank applies the TP plan)."""
    for key, n in sizes.items():
        if n % tp:
            divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= 16]
            raise ConfigError("parallelism.tp", tp, f"{key}={n} does not divide over tp={tp}: each rank must "
                              "hold whole heads and an equal share of the MLP",
                              f"use parallelism.tp in {divisors}, or change {key}")
