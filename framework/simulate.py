"""`python -m framework.simulate <job dir> [overrides]`: the simulator's CLI (framework/sim/cli.py)."""

import sys

from framework.sim.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
