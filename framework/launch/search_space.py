"""The layout search's keys that exist only for some models (conf/hparams_search/layout.yaml
names `expert_parallel` as the Optuna sweeper's `custom_search_space`, which the sweeper calls
for every trial after drawing the preset's `params`).

`parallelism.ep` (expert parallelism, framework/comm/expert_parallel.py) is searched for
MoE models only (`model.arch=qwen3_moe`); a dense model's trials draw exactly what they drew
without it. Its choices are the divisors of gcd(model.moe.experts, world size): ep must divide
the experts and dp, and dp divides the world size. They are fixed for the whole search
because Optuna's sampler refuses a categorical whose choices change between trials (optuna
2.10: "CategoricalDistribution does not support dynamic value space"), so a trial's ep may
still not divide its own dp = world / (tp x pp): framework/validate/expert.py rejects it
before any rank starts and it scores search.failed_value, as a pp that does not divide the
world does. A command line that sets `parallelism.ep` itself (a value or its own choice())
keeps it.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

EP_KEY = "parallelism.ep"


def ep_choices(cfg: DictConfig) -> list[int]:
    """The ep values a layout search over `cfg` (the sweep's composed config) tries; [] for a
    model without routed experts."""
    if OmegaConf.select(cfg, "model.arch") != "qwen3_moe":
        return []
    experts = int(OmegaConf.select(cfg, "model.moe.experts"))
    world = OmegaConf.select(cfg, "parallelism.world_size")
    if world is None:  # no fixed world: the layout's own dp bounds it
        world = OmegaConf.select(cfg, "parallelism.dp") or experts
    g = math.gcd(experts, int(world))
    return [d for d in range(1, g + 1) if g % d == 0]


def expert_parallel(cfg: DictConfig, trial) -> None:
    """Optuna's custom_search_space hook: suggest parallelism.ep for a MoE model."""
    if EP_KEY in trial.params or EP_KEY in trial.user_attrs:  # the command line's own ep (choice or value)
        return
    choices = ep_choices(cfg)
    if len(choices) > 1:
        trial.suggest_categorical(EP_KEY, choices)
