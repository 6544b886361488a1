"""Hydra entry point: compose -> validate -> launch ranks -> summarise.

Only this process runs Hydra. It writes the resolved config into the job directory and
starts dp*tp*pp ranks that read it (framework/train/worker.py), so ranks never race on `.hydra/`
or resolve `${now:}` differently. Returns the run's objective for Hydra sweepers.

A job that does not complete (rejected config, failed or hung rank) writes summary.json
with its status and reason. A single run then exits 1; in a multirun the job returns
`search.failed_value`, NaN by default (Optuna records a NaN objective as a failed trial, and
no sweeper mistakes it for a good score; a layout search scores such a trial 0 tokens/s
instead, so the sampler learns from it), and the sweep goes on. Ctrl-C / SIGTERM stop
everything: one line, exit 130 / 143. The job's console also goes to its run.log.
"""

import sys

if __name__ == "__main__":  # the ranks' server imports on another core while this process does (below)
    from framework.launch.forkserver import start_early

    start_early(sys.argv[1:])

import importlib.util
import math
import os

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.config import ConfigError, RunConfig, load_config
from framework.checkpoint import finished
from framework.device import share_cores_in_a_sweep
from framework.launch import repeats
from framework.launch.job import run_job
from framework.launch.jobdir import write_outcome
from framework.report.files import set_aside_previous
from framework.launch.diagnosis import RankFailure
from framework.report.progress import console_to_run_log
from framework.train.signals import StopSignals, Stopped
from framework.sim.sweep import OBJECTIVES as SIMULATED_OBJECTIVES
from framework.validate import configure
from framework.validate.overrides import add_absent_keys, check_command_line

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def name_run(run: RunConfig, hc) -> None:
    """W&B group = the preset or sweep; run name = the overrides that made this job."""
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra")]
    if run.logger.group is None and hc.mode == RunMode.MULTIRUN:
        run.logger.group = hc.sweep.dir.rstrip("/").replace("/", "_")
    if run.logger.run_name is None:
        run.logger.run_name = " ".join(o.removeprefix("++") for o in overrides) or "default"


def job(cfg: DictConfig, hc, job_dir: str) -> float:
    try:
        run = configure(cfg, list(hc.overrides.task))
    except ConfigError as e:
        write_outcome(job_dir, "rejected", str(e))
        raise
    name_run(run, hc)
    if hc.mode == RunMode.MULTIRUN:
        share_cores_in_a_sweep(run.trainer)  # every job the same threads per rank (framework/device.py)
    try:
        result = run_job(run, job_dir, set_aside=False)  # main() set earlier files aside before run.log began
    except (ConfigError, RankFailure):
        raise  # their summary.json is written
    except Exception as e:  # the launching process itself (an I/O error preparing data, ...)
        write_outcome(job_dir, "failed", f"launcher: {type(e).__name__}: {e}")
        raise
    return score(run, result, cfg)


def score(run: RunConfig, result, cfg: DictConfig) -> float:
    """The job's objective for the sweeper: measured, or predicted under search.mode=simulate."""
    key = run.objective
    if run.search.mode == "simulate":  # predicted, not run: the prediction of the objective
        key = SIMULATED_OBJECTIVES.get(key, "")
        if result and result.get(key) is None and result.get("reason"):
            return failed_value(cfg)  # predicted out of memory: scored as a rejected layout, so Optuna avoids it
    if not result or run.dry_run or result.get(key) is None:
        return math.nan  # e.g. objective=mfu under precision=fp64, which reports no MFU
    return float(result[key])


def outcome(cfg: DictConfig, hc) -> float:
    """The job's objective, or for a job that did not complete: exit 1 (a single run) or
    NaN (a sweep goes on)."""
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        return job(cfg, hc, hc.runtime.output_dir)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        if not sweep:
            raise SystemExit(1) from None
    except RankFailure:
        if not sweep:  # the report is printed already, and in error.txt
            raise SystemExit(1) from None
    except Stopped as s:  # a stop ends a sweep too
        print(f"stopped by {s.name}: every rank ended; exit {s.exit_code}", file=sys.stderr, flush=True)
        raise SystemExit(s.exit_code) from None
    score = failed_value(cfg)
    print(f"job {hc.job.num} did not complete (see {hc.runtime.output_dir}/summary.json); it scores {score}; "
          "the sweep goes on", file=sys.stderr, flush=True)
    return score


def failed_value(cfg: DictConfig) -> float:
    """search.failed_value, read from the composed config (a job rejected by the schema has
    no typed one); NaN when unset or unreadable."""
    try:
        value = OmegaConf.select(cfg, "search.failed_value", default=None)
        return math.nan if value is None else float(value)
    except Exception:  # noqa: BLE001 - a value the schema would reject: the sweep still goes on
        return math.nan


def sweeper_installed(argv: list[str]) -> bool:
    """hparams_search=layout needs the Optuna sweeper plugin; without it Hydra would only say
    that hydra/sweeper/optuna is not found."""
    if not any(a.startswith("hparams_search=") and a != "hparams_search=null" for a in argv):
        return True
    if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None:
        return True
    print("config error: hparams_search: needs the Hydra Optuna sweeper, which is not installed. "
          "Fix: pip install -e \".[sweep]\" (hydra-optuna-sweeper)", file=sys.stderr, flush=True)
    return False


def overrides_known(argv: list[str]) -> bool:
    """Every key and group option on the command line exists (framework/validate/overrides.py):
    told before Hydra composes, which would word it its own way; sweep.repeats outside a sweep."""
    try:
        check_command_line(argv, CONF_DIR)
        repeats.expand(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return False
    return True


def _finished(cfg: DictConfig, job_dir: str) -> bool:
    """A finished job relaunched as it was with trainer.resume=auto keeps its files
    (framework.launch.job says so and runs nothing)."""
    if OmegaConf.select(cfg, "trainer.resume", default=None) != "auto":
        return False
    try:
        return finished(load_config(cfg), job_dir) is not None
    except ConfigError:
        return False  # told by the usual path


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    if not _finished(cfg, hc.runtime.output_dir):
        set_aside_previous(hc.runtime.output_dir)
    with console_to_run_log(hc.runtime.output_dir):  # run.log: the job's whole console
        return outcome(cfg, hc)


if __name__ == "__main__":
    if not sweeper_installed(sys.argv[1:]) or not overrides_known(sys.argv[1:]):
        sys.exit(1)
    sys.argv[1:] = add_absent_keys(repeats.expand(sys.argv[1:]), CONF_DIR)  # sweep.repeats: A B C A B C
    StopSignals().install()  # Ctrl-C and SIGTERM raise Stopped, wherever this process is
    try:
        main()
    except Stopped as s:
        print(f"stopped by {s.name}: every rank ended; exit {s.exit_code}", file=sys.stderr, flush=True)
        sys.exit(s.exit_code)
