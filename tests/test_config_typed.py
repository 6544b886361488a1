"""framework/config/typed.py: the direct path from a composed config to the schema's
dataclasses builds exactly what OmegaConf's merge builds, or declines (None) and leaves the
config to OmegaConf. Checked on every option of every config group (each option's YAML
merged over the default composition where Hydra would put it) and on each kind of value a
command line gives: as typed, an int for a float, None, dicts merged into a default, lists,
and the forms only OmegaConf may judge."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from framework.config import RunConfig, derive_layout, load_config
from framework.config.load import _omegaconf_object, _sim_from
from framework.config.typed import plain_object

from .conftest import CONF, _COMPOSED, compose


@pytest.fixture(scope="module")
def default() -> dict:
    compose()  # the default composition, as every launch starts from it
    return _sim_from(copy.deepcopy(_COMPOSED[()]))


def _same(cfg: dict) -> bool:
    """Both paths on `cfg`: OmegaConf's object, and the direct one equal to it (True) or
    declined (False)."""
    ref = _omegaconf_object(copy.deepcopy(cfg))
    fast = plain_object(RunConfig, copy.deepcopy(cfg))
    if fast is None:
        return False
    assert fast == ref
    assert [type(v) for v in _leaves(fast)] == [type(v) for v in _leaves(ref)]  # 3 == 3.0 in ==
    return True


def _leaves(obj) -> list:
    if dataclasses.is_dataclass(obj):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [x for k in obj for x in [k, *_leaves(obj[k])]]
    if isinstance(obj, list):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def _written_and_read(run: RunConfig, tmp_path: Path) -> RunConfig:
    """config.yaml as launches write it, equal to OmegaConf's text, and read back."""
    from framework.config import read_config, to_yaml

    text = to_yaml(run)
    assert text == OmegaConf.to_yaml(OmegaConf.structured(run))
    (tmp_path / "config.yaml").write_text(text)
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml")) == yaml.safe_load(text)
    return read_config(str(tmp_path / "config.yaml"))


def _options():
    for group in sorted(p for p in Path(CONF).iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            yield group.name, option


@pytest.mark.parametrize("group", sorted(p.name for p in Path(CONF).iterdir() if p.is_dir()))
def test_every_option_of_a_group_builds_the_same_config(default, group, tmp_path):
    """Each option's YAML over the default composition; the direct path must take every
    option that only sets plain values (all of them today but the hyperparameter search,
    which configures Hydra's sweeper). Its config.yaml is OmegaConf's text and reads back
    to the same config."""
    taken, declined = [], []
    for _, path in (o for o in _options() if o[0] == group):
        text = path.read_text()
        content = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k not in ("defaults", "hydra")}
        where = content if text.startswith("# @package _global_") else {group: content}
        cfg = OmegaConf.to_container(OmegaConf.merge(default, where))
        (taken if _same(cfg) else declined).append(path.stem)
        run = _omegaconf_object(copy.deepcopy(cfg))
        derive_layout(run)  # what a launch writes: the sizes derived
        assert _written_and_read(run, tmp_path) == run
    assert taken and declined == [], (taken, declined)


KEEP = object()


def _with_each_leaf(cfg: dict, change) -> dict:
    """`cfg` with change(hint, value) applied to every leaf the schema types (KEEP: kept)."""
    out = copy.deepcopy(cfg)

    def walk(cls, node):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in node:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], node[f.name])
            else:
                new = change(hints[f.name], node[f.name])
                if new is not KEEP:
                    node[f.name] = new
    walk(RunConfig, out)
    return out


def test_each_kind_of_value_builds_the_same_config(default, tmp_path):
    assert _same(default)
    # every float given as an int (as `trainer.hang_timeout_s=300` is typed): converted as OmegaConf does
    as_ints = _with_each_leaf(default, lambda h, v: int(v) if h is float and float(v).is_integer() else KEEP)
    assert sum(type(v) is int for v in _leaves(as_ints)) > sum(type(v) is int for v in _leaves(default))
    assert _same(as_ints)
    # every Optional field null
    nulls = _with_each_leaf(default, lambda h, v: None if typing.get_origin(h) is typing.Union else KEEP)
    assert nulls != default and _same(nulls)
    # a dict merged into its default (optimizer keeps _target_), nested dicts, a list replaced
    merged = copy.deepcopy(default)
    merged["optimizer"] = {"lr": 1e-3, "betas": [0.9, 0.95], "extra": {"a": {"b": 1}}}
    merged["hardware"]["links"] = {"nvlink": {"GBps": 450.0, "latency_us": 2}}
    merged["schedule"]["modules"] = ["a", "b"]
    merged["model"]["moe"] = {"aux_losses": [{"name": "load_balance", "coef": 0.01}]}  # the rest: defaults
    assert _same(merged)
    run = plain_object(RunConfig, copy.deepcopy(merged))
    # strings YAML would read as something else, in every string field: config.yaml quotes them
    tricky = iter(["true", "1e-3", "null", "~", "", "0x10", "1_000", "yes", ": x", "- a", "'q'", "#c", "1.5"] * 20)
    strings = _with_each_leaf(merged, lambda h, v: next(tricky) if h is str else KEEP)
    assert _same(strings)
    run = _omegaconf_object(copy.deepcopy(strings))
    assert _written_and_read(run, tmp_path) == run
    schema_default = RunConfig.__dataclass_fields__["optimizer"].default_factory()  # the merge's base
    assert run.optimizer == {"_target_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95], "extra": {"a": {"b": 1}}}
    assert list(run.optimizer)[0] == list(schema_default)[0] == "_target_"


@pytest.mark.parametrize("path,value", [
    ("trainer.steps", "4"),  # a string for an int: OmegaConf converts it
    ("trainer.steps", True),  # a bool for an int: OmegaConf refuses it
    ("trainer.steps", "${trainer.log_interval}"),  # an interpolation
    ("trainer.steps", "???"),  # a missing value
    ("trainer.no_such_key", 1),  # an unknown key
    ("trainer.hang_timeout_s", 2**60),  # an int a float cannot hold exactly
    ("optimizer", {1: 2}),  # a dict key that is not a string
    ("model.name", 3),  # a number for a string: OmegaConf converts it
])
def test_what_only_omegaconf_may_judge_is_left_to_it(default, path, value):
    """The direct path declines; load_config's answer (a value or a ConfigError) is
    OmegaConf's, as it was before the direct path existed."""
    from framework.config import ConfigError, derive_layout

    cfg = copy.deepcopy(default)
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    assert plain_object(RunConfig, copy.deepcopy(cfg)) is None
    try:
        expected = _omegaconf_object(copy.deepcopy(cfg))
    except ConfigError as e:
        with pytest.raises(ConfigError, match=f"^{e.key}"):
            load_config(copy.deepcopy(cfg))
    else:
        derive_layout(expected)
        assert load_config(copy.deepcopy(cfg)) == expected
