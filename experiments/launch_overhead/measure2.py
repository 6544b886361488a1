"""The second round of launch costs (issue 49): what three launcher changes take off a tiny
local launch, and what a run.py fork costs when its rank server is kept or started afresh.

Tiny fp64 jobs through framework.launch.job.run_job in this process (the path run.py takes
after Hydra, composition included), alternating per repeat between
- `now`: the code as it is;
- `omegaconf`: the config through OmegaConf again (load_config's merge for every config,
  config.yaml written from OmegaConf's structured tree and read by its pure-Python loader);
- `waits`: elastic's random 0-0.3 s rendezvous skew again, and the agent's 0.2 s look.
and, in blocks (the rank server restarted between them, outside the timed launches),
- `no mpl`: the rank server without matplotlib.pyplot preloaded (rank 0 of a pipeline job
  imports it to draw timeline.png).
Per launch: wall seconds, the machine's busy core-seconds (/proc/stat: run it on a quiet
machine) and the launcher's own CPU seconds; medians over the repeats.

With --cli: tests/run_py.py's fork of run.py under pytest's variables, keeping the rank
server forked for it, against the same fork starting a fresh server (what every run.py fork
under pytest did until the server's environment was recorded as prepare() compares it).

    .venv/bin/python experiments/launch_overhead/measure2.py --repeats 5
    .venv/bin/python experiments/launch_overhead/measure2.py --cli --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import CLI, LAYOUTS, TINY, measure  # noqa: E402


@contextlib.contextmanager
def variant(name: str):
    from omegaconf import OmegaConf
    from omegaconf._utils import get_omega_conf_dumper, get_yaml_loader

    from framework.config import load
    from framework.launch import job, local

    saved = (load.plain_object, load._yaml_classes, job.to_yaml, local._no_rendezvous_skew, local.MONITOR_INTERVAL_S)
    try:
        if name == "omegaconf":
            load.plain_object = lambda cls, data: None
            load._yaml_classes = lambda: (get_yaml_loader(), get_omega_conf_dumper())
            job.to_yaml = lambda run: OmegaConf.to_yaml(OmegaConf.structured(run))
        if name == "waits":
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous

            assert dynamic_rendezvous._delay.__module__.endswith("utils")  # elastic's own: skew and all
            local._no_rendezvous_skew = contextlib.nullcontext
            local.MONITOR_INTERVAL_S = 0.2
        yield
    finally:
        (load.plain_object, load._yaml_classes, job.to_yaml, local._no_rendezvous_skew,
         local.MONITOR_INTERVAL_S) = saved


def launch(overrides: list[str], name: str) -> None:
    from hydra import compose, initialize_config_dir

    from framework.config import load_config
    from framework.launch.job import run_job

    with variant(name), contextlib.redirect_stdout(io.StringIO()):
        with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
            run = load_config(compose("config", overrides=overrides))
        run_job(run, tempfile.mkdtemp())


def restart_server(preload: list[str]) -> None:
    import multiprocessing.forkserver as fs

    from framework.launch import forkserver

    forkserver.PRELOAD = preload
    fs._forkserver._stop()
    fs._forkserver.framework_env = None
    launch(TINY + LAYOUTS["single"], "now")  # the server's start, outside the timed launches


def launches(repeats: int) -> None:
    from framework.launch import forkserver

    with_mpl = list(forkserver.PRELOAD)
    without = [m for m in with_mpl if not m.startswith("matplotlib")]
    restart_server(with_mpl)
    rows = {(n, v): [] for n in LAYOUTS for v in ("now", "omegaconf", "waits", "no mpl")}
    for _ in range(repeats):
        for n, layout in LAYOUTS.items():
            for v in ("now", "omegaconf", "waits"):  # alternating: drift hits each variant alike
                rows[n, v].append(measure(lambda: launch(TINY + layout, v)))
        restart_server(without)
        for n, layout in LAYOUTS.items():
            rows[n, "no mpl"].append(measure(lambda: launch(TINY + layout, "now")))
        restart_server(with_mpl)
    print("| layout | variant | wall s / launch | busy core-s / launch | launcher CPU s / launch |")
    print("|---|---|---|---|---|")
    for (n, v), r in rows.items():
        w, b, c = (statistics.median(x) for x in zip(*r))
        print(f"| {n} | {v} | {w:.2f} | {b:.2f} | {c:.2f} |", flush=True)


def cli(repeats: int) -> None:
    from tests.run_py import run_py

    os.environ["PYTEST_CURRENT_TEST"] = "measure2.py (call)"  # as under pytest
    run_py(CLI["config error"])  # this process's rank server, once
    hows = {"fork, its forked server kept": {}, "fork, a fresh server started": {"MEASURE2_FRESH_SERVER": "1"}}
    print("| run.py | tests/run_py.py | wall s | busy core-s | exit code | server kept |")
    print("|---|---|---|---|---|---|")
    for name, args in CLI.items():
        rows = {h: [] for h in hows}
        for _ in range(repeats):
            for how, env in hows.items():  # a variable given: run_py starts the server afresh
                out = {}
                w, b, _ = measure(lambda: out.setdefault("r", run_py([*args, "hydra.run.dir=" + tempfile.mkdtemp()],
                                                                       env=env)))
                rows[how].append((w, b, out["r"].returncode, out["r"].server_kept))
        for how, r in rows.items():
            print(f"| {name} | {how} | {statistics.median(x[0] for x in r):.1f} | "
                  f"{statistics.median(x[1] for x in r):.1f} | {sorted({x[2] for x in r})} | "
                  f"{sorted({x[3] for x in r}, key=str)} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cli", action="store_true")
    a = p.parse_args()
    cli(a.repeats) if a.cli else launches(a.repeats)


if __name__ == "__main__":
    main()
