"""The local launch: start the ranks on this node with the torch elastic launcher, and wait.

Locally the launching process starts `world_size` ranks (framework/train/worker.py) with the
torch elastic launcher (the library behind torchrun): when a rank exits with an error, the
agent stops the others (SIGTERM, then SIGKILL after 30 s). A hang watchdog
(launch/watchdog.py) runs beside it; how the ranks ended is told by launch/diagnosis.py.
This package reads what the ranks leave (failure records, flight recorders; it removes them
once read) and imports nothing of the rank side but its entry point. `run_ranks` is the
agent's run shared with a node of a multi-node job (launch/node.py).
"""

from __future__ import annotations

import contextlib
import logging as _logging
import os
import shutil
import signal
import sys
import uuid
from dataclasses import asdict
from typing import Optional

from framework.train import flight
from framework.config import RunConfig, read_config
from framework.device import resolve_device
from framework.train.signals import Stopped
from framework.train.worker import FAILURES_DIR, rank_main
from framework.launch import forkserver
from framework.launch.diagnosis import RankEnd, diagnose, read_records
from framework.launch.watchdog import Watchdog

# The agent looks at its ranks every MONITOR_INTERVAL_S: a job's end is seen that much later
# (0.2 s made a short job ~0.1 s longer on average); a look costs microseconds.
MONITOR_INTERVAL_S = 0.05

# What elastic's start_processes installs handlers for (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def ends_of(err, watchdog: Watchdog, job_dir: str, records: dict[int, dict]) -> dict[int, RankEnd]:
    """Each rank's end: its record, and its exit code (from the handles the watchdog kept,
    else elastic's one reported failure, keyed by global rank)."""
    ends = {r: RankEnd(r, record=rec) for r, rec in records.items()}
    flights = {r: flight.read(job_dir, r) for r in range(watchdog.world)}
    for r, code in watchdog.exit_codes(flights).items():
        if code != 0:
            ends.setdefault(r, RankEnd(r)).exitcode = code
    for rank, failure in getattr(err, "failures", {}).items():
        ends.setdefault(rank, RankEnd(rank)).first_seen = True
        if ends[rank].exitcode is None:
            ends[rank].exitcode = failure.exitcode
    return ends


def _quiet_elastic() -> None:
    """The agent logs every failed rank's traceback on ERROR lines, and a stop or the end of
    the survivors on WARNING lines; framework.launch.job prints one report instead. Elastic sets a
    level on each of its module loggers (from $LOGLEVEL), so a parent's level is not enough."""
    for name in list(_logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            _logging.getLogger(name).setLevel(_logging.CRITICAL)


def _frame_method_name(depth: int = 2) -> str:
    """Elastic's get_method_name, from the frame: the name of the method `depth` frames up."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shallower than depth, as elastic's own fallback says
        return "no_method_name"


def _event_names_from_the_frame() -> None:
    """Elastic's rendezvous names each of its events after the calling method with
    `inspect.stack()`, twice per event, before it looks whether anyone records events (no one
    does unless a handler is configured). inspect.stack() reads the source and the module of
    every frame on the stack, 12 walks a launch: 0.3-0.5 s of the launcher's CPU per launch inside
    pytest (33 frames, 3,400 modules: experiments/launch_overhead), against ~1 s for a whole short
    local job; little from a script's shallow stack. The same name, read from the frame itself
    (as the stdlib's own logging does)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):  # a torch without it names events otherwise
        dynamic_rendezvous.get_method_name = _frame_method_name


@contextlib.contextmanager
def _no_rendezvous_skew():
    """Elastic's rendezvous sleeps a random 0-0.3 s before a node's first join, to spread many
    nodes' attempts on the store; a local launch is one node, so it only delayed each launch
    (0.15 s on average, on the critical path of every short job and of the test suite's ~600
    launches). The skew alone is skipped; the rendezvous' other waits (its 1 s polls) stay."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:  # a torch without it: nothing to skip
        yield
        return

    def _delay(seconds):
        if not isinstance(seconds, tuple):  # (low, high): the skew; a number: a poll's wait
            delay(seconds)

    dynamic_rendezvous._delay = _delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = delay


def run_ranks(config, job_dir: str, info: dict, watchdog: Watchdog, run: RunConfig) -> dict:
    """Run this node's ranks (`rank_main`) under the elastic agent of `config` (a
    LaunchConfig) while `watchdog` runs; return their results by global rank. `run`: the
    job's config.yaml, read once here for every rank. Raises
    ChildFailedError (a rank failed, or the watchdog killed them: then its `report`) or
    Stopped (SIGINT / SIGTERM reached this process). The watchdog is stopped on return."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import elastic_launch

    _quiet_elastic()
    _event_names_from_the_frame()
    forkserver.prepare()
    handlers = {s: signal.getsignal(s) for s in ELASTIC_SIGNALS}  # elastic replaces them
    try:
        try:
            return elastic_launch(config, rank_main)(job_dir, info, run)
        finally:  # before any diagnosis: a signal now is this process's again, not elastic's
            for s, h in handlers.items():
                signal.signal(s, h)
    except SignalException as e:
        raise Stopped(e.sigval) from None
    finally:
        watchdog.stop()


def launch_local(run: RunConfig, job_dir: str, info) -> Optional[dict]:
    """Start world_size ranks on this node, wait, return rank 0's summary, or raise
    RankFailure (a rank failed or hung) or Stopped (SIGINT / SIGTERM reached this process)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=run.world_size, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, as torchrun --standalone
        max_restarts=0, monitor_interval=MONITOR_INTERVAL_S,
        start_method=forkserver.start_method(resolve_device(run.device)),
    )
    watchdog = Watchdog(job_dir, run.world_size, run.trainer.hang_timeout_s).start()
    try:
        # What the ranks would each read: the file, so they run exactly the job it records
        ranks_run = read_config(os.path.join(job_dir, "config.yaml"))
        with _no_rendezvous_skew():
            results = run_ranks(config, job_dir, asdict(info), watchdog, ranks_run)
    except ChildFailedError as e:
        if watchdog.report is not None:
            read_records(job_dir)  # the killed ranks' records are consequences of the hang
            raise watchdog.report from None
        records, notes = read_records(job_dir)
        raise diagnose(ends_of(e, watchdog, job_dir, records), notes) from None
    except Stopped:
        shutil.rmtree(os.path.join(job_dir, FAILURES_DIR), ignore_errors=True)  # a stop blames no one
        raise
    finally:
        shutil.rmtree(os.path.join(job_dir, flight.FLIGHT_DIR), ignore_errors=True)  # read; not a result
    return results[0]
