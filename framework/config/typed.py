"""`plain_object`: a composed config (plain dicts) as the schema's dataclasses, directly, for
the common case where every value already has its field's type.

`load_config` otherwise merges the config into the schema with OmegaConf (type checks,
conversions, unknown keys refused), ~30 ms a call here: twice per launch and once for each
of the schema fuzz's thousand cases, it was half of that test's time. This builds the same
object in ~2 ms when nothing needs OmegaConf's judgement, and returns None whenever
something might: an unknown key, a value whose type is not its field's (a string for a
number, a bool for an int; an int for a float is converted, as OmegaConf does), an
interpolation or a missing value (`${...}`, `???`), a dict key that is not a string. Then
OmegaConf decides, as before, and its conversion or error is what the user gets.
tests/test_config_typed.py holds the two paths equal on every option of every config group
and on each kind of value.

What OmegaConf's merge does that this repeats: a key the config leaves out keeps the
schema's default; a dict field merges the given dict into its default (the default's keys
first, a nested dict merged, anything else replaced); a list or any other value replaces.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, Optional

_ATOMS = (type(None), bool, int, float, str)


def plain_object(cls: type, data: Any) -> Optional[Any]:
    """`cls` (a schema dataclass) built from `data`, or None: OmegaConf must decide."""
    if not isinstance(data, dict):
        return None
    fields = _fields(cls)
    if any(not isinstance(k, str) or k not in fields for k in data):
        return None
    kwargs = {}
    for name, value in data.items():
        field, hint = fields[name]
        if dataclasses.is_dataclass(hint):
            value = plain_object(hint, value)
            if value is None:
                return None
        else:
            ok, value = _value(hint, value, _default(field))
            if not ok:
                return None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError:  # a field without a default left out: OmegaConf names it
        return None


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _value(hint, value, default) -> tuple[bool, Any]:
    """(whether `value` is exactly of type `hint`, the value as OmegaConf's merge leaves it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return type(None) in args, None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value, default) if len(inner) == 1 else (False, None)
    if hint is float and type(value) is int and abs(value) < 2**53:
        return True, float(value)  # what OmegaConf's FloatNode stores for an int (exactly, below 2**53)
    if hint in (bool, int, float):
        return type(value) is hint, value  # a bool is not taken for an int, nor a string for a number
    if hint is str:
        return type(value) is str and _plain_str(value), value
    if hint is Any:
        if isinstance(value, dict) and isinstance(default, dict):
            return _plain(value), _merged(default, value)
        return _plain(value), copy.deepcopy(value)
    if hint is dict or origin is dict:
        if not isinstance(value, dict) or not _plain(value):
            return False, None
        if args and (args[0] is not str or args[1] is not Any):
            return False, None
        return True, _merged(default if isinstance(default, dict) else {}, value)
    if hint is list or origin is list:
        if not isinstance(value, list) or not _plain(value):
            return False, None
        if args and args[0] is not Any and not (typing.get_origin(args[0]) is dict and all(
                isinstance(v, dict) for v in value)):
            return False, None
        return True, copy.deepcopy(value)
    return False, None


def _plain_str(s: str) -> bool:
    return "${" not in s and s != "???"


def _plain(value) -> bool:
    """JSON-like all the way down: atoms, lists, dicts with string keys; no interpolation."""
    if isinstance(value, str):
        return _plain_str(value)
    if type(value) in _ATOMS:
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _merged(default: dict, given: dict) -> dict:
    """OmegaConf's merge of a dict into another: the default's keys first, dicts merged."""
    out = copy.deepcopy(default)
    for k, v in given.items():
        if isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
