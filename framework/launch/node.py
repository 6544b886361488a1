"""One node of a multi-node job: `python -m framework.launch.node [torchrun options] <job dir>`.

`python run.py launcher=external ...` prepares the job directory (on a filesystem every node
sees) and prints this command; run it on every node. It is torchrun: torchrun's own parser
and options (--nnodes, --nproc-per-node, --rdzv-backend, --rdzv-endpoint, ...) and torch's
elastic agent, which starts this node's ranks (`rank_main`, as `torchrun -m framework.worker`
would), with two additions the local launcher (launch/local.py) has too: the hang watchdog
(launch/watchdog.py, several-node mode) and the exit path below. Plain torchrun still runs
the ranks, but then a failure is told only in torchrun's interleaved logs.

Who tells a failed job: every node's launcher, from its exit path. Not a surviving rank, nor
a rank 0 epilogue: under NCCL a rank blocked in a collective never returns to Python, the
agent SIGKILLs ranks that outlive its 30 s stop, and rank 0 may be the rank that died; and a
rank killed by a signal leaves no record, its exit code reaches only its own node's agent.
The agent always outlives its ranks and is blocked in nothing. So each node's launcher,
once its ranks have ended:
1. writes `nodes/<host>-<pid>.json`: its host, its ranks, their exit codes (a signal as
   -N) and the failure elastic saw first on this node;
2. waits until every node's report is there (at most NODE_SETTLE_S);
3. diagnoses from the shared job directory: the ranks' records (`rank_failures/`, each
   with its host) and every node's report, or `hang.txt` if a watchdog named a hang; and
   writes `error.txt` and `summary.json` (status failed, the reason), and prints it.
All nodes then write the same files (atomically), so no node is special and a lost node
does not silence the others; a node that reports after the settle time rewrites them with
more. When every node is done, the last one removes `rank_failures/`, `.flight/`, `nodes/`.
"""

from __future__ import annotations

if __name__ == "__main__":  # the ranks' server imports on another core while this process does (as run.py)
    from framework.launch.forkserver import start_early

    start_early([])

import json
import os
import shutil
import socket
import sys
import time
import uuid

from framework.train import flight
from framework.config import read_config
from framework.device import resolve_device
from framework.launch import forkserver
from framework.report.files import write_report
from framework.launch.jobdir import completed_summary, write_outcome
from framework.train.signals import Stopped
from framework.train.worker import FAILURES_DIR
from framework.launch.diagnosis import RankEnd, RankFailure, diagnose, peek_records
from framework.launch.local import run_ranks
from framework.launch.watchdog import HANG_FILE, Watchdog

NODES_DIR = "nodes"
NODE_SETTLE_S = 10.0
USAGE = ("python -m framework.launch.node --nnodes=N --nproc-per-node=P --rdzv-backend=c10d "
         "--rdzv-endpoint=HOST:PORT [other torchrun options] <job dir>")
# What a finished attempt leaves: a new attempt needs the job prepared again (run.py sets them aside).
OUTCOMES = ("summary.json", "error.txt", HANG_FILE, NODES_DIR, FAILURES_DIR)


def launch_config(argv: list[str]):
    """(LaunchConfig, job dir) from torchrun's own options, as torchrun's `run` builds them."""
    from torch.distributed.run import config_from_args, get_args_parser

    parser = get_args_parser()
    parser.prog, parser.usage = "python -m framework.launch.node", USAGE
    args = parser.parse_args(argv)
    if args.training_script_args:
        parser.error(f"one job directory after the options, not {[args.training_script, *args.training_script_args]}")
    if args.standalone:  # as torchrun's run()
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    return config, args.training_script


def check_node(config, job_dir: str, world: int) -> None:
    """Refuse what would mislead: a job directory of an earlier attempt, restarts (a restart
    is a new attempt: prepare again, trainer.resume=auto), or a layout of another size."""
    done = [n for n in OUTCOMES if os.path.lexists(os.path.join(job_dir, n))]
    if done:
        raise SystemExit(f"{job_dir} holds an earlier attempt's {', '.join(done)}: prepare the job again with "
                         "`python run.py launcher=external ... hydra.run.dir=<it>` (that sets them aside), then launch")
    if config.max_restarts:
        raise SystemExit(f"--max-restarts={config.max_restarts}: must be 0 (a restart is a new attempt: prepare "
                         "the job again, with trainer.resume=auto to continue from its checkpoint)")
    if config.min_nodes != config.max_nodes or config.max_nodes * config.nproc_per_node != world:
        raise SystemExit(f"--nnodes={config.min_nodes}:{config.max_nodes} x --nproc-per-node={config.nproc_per_node}: "
                         f"the job's layout has world size {world} (dp x tp x pp in {job_dir}/config.yaml); "
                         "use a fixed node count whose product with --nproc-per-node is that")


def main(argv: list[str]) -> int:
    config, job_dir = launch_config(argv)
    if not os.path.isfile(os.path.join(job_dir, "config.yaml")):
        raise SystemExit(f"{job_dir}: no config.yaml; prepare the job with `python run.py launcher=external ...`")
    run = read_config(os.path.join(job_dir, "config.yaml"))
    with open(os.path.join(job_dir, "run_info.json")) as f:
        info = json.load(f)
    check_node(config, job_dir, run.world_size)
    # CPU ranks fork from a server that imported the framework once; CUDA ranks are spawned
    config.start_method = forkserver.start_method(resolve_device(run.device))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nodes = config.max_nodes
    watchdog = Watchdog(job_dir, run.world_size, run.trainer.hang_timeout_s, nodes=nodes).start()
    try:
        results = run_ranks(config, job_dir, info, watchdog, run)
    except ChildFailedError as e:
        failure = tell_failure(job_dir, e, watchdog, nodes)
        print(str(failure), file=sys.stderr, flush=True)
        return 1
    except Stopped as s:
        shutil.rmtree(os.path.join(job_dir, FAILURES_DIR), ignore_errors=True)  # a stop blames no one
        if completed_summary(job_dir) is not None:  # agreed at the last step: the job completed
            print(f"stopped by {s.name} after the last step: the job completed", flush=True)
            return 0
        write_outcome(job_dir, "interrupted", f"stopped by {s.name}")
        print(f"stopped by {s.name}: this node's ranks ended; exit {s.exit_code}", file=sys.stderr, flush=True)
        return s.exit_code
    finally:
        node_done(job_dir, nodes)
    if results.get(0) is not None:  # the node of rank 0, which wrote summary.json
        from framework.report.closing import summary_lines

        print(summary_lines(results[0]), flush=True)
    return 0


def _node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def tell_failure(job_dir: str, err, watchdog: Watchdog, nodes: int) -> RankFailure:
    """Report this node's ranks, wait for the other nodes' reports, then write the job's
    error.txt and summary.json from everything in the shared job directory."""
    flights = {r: flight.read(job_dir, r) for r in range(watchdog.world)}
    failures = getattr(err, "failures", {})  # elastic's, by global rank
    codes = watchdog.exit_codes(flights)
    codes.update({r: f.exitcode for r, f in failures.items() if r not in codes})
    mine = {"host": socket.gethostname(), "ranks": sorted(watchdog.own_ranks(flights) | set(failures)),
            "exitcodes": codes, "first_seen": sorted(failures), "time": time.time()}
    folder = os.path.join(job_dir, NODES_DIR)
    write_report(os.path.join(folder, f"{_node_id()}.json"), json.dumps(mine))
    deadline = time.monotonic() + NODE_SETTLE_S
    while len(reports := read_reports(job_dir)) < nodes and time.monotonic() < deadline:
        time.sleep(0.2)
    failure = combine(job_dir, reports, nodes, watchdog.world)
    write_report(os.path.join(job_dir, "error.txt"), str(failure))
    write_outcome(job_dir, "failed", failure.reason)
    return failure


def read_reports(job_dir: str) -> list[dict]:
    folder = os.path.join(job_dir, NODES_DIR)
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass  # being replaced, or a full disk: the node counts as not reported
    return out


def combine(job_dir: str, reports: list[dict], nodes: int, world: int) -> RankFailure:
    """The job's one diagnosis from the shared job directory: a hang if a watchdog named one
    (its records are consequences), else the ranks' records and every node's exit codes."""
    notes = [] if len(reports) >= nodes else [
        f"({nodes - len(reports)} of {nodes} nodes' launchers sent no report within {NODE_SETTLE_S:g} s "
        "(a lost node, or one still ending its ranks): told from what the others saw)"]
    try:
        with open(os.path.join(job_dir, HANG_FILE)) as f:
            text = f.read()
        return RankFailure("\n".join([text.rstrip(), *notes, "every rank was killed (SIGKILL) by its node's "
                                      f"launcher; this report is in {os.path.join(job_dir, HANG_FILE)}"]),
                           text.splitlines()[0])
    except (OSError, IndexError):
        pass
    records, unreadable = peek_records(job_dir)
    ends = {r: RankEnd(r, record=rec) for r, rec in records.items()}
    hosts = {r: rec.get("host", "") for r, rec in records.items()}
    for r in range(world):
        f = flight.read(job_dir, r)
        if f is not None and not hosts.get(r):
            hosts[r] = f.host
    for rec in list(records.values()):  # a record's dead peers are of its own node
        for d in rec.get("peers_dead", []):
            hosts.setdefault(d, rec.get("host", ""))
            ends.setdefault(d, RankEnd(d))
    for rep in reports:
        for r in rep["ranks"]:
            hosts.setdefault(r, rep["host"])
        for r, code in rep["exitcodes"].items():
            if code not in (None, 0):
                ends.setdefault(int(r), RankEnd(int(r))).exitcode = code
        for r in rep["first_seen"]:
            ends.setdefault(r, RankEnd(r)).first_seen = True
    return diagnose(ends, unreadable + notes, hosts)


def node_done(job_dir: str, nodes: int) -> None:
    """This node has told what it saw; the last node done removes what is no result."""
    folder = os.path.join(job_dir, NODES_DIR)
    write_report(os.path.join(folder, f"{_node_id()}.done"), "")
    try:
        done = sum(n.endswith(".done") for n in os.listdir(folder))
    except OSError:  # another node was last and removed it
        return
    if done >= nodes:
        for name in (FAILURES_DIR, flight.FLIGHT_DIR, NODES_DIR):
            shutil.rmtree(os.path.join(job_dir, name), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
