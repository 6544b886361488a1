"""`load_config`: a composed config merged into the schema, the sizes left to derive filled
in; `read_config` (a job's config.yaml), `to_yaml`, `check_overrides`."""

from __future__ import annotations

import copy
import functools

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from framework.config.parallelism import ScheduleConfig
from framework.commands import ConfigError
from framework.config.rules import MAX_GLOBAL_BATCH, MAX_MICROBATCHES
from framework.config.run import RunConfig


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config into the schema; a wrong key or type is a ConfigError."""
    schema = _schema()
    cfg = _sim_from(cfg)
    try:
        merged = OmegaConf.merge(schema, cfg)
        run = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        value = getattr(e, "value", None)
        if value is None and key != "config":  # an unknown key's error carries no value: show the given one
            value = OmegaConf.select(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg, key, default=None)
        reason = str(e).splitlines()[0]  # OmegaConf appends full_key / object_type lines
        raise ConfigError(key, value, f"does not fit the schema ({reason})",
                          "see docs/configuration.md for the keys and their types") from None
    assert isinstance(run, RunConfig)
    derive_layout(run)
    return run


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema as an OmegaConf node, built once (merge copies it, never changes it)."""
    return OmegaConf.structured(RunConfig)


def _sim_from(cfg):
    """`sim.from=<job dir>` (the documented key) -> the schema's sim.source."""
    sim = cfg.get("sim") if hasattr(cfg, "get") else None
    if sim is None or "from" not in sim:
        return cfg
    cfg = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    with open_dict(cfg):
        cfg.sim.source = cfg.sim.pop("from")
    return cfg


def derive_layout(run: RunConfig) -> None:
    """Fill the sizes left to derive, so everything downstream reads plain ints:
    parallelism.dp = world_size / (tp * pp * cp) when dp is null, and with
    trainer.global_batch_size either schedule.microbatches (micro_batch_size set: the
    default) or trainer.micro_batch_size (null). Sizes that are not positive are left for
    framework.validate to name."""
    p, t, s = run.parallelism, run.trainer, run.schedule
    _clamp_skip_first(run)
    _sizes_from_csv(s)
    _recompute(t)
    if p.dp is None:
        if p.world_size is None or min(p.tp, p.pp, p.cp) < 1 or p.world_size % (p.tp * p.pp * p.cp):
            raise ConfigError("parallelism.dp", None, f"null derives dp = world_size / (tp * pp * cp), but world_size = "
                              f"{p.world_size} and tp * pp * cp = {p.tp}*{p.pp}*{p.cp}",
                              "set parallelism.dp, or a parallelism.world_size divisible by tp * pp * cp")
        p.dp = p.world_size // (p.tp * p.pp * p.cp)
    g = t.global_batch_size
    if g is None:
        if t.micro_batch_size is None:
            raise ConfigError("trainer.micro_batch_size", None, "null derives it from trainer.global_batch_size, "
                              "which is null too", "set trainer.micro_batch_size, or trainer.global_batch_size")
        return
    if not 1 <= g <= MAX_GLOBAL_BATCH or p.dp < 1:
        return  # framework.validate names it
    if t.micro_batch_size is None:
        t.micro_batch_size = _share(g, s.microbatches, p.dp, "microbatches", "trainer.micro_batch_size",
                                    "set trainer.micro_batch_size")
    else:
        s.microbatches = _share(g, t.micro_batch_size, p.dp, "micro_batch_size", "schedule.microbatches",
                                "change trainer.micro_batch_size")
        if s.microbatches > MAX_MICROBATCHES:
            raise ConfigError("trainer.global_batch_size", g, f"derives schedule.microbatches={s.microbatches} "
                              f"(micro_batch_size {t.micro_batch_size} x dp {p.dp}), above its limit "
                              f"{MAX_MICROBATCHES}", "a smaller global batch, or a larger trainer.micro_batch_size")


def _sizes_from_csv(s: ScheduleConfig) -> None:
    """schedule=csv: micro-batches and chunks left null are the file's (a file that cannot be
    read is left for framework.validate to name)."""
    from framework.schedules import CSV, csv_schedule

    if s.name != CSV or not s.csv or (s.microbatches is not None and s.virtual_stages is not None):
        return

    try:
        extra = csv_schedule(s.csv)[0].extra
    except (OSError, ValueError):
        return
    s.microbatches = extra["microbatches"] if s.microbatches is None else s.microbatches
    s.virtual_stages = extra["virtual_stages"] if s.virtual_stages is None else s.virtual_stages


def _recompute(t) -> None:
    """trainer.activation_checkpointing=true is trainer.recompute=full by its old name: each is
    set from the other, so code reading either sees the same mode."""
    if t.activation_checkpointing and t.recompute == "selective":
        raise ConfigError("trainer.activation_checkpointing", True, "is the old name of trainer.recompute=full and "
                          "contradicts trainer.recompute=selective",
                          "drop trainer.activation_checkpointing and set trainer.recompute=full or selective")
    if t.activation_checkpointing:
        t.recompute = "full"
    t.activation_checkpointing = t.recompute == "full"


def _clamp_skip_first(run: RunConfig) -> None:
    """A short run (trainer.steps=3 with the default metrics.skip_first=3) summarises its
    last step instead of failing: one line says so."""
    m, steps = run.metrics, run.trainer.steps
    if isinstance(m.skip_first, int) and isinstance(steps, int) and 1 <= steps <= m.skip_first:
        import sys

        print(f"note: metrics.skip_first={m.skip_first} would leave none of trainer.steps={steps} to summarise; "
              f"using metrics.skip_first={steps - 1}", file=sys.stderr)
        m.skip_first = steps - 1


def _share(global_batch: int, fixed: int, dp: int, fixed_name: str, derived: str, other_fix: str) -> int:
    """global_batch / (fixed * dp), or a ConfigError when it does not divide."""
    per = fixed * dp
    if fixed < 1 or global_batch % per:
        raise ConfigError("trainer.global_batch_size", global_batch, f"not divisible by {fixed_name} * dp = "
                          f"{fixed}*{dp} ({derived} is derived from it)",
                          f"use a multiple of {max(per, 1)}, or {other_fix}")
    return global_batch // per


def check_overrides(run: RunConfig, overrides: list[str]) -> None:
    """A size given on the command line that derive_layout replaced is a contradiction,
    not a preference: say so instead of running another batch than asked for."""
    given = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    for key, now in (("schedule.microbatches", run.schedule.microbatches),
                     ("trainer.micro_batch_size", run.trainer.micro_batch_size),
                     ("parallelism.dp", run.parallelism.dp)):
        if key in given and given[key] not in ("null", str(now)):
            raise ConfigError(key, given[key], f"trainer.global_batch_size={run.trainer.global_batch_size} / "
                              f"parallelism.world_size={run.parallelism.world_size} derive {key}={now}",
                              f"leave {key} out (it is derived), or set the size it is derived from to null")


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def read_config(path: str) -> RunConfig:
    """Workers load the resolved config the launching process wrote (no Hydra here). A file
    that is not YAML (a damaged job directory given to sim.from or the simulator) is a
    ConfigError naming the file."""
    import yaml

    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(path, None, f"is not a YAML config ({type(e).__name__})",
                          "give a job directory whose config.yaml this framework wrote") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(path, None, "is not a YAML mapping of config keys",
                          "give a job directory whose config.yaml this framework wrote")
    return load_config(cfg)
