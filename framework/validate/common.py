"""Helpers every check uses: each failure is a ConfigError naming the key, the value and
the fix. Float keys go through `number`, which tests `math.isfinite` first: nan fails every
comparison, so a check written `x < 0` would let it through."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

from framework.config import ConfigError


def choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(key, value, "unknown name", f"use one of {', '.join(allowed)}")


def positive(key: str, value: int) -> None:
    if value is None or value < 1:
        raise ConfigError(key, value, "must be a positive integer", f"set {key} to 1 or more")


def number(key: str, value: Any, ok: Callable[[float], bool], problem: str, fix: str) -> None:
    """A finite number (not a bool) for which `ok` holds; else `key=value: problem`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(key, value, problem, fix)


def suggest(word: str, names: list[str]) -> list[str]:
    """The names closest to a mistyped one (difflib), best first: the "Did you mean" of an
    unknown key, group option or schedule."""
    return difflib.get_close_matches(word, names, n=3, cutoff=0.6)
