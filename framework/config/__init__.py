"""Typed run configuration: the schema every worker reads, and `load_config` that builds it.

Hydra composes YAML groups into a DictConfig in the launching process only. `load_config`
merges that into these dataclasses (OmegaConf type checks, unknown keys are errors) and
returns plain dataclass instances, so `framework/` never indexes a raw dict. Each key
states its Rule (`key(default, ge=..., choices=..., when=...)`): its range, its choices and
the condition under which it acts, enforced for every key by framework/validate/ranges.py
and fuzzed key by key by tests/test_schema_fuzz.py; the checks a rule cannot say live in
`framework/validate/`.

One module per part of the schema, imported here so `from framework.config import X` is the
one way in:
- rules.py        Rule, key(), rule_of, the count bounds, the conditions keys act under
- model.py        model (model.moe), data
- parallelism.py  parallelism, schedule
- trainer.py      trainer, logger, metrics, debug, precision (precision.loss_scale)
- run.py          search, sweep, sim, hardware and RunConfig, the whole schema
- load.py         load_config, derive_layout, check_overrides, to_yaml, read_config
- typed.py        plain_object: a composed config as the dataclasses without OmegaConf, when no value needs it
"""

from framework.config.load import check_overrides, derive_layout, load_config, read_config, to_yaml
from framework.config.model import DataConfig, ModelConfig, MoEConfig
from framework.config.parallelism import ParallelismConfig, ScheduleConfig
from framework.commands import ConfigError
from framework.config.rules import (MAX_COUNT, MAX_GLOBAL_BATCH, MAX_MICROBATCHES, MAX_RANKS, MAX_WIDTH,
                                    Rule, key, rule_of)
from framework.config.run import HardwareConfig, RunConfig, SearchConfig, SimConfig, SweepConfig
from framework.config.trainer import (DebugConfig, LoggerConfig, LossScaleConfig, MetricsConfig, PrecisionConfig,
                                      TrainerConfig)

__all__ = ["check_overrides", "derive_layout", "load_config", "read_config", "to_yaml", "DataConfig", "ModelConfig",
           "MoEConfig", "ParallelismConfig", "ScheduleConfig", "MAX_COUNT", "MAX_GLOBAL_BATCH", "MAX_MICROBATCHES",
           "MAX_RANKS", "MAX_WIDTH", "ConfigError", "Rule", "key", "rule_of", "HardwareConfig", "RunConfig",
           "SearchConfig", "SimConfig", "SweepConfig", "DebugConfig", "LoggerConfig", "LossScaleConfig",
           "MetricsConfig", "PrecisionConfig", "TrainerConfig"]
