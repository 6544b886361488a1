"""The ranks' server: every rank of a local launch is a fork of one process that imported
torch, transformers and the framework once (about 5 s of imports per rank with `spawn`; a
sweep or the test suite starts hundreds of ranks). The server never runs torch ops, so
its forks are as clean as spawned processes on a CPU: no OpenMP pool. CUDA ranks are spawned
(`start_method`): a fork of a process in which anything asked CUDA for its devices fails its
first CUDA call.

run.py starts it first thing (`start_early`), so its imports (about 8 s on 2 cores) run on
another core while the launcher imports and validates the config, instead of after. This
module imports only the standard library: run.py calls it before anything heavy.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver as fs
import os
import signal
import sys

# matplotlib.pyplot: rank 0 of every pipeline job draws timeline.png; importing it in that
# rank was 0.6 s of wall time and 0.56-0.76 core-s of a tiny pipeline launch's 1.1-2.3
# (experiments/launch_overhead, second round), now ~0.7 s once per server. It picks no backend
# on import (timeline.py selects Agg before drawing).
PRELOAD = ["framework.train.worker", "framework.train.trainer", "matplotlib.pyplot"]

# Variables that change between jobs without meaning anything to a rank: elastic's own, and
# pytest's per-phase test name (else every test of the suite restarts the server: ~4 s each).
_NOT_FOR_RANKS = ("TORCHELASTIC_", "PYTEST_CURRENT_TEST")

# Arguments of run.py after which no rank starts here: Hydra's help and config printing, the
# dry run, the external launcher (torchrun starts the ranks), and a Hydra launcher plugin
# (submitit runs each job in a process of its own).
_NO_RANKS_HERE = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
                  "dry_run=true", "launcher=external", "hydra/launcher=")


def start_method(device: str) -> str:
    """How ranks on `device` (resolved: "cpu" or "cuda") start. CUDA ranks are spawned:
    `torch.cuda.is_available()` or `device_count()` in a process poisons its forks ("Cannot
    re-initialize CUDA in forked subprocess"), and libraries ask at import: with torchao
    installed, transformers' import reaches three such calls. On an H200 (2026-11-29) every
    forked rank failed so, and answering those calls through NVML during the server's imports
    (PYTORCH_NVML_BASED_CUDA_CHECK) did not cure it. A spawned rank imports the framework
    itself (~5 s), small beside a GPU job."""
    return "spawn" if device == "cuda" else "forkserver"


def prepare() -> None:
    """Before a launch: the ranks fork from a server holding this process's environment.

    A fork inherits the *server's* environment, plus what elastic sets per rank (RANK,
    MASTER_ADDR, ...). So the server is restarted whenever this process's environment
    changed since it started (a W&B or HF variable set between two jobs must reach the
    ranks, as it would with spawn)."""
    env = ranks_environment(os.environ)
    server = fs._forkserver  # the stdlib's per-process server; _stop is its own reset
    started = getattr(server, "framework_env", None)
    # Both compared as they are now: a server started before torch's imports (run.py's early
    # start) holds the inductor directory this process inherited, which is its default once
    # torch is imported here, so it is no change (else every run.py under a process that had
    # imported torch, the test suite's, restarted its server halfway through its imports).
    if started is None or _for_ranks(started) != _for_ranks(env):
        _kill(server)  # a server still importing would finish its imports before _stop returned
        server._stop()
        server.framework_env = env
    fs.set_forkserver_preload(PRELOAD)


def ranks_environment(environ) -> dict:
    """The variables a server is started with and compared by: `environ` less those that
    change between jobs without meaning anything to a rank (_NOT_FOR_RANKS)."""
    return {k: v for k, v in environ.items() if not k.startswith(_NOT_FOR_RANKS)}


def _for_ranks(env: dict) -> dict:
    """The variables of `env` that a rank must see. Inductor's cache directory is set by
    torch's own imports to its default (as each rank's imports set it again): not a change."""
    env = dict(env)
    if "TORCHINDUCTOR_CACHE_DIR" in env and "torch" in sys.modules:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # torch releases before the function: a restart, as for any variable
            return env
        if env["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir()):
            del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def start_early(argv: list[str]) -> None:
    """Start the server now unless `argv` says no rank starts in this process; it is killed
    when this process exits (a rejected config must not leave it importing on a core)."""
    if any(a.lower().lstrip("+").startswith(_NO_RANKS_HERE) for a in argv):
        return
    prepare()
    # The server inherits an ignored SIGINT: a Ctrl-C in the terminal (the whole process group)
    # during its imports is this process's to tell, not a KeyboardInterrupt traceback of the
    # server's (it ignores SIGINT itself once its imports are done; each rank installs its own).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fs.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
    atexit.register(_kill, fs._forkserver)


def _kill(server) -> None:
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
