"""The arguments of the framework's commands (`python -m framework.simulate`, `python -m
framework.report`, `python -m framework.schedules`), checked one way: every bad argument is
ONE line on stderr, `config error: <argument>=<value>: problem. Fix: ...` (ConfigError's
form, as run.py prints it), and exit code 2; never argparse's usage block, never a traceback.

- `Parser`      argparse, whose complaints (an unknown option, a missing argument, a value its
                type or its choices refuse) become that line; its subcommands' parsers too
- `Count`, `OutputPath`, `Directory`  argument types that say what is wrong with a value
- `command`     wraps a command's `main(argv) -> int`: a ConfigError raised anywhere inside
                becomes that line; an exit is returned as its code, never raised
- `ConfigError` the one error type of a bad value (key, value, problem, fix); `first_line`
- `reject`      print one such line (the commands' own checks); `message` its text
- MOST_*        the sizes a command computes in seconds

Why here and not in validate/: importing framework.validate imports the model stack (torch,
transformers), and `python -m framework.report` reads JSON and YAML only. So this module
imports nothing of the framework, and ConfigError itself lives here, the lowest module, so
every package can raise it and a command recognises it without importing the schema.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import sys
from typing import Any, Callable, NoReturn, Optional

EXIT_CODE = 2  # a bad argument (argparse's own code for one)
# Sizes a command checks or replays in seconds (framework.schedules proves every list;
# framework.simulate replays every micro-batch): 10^20 micro-batches would never finish.
MOST_MICROBATCHES = 4096
MOST_STAGES = 256  # pipeline ranks (--pp)
MOST_CHUNKS = 64  # model chunks per rank (--virtual-stages)
MOST_ACTIONS = 2**15  # pp x microbatches x virtual stages: forwards per step the checker proves


def reject(key: str, value: Any, problem: str, fix: str) -> NoReturn:
    _print(message(key, value, problem, fix))
    raise SystemExit(EXIT_CODE)


class ConfigError(ValueError):
    """A bad configuration value; the message names the key, the value and the fix. Here,
    the lowest module, so that every package can raise it (framework.config re-exports it)."""

    def __init__(self, key: str, value: Any, problem: str, fix: str):
        self.key, self.value = key, value
        super().__init__(message(key, value, problem, fix))


def message(key: str, value: Any, problem: str, fix: str) -> str:
    """str(ConfigError(key, value, problem, fix)): `key=value: problem. Fix: fix`."""
    end = " " if problem.endswith("?") else ". "  # "no such key. Did you mean x? Fix: ..."
    return f"{key}={value!r}: {problem}{end}Fix: {fix}"


def first_line(e: BaseException) -> str:
    """An exception's first line (its type's name when it has no text): what one line quotes."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _print(error: Exception | str) -> None:
    line = " ".join(str(error).split("\n"))  # one line, whatever a problem quoted
    print(f"config error: {line}", file=sys.stderr, flush=True)


def command(main: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """`main(argv)` with the commands' contract: returns the exit code (0, or 2 for a bad
    argument, told in one line), so a test or another program can call it in-process."""
    @functools.wraps(main)
    def run(argv: list[str]) -> int:
        try:
            return main(list(argv))
        except SystemExit as e:  # argparse's --help (0), reject() (2)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except ValueError as e:
            if not isinstance(e, ConfigError):
                raise
            _print(e)
            return EXIT_CODE
    return run


class BadValue(argparse.ArgumentTypeError):
    """What an argument type raises: argparse keeps it as the context of its ArgumentError,
    and `Parser` reads the value, problem and fix from it."""

    def __init__(self, value: Any, problem: str, fix: str):
        super().__init__(problem)
        self.value, self.problem, self.fix = value, problem, fix


class Count:
    """A whole number in [1, most]; `most` bounds what the command would compute (a
    schedule of 10^20 micro-batches never finishes checking). argparse and the fuzz test
    read its `__name__`, "int"."""

    def __init__(self, most: int, why: str):
        self.most, self.why, self.__name__ = most, why, "int"

    def __call__(self, text: str) -> int:
        fix = f"give a whole number from 1 to {self.most:,}"
        try:
            n = int(text)
        except ValueError:
            raise BadValue(text, "is not a whole number", fix) from None
        if n < 1:
            raise BadValue(n, "must be 1 or more", fix)
        if n > self.most:
            raise BadValue(n, f"is more than {self.most:,} ({self.why})", fix)
        return n


class OutputPath:
    """A file to write: not empty, in a directory that exists, not a directory itself; `-`
    (standard output) where `stdout`; with one of `suffixes` where given."""

    def __init__(self, stdout: bool = False, suffixes: Optional[tuple[str, ...]] = None):
        self.stdout, self.suffixes, self.__name__ = stdout, suffixes, "path"

    def __call__(self, text: str) -> str:
        if self.stdout and text == "-":
            return text
        fix = "give a file path in an existing, writable directory" + (" (or - for standard output)" if self.stdout
                                                                      else "")
        if not text:
            raise BadValue(text, "is empty", fix)
        if os.path.isdir(text):
            raise BadValue(text, "is a directory", fix)
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise BadValue(text, f"its directory {parent} does not exist", f"create it first (mkdir -p {parent}), or "
                           + fix)
        if not os.access(parent, os.W_OK):
            raise BadValue(text, f"its directory {parent} is not writable", fix)
        suffix = os.path.splitext(text)[1].lower().lstrip(".")
        if self.suffixes is not None and suffix and suffix not in self.suffixes:
            raise BadValue(text, f"cannot be written as .{suffix}", f"end the name in one of "
                           f"{', '.join('.' + s for s in self.suffixes)}")
        return text


class Directory:
    """An existing directory (`name` says what it must be, in the fix)."""

    def __init__(self, fix: str):
        self.fix, self.__name__ = fix, "directory"

    def __call__(self, text: str) -> str:
        if not text:
            raise BadValue(text, "is empty", self.fix)
        if not os.path.isdir(text):
            raise BadValue(text, "is a file, not a directory" if os.path.exists(text) else "no such directory",
                           self.fix)
        return text


def key_of(action: argparse.Action) -> str:
    """The name an argument's errors use: its long option (`--output` of `-o/--output`),
    else the positional's name (its dest, `sim.from` for simulate's job directory)."""
    if action.option_strings:
        return max(action.option_strings, key=len)
    return action.dest


class Parser(argparse.ArgumentParser):
    """argparse with the commands' one-line errors (the module docstring). Subcommands'
    parsers are Parsers too (argparse builds them with the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # ArgumentErrors reach parse_known_args below, with their action
        kwargs.setdefault("allow_abbrev", False)  # --micro is not --microbatches: say so instead of guessing
        super().__init__(*args, **kwargs)

    @property
    def fix(self) -> str:
        return f"{self.prog} --help lists its arguments"

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            action = self._action_named(e.argument_name)
            key = key_of(action) if action is not None else (e.argument_name or "arguments")
            bad = e.__context__
            if isinstance(bad, BadValue):
                reject(key, bad.value, bad.problem, bad.fix)
            reject(key, None, e.message, self.fix)  # e.g. "expected one argument"

    def _action_named(self, name: Optional[str]) -> Optional[argparse.Action]:
        return next((a for a in self._actions if name is not None and argparse._get_action_name(a) == name), None)

    def _check_value(self, action, value):
        """A value outside the argument's choices (argparse's own check, with a suggestion)."""
        if action.choices is not None and value not in action.choices:
            allowed = [str(c) for c in action.choices]
            close = difflib.get_close_matches(str(value), allowed, n=2, cutoff=0.6)
            reject(key_of(action) if action.dest != argparse.SUPPRESS else "command", value,
                   "no such choice" + (f". Did you mean {' or '.join(close)}?" if close else ""),
                   f"use one of {', '.join(allowed)}")

    def error(self, message: str) -> NoReturn:
        """argparse's remaining complaints: a missing argument, an unknown one."""
        required = "the following arguments are required: "
        unknown = "unrecognized arguments: "
        if message.startswith(required):
            first = message[len(required):].split(", ")[0]
            action = self._action_named(first)
            reject(key_of(action) if action else first, None, "is required", self.fix)
        if message.startswith(unknown):
            token = message[len(unknown):].split(" ")[0]
            if token.startswith("-"):
                name, _, value = token.partition("=")
                options = [o for a in self._actions for o in a.option_strings]
                close = difflib.get_close_matches(name, options, n=2, cutoff=0.6)
                reject(name, value or None,
                       "no such option" + (f". Did you mean {' or '.join(close)}?" if close else ""), self.fix)
            reject("arguments", token, f"one argument too many for {self.prog}", self.fix)
        reject("arguments", None, message, self.fix)
