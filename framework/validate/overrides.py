"""The command line's keys and group options, checked before Hydra composes anything.

Hydra rejects a key its composed config lacks (`trainer.stepz=10`) or a group option with
no file (`schedule=zbhh1`) with its own multi-line message, before run.py's task function
runs, so no later check can word it; and `+trainer.stepz=10`, which Hydra accepts, only
met the schema after composition. So run.py parses the overrides here first, as Hydra
parses them (its OverridesParser), and checks each one: a dotted key against the typed
schema (framework/config/'s dataclasses), a group's options (and each value of a sweep)
against conf/<group>/*.yaml. The first unknown one is a ConfigError with the closest names
(difflib), for a single run and a `-m` sweep alike: a typo in a sweep would fail every job.

Hydra's own keys (`hydra.*`, `hydra/launcher=...`) are Hydra's to check. Below a free-form
key (the optimizer's arguments, schedule.op_times, any dict, list or Any) every name is
accepted: framework.validate checks those with the object they configure.
"""

from __future__ import annotations

import argparse
import functools
import os
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Optional

from framework.config import ConfigError, RunConfig
from framework.validate.common import suggest

# Command-line names the schema stores under another (config.py's _sim_from).
ALIASES = {"sim.source": "sim.from"}
DOCS = "docs/configuration.md lists every key"


@functools.lru_cache(maxsize=1)
def schema_keys() -> dict[str, bool]:
    """Every key path of the schema (dataclass nodes included) -> whether any name below
    it is accepted (computed once per process)."""
    return _schema_keys(RunConfig, "")


def _schema_keys(cls: type, prefix: str) -> dict[str, bool]:
    """Every key path of the schema (dataclass nodes included) -> whether any name below
    it is accepted (a dict, list or Any field)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        path = ALIASES.get(prefix + f.name, prefix + f.name)
        t = _unwrap(hints[f.name])
        if is_dataclass(t):
            out[path] = False
            out.update(_schema_keys(t, path + "."))
        else:
            out[path] = t is Any or typing.get_origin(t) in (dict, list) or t in (dict, list)
    return out


def _unwrap(t: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t


def known_key(key: str, keys: dict[str, bool]) -> bool:
    parts = key.split(".")
    return any(keys.get(".".join(parts[:i])) for i in range(1, len(parts))) or key in keys


def group_options(conf_dirs: list[str], group: str) -> Optional[list[str]]:
    """The options of a config group (its .yaml files, without the suffix); None when no
    directory holds the group."""
    dirs = [os.path.join(d, group) for d in conf_dirs if os.path.isdir(os.path.join(d, group))]
    if not dirs:
        return None
    return sorted({os.path.relpath(os.path.join(root, f), d)[:-len(".yaml")]
                   for d in dirs for root, _, files in os.walk(d) for f in files if f.endswith(".yaml")})


def check_overrides(overrides: list[str], conf_dirs: list[str], check_groups: bool = True) -> None:
    """Raise a ConfigError for the first override whose key is in neither the schema nor
    conf/'s groups, or whose group option (any value of a sweep) has no file."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # a syntax error: Hydra's message shows where in the line
    keys = schema_keys()
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        shown = o.input_line.split("=", 1)[0]  # as typed: +, ++ and ~ kept
        options = group_options(conf_dirs, key)
        if options is not None:
            if check_groups and not o.is_delete():
                _check_options(key, shown, o, options, conf_dirs[0])
        elif key in keys and not o.is_delete():
            _check_literal(key, shown, o)
        elif not known_key(key, keys):
            close = _close_keys(key, list(keys) + [g for g in _groups(conf_dirs) if g not in keys])
            text = o.input_line.split("=", 1)[1] if "=" in o.input_line else ""
            fix = f"{close[0]}={text} ({DOCS})" if close and not o.is_delete() else DOCS
            raise ConfigError(shown, None if o.is_delete() else _value(o), "no such key" + _did_you_mean(close), fix)


def _check_literal(key: str, shown: str, o) -> None:
    """What Hydra would merge before any check of ours sees it: a dict for a list key (or the
    reverse) fails inside Hydra's composition, and `2` for a bool key becomes True in
    OmegaConf. Each value of a sweep is checked."""
    from framework.validate.ranges import leaves, unwrap

    types = {path: t for path, _, _, t in leaves()}
    t = types.get(key)
    if t is None:
        return
    values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    for value in values:
        if value is None:
            continue  # null: the schema says whether the key may be null
        if t is bool and not isinstance(value, bool):
            raise ConfigError(shown, value, "must be true or false", f"{key}=true or {key}=false")
        shape = list if (t is list or typing.get_origin(unwrap(t)) is list) else \
            dict if (t is dict or typing.get_origin(unwrap(t)) is dict) else None
        if shape is not None and not isinstance(value, shape):
            example = "[a, b]" if shape is list else "{name: value}"
            raise ConfigError(shown, value, f"must be a {shape.__name__}", f"e.g. {key}={example}")


def _close_keys(key: str, names: list[str]) -> list[str]:
    """The closest key paths: the command-line name of a schema field (sim.source ->
    sim.from), one with the same last name (`trainer.seq_len` -> data.seq_len), then by the
    whole path and by the last name."""
    tail = key.rsplit(".", 1)[-1]
    last = {}
    for name in names:
        last.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    close = [ALIASES[key]] if key in ALIASES else []
    close += last.get(tail, []) + suggest(key, names)
    close += [n for word in suggest(tail, list(last)) for n in last[word]]
    return list(dict.fromkeys(close))[:3]


def _check_options(group: str, shown: str, o, options: list[str], conf_dir: str) -> None:
    if o.value_type is not None and o.value_type.name == "GLOB_CHOICE_SWEEP":
        return  # Hydra matches the glob against the options itself
    values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    for value in values:
        if value is None or value == "null":
            if _default_option(conf_dir, group) is not None:
                raise ConfigError(shown, None, f"conf/{group}/ has no null option: the run needs one of them",
                                  f"the options: {', '.join(options)}")
            continue
        names = value if isinstance(value, list) else [value]  # a list: Hydra's multi-select of options
        if not all(isinstance(v, str) for v in names):
            raise ConfigError(shown, value, "a config group takes the name of one of its options",
                              f"the options: {', '.join(options)}")
        if all(v in options for v in names):
            continue
        value = next(v for v in names if v not in options)
        close = suggest(value, options)
        raise ConfigError(shown, value, f"no such option in conf/{group}/" + _did_you_mean(close),
                          (f"{group}={close[0]}; " if close else "") + f"the options: {', '.join(options)}")


def _default_option(conf_dir: str, group: str) -> Optional[str]:
    """conf/config.yaml's default option of a group (None: null, or not listed)."""
    path = os.path.join(conf_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    return next((d[group] for d in _yaml(path).get("defaults", []) if isinstance(d, dict) and group in d), None)


def _value(o) -> Any:
    return o.get_value_element_as_str() if o.is_sweep_override() else o.value()


def _groups(conf_dirs: list[str]) -> list[str]:
    return sorted({g for d in conf_dirs if os.path.isdir(d) for g in os.listdir(d) if os.path.isdir(os.path.join(d, g))})


def _did_you_mean(names: list[str]) -> str:
    if not names:
        return ""
    return f". Did you mean {' or '.join(names) if len(names) < 3 else ', '.join(names[:-1]) + ' or ' + names[-1]}?"


def check_command_line(argv: list[str], conf_dir: str) -> None:
    """`check_overrides` on run.py's arguments, separated from Hydra's flags as Hydra's own
    argument parser separates them. Another config directory (`--config-path`, a
    hydra.searchpath) leaves the group options to Hydra; `--config-dir` adds its groups."""
    from hydra._internal.utils import get_args_parser

    if {"-h", "--help", "--hydra-help", "--version", "-sc", "--shell-completion", "-i", "--info"} & set(argv):
        return
    try:
        args, _ = _quiet(get_args_parser()).parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return  # Hydra says what is wrong with its flags
    dirs = [conf_dir] + ([args.config_dir] if args.config_dir else [])
    own_path = args.config_path is not None or any(o.lstrip("+").startswith("hydra.searchpath") for o in args.overrides)
    check_overrides(list(args.overrides), dirs, check_groups=not own_path)


def _quiet(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A parser that raises instead of printing usage and exiting."""
    parser.exit_on_error = False
    parser.error = lambda message: (_ for _ in ()).throw(argparse.ArgumentError(None, message))
    return parser


def add_absent_keys(argv: list[str], conf_dir: str) -> list[str]:
    """A schema key that the chosen preset's YAML does not list (`model.moe.top_k=4` with
    model=gpt2, `model.moe.bias_update_rate=0.01` with a preset that leaves it to the default)
    would meet Hydra's "Key 'moe' is not in struct" before any check of ours could word it:
    such an override is passed on as `++key=value` (add or override), so the schema receives
    it, and framework.validate says what it means for this run (a key that has no effect is
    refused there). So is an override of an open key (a dict or list field), whose new names
    struct mode would refuse the same way. Other keys every chosen option lists are passed on
    untouched."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except HydraException:
        return argv
    chosen = {o.key_or_group: (list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()])
              for o in parsed if "." not in o.key_or_group and group_options([conf_dir], o.key_or_group) is not None}
    top = _yaml(os.path.join(conf_dir, "config.yaml"))
    defaults = {k: v for d in top.get("defaults", []) if isinstance(d, dict) for k, v in d.items()}
    keys = schema_keys()
    out = []
    for arg in argv:
        plain = not arg.startswith(("-", "+", "~")) and "=" in arg
        key = arg.split("=", 1)[0]
        group, _, rest = key.partition(".")
        if plain and rest and key in keys and group_options([conf_dir], group) is not None:
            options = chosen.get(group) or [defaults.get(group)]
            # an open key (a dict or list: hardware.links, schedule.op_times) takes names no
            # preset lists, which struct mode refuses; its owner checks what it holds
            if keys[key] or any(not _lists(conf_dir, top, group, option, rest) for option in options):
                arg = "++" + arg
        out.append(arg)
    return out


def _lists(conf_dir: str, top, group: str, option, rest: str) -> bool:
    """Whether conf/config.yaml's own section or the group option's YAML holds the key."""
    if _has(top.get(group), rest):
        return True
    if not isinstance(option, str):
        return True  # null or an unparsed value: nothing to compare against
    path = os.path.join(conf_dir, group, option + ".yaml")
    return os.path.isfile(path) and _has(_yaml(path), rest)


@functools.lru_cache(maxsize=256)
def _yaml(path: str) -> dict:
    """A conf/ YAML file as plain data (read once per process: conf/ does not change under a run)."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _has(node, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
