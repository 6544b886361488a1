"""The rank side: start-up, training, and telling the launcher how the rank ended.

Ranks never run Hydra: the launching process composed, validated and wrote
`<job_dir>/config.yaml` and `<job_dir>/run_info.json`. Locally `launch_local` calls
`rank_main`; on several nodes `python -m framework.launch.node ... <job_dir>` (torchrun's
agent with the watchdog and the diagnosis) calls it too, and plain
`torchrun ... -m framework.worker <job_dir>` runs `main` below (failures then told only in
torchrun's logs).

What a rank leaves for the launcher (which only reads it, framework/launch/):
- `.flight/rank<r>`: its flight recorder (framework/train/flight.py), created before anything
  that can block, so the hang watchdog sees every rank that started.
- `rank_failures/rank<r>.json`: its traceback, time and host, written when the rank raises,
  BEFORE the process group is destroyed. Destroying it (or exiting) closes the rank's
  connections, and its blocked peers then fail with "connection closed by peer" within
  milliseconds; recording first makes the true cause the earliest record every time.
- A stop (SIGINT / SIGTERM, framework/train/signals.py) is no failure: no record, exit 130 / 143.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from framework.config import RunConfig, read_config
from framework.device import backend_for, rank_device, threads_per_rank
from framework.report.files import write_report
from framework.train.flight import FlightRecorder, dead_ranks, path_of
from framework.report.records import RunInfo
from framework.train.signals import Stopped, StopSignals
from framework.topology import ParallelContext, ParallelDims
from framework.validate import check_rank_env

FAILURES_DIR = "rank_failures"
# A collective blocked this much longer than trainer.hang_timeout_s raises in the rank: the
# launcher's watchdog (which names the stalled rank) acts first, and under plain torchrun,
# where no watchdog runs, torch's timeout still ends the job.
PG_TIMEOUT_MARGIN_S = 30.0


@record
def rank_main(job_dir: str, info: dict, run: Optional[RunConfig] = None) -> Optional[dict]:
    """One rank, start to end. `run`: the job's config.yaml as its launcher read it (one read
    for every rank of the node: OmegaConf's typed load cost each rank ~0.15 s of CPU, 0.25
    core-s of a 0.8 core-s dp 2 tiny job, experiments/launch_overhead); None (plain torchrun):
    read here."""
    import logging

    import torch.distributed as dist

    # The launcher prints the failed rank's traceback once; elastic's in-rank error log
    # would print it a second time, prefixed on every line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    from framework.train.trainer import train

    rank = int(os.environ.get("RANK", "0"))
    stop = StopSignals().install()
    recorder = FlightRecorder.create(path_of(job_dir, rank))
    try:
        if run is None:
            run = read_config(os.path.join(job_dir, "config.yaml"))
        ctx = init_rank(run, recorder)
        summary = train(run, RunInfo(**info), ctx, job_dir, stop)
        recorder.note("rank finished")
        return summary
    except Stopped as s:
        recorder.note(f"rank finished: stopped by {s.name}")
        raise SystemExit(s.exit_code) from None  # quiet: elastic records no error for SystemExit
    except BaseException:
        stop.ignore()
        recorder.note("rank failed")
        record_failure(job_dir, rank)
        raise
    finally:
        stop.default()
        if dist.is_initialized():
            dist.destroy_process_group()  # after the record: on gloo this is what fails the peers


def init_rank(run: RunConfig, recorder) -> ParallelContext:
    """In a rank: read the launcher's env, start the process group, build the groups."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = rank_device(run.device, local_rank)
    cuda = device.type == "cuda"
    check_rank_env(run, world, local_world, torch.cuda.device_count() if cuda else 0, cuda)  # torchrun's launch
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(local_world, run.trainer.cpu_threads_per_rank))
    recorder.note("init_process_group", wait=True)
    dist.init_process_group(backend_for(device.type), rank=rank, world_size=world,
                            timeout=pg_timeout(run),
                            device_id=device if device.type == "cuda" else None)
    # One collective over the world before any point-to-point: NCCL sets up its
    # communicators on the first collective, and batch_isend_irecv must not be that call.
    recorder.note("barrier (world)", wait=True)
    dist.barrier()
    recorder.note("build process groups")
    p = run.parallelism
    return ParallelContext.create(ParallelDims.of(p), rank, device, recorder, pg_timeout(run), p.overlap_dualpipe)


def pg_timeout(run: RunConfig) -> timedelta:
    """Every group's collective timeout (the world's and each new_group's: a subgroup does
    not inherit the world's, it would take the backend's default of 10 or 30 minutes)."""
    return timedelta(seconds=run.trainer.hang_timeout_s + PG_TIMEOUT_MARGIN_S)


# A peer killed by a signal has closed its sockets a little before it is a zombie (a CUDA
# process: after its driver context is torn down, which can take longer); this rank's error
# arrives through those sockets. So when the error says a peer failed, the peers are
# looked at until one shows as dead (at most this long), and the launcher blames that one.
PEER_DEATH_SETTLE_S = 2.0
# What a rank raises when a peer failed first, not a fault of its own: the launcher tells its
# record as a consequence (framework/launch/diagnosis.py). Matched anywhere in the exception's
# text (an NCCL error spans lines). The NCCL texts are PyTorch's (ProcessGroupNCCL.cpp,
# NCCLUtils.cpp, torch 2.1 to 2.6) and NCCL's own ncclGetErrorString; a CPU wheel has none of them.
CONNECTION_ERRORS = (
    # gloo's and TCPStore's sockets: the peer's end closed
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "Connection was likely closed",  # TCPStore: "Failed to recv, got 0 bytes. Connection was likely closed. ..."
    # NCCL: a collective the peer never joined timed out; the watchdog then aborts the communicators
    "Watchdog caught collective operation timeout",  # "[Rank 0] Watchdog caught ...: WorkNCCL(SeqNum=..."
    "Some NCCL operations have failed or timed out",  # "... Due to the asynchronous nature of CUDA kernels, ..."
    "NCCL communicator was aborted on rank",  # an op on a communicator the watchdog aborted
    "ProcessGroupNCCL's watchdog got stuck",  # torch's heartbeat monitor, and its older wording:
    "Heartbeat monitor timed out",
    "remote process exited or there was a network error",  # ncclRemoteError: the peer's process is gone
    "timed out in blocking wait",  # TORCH_NCCL_BLOCKING_WAIT=1: "[Rank 0] Work WorkNCCL(...) timed out in ..."
    "DistBackendError",  # torch.distributed.DistBackendError: how every one of these reaches Python
    "DistNetworkError",  # the same for the store's sockets
)


def record_failure(job_dir: str, rank: int) -> None:
    """This rank's traceback with a precise time (elastic's own error files keep whole
    seconds), its host, and which peers on this node had already died (a rank killed by a
    signal leaves no record of its own; another node's deaths are its launcher's to tell). Written atomically; on a full disk it is lost and the
    launcher falls back to exit codes, so this never raises."""
    path = os.path.join(job_dir, FAILURES_DIR, f"rank{rank}.json")
    when, tb = time.time(), traceback.format_exc()
    first = rank - int(os.environ.get("LOCAL_RANK", "0"))
    node = range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # No peer can fail because of us while we wait: our own connections are still open.
    deadline = time.monotonic() + (PEER_DEATH_SETTLE_S if any(c in tb for c in CONNECTION_ERRORS) else 0.1)
    while not (dead := dead_ranks(job_dir, node, rank)) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = json.dumps({"rank": rank, "time": when, "traceback": tb, "peers_dead": dead,
                       "host": socket.gethostname()})
    write_report(path, text, who=f"rank {rank}: ")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: torchrun [options] -m framework.worker <job_dir>   (written by run.py launcher=external)")
    job_dir = argv[0]
    with open(os.path.join(job_dir, "run_info.json")) as f:
        info = json.load(f)
    rank_main(job_dir, info)


if __name__ == "__main__":
    main(sys.argv[1:])
