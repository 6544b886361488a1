"""A job's checkpoints on disk: finding them, pruning, one lineage, and whether a job is done.

Checked in the launching process, before any rank starts (`finished`; what a resume may load
is resume.py's). One lineage per job directory: resuming from `step_k` of
this job sets every newer checkpoint aside (`set_aside_newer`, to `.previous/<time>/`), so
`resume=auto` and pruning, which order by step, never mix the abandoned run with the one
continuing from k.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Optional

from yaml import YAMLError

from framework.config import ConfigError, RunConfig, read_config

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
META = "meta.json"
METRICS = "metrics.jsonl"
DCP_INDEX = ".metadata"  # DCP's index of what the .distcp files hold
PREVIOUS_DIR = ".previous"  # the job directory's set-aside folder (framework/report/files.py)
STEP_DIR = re.compile(r"^step_(\d+)$")
MOE_ARCHS = ("qwen3_moe",)  # model.moe.* means nothing to the others (framework.config.MoEConfig)


def step_dir(job_dir: str, step: int) -> str:
    return os.path.join(job_dir, CHECKPOINTS_DIR, f"step_{step}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def checkpoints(job_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint directory in the job, complete or not, by step."""
    root = os.path.join(job_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := STEP_DIR.match(n))]
    return sorted(found)


def latest(job_dir: str) -> Optional[str]:
    done = [p for _, p in checkpoints(job_dir) if is_complete(p)]
    return done[-1] if done else None


def prune(job_dir: str, keep: Optional[int]) -> None:
    """Keep the newest `keep` complete checkpoints; incomplete ones older than the newest
    complete one are leftovers of cut-off saves."""
    found = checkpoints(job_dir)
    complete = [(s, p) for s, p in found if is_complete(p)]
    if not complete:
        return
    newest = complete[-1][0]
    stale = [p for s, p in found if not is_complete(p) and s < newest]
    if keep is not None:
        stale += [p for _, p in complete[:-keep]]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)


def history(path: str, step: int) -> list[str]:
    """The saving run's metrics.jsonl rows of steps 1..`step` (steps are 1-based: checkpoint
    step_<k> is saved after step k); a resumed run's file starts with them."""
    f = os.path.join(path, METRICS)
    if not os.path.exists(f):
        return []
    with open(f, errors="replace") as fh:
        return [line for line in fh if _step_of(line) is not None and _step_of(line) <= step]


def _step_of(line: str) -> Optional[int]:
    """A metrics row's step; None for a blank or unreadable line (left out, not fatal)."""
    try:
        row = json.loads(line) if line.strip() else None
    except (ValueError, RecursionError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


# ---- one lineage ----

def set_aside_newer(job_dir: str, resume: str) -> Optional[str]:
    """Resuming from this job's own step_k: its checkpoints newer than k (an abandoned
    continuation) go to `.previous/<time>/checkpoints/`. Returns where, or None."""
    root = os.path.join(os.path.abspath(job_dir), CHECKPOINTS_DIR)
    here = os.path.abspath(resume)
    if os.path.dirname(here) != root or not (m := STEP_DIR.match(os.path.basename(here))):
        return None
    newer = [p for s, p in checkpoints(job_dir) if s > int(m.group(1))]
    if not newer:
        return None
    os.makedirs(os.path.join(job_dir, PREVIOUS_DIR), exist_ok=True)
    dest = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=os.path.join(job_dir, PREVIOUS_DIR))
    os.makedirs(os.path.join(dest, CHECKPOINTS_DIR))
    for p in newer:
        shutil.move(p, os.path.join(dest, CHECKPOINTS_DIR, os.path.basename(p)))
    print(f"resuming from {resume}: its newer checkpoints ({', '.join(os.path.basename(p) for p in newer)}) "
          f"belong to an abandoned continuation: moved to {dest}", flush=True)
    return dest


def finished(run: RunConfig, job_dir: str) -> Optional[dict]:
    """With trainer.resume=auto: the job's summary.json when this same job (its config.yaml
    equal to `run` but for trainer.resume) completed `trainer.steps` already: relaunching it
    is a no-op, not an error. Otherwise None (another config goes through the usual checks)."""
    if run.trainer.resume != "auto":
        return None
    try:
        with open(os.path.join(job_dir, "summary.json")) as f:
            summary = json.load(f)
        saved = read_config(os.path.join(job_dir, "config.yaml"))
    except (OSError, ValueError, RecursionError, ConfigError, YAMLError):  # unreadable: not finished, checked on
        return None
    if not isinstance(summary, dict) or (summary.get("status"), summary.get("steps")) != ("completed",
                                                                                          run.trainer.steps):
        return None
    return summary if _identity(saved) == _identity(run) else None


def _identity(run: RunConfig) -> dict:
    """What makes it the same training: the trainer (but resume), optimizer, layout, data,
    model and schedule. Not what the launch fills in (a pretrained model's sizes, the run
    name from the overrides, zb-auto's measured times) nor where it logs."""
    d = asdict(run)
    d["trainer"].pop("resume")
    return {"trainer": d["trainer"], "optimizer": d["optimizer"], "parallelism": d["parallelism"], "data": d["data"],
            "model": _model_identity(run),
            "schedule": {k: d["schedule"][k] for k in ("name", "microbatches", "virtual_stages")}}


def _model_identity(run: RunConfig) -> dict:
    """The model keys that make it the same training: all of them but the experts'
    implementation and, for a dense arch, model.moe.* (a pretrained model: name, source, arch
    and dropout; its sizes are the launch's, from its config.json)."""
    if run.model.pretrained:
        return {k: getattr(run.model, k) for k in ("name", "pretrained", "arch", "dropout")}
    moe = run.model.arch in MOE_ARCHS
    return {k: v for k, v in flat_keys(asdict(run.model)).items()
            if k != "moe.experts_impl" and (moe or not k.startswith("moe."))}


def flat_keys(d: dict, prefix: str = "") -> dict:
    """{"moe": {"experts": 4}} -> {"moe.experts": 4}."""
    out = {}
    for k, v in d.items():
        out.update(flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
