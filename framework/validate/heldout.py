"""Held-out evaluation (trainer.eval_interval / eval_batches, data.val_*), on the config alone.

What is held out per data source is defined in framework/data/sources.py; that the held-out data
gives at least one micro-batch is checked after preparation (`validate_prepared`).
The data.val_* keys are checked whether or not evaluation is on: they decide which
documents training leaves out, and that must not depend on evaluation being on.
"""

from __future__ import annotations

from framework.config import ConfigError, RunConfig
from framework.schedules import get, names, never_flushes



def flushing() -> list[str]:
    return [n for n in names() if get(n).flushes]


def check_eval(run: RunConfig) -> None:
    t, d = run.trainer, run.data
    # Their ranges are the schema's rules (framework/config/); what follows joins keys.
    evaluating = t.eval_interval > 0
    if evaluating and run.parallelism.pp > 1 and never_flushes(run.schedule):
        # Never flushed: between steps, activations of the next step's micro-batches are in
        # flight between stages, and a forward-only pass's messages would match them (NCCL
        # matches a pair's messages in issue order).
        raise ConfigError("trainer.eval_interval", t.eval_interval, f"schedule={run.schedule.name} never flushes the "
                          "pipeline, so there is no point between steps where a held-out forward pass can run",
                          f"use a flushing schedule ({', '.join(flushing())}) to evaluate, or trainer.eval_interval=0")
    if d.name == "pycode" and evaluating and d.val_files < 1:
        raise ConfigError("data.val_files", d.val_files, "evaluation (trainer.eval_interval > 0) on pycode needs "
                          "held-out stdlib files", "e.g. data.val_files=20, or trainer.eval_interval=0")
    if d.name == "hf":
        _hf(run, evaluating)


def _hf(run: RunConfig, evaluating: bool) -> None:
    d = run.data
    if d.val_split and d.val_fraction > 0:
        raise ConfigError("data.val_fraction", d.val_fraction,
                          f"data.val_split={d.val_split} is set too: the held-out data is a split or a fraction of "
                          "the training split, not both", "set data.val_fraction=0.0, or data.val_split=null")
    if d.val_split and d.val_split == d.split:
        raise ConfigError("data.val_split", d.val_split, "is the training split (data.split): every one of its "
                          "documents is trained on", "name another split (e.g. validation), or use data.val_fraction")
    if evaluating and not d.val_split and d.val_fraction == 0:
        raise ConfigError("trainer.eval_interval", run.trainer.eval_interval,
                          "data=hf holds nothing out: data.val_split is null and data.val_fraction is 0",
                          "set data.val_split (e.g. validation) or data.val_fraction (e.g. 0.05), or "
                          "trainer.eval_interval=0")
