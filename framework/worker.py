"""`torchrun ... -m framework.worker <job dir>`: one rank (framework/train/worker.py)."""

import sys

from framework.train.worker import main

if __name__ == "__main__":
    main(sys.argv[1:])
