"""Single-process implementations of the asynchronous schedules' update rules.

The plain reference beside the pipelined executor: one process, no communication, the
micro-batches in order, each stage's weights chosen by `schedules.version_of`:
- 1f1b: micro-batch j runs on stage s with the weights after max(0, j - (p-s-1)) of that
  stage's updates, forward and backward alike; every stage then applies j's gradient.
- 2bw:  every micro-batch of step t runs on W(t-1); the step's gradient, accumulated over
  its m micro-batches, gives W(t+1) = W(t) - lr * grad(W(t-1)).
Each stage has its own optimizer and clips by its own gradient norm (stages update at
different times, so there is no global norm), with the learning rate of the micro-batch's
step. The pipelined run must match this step by step (tests/test_pipeline_async.py).
"""

from __future__ import annotations

import torch

from ...config import RunConfig
from ...data import ShardedSampler, TokenData
from ...models import SplitLM, build_model
from ...optim import build_optimizer, lr_at, set_lr
from .schedules import version_of
from ..grads import clip_grad_norm
from .stage import stage_ranges, stage_state_dict


def _stages(full: SplitLM, ranges: list[range]) -> list[SplitLM]:
    last = len(ranges) - 1
    return [full.stage(r, first=g == 0, last=g == last) for g, r in enumerate(ranges)]


def _snapshot(stage: SplitLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in stage.named_parameters()}


def run_async_reference(run: RunConfig, vocab_size: int, tokens_path) -> tuple[list[float], dict]:
    """Per-step losses and the final parameters (transformers names) of the update rule."""
    name, p, m, steps = run.schedule.name, run.parallelism.pp, run.schedule.microbatches, run.trainer.steps
    full = build_model(run.model, vocab_size, run.trainer.seed, precision=run.trainer.precision)
    stages = _stages(full, stage_ranges(run.parallelism.partition, full, p))
    opts = [build_optimizer(run.optimizer, s.parameters()) for s in stages]
    versions = [{0: _snapshot(s)} for s in stages]
    applied = [0] * p
    data = TokenData.load(run, tokens_path)
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, m, 0, 1, run.trainer.seed)
    scale = 1.0 if name == "1f1b" else 1.0 / m
    losses: list[list[float]] = [[] for _ in range(steps)]
    for j in range(m * steps):
        x, y = data.batch(sampler.step_indices(j // m)[j % m])
        used = [versions[s][version_of(name, j, s, p, m)] for s in range(p)]
        h = x
        for s, stage in enumerate(stages):
            h = torch.func.functional_call(stage, used[s], (h, y) if s == p - 1 else (h,))
        losses[j // m].append(h.item())
        (h * scale).backward()
        if name == "1f1b" or (j + 1) % m == 0:
            for s in range(p):
                _update(stages[s], opts[s], used[s], run, lr_at(j // m, run))
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
