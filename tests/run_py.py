"""`python run.py ARGS` for the tests, in a fork of this session's rank server.

A fresh `python run.py` spends ~7 s of a core importing torch, transformers, Hydra and the
framework before it reads its first argument, and its own rank server imports them again on
the other core (~14 core-seconds for a config error, ~19 for a 2-step dp2 job, measured with
/proc/stat here). About fifty such runs made a third of the suite's CPU time. A fork of the
server (framework/launch/forkserver.py: those modules imported, no thread started, no torch
op run) runs run.py's `__main__` as the interpreter would, in its own process: its own
environment, working directory, argv, stdout and stderr, signal handlers, rank server and exit
code. It skips the interpreter's start and the parent's imports only; and its rank server is
a fork of it made before run.py starts (modules imported, no thread: what the server's own
imports would give) instead of a fresh interpreter importing them again. A run given extra
variables (`env`) starts its server as run.py does: a test that passes them finds its ranks
by them in /proc/<pid>/environ, which holds a process's variables as exec'd, not as forked.
Tests that signal the process start a real interpreter (subprocess.Popen).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fork_a_rank_server(env: dict) -> None:
    """This process's forkserver (the stdlib's, as ForkServer.ensure_running makes it) forked
    from this process instead of spawned; framework.launch.forkserver.prepare() keeps it while
    the environment is `env` (and replaces it, as usual, if run.py changes the environment)."""
    import socket
    from multiprocessing import connection
    from multiprocessing import forkserver as fs

    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w has exited
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            fs.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server = fs._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    server.framework_env = dict(env)


def _server_forks() -> bool:
    """Whether _fork_a_rank_server knows this Python's forkserver: 3.11-3.13's four fields.
    Python 3.14's adds an authentication key; there the run spawns its server as run.py does."""
    import inspect
    from multiprocessing import forkserver as fs

    return "authkey_r" not in inspect.signature(fs.main).parameters


def _main(argv: list[str], env: dict, out: str, err: str, fork_server: bool) -> None:
    """In the fork: become `python run.py *argv` and exit as it would."""
    import atexit
    import runpy
    import traceback

    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for stream, path, fd in ((sys.stdout, out, 1), (sys.stderr, err, 2)):
        stream.flush()
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if fork_server:
        _fork_a_rank_server(env)
    sys.argv = [str(ROOT / "run.py"), *argv]
    code = 0
    try:
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback, exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # run.py's: its own rank server is killed at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_py(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """What `subprocess.run([python, "run.py", *args], capture_output=True, text=True)` returns,
    with os.environ and `env` as the process's environment."""
    import tempfile

    import multiprocessing as mp

    from framework.launch import forkserver

    forkserver.prepare()  # this process's environment: the fork starts from it
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        fork_server = not env and _server_forks()
        p = ctx.Process(target=_main, args=(list(args), {**os.environ, **(env or {})}, out, err, fork_server))
        p.start()
        p.join(timeout)
        timed_out = p.exitcode is None
        if timed_out:
            p.kill()
            p.join()
        stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, p.exitcode, stdout, stderr)
