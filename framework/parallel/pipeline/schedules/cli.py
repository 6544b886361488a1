"""Schedules on the command line (no rank starts):

    python -m framework.schedules list        (each schedule, and whether its bubble is a closed form)
    python -m framework.schedules dump <name> --pp P --microbatches M [--virtual-stages V] [-o file.csv]
    python -m framework.schedules grid <name> --pp P --microbatches M [--virtual-stages V]

`dump` proves the schedule, then writes it in torch's compute-only CSV format (one row per
pipeline rank; torch's `_PipelineScheduleRuntime._load_csv` reads it, and
`schedule=csv schedule.csv=<file>` runs it here). `grid` prints it in unit time.
"""

from __future__ import annotations

import argparse
import sys

from framework.parallel.pipeline.check import ScheduleError, check
from framework.parallel.pipeline.schedules import dump_csv, get, names
from framework.sim.clock import grid


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.schedules", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registered schedules")
    for command in ("dump", "grid"):
        p = sub.add_parser(command)
        p.add_argument("name", choices=names())
        p.add_argument("--pp", type=int, required=True)
        p.add_argument("--microbatches", type=int, required=True)
        p.add_argument("--virtual-stages", type=int, default=None, help="default: what the schedule's preset uses")
        if command == "dump":
            p.add_argument("-o", "--output", default="-", help="a CSV file (default: standard output)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for n in names():
            s = get(n)
            print(f"{n:16} {s.doc}\n{'':16} bubble: "
                  + (f"closed form, {s.bubble_formula}" if s.bubble_formula else "schedule model (its lists on the clock)"))
        return 0
    sched = get(args.name)
    v = args.virtual_stages or sched.preset_chunks
    try:
        lists = check(args.name, args.pp, args.microbatches, v)
    except ScheduleError as e:
        print(f"{args.name} at pp={args.pp}, microbatches={args.microbatches}, virtual_stages={v}: {e}",
              file=sys.stderr)
        return 2
    smap = sched.stage_map(args.pp, v)
    if args.command == "grid":
        print(grid(lists, smap))
    else:
        dump_csv(lists, smap, "/dev/stdout" if args.output == "-" else args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
