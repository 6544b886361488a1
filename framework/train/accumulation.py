"""The pp = 1 runner: the whole model on this rank, gradient accumulation, and over dp DDP,
our ZeRO (framework/parallel/zero.py) or FSDP2 (framework/parallel/fsdp2.py).

One `step()` is one optimizer step: m micro-batches' forward and backward (DDP all-reduces
on the last one only; ZeRO-2/3 and FSDP2 reduce-scatter per unit as its backward ends), then
the gradient sync that remains, the global norm, and the update (framework/train/update.py:
loss scaling, clipping, the master copy). Returns a `StepResult` (framework/report/records.py).
"""

from __future__ import annotations

import torch

from framework.optim import master
from framework.optim.swap import offload_of
from framework.config import RunConfig
from framework.device import to_host
from framework.comm.comm_timer import timed
from framework.timestamps import now
from framework.metrics.memory import master_bytes, model_state_bytes
from framework.parallel import data_parallel
from framework.models.moe_layer import moe_step
from framework.comm.expert_parallel import expert_params
from framework.parallel.fsdp2 import FSDP2
from framework.parallel.grads import clip_grad_norm, reduce_expert_grads
from framework.comm.tensor_parallel import sync_replicated_grads
from framework.comm.tp_comm import TPComm
from framework.parallel.zero import Zero
from framework.precision import autocast_context, policy_of
from framework.report.records import StateBytes, StepResult
from framework.topology import ParallelContext
from framework.train.update import Update


class AccumulationRunner:
    """pp = 1: the whole model on this rank, gradient accumulation, and over dp either DDP
    (zero = 0) or ZeRO (framework/parallel/zero.py: units = the embedding with the head,
    and each block)."""

    is_async = False

    def __init__(self, run: RunConfig, ctx: ParallelContext, model, tracker, tp_comm: TPComm):
        self.run, self.ctx, self.tracker, self.tp_comm = run, ctx, tracker, tp_comm
        self.module, self.chunks = model, [model]
        self.moe, self.ep_comm = getattr(model, "moe", None), getattr(model, "ep_comm", None)
        stage = run.parallelism.zero
        if stage:
            units = [[model.embedding, model.head], *[[b] for b in model.blocks]]
            self.zero = (FSDP2(run, model, ctx, tracker) if run.parallelism.zero_impl == "fsdp2"  # the same units
                         else Zero(stage, units, ctx, tracker, fill=getattr(model, "fill", None),
                                   reduce_dtype=policy_of(run).reduce_dtype,
                                   overlap_reduce=run.parallelism.overlap_grad_reduce,
                                   prefetch=run.parallelism.overlap_param_gather,
                                   bucket_mb=run.parallelism.bucket_mb))
            self.wrapped, self.params = model, self.zero.shards
            self.optimizer = self.zero.build_optimizer(run.optimizer, offload_of(run), policy_of(run))
        else:
            self.zero = None
            if hasattr(model, "fill"):
                model.fill(model.parameters())  # built on the meta device: the whole model is this rank's
            self.wrapped = data_parallel.wrap(model, ctx, policy_of(run).reduce_dtype,
                                              ignore=expert_params(model.parameters()),  # reduced over edp
                                              bucket_mb=run.parallelism.bucket_mb)
            self.params = list(model.parameters())
            self.optimizer = master.build(run.optimizer, self.params, policy_of(run))
        c, d = ctx.coords, ctx.dims
        self.update = Update(run, self.optimizer, injects=c.dp == d.dp - 1 and c.tp == d.tp - 1, rank=ctx.rank)
        # Final storages: ZeRO's flat buffers, if any. FSDP2's shards are never saved for
        # backward; it names its gathered weights to the tracker itself.
        tracker.set_params([] if isinstance(self.zero, FSDP2) else model.parameters())
        self.states = None  # the last measured StateBytes

    def step(self, step: int, batch_of) -> StepResult:
        dev, m = self.ctx.device, self.run.schedule.microbatches
        self.update.set_lr(step)
        weight = self.update.loss_weight(step)  # the loss scale (fp16-mixed), else None
        if self.moe is not None:  # aux losses' gradients: scaled as the LM loss's
            self.moe.aux_scale.value = (1.0 if weight is None else weight) / m
        clock = self.ctx.timer.clock  # the step's one clock (marks: CUDA events, read at the end)
        m1 = clock.mark()
        loss_sum = torch.zeros((), device=dev)
        if self.zero:
            self.zero.start_step()
        for j in range(m):
            x, y = batch_of(j)
            if self.zero:
                self.zero.start_microbatch(last=j == m - 1)
            self.ctx.recorder.note(f"F+B mb{j} (tp collectives inside; the last one all-reduces over dp)")
            with data_parallel.sync_context(self.wrapped, last_microbatch=j == m - 1):
                with self.tracker.forward(j), autocast_context(self.run, dev):
                    loss = self.wrapped(x, y) / m  # mean over the step's tokens, as one big batch
                (loss if weight is None else loss * weight).backward()
            if self.zero:
                self.zero.finish_backward()
            self.tracker.backward_done(j)
            loss_sum = loss_sum + loss.detach()  # not +=: in place would round fp64 losses to fp32
        m2 = clock.mark()
        self.ctx.recorder.note("gradient sync (ZeRO / sequence parallel), clip (all_reduce), optimizer step", wait=True)
        with timed(self.ctx.timer if self.ctx.dims.dp > 1 else None, "dp", "gradient reduction"):
            if self.zero:
                self.zero.reduce_gradients()
            else:
                reduce_expert_grads(self.params, self.ctx, policy_of(self.run).reduce_dtype,
                                    self.run.parallelism.bucket_mb)
        if self.tp_comm.size > 1:
            sync_replicated_grads(self.params, self.tp_comm, self.run.parallelism.sequence_parallel)
        grad_norm = clip_grad_norm(self.params, 0.0, tp_comm=self.tp_comm,  # the norm only: Update clips
                                   dp_group=self.ctx.dp_group if self.zero else None,
                                   ep_group=None if self.zero else self.ctx.ep_group)
        grad_norm = self.update.apply(self.params, grad_norm, step)
        if self.zero and not self.update.overflow:
            self.zero.after_step()
        t3 = now(dev)  # the update's end: the host waits for the stream (the step's one wait)
        t1, t2 = clock.seconds(m1), clock.seconds(m2)
        # gradients still held; a walk over every tensor (ms at hundreds of tensors), so only on
        # the steps the tracker records (framework/train/trainer.py: tracks_activations) or
        # until the optimizer's states exist: the bytes do not change between steps
        if self.tracker.enabled or self.states is None or not self.states.optimizer_bytes:
            self.states = StateBytes(**(self.zero.state_bytes(self.optimizer) if self.zero
                                        else model_state_bytes(self.module, self.optimizer)))
            self.states.master_bytes = master_bytes(self.optimizer)
        states = self.states
        self.optimizer.zero_grad(set_to_none=True)
        moe = moe_step(self.moe, self.run, self.ctx, self.tp_comm, self.update.overflow)
        # The loss is this dp rank's; the logging rank averages ranks at its gather.
        loss, norm = to_host(torch.stack([loss_sum.to(grad_norm.dtype), grad_norm]), "step's loss and norm").tolist()
        return StepResult(loss=loss, grad_norm=norm, pipeline_s=t2 - t1, optimizer_s=t3 - t2,
                          states=states, moe=moe, started=t1, **self.update.step_fields())
