"""The Hydra callback of every run and sweep (conf/config.yaml `hydra.callbacks`): the job or
sweep directory checked before Hydra writes into it, a reused sweep directory's earlier sweep
set aside, and a sweep's end: a `search.mode=simulate` sweep runs its best candidates, an
Optuna search without a completed trial reports no best (framework/launch/search_result.py)."""

from __future__ import annotations

import sys

from framework.config import ConfigError
from framework.launch.job import run_job
from framework.report.files import set_aside_sweep
from framework.launch.search_result import applies, install_filter, rewrite_results
from framework.sim.sweep import finish as finish_simulated_search
from framework.validate import check_job_dir


class JobDirCallback:
    """A Hydra callback (conf/config.yaml hydra.callbacks). Hydra creates the job directory
    before run.py runs, so an unwritable `hydra.run.dir` / `hydra.sweep.dir` would end in
    Hydra's own traceback: checked here first, with the usual one-line error, exit 1. A
    reused sweep directory's earlier sweep is set aside before the new one writes."""

    def on_run_start(self, config, **kwargs) -> None:
        _dir_or_exit(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        _dir_or_exit(str(config.hydra.sweep.dir), "hydra.sweep.dir")
        set_aside_sweep(str(config.hydra.sweep.dir))
        if applies(config):  # no "Best value: 0.0" from a search without a completed trial
            install_filter(str(config.hydra.sweep.dir))

    def on_multirun_end(self, config, **kwargs) -> None:
        """search.mode=simulate: every job was predicted; now run the best top_k. A layout
        search none of whose trials completed has no best (framework/launch/search_result.py)."""
        if _select(config, "search.mode") == "simulate":
            finish_simulated_search(str(config.hydra.sweep.dir), run_job)
        if applies(config):
            rewrite_results(str(config.hydra.sweep.dir))  # an Optuna search without a completed trial: no best

    def __getattr__(self, name):  # Hydra calls every other hook too; they do nothing here
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def _select(config, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=None)


def _dir_or_exit(path: str, key: str) -> None:
    try:
        check_job_dir(path)
    except ConfigError as e:
        print(f"config error: {str(e).replace('hydra.run.dir=', key + '=', 1)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
