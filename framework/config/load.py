"""`load_config`: a composed config merged into the schema, the sizes left to derive filled
in; `read_config` (a job's config.yaml), `to_yaml`, `check_overrides`."""

from __future__ import annotations

import copy
import functools

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.parallelism import ScheduleConfig
from framework.commands import ConfigError
from framework.config.rules import MAX_GLOBAL_BATCH, MAX_MICROBATCHES
from framework.config.run import RunConfig
from framework.config.typed import plain_object


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config into the schema; a wrong key or type is a ConfigError."""
    cfg = _sim_from(cfg)
    run = plain_object(RunConfig, OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else cfg)
    if run is None:  # a value to convert, an unknown key, an interpolation: OmegaConf's merge decides
        run = _omegaconf_object(cfg)
    derive_layout(run)
    return run


def _omegaconf_object(cfg) -> RunConfig:
    """The composed config merged into the schema by OmegaConf (the judge of every type,
    conversion and unknown key), as a RunConfig; its errors as ConfigErrors."""
    schema = _schema()
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
    # A plain copy to rename in (the caller's config is left as it was): every composed
    # config has sim.from (conf/config.yaml), and a deep copy of the DictConfig took ~10 ms of
    # each load; interpolations stay strings, which the merge resolves as before.
    cfg = OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)
    cfg["sim"]["source"] = cfg["sim"].pop("from")
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
    """config.yaml's text: OmegaConf's container, representers and options, built from the
    dataclass directly and emitted by libyaml where PyYAML has it: 3 ms instead of 55 ms a
    launch here (building the OmegaConf tree was 45 of them). The text is OmegaConf's for the
    schema's configs and reads back to the same values in every case
    (tests/test_config_typed.py); libyaml escapes characters outside the Basic Multilingual
    Plane where OmegaConf's Python emitter writes them raw. The types are checked when the
    file is read (read_config: a local launch reads it back before any rank starts), no
    longer while it is written."""
    import yaml

    return yaml.dump(_container(run), Dumper=_yaml_classes()[1], default_flow_style=False, allow_unicode=True,
                     sort_keys=False)


def _container(value):
    """OmegaConf.to_container(OmegaConf.structured(value), enum_to_str=True), for the
    schema's values: dataclasses as dicts in field order, tuples as lists, enums by name."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(value):
        return {f.name: _container(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _container(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_container(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    return value


@functools.lru_cache(maxsize=1)
def _yaml_classes():
    """(loader, dumper): OmegaConf's own YAML dialect (its implicit float and no-timestamp
    resolvers, its constructors, duplicate keys refused; its string quoting) on libyaml's C
    parser and emitter when PyYAML was built with it, else OmegaConf's pure-Python classes.
    The resolvers and constructors run in Python either way, so the values are the same."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper, get_yaml_loader

    loader, dumper = get_yaml_loader(), get_omega_conf_dumper()
    if not getattr(yaml, "__with_libyaml__", False):
        return loader, dumper

    class Loader(yaml.CSafeLoader):
        yaml_implicit_resolvers = dict(loader.yaml_implicit_resolvers)
        yaml_constructors = dict(loader.yaml_constructors)

        def construct_mapping(self, node, deep=False):  # OmegaConfLoader's duplicate-key check
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag != yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    continue
                if key_node.value in keys:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {key_node.value}",
                                                            key_node.start_mark)
                keys.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    class Dumper(yaml.CDumper):
        yaml_representers = dict(dumper.yaml_representers)

    return Loader, Dumper


def read_config(path: str) -> RunConfig:
    """Workers load the resolved config the launching process wrote (no Hydra here). A file
    that is not YAML (a damaged job directory given to sim.from or the simulator) is a
    ConfigError naming the file."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.load(f, Loader=_yaml_classes()[0])  # what OmegaConf.load parses, in C
        cfg = {} if cfg is None else cfg  # an empty file: OmegaConf.load's empty config
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(path, None, f"is not a YAML config ({type(e).__name__})",
                          "give a job directory whose config.yaml this framework wrote") from None
    if not isinstance(cfg, dict):
        raise ConfigError(path, None, "is not a YAML mapping of config keys",
                          "give a job directory whose config.yaml this framework wrote")
    return load_config(cfg)
