"""`python run.py ARGS` for the tests, in a fork of this session's rank server.

A fresh `python run.py` spends ~7 s of a core importing torch, transformers, Hydra and the
framework before it reads its first argument, and its own rank server imports them again on
the other core (~14 core-seconds for a config error, ~19 for a 2-step dp2 job, measured with
/proc/stat here). About fifty such runs made a third of the suite's CPU time. A fork of the
server (framework/launch/forkserver.py: those modules imported, no thread started, no torch
op run) runs run.py's `__main__` as the interpreter would, in its own process: its own
environment, working directory, argv, stdout and stderr, signal handlers, rank server and exit
code. It skips the interpreter's start and the parent's imports only. Tests that signal the
process or read its environment from /proc start a real interpreter (subprocess.Popen).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _main(argv: list[str], env: dict, out: str, err: str) -> None:
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
        p = ctx.Process(target=_main, args=(list(args), {**os.environ, **(env or {})}, out, err))
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
