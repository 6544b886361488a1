"""The schema's vocabulary (its error, ConfigError, is framework/commands.py's): a key's Rule and `key(...)`, the bounds every count
shares, and the conditions under which groups of keys act (framework/config/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from framework.schedules.base import AUTO as AUTO_SCHEDULE
from framework.schedules.base import REGISTRY


@dataclass(frozen=True)
class Rule:
    """What one key accepts and when it acts: the schema's half of validation. The generic
    check (framework/validate/ranges.py) enforces it on every run before launch, and
    tests/test_schema_fuzz.py fuzzes every key from it, so a new key is checked and fuzzed
    once it states its rule. A bound is a number or another key's path ("trainer.steps",
    "world_size"); `when` is the condition under which the key has any effect: a key given
    on the command line while it does not hold is refused (it would be silently ignored)."""

    ge: Any = None
    gt: Any = None
    le: Any = None
    lt: Any = None
    inf: bool = False  # a float key to which inf means something (capacity_factor: dropless)
    choices: tuple = ()  # the names a string key accepts
    nonempty: bool = False  # a string key that must not be ""
    when: Optional[Callable[[Any], bool]] = None  # run -> does this key act?
    when_text: str = ""  # the condition as the user would set it ("trainer.precision=fp16-mixed")
    base: tuple = ()  # overrides under which the key acts (the fuzz runs this key's cases there)
    free: str = ""  # no range or choice to state: why, and which check owns the value


def key(default: Any = None, *, factory: Optional[Callable[[], Any]] = None, **rule: Any) -> Any:
    """A schema field with its Rule."""
    meta = {"rule": Rule(**rule)}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def rule_of(f) -> Rule:
    return f.metadata.get("rule", Rule())


# Counts past these are typos, and a dry run would allocate in proportion to them.
MAX_RANKS = 1 << 17  # ~131k ranks per dimension and in all (the largest runs use ~100k GPUs)
MAX_COUNT = 1 << 20
MAX_WIDTH = 1 << 20
MAX_MICROBATCHES = 1 << 16
MAX_GLOBAL_BATCH = 1 << 30
_MOE = dict(when=lambda r: r.model.arch == "qwen3_moe", when_text="model.arch=qwen3_moe", base=("model=moe-tiny",))
_FP16 = dict(when=lambda r: r.trainer.precision == "fp16-mixed", when_text="trainer.precision=fp16-mixed",
             base=("trainer.precision=fp16-mixed",))
_FP8 = dict(when=lambda r: r.precision.fp8 != "none", when_text="precision.fp8=tensorwise or rowwise",
            base=("precision.fp8=tensorwise", "trainer.precision=bf16-mixed"))
_SYNTHETIC = dict(when=lambda r: r.data.name == "synthetic", when_text="data=synthetic")
_PYCODE = dict(when=lambda r: r.data.name == "pycode", when_text="data=pycode", base=("data=pycode",))
_HF = dict(when=lambda r: r.data.name == "hf", when_text="data=hf", base=("data=hf", "data.path=json"))
_ZB_AUTO = dict(when=lambda r: r.schedule.name == AUTO_SCHEDULE, when_text=f"schedule={AUTO_SCHEDULE}",
                base=(f"schedule={AUTO_SCHEDULE}",))
_CHECKPOINTS = dict(when=lambda r: r.trainer.checkpoint_interval > 0, when_text="trainer.checkpoint_interval > 0",
                    base=("trainer.checkpoint_interval=2",))
_WANDB = dict(when=lambda r: r.logger.name == "wandb", when_text="logger=wandb",
              base=("logger=wandb", "logger.mode=disabled"))
_CP = dict(when=lambda r: r.parallelism.cp > 1, when_text="parallelism.cp > 1", base=("parallelism.cp=2",))
_LABEL = "a free label (only shown)"
PAIRED = [n for n, s in REGISTRY.items() if s.pairs]  # the schedules parallelism.overlap_dualpipe acts on
_HW = dict(when=lambda r: r.hardware.name != "none", when_text="hardware=<a profile in conf/hardware/>",
           base=("hardware=h100-sxm",))
_TABLE = "a table or map: framework/sim/cost/hardware.py checks its shape"
