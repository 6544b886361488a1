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
`start_run_py` is the same process as a handle (or `python -m module`: the node agents of
tests/test_multinode.py), for the tests that signal it mid-run
(Popen's pid, poll, send_signal, communicate, returncode; a new session if asked, as
Popen's start_new_session): its signal dispositions are a fresh interpreter's (the server
restores its own, Python's defaults, in each fork) and run.py installs its handlers itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fork_a_rank_server(env: dict) -> int:
    """This process's forkserver (the stdlib's, as ForkServer.ensure_running makes it) forked
    from this process instead of spawned; framework.launch.forkserver.prepare() keeps it while
    the environment is `env` (and replaces it, as usual, if run.py changes the environment).
    Returns its pid."""
    import socket
    from multiprocessing import connection
    from multiprocessing import forkserver as fs

    from framework.launch import forkserver

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
    # compared by prepare() as it compares its own: less pytest's test name and elastic's
    # variables (kept, every run.py under pytest restarted this server: ~7 core-s of imports)
    server.framework_env = forkserver.ranks_environment(env)
    return pid


def _server_forks() -> bool:
    """Whether _fork_a_rank_server knows this Python's forkserver: 3.11-3.13's four fields.
    Python 3.14's adds an authentication key; there the run spawns its server as run.py does."""
    import inspect
    from multiprocessing import forkserver as fs

    return "authkey_r" not in inspect.signature(fs.main).parameters


def _main(argv: list[str], env: dict, out: str, err: str, fork_server: bool, new_session: bool = False,
          module: str | None = None) -> None:
    """In the fork: become `python run.py *argv` (`python -m module *argv`) and exit as it
    would. `err` == `out`: one file for both (Popen's stderr=STDOUT)."""
    import atexit
    import runpy
    import traceback

    if new_session:
        os.setsid()
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for stream, path, fd in ((sys.stdout, out, 1), (sys.stderr, err, 2)):
        stream.flush()
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fd == 1 else 0))
        os.dup2(f, fd)
        os.close(f)
    forked = _fork_a_rank_server(env) if fork_server else None
    code = 0
    try:
        if module is None:
            sys.argv = [str(ROOT / "run.py"), *argv]
            runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
        else:
            sys.argv = [module, *argv]  # run_module sets argv[0] to the module's file, as -m does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter ends on one: its traceback, then SIGINT's default
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback, exit 1
        traceback.print_exc()
        code = 1
    from multiprocessing import forkserver as fs

    with open(out + ".server", "w") as f:  # whether run.py kept the forked server (RunPy.server_kept)
        f.write(str(forked is not None and fs._forkserver._forkserver_pid == forked))
    atexit._run_exitfuncs()  # run.py's: its own rank server is killed at exit
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class RunPy:
    """`subprocess.Popen([python, "run.py", *args], stdout=PIPE, stderr=PIPE or STDOUT,
    text=True)` as far as the tests use it, for a fork running run.py (`_main`)."""

    def __init__(self, args: list[str], env: dict | None = None, merge_stderr: bool = False,
                 new_session: bool = False, module: str | None = None, unset: tuple = ()):
        import tempfile

        import multiprocessing as mp

        from framework.launch import forkserver

        forkserver.prepare()  # this process's environment: the fork starts from it
        self.args = [sys.executable, *(["-m", module] if module else [str(ROOT / "run.py")]), *args]
        self._tmp = tempfile.TemporaryDirectory()
        self._out = os.path.join(self._tmp.name, "stdout")
        self._err = self._out if merge_stderr else os.path.join(self._tmp.name, "stderr")
        fork_server = not env and _server_forks()
        self._p = mp.get_context("forkserver").Process(
            target=_main, args=(list(args), {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset},
                                self._out, self._err, fork_server, new_session, module))
        self._p.start()
        self.pid = self._p.pid
        if new_session:  # as Popen returns: the child already leads its own process group
            deadline = time.monotonic() + 30
            while self._pgid() != self.pid and self._p.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.001)
        self.returncode = None
        self.server_kept = None

    def _pgid(self) -> int | None:
        try:
            return os.getpgid(self.pid)
        except ProcessLookupError:
            return None

    def poll(self):
        if self._p.exitcode is not None:
            self.returncode = self._p.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a pid the system may have given to another process
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._p.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """(stdout, stderr) once the process has exited; stderr None when merged into stdout."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired as e:
            e.stdout, e.stderr = self._read()
            raise
        out = self._read()
        flag = Path(self._out + ".server")
        # whether run.py kept the rank server forked for it (not a fresh one started): None when
        # the fork ended before it could tell (a signal)
        self.server_kept = flag.read_text() == "True" if flag.exists() else None
        self._tmp.cleanup()
        return out

    def _read(self) -> tuple[str, str | None]:
        out = Path(self._out).read_text(errors="replace")
        return out, None if self._err == self._out else Path(self._err).read_text(errors="replace")


# `python run.py *args` (`python -m module *args`) started, with os.environ and `env` as its
# environment, less the variables named in `unset`: the handle's constructor is the call.
start_run_py = RunPy


def run_py(args: list[str], timeout: float = 300, env: dict | None = None,
           unset: tuple = ()) -> subprocess.CompletedProcess:
    """What `subprocess.run([python, "run.py", *args], capture_output=True, text=True)` returns,
    with os.environ and `env` as the process's environment, less the variables in `unset`."""
    p = start_run_py(args, env, unset=unset)
    try:
        stdout, stderr = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        stdout, stderr = p._read()
        p._tmp.cleanup()
        raise subprocess.TimeoutExpired(p.args, timeout, stdout, stderr) from None
    done = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    done.server_kept = p.server_kept
    return done
