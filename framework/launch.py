"""Device and backend choice, rank start-up, and the local launcher.

Device choice lives here and only here: `device=auto` is CUDA when available, else CPU;
CPU ranks use gloo, CUDA ranks NCCL with one GPU per local rank. Locally the launching
process starts `world_size` ranks with the torch elastic launcher (the library behind
torchrun), which also gives the failure contract: when any rank raises, the agent stops
every other rank (SIGTERM, then SIGKILL) and reports the failed rank's traceback, recorded
by `torch.distributed.elastic.multiprocessing.errors.record`. The same rank code runs under
`torchrun -m framework.worker <job_dir>` on many nodes (see README).
"""

from __future__ import annotations

import json
import logging as _logging
import os
import shutil
import uuid
from dataclasses import asdict
from typing import Optional

import torch

from .config import ConfigError, RunConfig
from .topology import ParallelContext, ParallelDims

class RankFailure(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def resolve_device(requested: str, ranks_per_node: int) -> str:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        n = torch.cuda.device_count()
        if ranks_per_node > n:
            raise ConfigError("device", "cuda", f"{ranks_per_node} ranks on this node but {n} CUDA device(s)",
                              "use fewer ranks per node (dp*tp*pp), more GPUs, or device=cpu")
    return requested


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def threads_per_rank(ranks_per_node: int) -> int:
    """CPU ranks split the cores; oversubscribed intra-op threads would distort timings."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node)


def init_rank(run: RunConfig) -> ParallelContext:
    """In a rank: read the launcher's env, start the process group, build the groups."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world != run.world_size:
        raise ConfigError("parallelism", f"dp*tp*pp={run.world_size}", f"the launcher started {world} ranks",
                          "launch dp*tp*pp ranks (torchrun --nnodes * --nproc-per-node)")
    device_type = resolve_device(run.device, local_world)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(local_world))
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=world,
                            device_id=device if device_type == "cuda" else None)
    # One collective over the world before any point-to-point: NCCL sets up its
    # communicators on the first collective, and batch_isend_irecv must not be that call.
    dist.barrier()
    p = run.parallelism
    return ParallelContext.create(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp), rank, device)


def _failure_message(err, job_dir: str) -> str:
    """The root cause: the earliest failure the ranks recorded (worker.record_failure),
    else elastic's first failure. Ranks that failed after it are named, not blamed."""
    from .worker import FAILURES_DIR

    folder = os.path.join(job_dir, FAILURES_DIR)
    records = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                records.append(json.load(f))
        shutil.rmtree(folder)
    if records:
        records.sort(key=lambda r: r["time"])
        first, later = records[0], records[1:]
        also = f"\n(then ranks {', '.join(str(r['rank']) for r in later)} failed as a consequence)" if later else ""
        return f"rank {first['rank']} failed:\n{first['traceback']}{also}"
    rank, failure = err.get_first_failure()
    data = failure.error_file_data or {}
    msg = data.get("message", {})
    tb = msg.get("extraInfo", {}).get("py_callstack") if isinstance(msg, dict) else None
    return f"rank {rank} failed (exit code {failure.exitcode}):\n{tb or failure.message}"


def _preload_forkserver() -> None:
    """Ranks start as forks of one server process that imported torch, transformers and
    the framework once (about 5 s of imports per rank with `spawn`; a sweep or the test
    suite starts hundreds of ranks). The server never runs torch ops or touches CUDA, so
    its forks are as clean as spawned processes: no OpenMP pool, no CUDA context.

    A fork inherits the *server's* environment, plus what elastic sets per rank (RANK,
    MASTER_ADDR, ...). So the server is restarted whenever this process's environment
    changed since it started (a W&B or HF variable set between two jobs must reach the
    ranks, as it would with spawn)."""
    import multiprocessing.forkserver as fs

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}  # elastic's own
    server = fs._forkserver  # the stdlib's per-process server; _stop is its own reset
    if getattr(server, "framework_env", None) != env:
        server._stop()
        server.framework_env = env
    fs.set_forkserver_preload(["framework.worker", "framework.trainer"])


def launch_local(run: RunConfig, job_dir: str, info) -> Optional[dict]:
    """Start world_size ranks on this node, wait, return rank 0's summary or raise RankFailure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker import rank_main

    _logging.getLogger("torch.distributed.elastic").setLevel(_logging.WARNING)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=run.world_size, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, as torchrun --standalone
        max_restarts=0, monitor_interval=0.2, start_method="forkserver",
    )
    _preload_forkserver()
    try:
        results = elastic_launch(config, rank_main)(job_dir, asdict(info))
    except ChildFailedError as e:
        raise RankFailure(_failure_message(e, job_dir)) from None
    return results[0]
