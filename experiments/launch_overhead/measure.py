"""What a short local launch costs outside its steps, with and without two launcher changes.

Runs tiny fp64 jobs through framework.launch.job.run_job (the path run.py takes after Hydra)
in this process, alternating per repeat between
- `now`: the code as it is;
- `stack`: elastic's rendezvous naming its events with inspect.stack() again (its own
  get_method_name), the launch made from 60 frames deep (a test runner's or a notebook's
  depth; a script's own stack is shallow);
- `reads`: every rank reading config.yaml itself again (the launcher hands none over).
Per launch: wall seconds, the machine's busy core-seconds (/proc/stat: the launcher, the ranks,
anything else running: run it on a quiet machine) and the launcher's own CPU seconds.

With --cli: `python run.py` (a fresh interpreter) against tests/run_py.py's fork of a rank
server, for a config error and a 2-step dp 2 job.

    .venv/bin/python experiments/launch_overhead/measure.py --repeats 4
    .venv/bin/python experiments/launch_overhead/measure.py --cli --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=32", "logger=none",
        "trainer.micro_batch_size=2", "trainer.log_interval=2", "metrics.skip_first=0", "metrics.peak_tflops=1.0",
        "trainer.precision=fp64", "data=synthetic", "trainer.steps=4"]
LAYOUTS = {"single": ["parallelism=single"], "dp2": ["parallelism=dp2"],
           "pp2 flush": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4"],
           "tp2 x pp2": ["parallelism=tp2_pp2", "schedule=flush", "schedule.microbatches=4"]}
CLI = {"config error": ["parallelism.dp=0"],
       "2-step dp 2": ["model=gpt2-tiny", "data=synthetic", "logger=none", "trainer.steps=2", "parallelism=dp2"]}


def busy_s() -> float:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / 100  # all but idle and iowait


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def deep(n: int, fn):
    return fn() if n == 0 else deep(n - 1, fn)


def launch(overrides: list[str], variant: str) -> None:
    from hydra import compose, initialize_config_dir

    from framework.config import load_config
    from framework.launch import local
    from framework.launch.job import run_job
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        run = load_config(compose("config", overrides=overrides))
    patch, read = local._event_names_from_the_frame, local.read_config
    name = dynamic_rendezvous.get_method_name
    try:
        if variant == "stack":
            local._event_names_from_the_frame = lambda: setattr(dynamic_rendezvous, "get_method_name", ORIGINAL)
        if variant == "reads":
            local.read_config = lambda path: None  # rank_main(run=None): each rank reads the file
        with contextlib.redirect_stdout(io.StringIO()):
            deep(60, lambda: run_job(run, tempfile.mkdtemp()))
    finally:
        local._event_names_from_the_frame, local.read_config = patch, read
        dynamic_rendezvous.get_method_name = name


def measure(fn) -> tuple[float, float, float]:
    t, b, c = time.perf_counter(), busy_s(), own_cpu_s()
    fn()
    return time.perf_counter() - t, busy_s() - b, own_cpu_s() - c


def launches(repeats: int) -> None:
    variants = ("now", "stack", "reads")
    launch(TINY + LAYOUTS["dp2"], "now")  # the rank server's start, once
    print("| layout | variant | wall s / launch | busy core-s / launch | launcher CPU s / launch |")
    print("|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        rows = {v: [] for v in variants}
        for _ in range(repeats):
            for v in variants:  # alternating: drift hits each variant alike
                rows[v].append(measure(lambda: launch(TINY + layout, v)))
        for v in variants:
            w, b, c = (statistics.median(x) for x in zip(*rows[v]))
            print(f"| {name} | {v} | {w:.2f} | {b:.2f} | {c:.2f} |", flush=True)


def cli(repeats: int) -> None:
    from tests.run_py import run_py

    run_py(CLI["config error"])  # this process's rank server, once
    print("| run.py | started as | wall s | busy core-s | exit code |")
    print("|---|---|---|---|---|")
    for name, args in CLI.items():
        rows = {"python run.py": [], "tests/run_py.py fork": []}
        for _ in range(repeats):
            for how in rows:
                job = ["hydra.run.dir=" + tempfile.mkdtemp()]
                if how == "python run.py":
                    fn = lambda: subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), *args, *job],  # noqa: E731
                                                cwd=ROOT, capture_output=True).returncode
                else:
                    fn = lambda: run_py([*args, *job]).returncode  # noqa: E731
                out = {}
                w, b, _ = measure(lambda: out.setdefault("rc", fn()))
                rows[how].append((w, b, out["rc"]))
        for how, r in rows.items():
            print(f"| {name} | {how} | {statistics.median(x[0] for x in r):.1f} | "
                  f"{statistics.median(x[1] for x in r):.1f} | {sorted({x[2] for x in r})} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--cli", action="store_true")
    a = p.parse_args()
    cli(a.repeats) if a.cli else launches(a.repeats)


if __name__ == "__main__":
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    ORIGINAL = dynamic_rendezvous.get_method_name  # elastic's own, before any launch replaced it
    main()
