"""A job directory's hygiene: what a job writes there, and setting an earlier run's (or
sweep's) files aside so old and new results never mix."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Optional

from framework import checkpoint
from framework.report.files import write_report
from framework.report.progress import RUN_LOG


# Everything a job writes into its directory (the output files table in the README). Only
# these are set aside: a job directory may also hold the user's own files (inputs, notes),
# and `hydra.run.dir=.` makes it the working directory.
JOB_OUTPUTS = ("config.yaml", "run_info.json", "summary.json", "summary.json.tmp", "metrics.jsonl",
               "metrics.jsonl.partial", "error.txt", "hang.txt", "trace.json", "timeline.png", "final_model.pt",
               "final_model", "final_model.tmp",
               "plan.json", "wandb", "rank_failures", ".flight", "nodes", "calibration.json", "predicted_trace.json",
               "prediction.json")
PREVIOUS_DIR = ".previous"
# A sweep directory's own files (besides its numbered job directories): Hydra's record, the
# report (framework.report.compare) and an Optuna search's result.
SWEEP_OUTPUTS = ("multirun.yaml", "report.csv", "report.md", "report.html", "optimization_results.yaml",
                 "simulated_search.json")


def set_aside_previous(job_dir: str, keep: tuple[str, ...] = ()) -> Optional[str]:
    """A job directory that holds an earlier run's files (hydra.run.dir reused) gets them
    moved to `.previous/<time>/`, so old and new results never mix (a stale summary.json
    beside a new error.txt would read as a completed run). Returns where they went.
    `keep`: files that are this job's own, not an earlier run's (search.mode=simulate's
    prediction, framework/sim/sweep.py, beside which the predicted job then runs)."""
    if not os.path.isdir(job_dir):
        return None
    names = [n for n in JOB_OUTPUTS if n not in keep and os.path.lexists(os.path.join(job_dir, n))]
    log = os.path.join(job_dir, RUN_LOG)
    if RUN_LOG not in keep and os.path.isfile(log) and os.path.getsize(log) > 0:  # empty: this run's, just made
        names.append(RUN_LOG)
    return _move_aside(job_dir, names, "an earlier run's files")


def _move_aside(folder: str, names: list[str], what: str) -> Optional[str]:
    if not names:
        return None
    os.makedirs(os.path.join(folder, PREVIOUS_DIR), exist_ok=True)
    dest = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=os.path.join(folder, PREVIOUS_DIR))
    for name in names:
        shutil.move(os.path.join(folder, name), os.path.join(dest, name))
    print(f"{folder} held {what} ({', '.join(names)}): moved to {dest}", flush=True)
    return dest


def write_outcome(job_dir: str, status: str, reason: str) -> None:
    """summary.json of a job that did not complete: `status` failed | rejected |
    interrupted, the one-line `reason`, and no metrics (a sweeper gets NaN, run.py)."""
    write_report(os.path.join(job_dir, "summary.json"),
                json.dumps({"status": status, "reason": reason, "time": time.time()}, indent=2))


def completed_summary(job_dir: str) -> Optional[dict]:
    """The job's summary.json when its ranks finished every step, else None. A stop that
    reaches the launcher during the last step (the ranks agree on it after that step) ends
    the launch as stopped, but the job is complete: launchers read this before saying
    `interrupted`."""
    try:
        with open(os.path.join(job_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("status") == "completed" else None


def set_aside_checkpoints(job_dir: str, resume: Optional[str]) -> None:
    """A run that does not continue this job's own checkpoints starts a new lineage: the
    earlier ones go to `.previous/` too, so `trainer.resume=auto` never finds a checkpoint of
    another run. One resuming from its own step_k sets the newer ones aside (an abandoned
    continuation). (checkpoints/ is not in JOB_OUTPUTS: a resuming run must find it.)"""
    root = os.path.join(os.path.abspath(job_dir), checkpoint.CHECKPOINTS_DIR)
    if os.path.isdir(root) and not (resume and os.path.abspath(resume).startswith(root + os.sep)):
        _move_aside(job_dir, [checkpoint.CHECKPOINTS_DIR], "an earlier run's checkpoints")
    elif resume:
        checkpoint.set_aside_newer(job_dir, resume)  # one lineage: newer ones were abandoned


def set_aside_sweep(sweep_dir: str) -> Optional[str]:
    """A reused sweep directory: the earlier sweep's job directories (numbered), its
    multirun.yaml and its report go to `.previous/<time>/`, so the report never mixes two
    sweeps (an old job 5 beside a new sweep of 3 jobs)."""
    if not os.path.isdir(sweep_dir):
        return None
    return _move_aside(sweep_dir, sorted(n for n in os.listdir(sweep_dir)
                                         if n.isdigit() or n in SWEEP_OUTPUTS),
                       "an earlier sweep")
