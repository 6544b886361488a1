"""`python -m framework.schedules list | dump | grid ...`: the schedule registry's CLI
(framework/schedules/cli.py)."""

import sys

from framework.schedules.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
