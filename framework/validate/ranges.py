"""The schema's rules, enforced on every key: what framework/config/'s `key(...)` states
(range, finiteness, choices, non-empty, the condition under which the key acts) is checked
here for every key of a run, so a key is validated by stating its rule, not by someone
remembering to write its check. Cross-key conditions a rule cannot state stay in the
hand-written checks beside this module.

Types are OmegaConf's, at merge (framework.config.load_config): a string for an int, a
float for an int, a word for a bool are rejected there, naming the key.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Iterator
from dataclasses import Field, fields, is_dataclass
from typing import Any

from framework.config import ConfigError, Rule, RunConfig, rule_of

# Command-line names of schema fields stored under another name (config._sim_from).
CLI_NAMES = {"sim.source": "sim.from"}
_OPS = {"ge": (">=", lambda x, b: x >= b), "gt": (">", lambda x, b: x > b),
        "le": ("<=", lambda x, b: x <= b), "lt": ("<", lambda x, b: x < b)}


@functools.lru_cache(maxsize=1)
def leaves() -> tuple[tuple[str, str, Field, Any], ...]:
    """(command-line path, attribute path, field, type with Optional removed) of every leaf
    key of RunConfig (computed once: the schema is fixed for the process)."""
    return tuple(_leaves(RunConfig, ""))


def _leaves(cls: type, prefix: str) -> Iterator[tuple[str, str, Field, Any]]:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        attr = prefix + f.name
        t = unwrap(hints[f.name])
        if is_dataclass(t):
            yield from _leaves(t, attr + ".")
        else:
            yield CLI_NAMES.get(attr, attr), attr, f, t


def unwrap(t: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t


def lookup(run: Any, attr: str) -> Any:
    for part in attr.split("."):
        run = getattr(run, part)
    return run


def check_ranges(run: RunConfig) -> None:
    """Every key's value against its rule."""
    for path, attr, f, t in leaves():
        check_value(run, path, lookup(run, attr), rule_of(f), t, f)


def check_value(run: RunConfig, path: str, value: Any, rule: Rule, t: Any, f: Field) -> None:
    if value is None:
        return  # OmegaConf let it through: the key is Optional, and null has a stated meaning
    if rule.choices and value not in rule.choices:
        raise ConfigError(path, value, "unknown name", f"use one of {', '.join(map(str, rule.choices))}")
    if isinstance(value, str) and rule.nonempty and not value.strip():
        raise ConfigError(path, value, "empty", f"give a value, or null for the default ({_default(f)!r})")
    if t in (int, float) and not isinstance(value, bool):
        _number(run, path, value, rule, t, f)


def _number(run: RunConfig, path: str, value: float, rule: Rule, t: Any, f: Field) -> None:
    noun = "integer" if t is int else "number"
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(path, value, f"must be a {noun}, not nan", _example(path, f, run, rule))
    if isinstance(value, float) and math.isinf(value) and not rule.inf:
        raise ConfigError(path, value, f"must be a finite {noun}", _example(path, f, run, rule))
    for op, bound, ref in _bounds(run, rule):
        text, ok = _OPS[op]
        if not ok(value, bound):
            where = f" ({ref}={bound})" if ref else ""
            raise ConfigError(path, value, f"must be {text} {ref or _shown(bound)}{where}",
                              _example(path, f, run, rule, value))


def _bounds(run: RunConfig, rule: Rule) -> list[tuple[str, float, str]]:
    """(op, bound, the key it comes from or "") of a rule; a bound from a null key is skipped."""
    out = []
    for op in _OPS:
        b = getattr(rule, op)
        if isinstance(b, str):
            value = lookup(run, b)
            if value is not None:
                out.append((op, value, b))
        elif b is not None:
            out.append((op, b, ""))
    return out


def range_text(run: RunConfig, rule: Rule) -> str:
    return " and ".join(f"{_OPS[op][0]} {_shown(bound)}" for op, bound, _ in _bounds(run, rule))


def _shown(bound: float) -> str:
    """2**40, not 1099511627776."""
    if isinstance(bound, int) and bound >= 1 << 16 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return str(bound)


def _default(f: Field) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def _example(path: str, f: Field, run: RunConfig, rule: Rule, value: Any = None) -> str:
    """The fix: the range, with an example inside it (the default when it is inside, else the
    bound nearest the value given: data.seq_len's default 64 is no example of `<= 16`)."""
    text = range_text(run, rule)
    default = _default(f)
    if not text:
        return f"set {path} to a finite number, e.g. its default {default}"
    if default is not None and _inside(run, rule, default):
        return f"set {path} {text}, e.g. its default {path}={default}"
    inside = [b for _, b, _ in _bounds(run, rule) if _inside(run, rule, b)]
    near = value if isinstance(value, (int, float)) and math.isfinite(value) else 0
    example = min(inside, key=lambda b: abs(b - near)) if inside else None
    return f"set {path} {text}" + (f", e.g. {path}={_shown(example)}" if example is not None else "")


def _inside(run: RunConfig, rule: Rule, value: Any) -> bool:
    return isinstance(value, (int, float)) and all(_OPS[op][1](value, b) for op, b, _ in _bounds(run, rule))


def check_effect(run: RunConfig, overrides: list[str]) -> None:
    """A key given on the command line that has no effect in this run (a loss-scaling key
    without fp16-mixed, a zb-auto key under another schedule, an expert key on a dense
    model) is refused: silently ignored, it would make a sweep or a comparison lie."""
    rules = {path: (attr, rule_of(f), f) for path, attr, f, _ in leaves()}
    for o in overrides:
        name, _, value = o.lstrip("+~").partition("=")
        attr, rule, f = rules.get(name, (None, None, None))
        if o.startswith("~") or value == "null" or rule is None or rule.when is None or rule.when(run):
            continue
        if lookup(run, attr) == _default(f):
            continue  # spelled out at its default (a sweep's `overlap_cp_ring=false` beside cp_comm=a2a): changes nothing
        raise ConfigError(name, lookup(run, attr), f"has no effect in this run: it acts only with {rule.when_text}",
                          f"leave {name} out, or set {rule.when_text}")
