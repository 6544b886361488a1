"""Two nodes on one machine: two torchrun agents (`python -m framework.launch.node`: torchrun's
options and elastic agent, plus the watchdog and the exit path that tells a failure) meet in
a c10d rendezvous on 127.0.0.1, 2 ranks each, the job prepared by `launcher=external`.

A healthy dp 2 x tp 1 x pp 2 run equals the single process (fp64); a fault on the second
node is told with its rank, host and traceback; a stopped rank there is named by rank and
host; and the 2-node run's checkpoint resumes on one node under tp 2. Each multi-node run is
a module fixture shared by its assertions; every agent runs in its own process group, killed
whatever happens. The agents are forks of the session's rank server (tests/run_py.py), not
fresh interpreters: 4 x 7 core-s of imports less per two-node run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from torch.distributed.launcher.api import LaunchConfig

from framework.train import flight
from framework.launch.node import check_node, combine
from framework.report.compare import collect

from .conftest import FP64, TINY, assert_same_training, final_params, read_metrics, run_local
from .test_failures import NCCL_VICTIMS, OOM
from .test_run import _processes_with
from .run_py import start_run_py

HOST = socket.gethostname()
# Global batch 8 in every layout; steps 4, a checkpoint every 2 (step_2 and step_4 kept).
BASE = [*TINY, "data=synthetic", "trainer.steps=4", "trainer.warmup_steps=1", "optimizer.lr=3e-3",
        "trainer.save_checkpoint=true", FP64]
TWO_NODES = ["parallelism=dp2_pp2", "schedule.microbatches=2"]
SINGLE = ["parallelism=single", "schedule.microbatches=4"]
TP2 = ["parallelism=tp2", "schedule.microbatches=4"]
AGENT_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _two_nodes(job: Path, marker: str):
    """Prepare nothing; start the two agents on `job` and kill their process groups (agents,
    forkservers, ranks) on the way out, however the test went."""
    port, key, value = _free_port(), *marker.split("=")
    # each agent a fork of this session's rank server running `python -m framework.launch.node`
    # (tests/run_py.py), its own rank server started from the marked variables
    procs = [start_run_py(["--nnodes=2", f"--node-rank={i}", "--nproc-per-node=2", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{port}", str(job)], env={key: value}, new_session=True,
                          module="framework.launch.node")
             for i in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if p.returncode is None:
                p.communicate(timeout=30)


def _run_two_nodes(job: Path, *overrides: str, during=None) -> dict:
    """Prepare `job` (launcher=external, the path run.py takes), run it on two agents, and
    return their exit codes, outputs and what `during(job)` returned (called meanwhile)."""
    assert run_local(job, *BASE, *TWO_NODES, *overrides, "launcher=external") is None
    marker = f"FRAMEWORK_TEST_MARKER={uuid.uuid4().hex}"
    with _two_nodes(job, marker) as procs:
        seen = during(job) if during else None
        outs = [p.communicate(timeout=AGENT_TIMEOUT_S) for p in procs]
        ended = time.time()
    deadline = time.time() + 10  # a forkserver ends once its agent has gone
    while (left := _processes_with(marker)) and time.time() < deadline:
        time.sleep(0.2)
    return {"codes": [p.returncode for p in procs], "out": [o for o, _ in outs], "err": [e for _, e in outs],
            "seen": seen, "ended": ended, "left": left}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = tmp_path_factory.mktemp("single")
    run_local(job, *BASE, *SINGLE)
    return read_metrics(job), final_params(job)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    job = tmp_path_factory.mktemp("two_nodes")
    return job, _run_two_nodes(job, "trainer.checkpoint_interval=2")


def test_two_nodes_train_as_the_single_process(healthy, reference):
    job, r = healthy
    assert r["codes"] == [0, 0], r["err"]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["pp"] == 2 and summary["global_batch"] == 8
    assert sum("(medians over" in out for out in r["out"]) == 1  # the node of rank 0 prints the summary
    assert_same_training(read_metrics(job), final_params(job), *reference)
    assert not {"rank_failures", ".flight", "nodes", "error.txt"} & {p.name for p in job.iterdir()}
    assert r["left"] == []


def test_a_two_node_checkpoint_resumes_on_one_node_under_another_layout(healthy, reference, tmp_path):
    job, r = healthy
    assert r["codes"] == [0, 0]
    summary = run_local(tmp_path, *BASE, *TP2, f"trainer.resume={job / 'checkpoints' / 'step_2'}")
    assert summary["first_step"] == 3 and summary["world_size"] == 2
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert_same_training(metrics, final_params(tmp_path), *reference)


@pytest.fixture(scope="module")
def fault(tmp_path_factory):
    job = tmp_path_factory.mktemp("fault")
    return job, _run_two_nodes(job, "debug.fail_rank=3", "debug.fail_step=3")


def test_a_fault_on_the_second_node_is_told_with_rank_host_and_traceback(fault):
    job, r = fault
    assert r["codes"] == [1, 1]
    cause = f"rank 3 (host {HOST}) failed: framework.train.trainer.InjectedFault: injected fault on rank 3 at step 3"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith(cause), summary
    report = (job / "error.txt").read_text()
    lines = report.splitlines()
    assert lines[0] == summary["reason"] and lines[1] == "Traceback (most recent call last):"
    # the traceback down to its last line, then the consequences: the other ranks, each with its host
    assert lines[-2] == summary["reason"].split(": ", 1)[1] and lines[-1].startswith("then, as a consequence: rank ")
    named = re.findall(r"rank (\d+) \(host ([^)]*)\)", lines[-1])
    assert named and {int(r) for r, _ in named} <= {0, 1, 2} and {h for _, h in named} == {HOST}, lines[-1]
    assert report.count("Traceback") == 1  # one block: the cause's traceback only
    for err in r["err"]:  # each node prints that block once, not its ranks' interleaved tracebacks
        assert err.count(summary["reason"]) == 1 and err.count("Traceback") == 1, err[-3000:]
    rows = collect(job)
    assert [(x["status"], x["reason"]) for x in rows] == [("failed", summary["reason"])]
    assert not {"rank_failures", ".flight", "nodes"} & {p.name for p in job.iterdir()}
    assert r["left"] == []


def _stop_rank_3(job: Path) -> tuple[int, float]:
    """SIGSTOP rank 3 once it has run two steps; (its pid, when)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        f = flight.read(str(job), 3)
        if f is not None and sum(n.text.startswith("step ") for n in f.notes) >= 2:
            os.kill(f.pid, signal.SIGSTOP)
            return f.pid, time.time()
        time.sleep(0.2)
    raise AssertionError("rank 3 never ran two steps")


HANG_S = 10


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    job = tmp_path_factory.mktemp("stopped")
    return job, _run_two_nodes(job, "trainer.steps=5000", f"trainer.hang_timeout_s={HANG_S}", during=_stop_rank_3)


def test_a_stopped_rank_on_the_second_node_is_named_with_its_host(stopped):
    job, r = stopped
    pid, when = r["seen"]
    assert r["codes"] == [1, 1]
    assert r["ended"] - when < HANG_S + 60, r["ended"] - when
    headline = f"hang: rank 3 (host {HOST}) made no progress for {HANG_S} s (trainer.hang_timeout_s)"
    summary = json.loads((job / "summary.json").read_text())
    assert summary == {**summary, "status": "failed", "reason": headline}
    hang = (job / "hang.txt").read_text()
    assert hang.splitlines()[0] == headline and f"rank 3 (host {HOST}, pid {pid}, STOPPED (SIGSTOP))" in hang
    assert "rank 0 (host" in hang and "WAIT" in hang  # every rank's last actions, from the shared directory
    assert (job / "error.txt").read_text().startswith(hang)
    for err in r["err"]:
        assert headline in err, err[-3000:]
    assert collect(job)[0]["reason"] == headline
    assert r["left"] == []


# ---- the diagnosis across nodes, as pure functions ----------------------------------------

def _record(job: Path, rank: int, t: float, last: str, host: str, dead=()) -> None:
    (job / "rank_failures").mkdir(exist_ok=True)
    (job / "rank_failures" / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "time": t, "traceback": f"Traceback (most recent call last):\n{last}\n",
         "peers_dead": list(dead), "host": host}))


GONE = "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4242"


def test_a_signal_killed_rank_on_another_node_is_the_cause(tmp_path):
    """Rank 3 (node b) is killed by SIGKILL: it leaves no record; rank 0 (node a) records a
    closed connection first and sees no dead peer (another host's /proc); node b's agent saw
    rank 3 die first, with -9: rank 3 is named, with its host, as killed by SIGKILL."""
    _record(tmp_path, 0, 1.0, GONE, "a")
    _record(tmp_path, 2, 1.5, GONE, "b", dead=[3])
    reports = [{"host": "a", "ranks": [0, 1], "exitcodes": {"0": 1, "1": -15}, "first_seen": [0]},
               {"host": "b", "ranks": [2, 3], "exitcodes": {"2": 1, "3": -9}, "first_seen": [3]}]
    e = combine(str(tmp_path), reports, 2, 4)
    assert e.reason == "rank 3 (host b) killed by SIGKILL"
    assert str(e).splitlines()[-1] == ("then, as a consequence: rank 0 (host a) failed: " + GONE
                                       + "; rank 2 (host b) failed: " + GONE)
    # without node b's report: rank 2's record names rank 3 dead on its host; the gap is said
    e = combine(str(tmp_path), reports[:1], 2, 4)
    assert e.reason == "rank 3 (host b) exited with code unknown without a traceback"
    assert "1 of 2 nodes' launchers sent no report" in str(e)


def test_a_closed_connection_is_a_consequence_even_if_recorded_first(tmp_path):
    """Two hosts' clocks differ: a victim's record may carry an earlier time than the fault."""
    _record(tmp_path, 1, 99.0, GONE, "a")
    _record(tmp_path, 3, 100.0, "ValueError: boom", "b")
    reports = [{"host": "a", "ranks": [0, 1], "exitcodes": {"1": 1}, "first_seen": [1]},
               {"host": "b", "ranks": [2, 3], "exitcodes": {"3": 1}, "first_seen": [3]}]
    e = combine(str(tmp_path), reports, 2, 4)
    assert e.reason == "rank 3 (host b) failed: ValueError: boom"


def test_an_nccl_timeout_on_one_node_is_a_consequence_of_a_fault_on_the_other(tmp_path):
    """Rank 2 (node b) runs out of memory; ranks 0, 1 (node a) and 3 (node b) end with NCCL's
    watchdog timeout, an aborted communicator and a remote error, node a's clock ahead."""
    for rank, victim, host in ((0, "timeout", "a"), (1, "aborted", "a"), (3, "remote", "b")):
        (tmp_path / "rank_failures").mkdir(exist_ok=True)
        (tmp_path / "rank_failures" / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "time": 50.0 + rank, "traceback": NCCL_VICTIMS[victim], "peers_dead": [], "host": host}))
    (tmp_path / "rank_failures" / "rank2.json").write_text(json.dumps(
        {"rank": 2, "time": 60.0, "traceback": OOM, "peers_dead": [], "host": "b"}))
    reports = [{"host": "a", "ranks": [0, 1], "exitcodes": {"0": 1, "1": 1}, "first_seen": [0]},
               {"host": "b", "ranks": [2, 3], "exitcodes": {"2": 1, "3": 1}, "first_seen": [3]}]
    e = combine(str(tmp_path), reports, 2, 4)
    assert e.reason.startswith("rank 2 (host b) failed: torch.OutOfMemoryError: CUDA out of memory"), e.reason
    assert str(e).splitlines()[-1].startswith("then, as a consequence: rank 0 (host a) failed: "
                                              "torch.distributed.DistBackendError: [Rank 0] Watchdog caught")


def test_a_node_refuses_what_would_mislead(tmp_path):
    def config(nodes: str = "2", nproc: int = 2, restarts: int = 0) -> LaunchConfig:
        lo, hi = (int(x) for x in (nodes.split(":") * 2)[:2])
        return LaunchConfig(min_nodes=lo, max_nodes=hi, nproc_per_node=nproc, max_restarts=restarts)

    check_node(config(), str(tmp_path), 4)  # a freshly prepared job
    with pytest.raises(SystemExit, match="the job's layout has world size 4"):
        check_node(config(nproc=1), str(tmp_path), 4)
    with pytest.raises(SystemExit, match="use a fixed node count"):
        check_node(config("1:2"), str(tmp_path), 4)
    with pytest.raises(SystemExit, match="--max-restarts=1: must be 0"):
        check_node(config(restarts=1), str(tmp_path), 4)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds an earlier attempt's summary.json: prepare the job again"):
        check_node(config(), str(tmp_path), 4)
