"""Failures told right: the root cause named over repeated runs, hangs caught, sweeps that
survive failed jobs, run directories that never mix, signals, and a full disk."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from framework.train import flight
from framework.launch.jobdir import write_outcome
from framework.report.files import set_aside_previous
from framework.launch.diagnosis import RankEnd, RankFailure, diagnose, read_records
from framework.report.compare import collect
from framework.report.records import RunInfo

from .conftest import TINY, compose, run_cli, run_local
from .run_py import RunPy, start_run_py
from .test_run import _processes_with

PP2 = [*TINY, "data=synthetic", "parallelism=pp2", "schedule.microbatches=2"]
FAST = ["model=gpt2-tiny", "data=synthetic", "logger=none", "trainer.log_interval=1"]


def _failure(tmp_path: Path, name: str, *overrides: str) -> RankFailure:
    with pytest.raises(RankFailure) as e:
        run_local(tmp_path / name, *overrides)
    return e.value


@pytest.mark.parametrize("attempt", range(3))
def test_pp2_fault_on_rank0_blames_rank0_every_time(tmp_path, attempt):
    """Rank 1 blocks in a receive from rank 0 when rank 0 raises: the record rank 0 writes
    before closing its connections makes it the cause, never the peer it brought down."""
    e = _failure(tmp_path, "job", *PP2, "trainer.steps=4", "debug.fail_rank=0", "debug.fail_step=3")
    assert e.reason.startswith("rank 0 failed: framework.train.trainer.InjectedFault: injected fault on rank 0"), e.reason
    report = (tmp_path / "job" / "error.txt").read_text()
    assert report.splitlines()[0] == e.reason and "InjectedFault" in report
    assert "rank 1" not in report.splitlines()[0]
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == e.reason
    assert not (tmp_path / "job" / "rank_failures").exists() and not (tmp_path / "job" / ".flight").exists()


@pytest.mark.parametrize("attempt", range(2))
def test_fault_in_a_3d_layout_names_the_failing_rank(tmp_path, attempt):
    e = _failure(tmp_path, "job", *TINY, "data=synthetic", "parallelism=3d_2x2x2", "schedule.microbatches=2",
                 "trainer.steps=4", "debug.fail_rank=5", "debug.fail_step=2")
    assert e.reason.startswith("rank 5 failed: framework.train.trainer.InjectedFault: injected fault on rank 5"), e.reason
    assert str(e).count("Traceback") == 1  # one block: the cause's traceback, consequences named only


def _wait_for_steps(job: Path, rank: int, proc: RunPy, timeout: float = 120) -> int:
    """The rank's pid once it has run a few pipeline actions (its flight recorder says so)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        f = flight.read(str(job), rank)
        if f is not None and sum(n.text.startswith("step ") for n in f.notes) >= 2:
            return f.pid
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("the rank never started its steps")


def _start(job: Path, *overrides: str, marker: str) -> RunPy:
    """`python run.py` in a session of its own (a terminal's job), its variables marked: its
    rank server is started from them, so every rank carries the marker in /proc/<pid>/environ."""
    key, value = marker.split("=")
    return start_run_py([*overrides, f"hydra.run.dir={job}"], env={key: value}, new_session=True)


@pytest.mark.parametrize("attempt", range(2))
def test_kill_9_of_a_pp_rank_is_reported_as_that_signal(tmp_path, attempt):
    marker = f"FRAMEWORK_TEST_MARKER={uuid.uuid4().hex}"
    proc = _start(tmp_path, *FAST, "parallelism=pp2", "trainer.steps=500", marker=marker)
    os.kill(_wait_for_steps(tmp_path, 1, proc), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # rank 0 is named as a consequence when its receive failed before the agent stopped it
    assert err.splitlines()[0] == "rank 1 killed by SIGKILL", err[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["reason"] == "rank 1 killed by SIGKILL"
    assert _processes_with(marker) == []


def test_a_stopped_rank_is_detected_as_a_hang(tmp_path):
    marker = f"FRAMEWORK_TEST_MARKER={uuid.uuid4().hex}"
    proc = _start(tmp_path, *FAST, "parallelism=pp2", "trainer.steps=5000", "trainer.hang_timeout_s=10",
                  marker=marker)
    pid = _wait_for_steps(tmp_path, 1, proc)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    _, err = proc.communicate(timeout=120)
    assert time.time() - stopped < 60
    assert proc.returncode == 1
    assert "hang: rank 1 made no progress for 10 s (trainer.hang_timeout_s)" in err, err[-3000:]
    hang = (tmp_path / "hang.txt").read_text()
    assert f"rank 1 (pid {pid}, STOPPED (SIGSTOP))" in hang
    assert "rank 0 (pid" in hang and "WAIT" in hang  # rank 0 blocked on its peer, with what it last did
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert _processes_with(marker) == []


def _flight(rank: int, last: float, wait: bool, text: str = "p2p batch") -> flight.Flight:
    return flight.Flight(rank, 1000 + rank, last, [flight.Note(last, wait, text)], count=1)


def test_the_watchdog_names_the_stopped_rank_not_the_peer_blocked_on_it(monkeypatch):
    # The race behind a once-flaky launch test: rank 0's WAIT note is older than the stopped
    # rank 1's last note, so rank 0 crosses the timeout first, alone.
    from framework.launch import watchdog as wd
    states = {1000: "S", 1001: "T"}
    monkeypatch.setattr(wd, "process_state", lambda pid: states[pid])
    dog = wd.Watchdog("unused", world=2, timeout_s=10)
    flights = {0: _flight(0, 100.0, wait=True), 1: _flight(1, 103.0, wait=False)}
    own = dog.own_ranks(flights)
    for now, want in [(109.0, None), (111.0, []), (114.0, [1])]:
        stalled = [r for r, f in flights.items() if dog._stalled(f, own, now)]
        assert stalled == ([] if want is None else [0] if want == [] else [0, 1])
        assert dog._suspects(flights, stalled, own, now) == (want or [])
    states[1001] = "R"  # not stopped, busy without a note (a loop in C): named once it is stalled
    assert dog._suspects(flights, [0], own, 111.0) == []
    assert dog._suspects(flights, [0, 1], own, 114.0) == [1]


def test_the_watchdog_names_a_deadlock_once_every_rank_waits_or_after_a_grace(monkeypatch):
    from framework.launch import watchdog as wd
    monkeypatch.setattr(wd, "process_state", lambda pid: "S")
    dog = wd.Watchdog("unused", world=3, timeout_s=10)
    flights = {0: _flight(0, 100.0, True), 1: _flight(1, 101.0, True),
               2: _flight(2, 100.0, False, "rank finished")}
    own = dog.own_ranks(flights)
    assert dog._suspects(flights, [0], own, 110.5) == []  # rank 1 may still arrive
    assert dog._suspects(flights, [0, 1], own, 111.5) == [0, 1]  # every unfinished rank waits
    dog._deferred = None
    flights[2] = _flight(2, 200.0, True)  # a rank that keeps noting progress never lets it fire early
    assert dog._suspects(flights, [0, 1], own, 111.5) == []
    assert dog._suspects(flights, [0, 1], own, 111.5 + wd.REMOTE_GRACE_S) == [0, 1]


def test_a_sweep_survives_a_failed_job_and_the_report_lists_every_job(tmp_path):
    r = run_cli(["-m", "debug.fail_rank=null,0,null", "debug.fail_step=3", *FAST, "parallelism=pp2",
                 "trainer.steps=4", "metrics.skip_first=0", f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    status = [json.loads((tmp_path / str(j) / "summary.json").read_text())["status"] for j in range(3)]
    assert status == ["completed", "failed", "completed"]
    rows = collect(tmp_path)
    assert [(x["job"], x["status"]) for x in rows] == [("0", "completed"), ("1", "failed"), ("2", "completed")]
    assert rows[1]["reason"].startswith("rank 0 failed: framework.train.trainer.InjectedFault")
    assert "debug.fail_rank=0" in rows[1]["overrides"] and rows[0]["loss"] > 0


def test_a_config_error_in_a_sweep_is_rejected_and_the_sweep_goes_on(tmp_path):
    r = run_cli(["-m", "trainer.steps=0,-1", *FAST, f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = collect(tmp_path)
    assert [(x["job"], x["status"]) for x in rows] == [("0", "rejected"), ("1", "rejected")]
    assert rows[1]["reason"].startswith("trainer.steps=-1: must be >= 1. Fix:")
    assert r.stderr.count("config error: trainer.steps=") == 2


def test_the_report_lists_planned_jobs_that_never_ran(tmp_path):
    r = run_cli(["-m", "trainer.steps=0,-1", *FAST, f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0
    import shutil

    shutil.rmtree(tmp_path / "1")  # as if the sweep had been stopped before job 1
    rows = collect(tmp_path)
    assert [(x["job"], x["status"]) for x in rows] == [("0", "rejected"), ("1", "not run")]
    assert rows[1]["overrides"].split() == ["trainer.steps=-1", *FAST]


def test_a_reused_run_directory_never_mixes_results(tmp_path):
    job = tmp_path / "job"
    run_local(job, *PP2, "trainer.steps=3")
    assert {"summary.json", "metrics.jsonl", "trace.json", "timeline.png"} <= {p.name for p in job.iterdir()}
    with pytest.raises(RankFailure):
        run_local(job, *PP2, "trainer.steps=3", "debug.fail_rank=1", "debug.fail_step=2")
    names = {p.name for p in job.iterdir()}
    assert not names & {"metrics.jsonl", "trace.json", "timeline.png"}, names
    assert json.loads((job / "summary.json").read_text())["status"] == "failed"
    aside = list((job / ".previous").iterdir())
    assert len(aside) == 1 and json.loads((aside[0] / "summary.json").read_text())["status"] == "completed"
    run_local(job, *PP2, "trainer.steps=3")
    assert not (job / "error.txt").exists() and json.loads((job / "summary.json").read_text())["status"] == "completed"
    assert len(list((job / ".previous").iterdir())) == 2
    assert [r["status"] for r in collect(tmp_path)] == ["completed"]  # set-aside runs are not jobs


def test_a_fresh_run_keeps_its_own_run_log(tmp_path):
    """A note printed before the job starts (the skip_first clamp) reaches run.log; the job must
    not then take that run.log for an earlier run's and move it aside. A reused directory's
    run.log still is."""
    job = tmp_path / "job"
    args = ["trainer.steps=3", "dry_run=true", f"hydra.run.dir={job}"]
    first = run_cli(args)
    assert first.returncode == 0, first.stderr
    assert "held an earlier run's files" not in first.stdout and not (job / ".previous").exists()
    assert "metrics.skip_first=3 would leave none" in (job / "run.log").read_text()
    second = run_cli(args)
    assert second.stdout.count("held an earlier run's files") == 1 and len(list((job / ".previous").iterdir())) == 1


def test_set_aside_keeps_hydra_files_and_says_where(tmp_path, capsys):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "run.log").write_text("step    1/40 | loss 5.0\n")  # an earlier run's console
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "my_inputs.jsonl").write_text("the user's own file")
    dest = set_aside_previous(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", ".previous", "my_inputs.jsonl"]
    assert sorted(os.listdir(dest)) == ["run.log", "summary.json"] and dest in capsys.readouterr().out
    (tmp_path / "run.log").write_text("")  # what Hydra's log handler of the new run opens
    assert set_aside_previous(str(tmp_path)) is None  # nothing left to move


# ---- diagnosis and a full disk, as pure functions --------------------------------------

def test_an_empty_failure_record_does_not_crash_the_report(tmp_path):
    (tmp_path / "rank_failures").mkdir()
    (tmp_path / "rank_failures" / "rank0.json").write_text("")  # what a full disk leaves
    (tmp_path / "rank_failures" / "rank1.json").write_text(json.dumps(
        {"rank": 1, "time": 5.0, "traceback": "Traceback ...\nValueError: boom\n", "peers_dead": []}))
    records, notes = read_records(str(tmp_path))
    assert list(records) == [1] and "rank0.json unreadable" in notes[0]
    e = diagnose({0: RankEnd(0, exitcode=1), 1: RankEnd(1, exitcode=1, record=records[1])}, notes)
    assert e.reason == "rank 1 failed: ValueError: boom" and "rank0.json unreadable" in str(e)
    assert not (tmp_path / "rank_failures").exists()


def test_diagnose_orders_causes():
    rec = lambda t, msg, dead=(): {"time": t, "traceback": f"Traceback\n{msg}\n", "peers_dead": list(dead)}  # noqa: E731
    # the earliest record is the cause; a later one and an agent-terminated rank are not blamed
    e = diagnose({0: RankEnd(0, 1, rec(2.0, "RuntimeError: reset")), 1: RankEnd(1, 1, rec(1.0, "KeyError: x")),
                  2: RankEnd(2, -signal.SIGTERM)}, [])
    assert e.reason == "rank 1 failed: KeyError: x"
    assert str(e).endswith("then, as a consequence: rank 0 failed: RuntimeError: reset")
    # a rank that died without a record, seen dead by the recording peer, is the cause
    e = diagnose({0: RankEnd(0, 1, rec(1.0, "RuntimeError: reset", dead=[3])), 3: RankEnd(3, -signal.SIGKILL),
                  1: RankEnd(1, 1, rec(2.0, "RuntimeError: reset", dead=[2])), 2: RankEnd(2, 143)}, [])
    assert e.reason == "rank 3 killed by SIGKILL"
    # a dead peer the agent had merely stopped is not preferred over one killed from outside
    e = diagnose({0: RankEnd(0, 1, rec(5.0, "RuntimeError: reset", dead=[1, 2])), 1: RankEnd(1, 143),
                  2: RankEnd(2, -signal.SIGKILL)}, [])
    assert e.reason == "rank 2 killed by SIGKILL"
    # nothing recorded at all: the failure elastic saw first, not the lowest rank the agent killed
    ends = {0: RankEnd(0, -signal.SIGKILL), 1: RankEnd(1, -signal.SIGKILL), 2: RankEnd(2, -signal.SIGSEGV),
            3: RankEnd(3, -signal.SIGKILL)}
    assert diagnose(ends, []).reason == "rank 2 killed by SIGSEGV"
    ends[3].first_seen = True
    assert diagnose(ends, []).reason == "rank 3 killed by SIGKILL"


# What ranks blocked in a collective raise under NCCL when a peer failed (PyTorch's texts from
# ProcessGroupNCCL.cpp / NCCLUtils.cpp, as torch 2.1-2.6 print them; a CPU wheel has none of them).
FRAMES = ('Traceback (most recent call last):\n  File "/work/framework/train/worker.py", line 66, in rank_main\n'
          '    trainer.run()\n  File "/venv/torch/distributed/c10d_logger.py", line 83, in wrapper\n'
          '    return func(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^^^^\n')
NCCL_VICTIMS = {
    "timeout": FRAMES + "torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=16777216, NumelOut=16777216, Timeout(ms)=600000) ran for 600031 "
    "milliseconds before timing out.\nException raised from checkTimeout at ../torch/csrc/distributed/c10d/"
    "ProcessGroupNCCL.cpp:565 (most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, "
    "std::string) + 0x57 (0x7f1c2c581897 in /venv/torch/lib/libc10.so)\n",
    "aborted": FRAMES + "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 1.  Original "
    "reason for failure was: [Rank 1] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
    "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n",
    "remote": FRAMES + "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:275, remote process exited or there was a network error, NCCL version 2.20.5\nncclRemoteError: "
    "A call failed possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
    "socketProgress: Connection closed by remote peer gpu-node2<43210>\n",
    "stuck": FRAMES + "RuntimeError: [PG ID 0 PG GUID 0(default_pg) Rank 3] ProcessGroupNCCL's watchdog got stuck "
    "for 480 seconds without making progress in monitoring enqueued collectives.\n",
    "store": FRAMES + "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
    "closed. Did the remote server shutdown or crash?\n",
}
OOM = FRAMES + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity " \
    "of 79.10 GiB of which 1.02 GiB is free.\n"


def test_nccl_victims_are_consequences_of_the_rank_that_failed():
    """Rank 2 runs out of memory; ranks 0, 1 and 3, blocked in its collective, end with NCCL's
    watchdog timeout, an aborted communicator, a remote error: recorded earlier or not, they
    are consequences, each told by its exception's first line."""
    rec = lambda t, tb: {"time": t, "traceback": tb, "peers_dead": []}  # noqa: E731
    for victims in (("timeout", "aborted", "remote"), ("stuck", "store", "timeout")):
        ends = {r: RankEnd(r, 1, rec(1.0 + r, NCCL_VICTIMS[v])) for r, v in zip((0, 1, 3), victims)}
        ends[2] = RankEnd(2, 1, rec(9.0, OOM))
        e = diagnose(ends, [])
        assert e.reason == "rank 2 failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. " \
                           "GPU 2 has a total capacity of 79.10 GiB of which 1.02 GiB is free.", e.reason
        tail = str(e).splitlines()[-1]
        assert tail.startswith("then, as a consequence: rank 0 failed: torch.distributed.DistBackendError: ") \
            or tail.startswith("then, as a consequence: rank 0 failed: RuntimeError: [PG ID 0"), tail
        assert "frame #0" not in tail and "socketProgress" not in tail, tail
    # only victims: the earliest is told (nothing better is known)
    e = diagnose({r: RankEnd(r, 1, rec(5.0 - r, NCCL_VICTIMS[v])) for r, v in enumerate(NCCL_VICTIMS)}, [])
    assert e.reason.startswith("rank 4 failed: torch.distributed.DistNetworkError: Failed to recv"), e.reason


def test_failure_files_survive_an_unwritable_job_dir(tmp_path, capsys):
    (tmp_path / "summary.json").mkdir()  # writing summary.json fails, as on a full disk
    write_outcome(str(tmp_path), "failed", "rank 0 failed: X")  # reports, never raises
    assert "could not write" in capsys.readouterr().err


# ---- signals ----------------------------------------------------------------------------

@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_stop_every_rank_with_one_line(tmp_path, sig, code):
    marker = f"FRAMEWORK_TEST_MARKER={uuid.uuid4().hex}"
    proc = _start(tmp_path, *FAST, "parallelism=pp2", "trainer.steps=5000", marker=marker)
    _wait_for_steps(tmp_path, 1, proc)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole process group
    else:
        proc.send_signal(sig)  # a scheduler's SIGTERM to the launching process
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == code, err[-3000:]
    assert err.strip().splitlines() == [f"stopped by {signal.Signals(sig).name}: every rank ended; exit {code}"]
    assert not (tmp_path / "rank_failures").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    assert _processes_with(marker) == []


def test_a_reused_sweep_directory_never_mixes_two_sweeps(tmp_path):
    assert run_cli(["-m", "trainer.steps=0,-1,-2", *FAST, f"hydra.sweep.dir={tmp_path}"]).returncode == 0
    r = run_cli(["-m", "trainer.steps=-3,-4", *FAST, f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0 and "held an earlier sweep" in r.stdout
    rows = collect(tmp_path)
    assert [(x["job"], x["overrides"].split()[0]) for x in rows] == [("0", "trainer.steps=-3"), ("1", "trainer.steps=-4")]
    (aside,) = (tmp_path / ".previous").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["0", "1", "2", "multirun.yaml"]


def test_a_run_py_fork_runs_its_ranks_from_the_server_forked_for_it(tmp_path):
    """tests/run_py.py forks run.py a rank server instead of spawning one (~7 core-s of
    imports): under pytest (PYTEST_CURRENT_TEST set) run.py's prepare() must keep it. Its
    environment was once recorded with pytest's test name in it, so every run.py under pytest
    threw the fork away and spawned a fresh server."""
    assert os.environ.get("PYTEST_CURRENT_TEST")
    r = run_cli([*FAST, "trainer.steps=1", "metrics.skip_first=0", f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.server_kept is True


def test_the_rank_server_restarts_for_a_new_variable_but_not_for_pytests_test_name(monkeypatch):
    """Ranks fork from a server that holds the environment it started with: a variable set
    between two jobs restarts it (the ranks must see it), pytest's per-test name does not, nor
    inductor's cache directory set to its default by torch's imports."""
    import multiprocessing.forkserver as fs

    from framework.launch import forkserver

    class Server:
        stops = 0
        framework_env = None

        def _stop(self):
            Server.stops += 1

    monkeypatch.setattr(fs, "_forkserver", Server())
    monkeypatch.setattr(fs, "set_forkserver_preload", lambda modules: None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # as in a launcher before torch's imports
    forkserver.prepare()
    assert Server.stops == 1  # first job: started with this environment
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    forkserver.prepare()
    assert Server.stops == 1
    monkeypatch.setenv("WANDB_MODE", "offline-between-jobs")
    forkserver.prepare()
    assert Server.stops == 2
    # torch's imports set inductor's cache directory to its default (the ranks' imports do too)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    forkserver.prepare()
    assert Server.stops == 2
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    forkserver.prepare()
    assert Server.stops == 3
    # run.py under a process that imported torch (this suite): the server starts before torch's
    # imports with the inherited default, and the launch after them is no change
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch")
        forkserver.prepare()
    assert Server.stops == 4
    forkserver.prepare()
    assert Server.stops == 4


def test_run_py_starts_the_rank_server_early_unless_no_rank_starts_here(monkeypatch):
    """run.py starts the server before its own imports (framework/launch/forkserver.py), with
    SIGINT ignored while it starts (a Ctrl-C then is the launcher's to tell), killed at exit;
    not for Hydra's help or config printing, a dry run, the external launcher or a plugin."""
    import atexit
    import multiprocessing.forkserver as fs
    import signal

    from framework.launch import forkserver

    seen, exits = [], []
    monkeypatch.setattr(forkserver, "prepare", lambda: None)
    monkeypatch.setattr(fs, "ensure_running", lambda: seen.append(signal.getsignal(signal.SIGINT)))
    monkeypatch.setattr(atexit, "register", lambda f, *a: exits.append((f, a)))
    for argv in (["--help"], ["--cfg", "job"], ["dry_run=true"], ["launcher=external"],
                 ["hydra/launcher=submitit_local", "-m"], ["++dry_run=True"]):
        forkserver.start_early(argv)
    assert seen == [] and exits == []
    before = signal.getsignal(signal.SIGINT)
    forkserver.start_early(["parallelism=dp2", "trainer.steps=3"])
    assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is before
    assert exits == [(forkserver._kill, (fs._forkserver,))]



@pytest.mark.parametrize("device,method", [("cuda", "spawn"), ("cpu", "forkserver")])
def test_cuda_ranks_are_spawned_and_cpu_ranks_forked_from_the_rank_server(tmp_path, monkeypatch, device, method):
    """A fork of a process in which any import asked CUDA for its devices cannot use CUDA
    (every forked rank failed so on an H200, torchao installed): a local launch spawns CUDA
    ranks and forks CPU ones from the server that imported the framework once."""
    from framework.launch import local

    seen = []

    def capture(config, job_dir, info, watchdog, run):
        watchdog.stop()
        seen.append(config.start_method)
        return {0: {}}

    monkeypatch.setattr(local, "run_ranks", capture)
    monkeypatch.setattr(local, "resolve_device", lambda requested: device)
    (tmp_path / "config.yaml").write_text("")
    monkeypatch.setattr(local, "read_config", lambda path: None)
    run = compose(*TINY)
    info = RunInfo(None, 256, 8, 1.0, None, "none", 0.0)
    assert local.launch_local(run, str(tmp_path), info) == {}
    assert seen == [method]
