"""Schedules on the command line (no rank starts):

    python -m framework.schedules list        (each schedule, and whether its bubble is a closed form)
    python -m framework.schedules dump <name> --pp P --microbatches M [--virtual-stages V] [-o file.csv]
    python -m framework.schedules grid <name> --pp P --microbatches M [--virtual-stages V]

`dump` proves the schedule, then writes it in torch's compute-only CSV format (one row per
pipeline rank; torch's `_PipelineScheduleRuntime._load_csv` reads it, and
`schedule=csv schedule.csv=<file>` runs it here). `grid` prints it in unit time.

A bad argument is one `config error:` line and exit code 2 (framework/commands.py):
sizes below 1 or too large to prove in seconds, a (pp, m, v) the schedule refuses (its own
`why_not`, named by the argument), an output file that cannot be written.
"""

from __future__ import annotations

import sys

from framework.commands import ConfigError
from framework.commands import (MOST_ACTIONS, MOST_CHUNKS, MOST_MICROBATCHES, MOST_STAGES, Count, OutputPath,
                                       Parser, command)
from framework.schedules.check import ScheduleError, check
from framework.schedules import dump_csv, get, names
from framework.schedules.clock import grid

# A schedule's Violation names a config key; here it is this argument.
ARGUMENTS = {"parallelism.pp": "--pp", "schedule.microbatches": "--microbatches",
             "schedule.virtual_stages": "--virtual-stages", "schedule.name": "name"}


def parser() -> Parser:
    p = Parser(prog="python -m framework.schedules", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registered schedules")
    for command_name in ("dump", "grid"):
        s = sub.add_parser(command_name, help="write the schedule as torch's CSV" if command_name == "dump"
                           else "print the schedule in unit time")
        s.add_argument("name", choices=names())
        s.add_argument("--pp", type=Count(MOST_STAGES, "pipeline ranks"), required=True)
        s.add_argument("--microbatches", type=Count(MOST_MICROBATCHES, "proving more takes minutes"), required=True)
        s.add_argument("--virtual-stages", type=Count(MOST_CHUNKS, "model chunks per rank"), default=None,
                       help="default: what the schedule's preset uses")
        if command_name == "dump":
            s.add_argument("-o", "--output", type=OutputPath(stdout=True), default="-",
                           help="a CSV file (default: standard output)")
    return p


@command
def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "list":
        for n in names():
            s = get(n)
            print(f"{n:16} {s.doc}\n{'':16} bubble: "
                  + (f"closed form, {s.bubble_formula}" if s.bubble_formula else "schedule model (its lists on the clock)"))
        return 0
    sched = get(args.name)
    pp, m = args.pp, args.microbatches
    v = args.virtual_stages or sched.preset_chunks
    values = {"--pp": pp, "--microbatches": m, "--virtual-stages": v, "name": args.name}
    bad = sched.why_not(pp, m, v)
    if bad is not None:
        key = ARGUMENTS.get(bad.key, bad.key)
        fix = bad.fix
        for config_key, argument in ARGUMENTS.items():
            fix = fix.replace(f"{config_key}=", f"{argument} ").replace(config_key, argument)
        fix = fix.replace("schedule=", "schedule ")
        raise ConfigError(key, values.get(key), bad.reason, fix)
    if pp * m * v > MOST_ACTIONS:
        raise ConfigError("--microbatches", m, f"pp x microbatches x virtual stages = {pp * m * v:,} forwards per "
                          f"step, more than {MOST_ACTIONS:,} (proving them would take minutes)",
                          "fewer micro-batches, ranks or virtual stages")
    try:
        lists = check(args.name, pp, m, v)
    except ScheduleError as e:
        raise ConfigError("name", args.name, f"at --pp {pp} --microbatches {m} --virtual-stages {v}, its lists fail "
                          f"the checker: {e}", "another size, or another schedule") from None
    smap = sched.stage_map(pp, v)
    if args.command == "grid":
        print(grid(lists, smap))
        return 0
    try:
        dump_csv(lists, smap, "/dev/stdout" if args.output == "-" else args.output)
    except OSError as e:  # checked before; a full disk, a path that changed meanwhile
        raise ConfigError("--output", args.output, f"cannot be written ({e.strerror or e})",
                          "give a writable file path") from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
