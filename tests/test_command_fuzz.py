"""Every argument of every command, fuzzed from its own declaration: no list of arguments
here. For each command's argparse parser (`parser()` of framework/sim/cli.py,
framework/report/compare.py and framework/schedules/cli.py, and each
subcommand's parser), every action gets bad values derived from its type, choices and nargs;
`main(argv)` runs in-process on a valid base command line with that one value changed. Each
case either succeeds (the value is in fact valid) or returns a non-zero code with exactly one
`config error:` line on stderr naming the argument or the value, no traceback, nothing on
stdout, within TIME_S and MEMORY_BYTES (tracemalloc's peak). The simulator's key=value
overrides get one pass over its layout keys, with values from each key's schema type."""

from __future__ import annotations

import argparse
import time
import tracemalloc

import pytest
from omegaconf import OmegaConf

from framework.commands import key_of
from framework.schedules import cli as schedules_cli
from framework.report import compare as report_cli
from framework.sim import cli as simulate_cli

from .conftest import PIPELINE_JOB, compose

TIME_S = 20.0
MEMORY_BYTES = 200 * 2**20

# Bad values by the kind of argument; MUST_FAIL are never valid for that kind.
BAD = {"int": ["abc", "0", "-1", "99999999999999999999"], "float": ["nan", "inf", "-1", "abc"],
       "choice": ["nosuch"], "path": ["{missing}", "{garbage}", ""], "str": ["nosuch", ""]}
MUST_FAIL = {"abc", "nosuch", "{missing}", ""}

# A valid command line per command (and subcommand), by argument name (key_of): the base each case changes.
COMMANDS = {
    "simulate": (simulate_cli, {"sim.from": "{job}", "overrides": []}),
    "report": (report_cli, {"sweep_dir": "{sweep}"}),
    "schedules": (schedules_cli, {"list": {},
                                  "dump": {"name": "flush", "--pp": "2", "--microbatches": "4", "--output": "{out}"},
                                  "grid": {"name": "zbh1", "--pp": "2", "--microbatches": "4"}}),
}


def kind(action: argparse.Action) -> str:
    name = getattr(action.type, "__name__", "str")  # int, float, or an argument type named like one
    if action.choices is not None:
        return "choice"
    return name if name in ("int", "float") else "path"


def argv_of(parser: argparse.ArgumentParser, values: dict) -> list[str]:
    """The command line that gives each argument its value (positionals first, in order)."""
    out = []
    for a in parser._actions:
        if not a.option_strings and key_of(a) in values:
            v = values[key_of(a)]
            out += v if isinstance(v, list) else [v]
    for a in parser._actions:
        v = values.get(key_of(a))
        if a.option_strings and v not in (None, False):
            out += [a.option_strings[0]] + ([] if v is True else [v])
    return out


def cases_of(parser: argparse.ArgumentParser, base: dict, prefix: list[str]):
    """(argument, bad value, argv, must fail) for every action of `parser` and its subcommands."""
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if isinstance(a, argparse._SubParsersAction):
            yield from ((key_of(a), v, [*prefix, v], True) for v in BAD["choice"])
            for name, sub in a.choices.items():
                yield from cases_of(sub, base[name], [*prefix, name])
            continue
        if a.nargs == 0:  # a flag: no value to get wrong; set, the base still runs
            yield key_of(a), True, [*prefix, *argv_of(parser, {**base, key_of(a): True})], False
            continue
        for v in BAD[kind(a)]:
            given = [v] if a.nargs in ("*", "+") else v
            yield key_of(a), v, [*prefix, *argv_of(parser, {**base, key_of(a): given})], v in MUST_FAIL


def override_cases():
    """simulate's key=value overrides: each layout key (KEYS) with bad values of its schema type."""
    run = OmegaConf.structured(compose(*PIPELINE_JOB))
    for key in simulate_cli.KEYS:
        default = OmegaConf.select(run, "schedule.name" if key == "schedule" else key)
        for v in BAD["int" if isinstance(default, int) else "str"]:
            yield key, v, ["{job}", f"{key}={v}"], v in MUST_FAIL


CASES = [(name, *case) for name, (module, base) in COMMANDS.items()
         for case in cases_of(module.parser(), base, [])] + [("simulate", *c) for c in override_cases()]
IDS = [f"{c}{' ' + argv[0] if c == 'schedules' and k != 'command' else ''}:{k}={v!r}" for c, k, v, argv, _ in CASES]


@pytest.fixture(scope="module")
def places(tmp_path_factory, pipeline_job_files) -> dict:
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "garbage.bin").write_bytes(bytes(range(256)) * 4)
    sweep = tmp / "sweep" / "0"
    sweep.mkdir(parents=True)
    for f in pipeline_job_files.iterdir():
        (sweep / f.name).write_bytes(f.read_bytes())
    return {"job": str(pipeline_job_files), "sweep": str(sweep.parent), "out": str(tmp / "out.csv"),
            "missing": str(tmp / "missing" / "x"), "garbage": str(tmp / "garbage.bin")}


def _run(command: str, argv: list[str], places: dict, capsys) -> tuple[int, str, str, float, int]:
    argv = [a.format(**places) for a in argv]
    capsys.readouterr()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        code = COMMANDS[command][0].main(argv)
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out = capsys.readouterr()
    return code, out.out, out.err, seconds, peak


@pytest.mark.parametrize("command", COMMANDS)
def test_each_base_command_line_runs(command, places, capsys):
    """The base the cases change is valid, so a failing case fails for its one value."""
    module, base = COMMANDS[command]
    parser = module.parser()
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    lines = [[name, *argv_of(sub.choices[name], base[name])] for name in sub.choices] if sub \
        else [argv_of(parser, base)]
    for argv in lines:
        code, out, err, _, _ = _run(command, argv, places, capsys)
        assert code == 0 and err == "", (argv, err)


@pytest.mark.parametrize("command,key,value,argv,must_fail", CASES, ids=IDS)
def test_a_bad_argument_is_one_line_or_valid(command, key, value, argv, must_fail, places, capsys):
    code, out, err, seconds, peak = _run(command, argv, places, capsys)
    assert seconds < TIME_S and peak < MEMORY_BYTES, (seconds, peak)
    assert "Traceback" not in err, err
    if code == 0:
        assert not must_fail, f"{argv}: {value!r} is no valid {key}, yet the command succeeded"
        return
    assert code == 2 and out == "", (code, out)
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    shown = str(value).format(**places) if isinstance(value, str) else ""
    assert f"{key}=" in err or (shown and shown in err), err


def test_the_fuzz_covers_every_argument():
    """Every action of every parser is in CASES (a new argument is fuzzed without an edit here)."""
    def keys(parser, prefix=""):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                yield f"{prefix}{key_of(a)}"
                for name, sub in a.choices.items():
                    yield from keys(sub, f"{prefix}{name} ")
            elif not isinstance(a, argparse._HelpAction):
                yield f"{prefix}{key_of(a)}"
    declared = {(name, k.split()[-1]) for name, (module, _) in COMMANDS.items() for k in keys(module.parser())}
    assert declared and declared <= {(c, k) for c, k, *_ in CASES}
    assert {k for c, k, *_ in CASES if c == "simulate"} >= set(simulate_cli.KEYS)


def test_the_line_is_config_errors_own_form():
    """commands.message formats without importing framework.config (torch): the same text."""
    from framework.config import ConfigError
    from framework.commands import message

    for value, problem in [("x", "no such directory"), (None, "is required"), (3, "no such choice. Did you mean 2?")]:
        assert message("--k", value, problem, "do y") == str(ConfigError("--k", value, problem, "do y"))
