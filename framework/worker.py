"""A rank's entry point: read the resolved config from the job directory, train, exit.

Ranks never run Hydra: the launching process composed, validated and wrote
`<job_dir>/config.yaml` and `<job_dir>/run_info.json`. Locally `launch_local` calls
`rank_main`; on a cluster run `torchrun ... -m framework.worker <job_dir>`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from torch.distributed.elastic.multiprocessing.errors import record

from .config import read_config
from .logging import RunInfo

FAILURES_DIR = "rank_failures"


@record
def rank_main(job_dir: str, info: dict) -> Optional[dict]:
    import logging

    import torch.distributed as dist

    from .launch import init_rank

    # The launcher prints the failed rank's traceback once; elastic's in-rank error log
    # would print it a second time, prefixed on every line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    from .trainer import train

    try:
        run = read_config(os.path.join(job_dir, "config.yaml"))
        ctx = init_rank(run)
        try:
            return train(run, RunInfo(**info), ctx, job_dir)
        finally:
            dist.destroy_process_group()
    except BaseException:
        record_failure(job_dir)
        raise


def record_failure(job_dir: str) -> None:
    """Note this rank's failure with a precise time: when one rank dies, its peers' next
    collective fails too ("connection closed by peer") within milliseconds, and elastic's
    own error files only keep whole seconds. The launcher reports the earliest as the cause."""
    import time
    import traceback

    folder = os.path.join(job_dir, FAILURES_DIR)
    os.makedirs(folder, exist_ok=True)
    rank = os.environ.get("RANK", "?")
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}, f)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: torchrun [options] -m framework.worker <job_dir>   (written by run.py launcher=external)")
    job_dir = argv[0]
    with open(os.path.join(job_dir, "run_info.json")) as f:
        info = json.load(f)
    rank_main(job_dir, info)


if __name__ == "__main__":
    main(sys.argv[1:])
