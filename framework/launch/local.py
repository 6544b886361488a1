"""The local launch: start the ranks on this node with the torch elastic launcher, and wait.

Locally the launching process starts `world_size` ranks (framework/worker.py) with the
torch elastic launcher (the library behind torchrun): when a rank exits with an error, the
agent stops the others (SIGTERM, then SIGKILL after 30 s). A hang watchdog
(launch/watchdog.py) runs beside it; how the ranks ended is told by launch/diagnosis.py.
This package reads what the ranks leave (failure records, flight recorders; it removes them
once read) and imports nothing of the rank side but its entry point; the same rank code runs
under `torchrun -m framework.worker`.
"""

from __future__ import annotations

import logging as _logging
import os
import shutil
import signal
import uuid
from dataclasses import asdict
from typing import Optional

from .. import flight
from ..config import RunConfig
from ..signals import Stopped
from ..worker import FAILURES_DIR, rank_main
from .diagnosis import RankEnd, diagnose, read_records
from .watchdog import Watchdog

# What elastic's start_processes installs handlers for (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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


def _ends(err, watchdog: Watchdog, job_dir: str) -> tuple[dict[int, RankEnd], list[str]]:
    """Each rank's end: its record, and its exit code (from the handles the watchdog kept,
    else elastic's one reported failure). Local launches are one node: rank = local rank."""
    records, notes = read_records(job_dir)
    ends = {r: RankEnd(r, record=rec) for r, rec in records.items()}
    for r in range(watchdog.world):
        f = flight.read(job_dir, r)
        p = watchdog.processes.get(f.pid) if f else None
        code = p._popen.returncode if p is not None and p._popen is not None else None  # joined by now
        if code is not None and code != 0:
            ends.setdefault(r, RankEnd(r)).exitcode = code
    for local_rank, failure in getattr(err, "failures", {}).items():
        ends.setdefault(local_rank, RankEnd(local_rank)).first_seen = True
        if ends[local_rank].exitcode is None:
            ends[local_rank].exitcode = failure.exitcode
    return ends, notes


def _quiet_elastic() -> None:
    """The agent logs every failed rank's traceback on ERROR lines, and a stop or the end of
    the survivors on WARNING lines; framework.job prints one report instead. Elastic sets a
    level on each of its module loggers (from $LOGLEVEL), so a parent's level is not enough."""
    for name in list(_logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            _logging.getLogger(name).setLevel(_logging.CRITICAL)


def launch_local(run: RunConfig, job_dir: str, info) -> Optional[dict]:
    """Start world_size ranks on this node, wait, return rank 0's summary, or raise
    RankFailure (a rank failed or hung) or Stopped (SIGINT / SIGTERM reached this process)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=run.world_size, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, as torchrun --standalone
        max_restarts=0, monitor_interval=0.2, start_method="forkserver",
    )
    _preload_forkserver()
    handlers = {s: signal.getsignal(s) for s in ELASTIC_SIGNALS}  # elastic replaces them
    watchdog = Watchdog(job_dir, run.world_size, run.trainer.hang_timeout_s).start()
    try:
        try:
            results = elastic_launch(config, rank_main)(job_dir, asdict(info))
        finally:  # before any diagnosis: a signal now is this process's again, not elastic's
            for s, h in handlers.items():
                signal.signal(s, h)
    except ChildFailedError as e:
        watchdog.stop()
        if watchdog.report is not None:
            read_records(job_dir)  # the killed ranks' records are consequences of the hang
            raise watchdog.report from None
        raise diagnose(*_ends(e, watchdog, job_dir)) from None
    except SignalException as e:
        shutil.rmtree(os.path.join(job_dir, FAILURES_DIR), ignore_errors=True)  # a stop blames no one
        raise Stopped(e.sigval) from None
    finally:
        watchdog.stop()
        shutil.rmtree(os.path.join(job_dir, flight.FLIGHT_DIR), ignore_errors=True)  # read; not a result
    return results[0]
