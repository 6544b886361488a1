"""Single-process implementations of the asynchronous schedules' update rules.

The plain reference beside the pipelined executor: one process, no communication, the
micro-batches in order, each stage's weights chosen by a version table this module derives
from the papers' definitions. It never asks the registry's `version_of` (the executor's
rule): a wrong rule there cannot pass both, and tests/test_pipeline_async.py checks that
the two derivations agree. From the registry it reads only how often an update comes
(`updates_per_step`) and the loss scale.

- An update after every micro-batch (PipeDream 1F1B with weight stashing; Narayanan et
  al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019): a
  never-flushed pipeline of p stages. Stage s admits a micro-batch whenever it holds fewer
  than p - s in flight (forward done, backward not yet); otherwise it runs the backward of
  its oldest one, which needs that micro-batch's backward on stage s+1 (and its own
  forward), and then applies that micro-batch's update. `pipedream_versions` runs this
  order (checking that it never deadlocks) and records how many updates each forward sees;
  weight stashing makes the backward use the forward's version.
- One update per step (PipeDream-2BW; Narayanan et al., "Memory-Efficient Pipeline-Parallel
  DNN Training", ICML 2021): double-buffered weights. Every micro-batch of step t runs on
  W(t-1), and the step's gradient, accumulated over its m micro-batches, gives
  W(t+1) = W(t) - lr * grad(W(t-1)) (`double_buffer_versions`; before the first update
  both buffers hold W(0)). The same 1F1B pipeline, updating after every m-th backward,
  must hold that version when each forward runs, as the newest or the one before (two
  buffers): checked there too.

Each stage has its own optimizer and clips by its own gradient norm (stages update at
different times, so there is no global norm), with the learning rate of the micro-batch's
step. The pipelined run must match this step by step (tests/test_pipeline_async.py).

`start`: a checkpoint (checkpoints/step_<k>) to begin from, read here with DCP in one
process: its weights and optimizer states, the lr and data of step k + 1 on, and a pipeline
filled afresh from those weights (a checkpoint holds no micro-batches in flight and no older
versions), which is what a resumed run is documented to equal (docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch

from framework.config import RunConfig
from framework.data import ShardedSampler, TokenData
from framework.models import SplitLM, build_model
from framework.optim.build import build_optimizer, lr_at, set_lr
from framework.schedules import resolve
from framework.parallel.grads import clip_grad_norm
from framework.parallel.pipeline.stage import stage_ranges, stage_state_dict


def pipedream_versions(p: int, n: int, every: int = 1) -> list[list[int]]:
    """versions[s][j]: the updates stage s has applied when it runs micro-batch j's forward,
    in a never-flushed 1F1B pipeline of p stages over n micro-batches that updates after
    every `every`-th backward. Stage s's next op is a forward while it holds fewer than
    p - s micro-batches in flight, else the backward of its oldest; an op runs once what it
    needs is done (forward j on s-1; backward j on s+1). Raises if that order deadlocks."""
    fwd, bwd, applied = [0] * p, [0] * p, [0] * p  # forwards / backwards done, updates applied
    seen = [[-1] * n for _ in range(p)]
    while any(b < n for b in bwd):
        progressed = False
        for s in range(p):
            j = fwd[s]
            if j < n and fwd[s] - bwd[s] < p - s:  # room in the window: admit micro-batch j
                if s == 0 or fwd[s - 1] > j:
                    seen[s][j] = applied[s]
                    fwd[s] += 1
                    progressed = True
            elif bwd[s] < fwd[s] and (s == p - 1 or bwd[s + 1] > bwd[s]):
                bwd[s] += 1
                if bwd[s] % every == 0:
                    applied[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the pipeline of p={p} stages over n={n} micro-batches deadlocks at forwards "
                               f"{fwd}, backwards {bwd}")
    return seen


def double_buffer_versions(p: int, m: int, steps: int) -> list[list[int]]:
    """versions[s][j] under 2BW's double buffering: a step's micro-batches read the shadow
    buffer, W(t-1); its update writes W(t+1) from the current W(t), which becomes the shadow.
    Checked against the 1F1B pipeline's order (`pipedream_versions` updating every m)."""
    current, shadow, out = 0, 0, []
    for _ in range(steps):
        out += [shadow] * m
        current, shadow = current + 1, current
    held = pipedream_versions(p, m * steps, every=m)
    for s in range(p):
        for j, v in enumerate(out):
            if not held[s][j] - 1 <= v <= held[s][j]:
                raise ValueError(f"double buffering with p={p}, m={m}: stage {s}'s forward of micro-batch {j} "
                                 f"needs W({v}), but it has applied {held[s][j]} updates (two buffers hold the "
                                 "newest two)")
    return [list(out) for _ in range(p)]


def derived_versions(updates_per_step: int, p: int, m: int, steps: int) -> list[list[int]]:
    """The version table of an asynchronous rule with `updates_per_step` updates per step of
    m micro-batches: m (one per micro-batch, PipeDream) or 1 (one per step, 2BW). With m = 1
    the two read the same; it is PipeDream's (2BW needs m >= p >= 2)."""
    if updates_per_step == m:
        return pipedream_versions(p, m * steps)
    if updates_per_step == 1:
        return double_buffer_versions(p, m, steps)
    raise NotImplementedError(f"no reference for {updates_per_step} updates per step of {m} micro-batches")


def _stages(full: SplitLM, ranges: list[range]) -> list[SplitLM]:
    last = len(ranges) - 1
    return [full.stage(r, first=g == 0, last=g == last) for g, r in enumerate(ranges)]


def _snapshot(stage: SplitLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in stage.named_parameters()}


def _load(path: str, full: SplitLM, stages: list[SplitLM], opts: list) -> int:
    """The checkpoint's weights and optimizer states into the stages; returns its step."""
    import torch.distributed.checkpoint as dcp

    with open(os.path.join(path, "meta.json")) as f:
        step = int(json.load(f)["step"])
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    want = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
            if k.startswith(("model/", "optim/"))}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, checkpoint_id=path, no_dist=True)
    names = {id(q): n for n, q in full.hf_model.named_parameters()}
    with torch.no_grad():
        for stage, opt in zip(stages, opts, strict=True):
            for q in stage.parameters():
                name = names[id(q)]
                q.copy_(want[f"model/{name}"])
                prefix = f"optim/{name}/"
                state = {k[len(prefix):]: v for k, v in want.items() if k.startswith(prefix)}
                if state:
                    opt.state[q] = state
    return step


def run_async_reference(run: RunConfig, vocab_size: int, tokens_path, start: Optional[str] = None
                        ) -> tuple[list[float], dict]:
    """Per-step losses and the final parameters (transformers names) of the update rule;
    with `start`, of the steps after that checkpoint's."""
    p, m = run.parallelism.pp, run.schedule.microbatches
    full = build_model(run.model, vocab_size, run.trainer.seed, precision=run.trainer.precision)
    stages = _stages(full, stage_ranges(run.parallelism.partition, full, p))
    opts = [build_optimizer(run.optimizer, s.parameters()) for s in stages]
    first = _load(start, full, stages, opts) if start else 0
    steps = run.trainer.steps - first
    rule = resolve(run.schedule).asynchronous
    table = derived_versions(rule.updates_per_step(m), p, m, steps)
    versions = [{0: _snapshot(s)} for s in stages]
    applied = [0] * p
    data = TokenData.load(run, tokens_path)
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, m, 0, 1, run.trainer.seed)
    scale = rule.microbatch_weight(m)
    losses: list[list[float]] = [[] for _ in range(steps)]
    for j in range(m * steps):
        step = first + j // m
        x, y = data.batch(sampler.step_indices(step)[j % m])
        used = [versions[s][table[s][j]] for s in range(p)]
        h = x
        for s, stage in enumerate(stages):
            h = torch.func.functional_call(stage, used[s], (h, y) if s == p - 1 else (h,))
        losses[j // m].append(h.item())
        (h * scale).backward()
        if (j + 1) % (m // rule.updates_per_step(m)) == 0:
            for s in range(p):
                _update(stages[s], opts[s], used[s], run, lr_at(step, run))
                applied[s] += 1
                versions[s][applied[s]] = _snapshot(stages[s])
    return [sum(ls) / len(ls) for ls in losses], stage_state_dict(full, stages)


def _update(stage: SplitLM, opt, snapshot: dict[str, torch.Tensor], run: RunConfig, lr: float) -> None:
    for n, param in stage.named_parameters():
        param.grad, snapshot[n].grad = snapshot[n].grad, None
    set_lr(opt, lr)
    clip_grad_norm(list(stage.parameters()), run.trainer.grad_clip, None)
    opt.step()
    opt.zero_grad(set_to_none=True)
