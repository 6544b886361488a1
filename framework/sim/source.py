"""The job a what-if predicts from (`sim.from`, or `python -m framework.simulate <job dir>`):
its files, read and checked, and what it can predict.

- `load_job`: config.yaml, run_info.json, calibration.json and summary.json of a finished
  pipeline job (or pp = 1 job with ep > 1); anything missing, truncated or of another
  version is a ConfigError naming sim.from, never a traceback further on.
- `predicts`: whether its calibration predicts a layout at all (a pipeline from a pipeline
  job, pp = 1 from a pp = 1 job).
- `check_same_work`: the simulator rescales the layout only (framework/sim/whatif.py); a
  target whose work per op differs from the job's (UNSCALED: the model, the tokens per
  micro-batch, the dtype, tp, ...) is refused, since the job's measured durations do not
  carry over to it.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Optional

import yaml
from omegaconf.errors import OmegaConfBaseException

from framework.config import ConfigError, RunConfig, read_config
from framework.metrics.calibrate import Calibration, read_calibration
from framework.files import read_json

# What a measured duration depends on that `rescale` does not model: every model.* key (moe.*
# included) but its label and where its weights come from (its sizes are the other keys); the
# tokens per micro-batch (sequence length, micro-batch size); the dtype and recomputation; the
# split of every op over tensor-parallel ranks; ZeRO's gathers and sharded optimizer step (in the
# time outside the pipeline, which is replayed as measured); the device. parallelism.dp is not
# here: it changes only the dp all-reduce in that outside time (docs/simulator.md, Limits).
UNSCALED = ("model", "data.seq_len", "trainer.micro_batch_size", "trainer.precision", "precision.fp8",
            "trainer.compile", "trainer.activation_checkpointing", "trainer.partition_activations",
            "trainer.cpu_checkpointing", "parallelism.tp", "parallelism.sequence_parallel",
            "parallelism.zero", "parallelism.zero_impl", "parallelism.offload_optimizer", "device")
MAX_JOB_FILE_BYTES = 64 << 20  # run_info.json, summary.json: kilobytes when this framework wrote them
NOT_WORK = ("model.name", "model.pretrained")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _vocabulary(run) -> tuple[str, Any]:
    """The key that sets the model's vocabulary: model.vocab_size, else the data's."""
    if run.model.vocab_size is not None:
        return "model.vocab_size", run.model.vocab_size
    if run.data.name == "synthetic":
        return "data.vocab_size", run.data.vocab_size
    return "data.tokenizer", run.data.tokenizer


def unscaled_difference(src, dst, src_vocab: Optional[int] = None) -> Optional[tuple[str, str, Any]]:
    """The first key (schema order) in which `dst` does other work per op than the job `src`
    measured: (key, the job's setting as `key=value`, the target's value), or None. Configs
    are RunConfig; `src_vocab`: the job's vocabulary size (run_info.json), which a target's
    model.vocab_size may state instead of the data that set it."""
    a, b = _flat(asdict(src)), _flat(asdict(dst))
    for key in dict.fromkeys([*a, *b]):
        if key in NOT_WORK or key == "model.vocab_size" or not any(key == p or key.startswith(p + ".")
                                                                    for p in UNSCALED):
            continue
        if a.get(key) != b.get(key):
            return key, f"{key}={a.get(key)}", b.get(key)
    (key_a, vocab_a), (key_b, vocab_b) = _vocabulary(src), _vocabulary(dst)
    if key_b == "model.vocab_size" and vocab_b == src_vocab:
        return None
    if (key_a, vocab_a) != (key_b, vocab_b):  # the head's and the embedding's size
        return key_b, f"{key_a}={vocab_a}", vocab_b
    return None


def load_job(job_dir: str) -> tuple[RunConfig, dict, Calibration, dict]:
    """(config, run_info, calibration, summary) of a finished pipeline (or pp = 1, ep > 1) job."""
    fix = "give the directory of a completed run with parallelism.pp > 1 or parallelism.ep > 1"
    if not os.path.isdir(job_dir):
        raise ConfigError("sim.from", job_dir, "is a file, not a job directory" if os.path.exists(job_dir)
                          else "no such directory", fix)
    paths = {name: os.path.join(job_dir, name) for name in ("config.yaml", "run_info.json", "calibration.json",
                                                            "summary.json")}
    missing = [n for n, p in paths.items() if not os.path.exists(p)]
    if missing:
        raise ConfigError("sim.from", job_dir, f"has no {', '.join(missing)}: not a finished pipeline job (pp > 1) "
                          "(or pp = 1 with ep > 1) of this framework's version", fix)
    cal = read_calibration(job_dir)  # bounded and checked: a ConfigError naming sim.from
    info, summary = (read_json("sim.from", job_dir, paths[n], fix, MAX_JOB_FILE_BYTES)
                     for n in ("run_info.json", "summary.json"))
    if not isinstance(info, dict) or not isinstance(summary, dict):
        raise ConfigError("sim.from", job_dir, "run_info.json and summary.json must hold JSON objects", fix)
    try:
        src = read_config(paths["config.yaml"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OmegaConfBaseException, yaml.YAMLError) as e:
        # of another version (a ConfigError: config.yaml does not fit this schema)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError("sim.from", job_dir, f"config.yaml is unreadable ({type(e).__name__}: {first})", fix) from None
    return src, info, cal, summary


def predicts(job_dir: str, run: RunConfig) -> bool:
    """Whether the job's calibration can predict `run`'s layout at all: a pipeline from a
    pipeline job, a pp = 1 layout from a pp = 1 job (the dry run predicts only then). An
    unreadable job is a ConfigError naming sim.from."""
    return (run.parallelism.pp == 1) == (load_job(job_dir)[2].fwd_bwd_s is not None)


def check_same_work(job_dir: str, src: RunConfig, info: dict, dst: RunConfig) -> None:
    """The target must do the work per op the job measured: the simulator rescales the layout
    only (framework/sim/whatif.py), so a target that differs in UNSCALED (another model,
    micro-batch, sequence length, precision, tp) is refused rather than predicted from the
    job's durations."""
    diff = unscaled_difference(src, dst, info.get("vocab_size"))
    if diff is not None:
        key, job_setting, value = diff
        raise other_work(job_dir, key, job_setting, value)


def other_work(job_dir: str, key: str, job_setting: str, value) -> ConfigError:
    return ConfigError(key, value, f"differs from the job sim.from={job_dir}, which ran with {job_setting}: its "
                       "measured durations do not carry over to other work (the simulator rescales only the layout)",
                       f"simulate from a job run with {key}={value}, or keep {job_setting}")


