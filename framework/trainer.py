"""One rank's training run: build model, data, wrapper and optimizer, then loop over steps.

Per step each rank records wall time split into data loading, forward+backward (which on
the last micro-batch includes DDP's overlapped gradient all-reduce) and optimizer, plus
loss, lr, grad norm and saved-activation peak. Records are gathered to the logging rank
every log interval (not every step, so logging does not add a sync point to each step).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .config import RunConfig
from .data import ShardedSampler, TokenData
from .logging import RunInfo, RunLogger
from .metrics.memory import ActivationTracker, device_memory, model_state_bytes, peak_rss_bytes
from .models import build_model
from .optim import build_optimizer, lr_at, set_lr
from .parallel import data_parallel
from .topology import ParallelContext


class InjectedFault(RuntimeError):
    """Raised by debug.fail_rank to test that a crashed rank ends the whole job."""


@dataclass
class RankState:
    model: torch.nn.Module  # the SplitLM
    wrapped: torch.nn.Module  # DDP(model) or model
    optimizer: torch.optim.Optimizer
    data: TokenData
    sampler: ShardedSampler
    tracker: ActivationTracker


def build(run: RunConfig, info: RunInfo, ctx: ParallelContext) -> RankState:
    vocab = run.model.vocab_size or info.vocab_size
    model = build_model(run.model, vocab, run.trainer.seed, ctx.device, run.trainer.activation_checkpointing)
    wrapped = data_parallel.wrap(model, ctx)
    optimizer = build_optimizer(run.optimizer, model.parameters())
    data = TokenData.load(run, info.tokens_path)
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, run.schedule.microbatches,
                             ctx.coords.dp, ctx.dims.dp, run.trainer.seed)
    return RankState(model, wrapped, optimizer, data, sampler, ActivationTracker(model))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time the work, not the kernel launches
    return time.perf_counter()


def _autocast(run: RunConfig, device: torch.device):
    if run.trainer.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(step: int, st: RankState, run: RunConfig, ctx: ParallelContext) -> dict:
    dev, m = ctx.device, run.schedule.microbatches
    lr = lr_at(step, run)
    set_lr(st.optimizer, lr)
    t0 = _now(dev)
    batches = [(x.to(dev), y.to(dev)) for x, y in st.sampler.microbatches(st.data, step)]
    t1 = _now(dev)
    loss_sum = torch.zeros((), device=dev)
    for j, (x, y) in enumerate(batches):
        with data_parallel.sync_context(st.wrapped, last_microbatch=j == m - 1):
            with st.tracker.forward(j), _autocast(run, dev):
                loss = st.wrapped(x, y) / m  # mean over the step's tokens, as one big batch
            loss.backward()
        st.tracker.backward_done(j)
        loss_sum += loss.detach()
    t2 = _now(dev)
    clip = run.trainer.grad_clip or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(st.model.parameters(), clip)
    st.optimizer.step()
    t3 = _now(dev)
    states = model_state_bytes(st.model, st.optimizer)  # untimed; grads still held, so measured before freeing
    st.optimizer.zero_grad(set_to_none=True)
    if ctx.dims.dp > 1:
        dist.all_reduce(loss_sum, group=ctx.dp_group)  # after timing: reporting, not training
        loss_sum /= ctx.dims.dp
    return {"step": step, "loss": loss_sum.item(), "lr": lr, "grad_norm": grad_norm.item(),
            "step_time_s": t3 - t0, "data_s": t1 - t0, "fwd_bwd_s": t2 - t1, "optimizer_s": t3 - t2,
            "activation_peak_bytes": st.tracker.peak_bytes, **states}


def rank_memory(st: RankState, last: dict, device: torch.device) -> dict:
    rss = peak_rss_bytes()
    mem = {k: last[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    mem["model_state_bytes"] = sum(mem.values())
    mem.update(activation_peak_bytes=st.tracker.peak_bytes, rss_peak_bytes=rss, **device_memory(device))
    mem["memory_peak_bytes"] = mem.get("cuda_max_reserved_bytes", rss)
    return mem


def save_checkpoint(model, job_dir: str) -> None:
    """final_model.pt: the transformers state dict (loadable with from_pretrained's names)."""
    path = os.path.join(job_dir, "final_model.pt")
    torch.save(model.hf_model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)


def train(run: RunConfig, info: RunInfo, ctx: ParallelContext, job_dir: str) -> Optional[dict]:
    """Run every step on this rank; the logging rank returns the summary, others None."""
    st = build(run, info, ctx)
    logger = RunLogger(run, job_dir, ctx, info)
    try:
        pending, rec = [], {}
        for step in range(run.trainer.steps):
            if run.debug.fail_rank == ctx.rank and step == run.debug.fail_step:
                raise InjectedFault(f"injected fault on rank {ctx.rank} at step {step} (debug.fail_rank)")
            rec = train_step(step, st, run, ctx)
            pending.append(rec)
            if (step + 1) % run.trainer.log_interval == 0 or step + 1 == run.trainer.steps:
                logger.gather_and_log(pending)
                pending = []
        if run.trainer.save_checkpoint and ctx.rank == 0:
            save_checkpoint(st.model, job_dir)
        return logger.finish(rank_memory(st, rec, ctx.device))  # summary.json last: marks completion
    finally:
        logger.close()
