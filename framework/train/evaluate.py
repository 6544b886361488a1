"""Held-out loss (val_loss): the model's mean next-token loss on data no training step sees.

What is held out per data source: framework/data/sources.py. Every evaluation reads the same
sequences, [0, eval_batches * global_batch) of the held-out stream in order (wrapping around
a smaller stream), cut as training's `ShardedSampler` cuts a step: dp rank r takes the r-th
contiguous slice of each global batch, in micro-batches of trainer.micro_batch_size. So
layouts with the same global batch evaluate the same sequences, and val_loss is the same
number for all of them (to round-off).

What runs, with no gradients and the model in eval mode (restored after):
- pp = 1: the whole model's forward with labels, per micro-batch. Tensor parallelism runs its
  forward collectives inside the model (every tp rank the same forwards); DDP is bypassed (no
  collective in forward to skip); ZeRO-3 all-gathers each unit in its forward hooks as in
  training, and the units still gathered afterwards are freed, the state between steps.
- pp > 1: a forward-only pipeline, one micro-batch and one stage at a time in global order
  (stage g = chunk * pp + pp_rank): the owner of stage g > 0 receives its input from the owner
  of g - 1 (blocking recv on the pp group), runs the chunk, sends the output to the owner of
  g + 1; the last stage computes the loss. No bubble-hiding schedule: evaluation is rare, and
  this order cannot deadlock under any backend: every rank issues its sends and receives in
  the one global (micro-batch, stage) order, and the earliest pending one is always a send
  and its matching receive, both reached by now (an NCCL send completes only with its
  receive; a pair's messages match in issue order, which is this order).
Then one all-reduce over the world on the log group (gloo, CPU tensors, also under NCCL):
(sum of the micro-batch mean losses, count) from every rank that computed losses, in fp64.
Every micro-batch has the same number of tokens, so the mean of the means is the mean over
every held-out token of the evaluation; tp peers count each micro-batch equally often.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from framework.config import RunConfig
from framework.data import TokenData
from framework.precision import autocast_context
from framework.topology import ParallelContext


def eval_indices(num_samples: int, micro_batch_size: int, microbatches: int, dp_rank: int, dp: int,
                 batches: int) -> list[np.ndarray]:
    """Held-out sequence indices of one dp rank's micro-batches, in order: global batch b is
    stream positions [b*G, (b+1)*G) (modulo num_samples), dp rank r its r-th contiguous slice."""
    per_rank, global_batch = micro_batch_size * microbatches, micro_batch_size * microbatches * dp
    out = []
    for b in range(batches):
        start = b * global_batch + dp_rank * per_rank
        idx = np.arange(start, start + per_rank) % num_samples  # wraps a small held-out set
        out += [idx[j * micro_batch_size:(j + 1) * micro_batch_size] for j in range(microbatches)]
    return out


class HeldOut:
    """This rank's held-out micro-batches: the same ones at every evaluation."""

    def __init__(self, run: RunConfig, val_tokens_path, val_num_samples: int, ctx: ParallelContext):
        self.data = TokenData.load_heldout(run, val_tokens_path, val_num_samples)
        assert self.data.num_samples == val_num_samples > 0, (self.data.num_samples, val_num_samples)
        t = run.trainer
        self.indices = eval_indices(val_num_samples, t.micro_batch_size, run.schedule.microbatches,
                                    ctx.dims.data_rank(ctx.coords), ctx.dims.data, t.eval_batches)
        self.device = ctx.device

    def microbatches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.indices:
            x, y = self.data.batch(idx)  # (mbs, T) each
            yield x.to(self.device), y.to(self.device)


def evaluate(runner, heldout: HeldOut, run: RunConfig, ctx: ParallelContext) -> float:
    """The held-out loss, the same float on every rank (see the module docstring)."""

    modes = {m: m.training for m in runner.module.modules()}
    runner.module.eval()
    try:
        with torch.no_grad(), autocast_context(run, ctx.device):
            if run.parallelism.pp == 1:
                losses = _whole_model(runner, heldout, ctx)
            else:
                losses = _pipeline(runner, heldout, ctx)
    finally:
        for m, training in modes.items():
            m.training = training
        if getattr(runner, "zero", None) is not None:
            runner.zero.free_gathered()
    total = torch.stack(losses).double().sum().item() if losses else 0.0
    stats = torch.tensor([total, float(len(losses))], dtype=torch.float64)  # CPU: the log group is gloo
    ctx.recorder.note("evaluate: all_reduce (loss sum, count) over the world (log group)", wait=True)
    dist.all_reduce(stats, group=ctx.log_group)
    return (stats[0] / stats[1]).item()


def _whole_model(runner, heldout: HeldOut, ctx: ParallelContext) -> list[torch.Tensor]:
    losses = []
    for j, (x, y) in enumerate(heldout.microbatches()):
        ctx.recorder.note(f"evaluate: forward mb{j} (tp collectives inside)")
        losses.append(runner.module(x, y))  # the unwrapped model: DDP would only add bookkeeping
    return losses


def _pipeline(runner, heldout: HeldOut, ctx: ParallelContext) -> list[torch.Tensor]:
    """Forward-only pipeline in global (micro-batch, stage) order; losses on the last stage.
    Consecutive stages on this rank (the turn of a V) hand over in memory."""
    me, peers, smap = ctx.coords.pp, ctx.group_ranks["pp"], runner.smap
    num_stages = smap.num_stages
    # (mbs, T or T/tp under sequence parallelism, H), in fp32 (fp64 in verification mode)
    shape, dtype = runner.executor.act_shape, runner.executor.act_dtype
    mine = [g for g in range(num_stages) if smap.rank(g) == me]  # this rank's stages, in order
    losses = []
    for j, (x, y) in enumerate(heldout.microbatches()):
        h = None
        for g in mine:
            chunk = runner.chunks[smap.chunk(g)]
            if g == 0:
                h = x
            elif smap.rank(g - 1) != me:
                h = torch.empty(shape, dtype=dtype, device=ctx.device)
                ctx.recorder.note(f"evaluate: recv mb{j} stage {g} <- pp{smap.rank(g - 1)}", wait=True)
                dist.recv(h, src=peers[smap.rank(g - 1)], group=ctx.pp_group)
            ctx.recorder.note(f"evaluate: forward mb{j} stage {g}")
            if g == num_stages - 1:
                losses.append(chunk(h, y))
                continue
            h = chunk(h).to(dtype)
            if smap.rank(g + 1) != me:
                ctx.recorder.note(f"evaluate: send mb{j} stage {g} -> pp{smap.rank(g + 1)}", wait=True)
                dist.send(h.contiguous(), dst=peers[smap.rank(g + 1)], group=ctx.pp_group)
    return losses
