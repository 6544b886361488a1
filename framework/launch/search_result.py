"""An Optuna layout search none of whose trials completed has no best layout.

Hydra's Optuna sweeper takes its best trial from the scores, and a rejected or failed trial
scores `search.failed_value` (0.0 in conf/hparams_search/layout.yaml), so a search whose
every trial was rejected printed "Best parameters: {...}" and "Best value: 0.0" and saved
them in optimization_results.yaml, as if a layout had run at 0 tokens/s. Here: the two log
lines are replaced by one that says no trial completed (a logging filter on the sweeper's
logger, installed at the sweep's start by JobDirCallback), and JobDirCallback.on_multirun_end rewrites the file with
`best_params: null`, `best_value: null` and the reason.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

RESULTS = "optimization_results.yaml"  # the Optuna sweeper's file in the sweep directory
SWEEPER_LOGGER = "hydra_plugins.hydra_optuna_sweeper._impl"


def trials(sweep_dir: str) -> tuple[int, int]:
    """(trials, how many of them have a result: a completed run, or a search.mode=simulate
    prediction, framework/sim/sweep.py's prediction.json)."""
    jobs = [d for d in Path(sweep_dir).iterdir() if d.is_dir() and d.name.isdigit()] if Path(sweep_dir).is_dir() else []
    return len(jobs), sum(_has_result(d) for d in jobs)


def _has_result(job: Path) -> bool:
    if (job / "prediction.json").exists():
        return True
    try:
        return json.loads((job / "summary.json").read_text()).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False


def no_best_reason(sweep_dir: str) -> Optional[str]:
    """Why the search has no best trial; None when one has a result."""
    n, done = trials(sweep_dir)
    if done or not n:  # no numbered job directory (another hydra.sweep.subdir): nothing to tell
        return None
    return (f"no trial completed: every one of the {n} trials was rejected or failed, and each scored "
            "search.failed_value, which is no measurement (python -m framework.report "
            f"{sweep_dir} says why each did not run)")


def rewrite_results(sweep_dir: str) -> None:
    """optimization_results.yaml of a search without a completed trial: no best."""
    f = Path(sweep_dir) / RESULTS
    why = no_best_reason(sweep_dir) if f.exists() else None
    if why is None:
        return
    import yaml

    f.write_text(yaml.safe_dump({"name": "optuna", "best_params": None, "best_value": None, "no_best": why},
                                sort_keys=False))
    print(f"no best layout: {why}", flush=True)


class _NoFalseBest(logging.Filter):
    """Drops the sweeper's "Best parameters" / "Best value" lines when no trial completed."""

    def __init__(self, sweep_dir: str):
        super().__init__()
        self.sweep_dir = sweep_dir

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(("Best parameters:", "Best value:")):
            return True
        return no_best_reason(self.sweep_dir) is None


def applies(config) -> bool:
    """Only a study that lives in this sweep alone: with `hydra.sweeper.storage` set, Optuna
    resumes the study, and its best may be a trial of an earlier sweep."""
    from omegaconf import OmegaConf

    return OmegaConf.select(config, "hydra.sweeper.storage", default=None) is None


def install_filter(sweep_dir: str) -> None:
    """At the start of a sweep (JobDirCallback.on_multirun_start): this sweep's filter only."""
    logger = logging.getLogger(SWEEPER_LOGGER)
    for f in [f for f in logger.filters if isinstance(f, _NoFalseBest)]:
        logger.removeFilter(f)
    logger.addFilter(_NoFalseBest(sweep_dir))
