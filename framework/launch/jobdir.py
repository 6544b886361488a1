"""A job directory's outcome: summary.json of a job that did not complete, whether the ranks
finished, and an earlier run's checkpoints set aside. What a job writes there and setting an
earlier run's (or sweep's) files aside is framework/report/files.py, below the simulator
that sets files aside too."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from framework import checkpoint
from framework.report.files import move_aside, write_report


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
        move_aside(job_dir, [checkpoint.CHECKPOINTS_DIR], "an earlier run's checkpoints")
    elif resume:
        checkpoint.set_aside_newer(job_dir, resume)  # one lineage: newer ones were abandoned
