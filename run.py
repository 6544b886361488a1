"""Hydra entry point: compose -> validate -> launch ranks -> summarise.

Only this process runs Hydra. It writes the resolved config into the job directory and
starts dp*tp*pp ranks that read it (framework/worker.py), so ranks never race on `.hydra/`
or resolve `${now:}` differently. Returns the run's objective for Hydra sweepers.

A job that does not complete (rejected config, failed or hung rank) writes summary.json
with its status and reason. A single run then exits 1; in a multirun the job returns NaN
(Optuna records a NaN objective as a failed trial, and no sweeper mistakes it for a good
score) and the sweep goes on. Ctrl-C / SIGTERM stop everything: one line, exit 130 / 143.
"""

import math
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.config import ConfigError, RunConfig, load_config
from framework.job import run_job, set_aside_previous, write_outcome
from framework.launch import RankFailure
from framework.signals import StopSignals, Stopped


def name_run(run: RunConfig, hc) -> None:
    """W&B group = the preset or sweep; run name = the overrides that made this job."""
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra")]
    if run.logger.group is None and hc.mode == RunMode.MULTIRUN:
        run.logger.group = hc.sweep.dir.rstrip("/").replace("/", "_")
    if run.logger.run_name is None:
        run.logger.run_name = " ".join(overrides) or "default"


def job(cfg: DictConfig, hc) -> float:
    job_dir = hc.runtime.output_dir
    set_aside_previous(job_dir)
    try:
        run = load_config(cfg)
    except ConfigError as e:
        write_outcome(job_dir, "rejected", str(e))
        raise
    name_run(run, hc)
    try:
        result = run_job(run, job_dir)
    except (ConfigError, RankFailure):
        raise  # their summary.json is written
    except Exception as e:  # the launching process itself (an I/O error preparing data, ...)
        write_outcome(job_dir, "failed", f"launcher: {type(e).__name__}: {e}")
        raise
    if not result or run.dry_run or result.get(run.objective) is None:
        return math.nan  # e.g. objective=mfu under precision=fp64, which reports no MFU
    return float(result[run.objective])


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        return job(cfg, hc)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        if not sweep:
            raise SystemExit(1) from None
    except RankFailure:
        if not sweep:  # the report is printed already, and in error.txt
            raise SystemExit(1) from None
    print(f"job {hc.job.num} did not complete (see {hc.runtime.output_dir}/summary.json); the sweep goes on",
          file=sys.stderr, flush=True)
    return math.nan


if __name__ == "__main__":
    StopSignals().install()  # Ctrl-C and SIGTERM raise Stopped, wherever this process is
    try:
        main()
    except Stopped as s:
        print(f"stopped by {s.name}: every rank ended; exit {s.exit_code}", file=sys.stderr, flush=True)
        sys.exit(s.exit_code)
