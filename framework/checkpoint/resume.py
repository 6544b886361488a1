"""What a resume may load, checked in the launching process before any rank starts.

`resolve_resume`: what trainer.resume names (a complete checkpoint, a job directory and its
newest one, a cut-off save, a directory with no checkpoint: each told as what it is), its
`meta.json` read bounded and checked (`read_meta`) and its DCP index present. Then
`check_compatible`: every size the checkpoint records against the run: its model section key by
key (`RESUME_MAY_CHANGE` lists the few keys that may differ; any other key, one added later
included, must match), then every stored parameter's shape (DCP's `.metadata`) against the
run's meta-device model; the optimizer, the state dtype and the step.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Optional

from framework.checkpoint.store import (CHECKPOINTS_DIR, DCP_INDEX, MARKER, META, MOE_ARCHS, STEP_DIR, checkpoints,
                                        flat_keys, is_complete, latest)
from framework.config import ConfigError, ModelConfig, RunConfig
from framework.commands import first_line
from framework.files import read_json

MAX_META_BYTES = 4 << 20  # a meta.json is a few KiB


# meta.json's fields something reads, and their types (an int is not a bool here)
_META_FIELDS = {"step": int, "layout": dict, "model": dict, "precision": str, "optimizer": dict, "seed": int,
                "global_batch": int, "data": dict}
_META_FIX = ("resume from another complete checkpoint (trainer.resume=<job>/checkpoints/step_<k>), or start afresh "
             "(trainer.resume=null)")


def read_meta(path: str) -> dict:
    """The checkpoint's meta.json, read bounded and checked: absent, unreadable, not JSON or
    of the wrong shape is a ConfigError naming trainer.resume (the launcher reads it first)."""
    from framework.precision import PRECISIONS

    f = os.path.join(path, META)
    if not os.path.isfile(f):
        raise ConfigError("trainer.resume", path, f"has no {META} (its step, layout and model sizes): not a "
                          "checkpoint this framework wrote whole", _META_FIX)
    meta = read_json("trainer.resume", path, f, _META_FIX, MAX_META_BYTES)
    if not isinstance(meta, dict):
        raise ConfigError("trainer.resume", path, f"{META} is a JSON {type(meta).__name__}, not an object", _META_FIX)
    bad = [k for k, t in _META_FIELDS.items() if not isinstance(meta.get(k), t) or isinstance(meta.get(k), bool)]
    if not bad and (meta["step"] < 0 or meta["precision"] not in PRECISIONS):
        bad = ["step" if meta["step"] < 0 else "precision"]
    if bad:
        raise ConfigError("trainer.resume", path, f"{META} lacks or has an invalid {', '.join(bad)}: not a "
                          "checkpoint this framework wrote whole", _META_FIX)
    return meta


# The model keys a resume may change: they change no stored shape and not what the weights
# compute (a label, where the initial weights came from, dropout, and MoE training policy:
# the experts' implementation, capacity dropping, auxiliary losses, the bias update rate, whose
# bias a checkpoint without one starts afresh). Every other key of the model section the
# checkpoint records must be the run's: a new key is compared unless it is added here.
RESUME_MAY_CHANGE = ("name", "pretrained", "dropout", "moe.experts_impl", "moe.capacity_factor", "moe.drop_policy",
                     "moe.aux_losses", "moe.bias_update_rate")


def resolve_resume(run: RunConfig, job_dir: str) -> Optional[str]:
    """trainer.resume -> the checkpoint to load, or None to start at step 0. `auto` takes
    the newest complete checkpoint in this job directory and starts afresh without one (so
    a pre-emptible job can always be launched with it). A checkpoint found is complete and
    its meta.json and DCP index readable."""
    r = run.trainer.resume
    if r is None:
        return None
    path = latest(job_dir) if r == "auto" else _given(r)
    if path is not None:
        read_meta(path)
        if not os.path.isfile(os.path.join(path, DCP_INDEX)):
            raise ConfigError("trainer.resume", path, f"has {MARKER} and {META} but no {DCP_INDEX} (DCP's index of "
                              "the stored tensors): damaged", _META_FIX)
    return path


def _given(r: str) -> str:
    """trainer.resume=<path>: a complete checkpoint, or a job directory's newest one."""
    path = os.path.abspath(os.path.expanduser(r))
    if os.path.isdir(path) and not STEP_DIR.match(os.path.basename(path)) and latest(path):
        path = latest(path)  # a job directory: its newest complete checkpoint
    if not os.path.isdir(path):
        raise ConfigError("trainer.resume", r, "no such checkpoint directory",
                          "give checkpoints/step_<k> of a job (or the job directory), or auto")
    if not is_complete(path):
        raise ConfigError("trainer.resume", r, *_not_complete(path))
    return path


def _not_complete(path: str) -> tuple[str, str]:
    """(problem, fix) for a directory without COMPLETE: a cut-off save, a job directory with
    no complete checkpoint, or neither."""
    whole = (f"a checkpoint is <job>/{CHECKPOINTS_DIR}/step_<k>/ holding {DCP_INDEX}, __<rank>_0.distcp, {META} "
             f"and {MARKER}")
    fix = (f"give <job>/{CHECKPOINTS_DIR}/step_<k> (or that job directory), or trainer.resume=auto to continue the "
           "job in this run's directory; checkpoints are saved with trainer.checkpoint_interval=N")
    found = checkpoints(path)
    if found:
        names = ", ".join(os.path.basename(p) for _, p in found[-3:])
        return (f"is a job directory with no complete checkpoint ({names}: no {MARKER} marker, their saves were cut "
                "off)", "resume from a complete checkpoint of another job, or start afresh (trainer.resume=null)")
    if any(os.path.exists(os.path.join(path, n)) for n in (DCP_INDEX, META)) or STEP_DIR.match(
            os.path.basename(path)):
        return (f"incomplete checkpoint (no {MARKER} marker: its save was cut off)",
                "resume from an earlier complete checkpoint of the same job")
    if os.path.isfile(os.path.join(path, "config.yaml")):
        return f"is a job directory with no checkpoint (its run saved none; {whole})", fix
    return f"holds no checkpoint ({whole})", fix


def check_compatible(run: RunConfig, path: str, vocab_size: int, model=None) -> dict:
    """The checkpoint's meta against this run: the model must be the same (and, given the
    run's meta-device `model`, so must every stored parameter's shape), the step inside the
    run. A different global batch or seed is allowed but warned about (the data stream then
    differs from the saving run's). Returns the meta."""
    meta = read_meta(path)
    _same_model(run, meta["model"], path, vocab_size)
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
    if model is not None:
        _same_shapes(model, path)
    return meta


def _same_model(run: RunConfig, saved: dict, path: str, vocab_size: int) -> None:
    """Every key of the checkpoint's model section equals the run's, but RESUME_MAY_CHANGE (a
    key an older checkpoint lacks is its default; model.moe.* only for a MoE arch)."""
    here = flat_keys({**asdict(run.model), "vocab_size": vocab_size})
    was = {**flat_keys(asdict(ModelConfig())), **flat_keys(saved)}
    moe = run.model.arch in MOE_ARCHS
    for k, now in here.items():
        if k in RESUME_MAY_CHANGE or (k.startswith("moe.") and not moe) or was.get(k) == now:
            continue
        raise ConfigError(f"model.{k}", now, f"the checkpoint {path} was saved with model.{k}={was.get(k)!r}",
                          f"resume with model.{k}={was.get(k)!r} (the model must match)")


def _same_shapes(model, path: str) -> None:
    """Every stored parameter (`model/<name>` in DCP's index) has this run's shape, and the
    run's model has no parameter the checkpoint lacks, nor the reverse."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged index: whatever unpickling it raised
        raise ConfigError("trainer.resume", path, f"its {DCP_INDEX} is unreadable ({type(e).__name__}: "
                          f"{first_line(e)}): damaged", _META_FIX) from None
    stored = {k[len("model/"):]: tuple(getattr(v, "size", ())) for k, v in md.items() if k.startswith("model/")}
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name in sorted(set(stored) | set(ours)):
        if stored.get(name) != ours.get(name):
            was = f"shape {stored[name]}" if name in stored else "no such tensor"
            have = f"shape {ours[name]}" if name in ours else "no such parameter"
            raise ConfigError("trainer.resume", path, f"model/{name}: the checkpoint has {was}, this run's model has "
                              f"{have} (a model of another shape)", "resume with the model the checkpoint was saved "
                              "with")
