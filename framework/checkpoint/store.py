"""A job's checkpoints on disk: finding them, pruning, one lineage, and what a resume may load.

Resolved and checked in the launching process, before any rank starts (`resolve_resume`,
`check_compatible`, `finished`). One lineage per job directory: resuming from `step_k` of
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

from framework.config import ConfigError, RunConfig, read_config

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
META = "meta.json"
METRICS = "metrics.jsonl"
PREVIOUS_DIR = ".previous"  # the job directory's set-aside folder (framework/launch/jobdir.py)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(job_dir: str, step: int) -> str:
    return os.path.join(job_dir, CHECKPOINTS_DIR, f"step_{step}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def checkpoints(job_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint directory in the job, complete or not, by step."""
    root = os.path.join(job_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP_DIR.match(n))]
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


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def history(path: str, step: int) -> list[str]:
    """The saving run's metrics.jsonl rows of steps 1..`step` (steps are 1-based: checkpoint
    step_<k> is saved after step k); a resumed run's file starts with them."""
    f = os.path.join(path, METRICS)
    if not os.path.exists(f):
        return []
    with open(f) as fh:
        return [line for line in fh if line.strip() and json.loads(line)["step"] <= step]


# ---- one lineage ----

def set_aside_newer(job_dir: str, resume: str) -> Optional[str]:
    """Resuming from this job's own step_k: its checkpoints newer than k (an abandoned
    continuation) go to `.previous/<time>/checkpoints/`. Returns where, or None."""
    root = os.path.join(os.path.abspath(job_dir), CHECKPOINTS_DIR)
    here = os.path.abspath(resume)
    if os.path.dirname(here) != root or not (m := _STEP_DIR.match(os.path.basename(here))):
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
    except (OSError, ValueError, ConfigError):
        return None
    if summary.get("status") != "completed" or summary.get("steps") != run.trainer.steps:
        return None
    return summary if _identity(saved) == _identity(run) else None


def _identity(run: RunConfig) -> dict:
    """What makes it the same training: the trainer (but resume), optimizer, layout, data,
    model and schedule. Not what the launch fills in (a pretrained model's sizes, the run
    name from the overrides, zb-auto's measured times) nor where it logs."""
    d = asdict(run)
    d["trainer"].pop("resume")
    return {"trainer": d["trainer"], "optimizer": d["optimizer"], "parallelism": d["parallelism"], "data": d["data"],
            "model": {k: d["model"][k] for k in ("name", "pretrained", "arch", "dropout")} | (
                {} if run.model.pretrained else {k: d["model"][k] for k in _SIZE_KEYS if k in d["model"]}),
            "schedule": {k: d["schedule"][k] for k in ("name", "microbatches", "virtual_stages")}}


# ---- resume ----

_SIZE_KEYS = ("arch", "n_layer", "n_embd", "n_head", "n_kv_head", "n_inner", "max_positions", "vocab_size",
              "tie_embeddings")


def resolve_resume(run: RunConfig, job_dir: str) -> Optional[str]:
    """trainer.resume -> the checkpoint to load, or None to start at step 0. `auto` takes
    the newest complete checkpoint in this job directory and starts afresh without one (so
    a pre-emptible job can always be launched with it)."""
    r = run.trainer.resume
    if r is None:
        return None
    if r == "auto":
        return latest(job_dir)
    path = os.path.abspath(os.path.expanduser(r))
    if os.path.isdir(path) and not _STEP_DIR.match(os.path.basename(path)) and latest(path):
        path = latest(path)  # a job directory: its newest complete checkpoint
    if not os.path.isdir(path):
        raise ConfigError("trainer.resume", r, "no such checkpoint directory",
                          "give checkpoints/step_<k> of a job (or the job directory), or auto")
    if not is_complete(path):
        raise ConfigError("trainer.resume", r, f"incomplete checkpoint (no {MARKER} marker: its save was cut off)",
                          "resume from an earlier complete checkpoint of the same job")
    return path


def check_compatible(run: RunConfig, path: str, vocab_size: int) -> dict:
    """The checkpoint's meta against this run: the model must be the same, the step inside
    the run. A different global batch or seed is allowed but warned about (the data stream
    then differs from the saving run's). Returns the meta."""
    meta = read_meta(path)
    saved = meta["model"]
    here = {**asdict(run.model), "vocab_size": vocab_size}
    for k in _SIZE_KEYS:
        if saved.get(k) != here.get(k):
            raise ConfigError(f"model.{k}", here.get(k), f"the checkpoint {path} was saved with model.{k}="
                              f"{saved.get(k)!r}", f"resume with model.{k}={saved.get(k)!r} (the model must match)")
    if meta["step"] >= run.trainer.steps:
        raise ConfigError("trainer.steps", run.trainer.steps, f"the checkpoint {path} is already at step "
                          f"{meta['step']}: nothing left to run", f"raise trainer.steps above {meta['step']}")
    target = run.optimizer.get("_target_")
    if meta["optimizer"].get("_target_") != target:
        raise ConfigError("optimizer._target_", target, f"the checkpoint holds {meta['optimizer'].get('_target_')} "
                          "states", "resume with the same optimizer")
    from framework.precision import policy_of

    # The rule: a checkpoint stores the optimizer's weights and states in the state dtype
    # (fp32 in fp32, bf16-autocast, bf16-mixed and fp16-mixed; fp64 in fp64), so modes of the
    # same state dtype resume each other's (16-bit parameters are the master's rounding; a
    # scaler absent from the checkpoint starts afresh). fp64, the verification mode, resumes
    # only fp64: a silent fp32 <-> fp64 cast would make a verification run unverifiable.
    if policy_of(meta["precision"]).state_dtype != policy_of(run).state_dtype:
        raise ConfigError("trainer.precision", run.trainer.precision, f"the checkpoint was saved in "
                          f"{meta['precision']}, whose weights and optimizer states are "
                          f"{policy_of(meta['precision']).state_dtype} (this mode's are {policy_of(run).state_dtype})",
                          f"resume with trainer.precision={meta['precision']}, or a mode with the same state dtype "
                          "(fp32, bf16-autocast, bf16-mixed and fp16-mixed resume each other)")
    data = {k: getattr(run.data, k) for k in ("name", "seq_len", "tokenizer")}
    for key, now in (("global_batch", run.global_batch), ("seed", run.trainer.seed), ("data", data)):
        if meta[key] != now:
            print(f"WARNING: resuming {path}: {key} {meta[key]} -> {now}; the data stream is this run's from "
                  f"step {meta['step'] + 1} on, not the saving run's", flush=True)
    return meta
