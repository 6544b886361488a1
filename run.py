"""Hydra entry point: compose -> validate -> launch ranks -> summarise.

Only this process runs Hydra. It writes the resolved config into the job directory and
starts dp*tp*pp ranks that read it (framework/worker.py), so ranks never race on `.hydra/`
or resolve `${now:}` differently. Returns the run's objective for Hydra sweepers.
"""

import math

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.config import ConfigError, RunConfig, load_config
from framework.job import run_job
from framework.launch import RankFailure


def name_run(run: RunConfig, hc) -> None:
    """W&B group = the preset or sweep; run name = the overrides that made this job."""
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra")]
    if run.logger.group is None and hc.mode == RunMode.MULTIRUN:
        run.logger.group = hc.sweep.dir.rstrip("/").replace("/", "_")
    if run.logger.run_name is None:
        run.logger.run_name = " ".join(overrides) or "default"


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    try:
        run = load_config(cfg)
        name_run(run, hc)
        result = run_job(run, hc.runtime.output_dir)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    except RankFailure:
        raise SystemExit(1) from None  # the rank's traceback is already printed
    if not result or run.dry_run or result.get(run.objective) is None:
        return math.nan  # e.g. objective=mfu under precision=fp64, which reports no MFU
    return float(result[run.objective])


if __name__ == "__main__":
    main()
