"""A pipeline rank's training step: the executor's actions plus what surrounds them.

Flushing schedules (the registry's `flushes`): run the step's action list (loss of each
micro-batch scaled by 1/m), wait for the sends, then dp all-reduce, tied-embedding sum,
global clip and one optimizer step.
Asynchronous schedules (an `AsyncRule`): the run is one never-flushed action list, cut
into steps at the update after each step's last micro-batch; each update applies this
stage's gradients on its own (clipping by this stage's norm, since other stages update at
other times; the single-process reference in reference.py does the same).

Measured bubble per rank and step = 1 - busy / window, where busy is the sum of the
rank's compute (F, B, I, W and, for async, updates; receive waits excluded) and the window
runs from the start of the rank's first action of the step (its first mark, before any
receive wait) to the flush (flushing schedules: a pp all-reduce after the step's sends are
waited for, so it ends when every stage has finished the step's compute) or to the end of
the rank's last action (asynchronous schedules). Outside the window, counted neither busy
nor idle: the learning-rate update and ZeRO's buffer reset before the first action, and
the dp all-reduce, clipping and optimizer step after the flush. Inside it every gap is a
wait on a peer: a receive, the step's sends, or the flush.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from framework.config import RunConfig
from framework.device import to_host
from framework.optim.master import build as build_master
from framework.optim.swap import offload_of
from framework.train.update import Update
from framework.report.records import StateBytes, StepResult
from framework.topology import ParallelContext
from framework.comm.comm_timer import timed, watch
from framework.parallel.pipeline.executor import ActionRecord, PipelineExecutor, PipelinePeers
from framework.schedules.p2p import RankPlan, comm_plan
from framework.schedules.tiling import TiledPlan
from framework.schedules import resolve
from framework.models.moe_layer import moe_step
from framework.comm.expert_parallel import is_expert
from framework.parallel.grads import GradBuffer, clip_grad_norm, finish_all_reduce, reduce_expert_grads
from framework.comm.tensor_parallel import sync_replicated_grads
from framework.precision import policy_of
from framework.parallel.pipeline.stage import build_chunks, stage_ranges, sum_tied_grad, tied_weight
from framework.parallel.zero import Zero
from framework.parallel.pipeline.weights import VersionUses, WeightVersions


def _delay_s(run: RunConfig, pp_rank: int) -> float:
    d = run.debug
    return d.stage_delay_ms / 1e3 if d.stage_delay_ms and d.delay_pp_rank == pp_rank else 0.0


class PipelineRunner:
    def __init__(self, run: RunConfig, ctx: ParallelContext, full, tracker, forward_context: Callable, tp_comm,
                 first_step: int = 0):
        """`first_step`: a resumed run's first step. An asynchronous schedule then starts its
        never-flushed list afresh there (a fill, as at step 0): a checkpoint holds the newest
        weights and optimizer states, not the micro-batches in flight or older versions."""
        p, v, m = run.parallelism.pp, run.schedule.virtual_stages, run.schedule.microbatches
        self.run, self.ctx, self.m, self.p, self.tp_comm = run, ctx, m, p, tp_comm
        self.moe, self.ep_comm = getattr(full, "moe", None), getattr(full, "ep_comm", None)
        self.first_step, steps = first_step, run.trainer.steps - first_step
        self.schedule = resolve(run.schedule)
        self.is_async = not self.schedule.flushes
        self.smap = self.schedule.stage_map(p, v)
        self.ranges = stage_ranges(run.parallelism.partition, full, p * v)
        self.chunks = build_chunks(full, self.ranges, self.smap, ctx.coords.pp)
        self.module = nn.ModuleList(self.chunks)  # what this rank owns, for memory accounting
        self.tied = tied_weight(full, self.chunks)
        self.policy = policy_of(run)
        self.zero = None
        if run.parallelism.zero:  # stage 1 only with pp > 1 (framework.validate): one buffer per chunk
            self.zero = Zero(1, [[c] for c in self.chunks], ctx, tracker, separate=self.tied,
                             reduce_dtype=self.policy.reduce_dtype, bucket_mb=run.parallelism.bucket_mb)
            self.params = self.zero.shards
            self.optimizer = self.zero.build_optimizer(run.optimizer, offload_of(run), self.policy)
        else:
            self.params = list(self.module.parameters())
            self.optimizer = build_master(run.optimizer, self.params, self.policy)
        c, d = ctx.coords, ctx.dims  # the last dp and tp rank of a stage holding the head (V: pp rank 0)
        self.update = Update(run, self.optimizer, injects=any(ch.head is not None for ch in self.chunks)
                             and c.dp == d.dp - 1 and c.tp == d.tp - 1, rank=ctx.rank)
        self.is_last = any(ch.head is not None for ch in self.chunks)
        self.tracker = tracker
        tracker.set_params(self.module.parameters())  # final now: others' freed, ZeRO's flattened
        self.stage = self.smap.stage(ctx.coords.pp, 0)
        peers = PipelinePeers(ctx.group_ranks["pp"], ctx.coords.pp, self.smap, ctx.pp_group, ctx.pp_pairs)
        # Context parallelism: a rank's T / cp tokens; sequence parallelism: their tp shard.
        seq = run.data.seq_len // run.parallelism.cp // (tp_comm.size if run.parallelism.sequence_parallel else 1)
        act_shape = (run.trainer.micro_batch_size, seq, full.hf_model.config.hidden_size)
        act_dtype = self.policy.comm_dtype  # p2p messages: the precision policy's
        # Every rank derives every rank's batches from the same lists: the plan check.py proves.
        if self.is_async:  # never flushed: a template run proved and tiled (tiling.py), any length
            self.tiled = TiledPlan(self.schedule, self.smap, m, steps)
            self.steps = steps
            plan = self._segment_plan(0)
        else:
            plan = comm_plan(self.schedule.generate(p, m, v, 1), self.smap,
                             run.parallelism.overlap_dualpipe)[ctx.coords.pp]
        self.clock = ctx.timer.clock  # the step's one clock: the trainer anchors it (begin_step)
        self.executor = PipelineExecutor(self.chunks, peers, ctx.device, act_shape, forward_context,
                                         self._backward_done, act_dtype, plan, self.clock, run.debug.coalesced_p2p,
                                         _delay_s(run, ctx.coords.pp), ctx.recorder, run.parallelism.overlap_dualpipe)
        if self.is_async:
            self.versions = WeightVersions(self.chunks[0], self._uses(), tracker)
        else:
            self.actions = plan.actions
        # parallelism.overlap_grad_reduce: backwards done per chunk this step, buckets in flight
        self.overlap = [0] * len(self.chunks) if run.parallelism.overlap_grad_reduce and ctx.dims.dp > 1 else None
        self.reducing: list = []
        self.own = self._owned()
        # dp without ZeRO: gradients accumulate in flat buffers reduced in place (grads.py's
        # GradBuffer): per chunk with the overlap, else one for the rank's dense parameters.
        self.grad_buffers = []
        if ctx.dims.dp > 1 and not self.zero and not self.is_async:
            lists = self.own if self.overlap is not None else [[q for ps in self.own for q in ps]]
            self.grad_buffers = [GradBuffer(ps, self.run.parallelism.bucket_mb) if ps else None for ps in lists]

    def _owned(self) -> list[list]:
        """Per chunk its dense parameters no other chunk of this rank holds (reduced after its
        last backward), and last those shared by two (a V's tied embedding: after the step)."""
        chunk_params = [[q for q in c.parameters() if q.requires_grad and not is_expert(q)] for c in self.chunks]
        count: dict[int, int] = {}
        for ps in chunk_params:
            for q in ps:
                count[id(q)] = count.get(id(q), 0) + 1
        shared = list({id(q): q for ps in chunk_params for q in ps if count[id(q)] > 1}.values())
        return [[q for q in ps if count[id(q)] == 1] for ps in chunk_params] + [shared]

    def _uses(self) -> VersionUses:
        return VersionUses(self._version, self.m * self.steps)

    def _segment_plan(self, k: int) -> RankPlan:
        """Step k's (from this process's first step) actions and batches on this rank."""
        seg = self.tiled.segment(self.ctx.coords.pp, k)
        return RankPlan(seg.actions, [seg.first] + seg.batches)

    def step_actions(self, step: int) -> list:
        """Async: the actions of one step's share of the never-flushed list (micro-batch ids
        count from first_step)."""
        return self.tiled.segment(self.ctx.coords.pp, step - self.first_step).actions

    def weights_loaded(self) -> None:
        """After a checkpoint replaced the weights: the first version is those weights."""
        if self.is_async:
            for snapshot in self.versions.versions.values():
                self.tracker.include_again(snapshot)
            self.versions = WeightVersions(self.chunks[0], self._uses(), self.tracker)

    def _version(self, j: int) -> int:
        return self.schedule.asynchronous.version_of(j, self.stage, self.smap.num_stages, self.m)

    def _backward_done(self, mb: int, chunk: int) -> None:
        self.tracker.backward_done((mb, chunk))
        if self.is_async:
            self.versions.backward_done(self._version(mb))
        elif self.overlap is not None:
            self.overlap[chunk] += 1
            if self.overlap[chunk] == self.m and self.zero:  # ZeRO 1: the chunk's unit (the tied weight
                self.zero.start_unit_reduce(chunk)             # is the separate one, reduced after the sum)
            elif self.overlap[chunk] == self.m and self.grad_buffers[chunk]:  # its gradients are final
                started = self.grad_buffers[chunk].start_all_reduce(self.ctx.dp_group, self.ctx.dims.dp,
                                                                    self.policy.reduce_dtype)
                # each bucket's Work watched: its completion stamped off the step's path (comm_timer.py)
                self.reducing += [(None if w is None else watch(self.ctx.timer, "dp", [w])[0], b, f)
                                  for w, b, f in started]

    def step(self, step: int, batch_of: Callable) -> StepResult:
        if self.is_async:
            k = step - self.first_step
            self.executor.plan = self._segment_plan(k)  # batch 0 of a later step's segment is empty
            self._aux_scale(self.schedule.asynchronous.microbatch_weight(self.m))
            marks = self.executor.run(0, len(self.executor.plan.actions), batch_of,
                                      self.schedule.asynchronous.microbatch_weight(self.m),
                                      params_of=lambda j, c: self.versions.params(self._version(j)),
                                      update=self._async_update)
            if k == self.steps - 1:
                self.executor.wait_sends()
            else:
                self.executor.prune_sends()
            self.clock.sync()
            records = self._records(marks)
            pipe_end = time.time()
            norm = self._last_norm
            window_end = max(r.end for r in records)
            start = min(r.start for r in records)
        else:
            self.update.set_lr(step)
            if self.zero:
                self.zero.start_step()
            for buffer in filter(None, self.grad_buffers):
                buffer.attach()
            weight = self.update.loss_weight(step)  # the loss scale (fp16-mixed) multiplies 1/m
            self._aux_scale((1.0 if weight is None else weight) / self.m)
            marks = self.executor.run(0, len(self.actions), batch_of, (1.0 if weight is None else weight) / self.m)
            self.executor.wait_sends()
            window_end = pipe_end = self._flush()
            records = self._records(marks)
            start = min(r.start for r in records)  # the first action's first mark
            norm = self._sync_update(step)
        done = time.time()
        moe = moe_step(self.moe, self.run, self.ctx, self.tp_comm,  # untimed, as the memory accounting
                       not self.is_async and self.update.overflow)
        busy = sum(r.compute_s for r in records)
        window = window_end - start
        return StepResult(loss=self._local_loss(), grad_norm=to_host(torch.as_tensor(norm), "step's norm").item(), pipeline_s=pipe_end - start,
                          optimizer_s=done - pipe_end, states=self.states, bubble=1.0 - busy / window, busy_s=busy,
                          window_s=window, records=records,
                          weight_version_bytes=self.versions.peak_bytes if self.is_async else 0,
                          p2p_buffer_peak_bytes=self.executor.p2p_peak_bytes, moe=moe, started=start,
                          pairs=[(k, *map(self.clock.seconds, m)) for k, *m in self.executor.pair_marks],
                          **self.update.step_fields())

    def _aux_scale(self, loss_weight: float) -> None:
        """MoE aux losses' gradients: scaled as each micro-batch's LM loss."""
        if self.moe is not None:
            self.moe.aux_scale.value = loss_weight

    def _flush(self) -> float:
        """The flush: returns when every stage has finished the step's compute. Ends each
        rank's bubble window at the same moment, so a stage that finishes early counts its
        wait for the others as idle (a later collective would otherwise hide it)."""
        self.ctx.recorder.note("flush: all_reduce over pp", wait=True)
        dist.all_reduce(torch.zeros(1, device=self.ctx.device), group=self.ctx.pp_group)
        self.clock.sync()  # CUDA: the all-reduce only enqueued; the host waits for it here
        return time.time()

    def _records(self, marks) -> list[ActionRecord]:
        """Marks -> unix seconds, read once the step's work is done (CUDA events then)."""
        sec = self.clock.seconds
        return [ActionRecord(a, sec(s), sec(c), sec(e)) for a, s, c, e in marks]

    def _sync_update(self, step: int) -> torch.Tensor:
        ctx = self.ctx
        ctx.recorder.note("gradient sync (dp / embedding / ZeRO / tp collectives), clip, optimizer step", wait=True)
        if not self.zero:
            if self.overlap is not None:  # issued in the cooldown: what is left is the wait
                with timed(ctx.timer, "dp", "gradient all-reduce (overlapped)"):
                    finish_all_reduce(self.reducing, ctx.dims.dp)
            with timed(ctx.timer if ctx.dims.dp > 1 else None, "dp", "gradient all-reduce"):
                if self.grad_buffers and self.grad_buffers[-1]:  # overlap: the shared ones; else all
                    self.grad_buffers[-1].all_reduce(ctx.dp_group, ctx.dims.dp, self.policy.reduce_dtype)
                if self.overlap is not None:
                    self.reducing, self.overlap = [], [0] * len(self.chunks)
                reduce_expert_grads(self.params, ctx, self.policy.reduce_dtype, self.run.parallelism.bucket_mb)
        with timed(ctx.timer if self.tied is not None else None, "pp", "tied embedding sum"):  # the pipeline's ends
            sum_tied_grad(self.tied, ctx.groups.get("embedding"))
        if self.zero:  # ZeRO-1: the dp reduction is a reduce-scatter to each slice's owner
            self.zero.reduce_gradients()
            if self.overlap is not None:
                self.overlap = [0] * len(self.chunks)
        self._sync_sequence_parallel()
        skip = self.tied if (self.tied is not None and self.is_last) else None  # count the tied weight once
        if skip is not None and self.zero:
            skip = self.zero.separate.shard
        norm = clip_grad_norm(self.params, 0.0, ctx.pp_group, self.tp_comm, skip=skip,  # the norm only: Update clips
                              dp_group=ctx.dp_group if self.zero else None,
                              ep_group=None if self.zero else ctx.ep_group)
        norm = self.update.apply(self.params, norm, step)
        if self.zero and not self.update.overflow:
            self.zero.after_step()
        self.states = self._state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _async_update(self, j: int) -> None:
        self.versions.take_grads(self._version(j))
        self.update.set_lr(self.first_step + j // self.m)
        self._sync_sequence_parallel()
        norm = clip_grad_norm(self.params, 0.0, None, self.tp_comm)  # this stage's: it updates alone
        self._last_norm = self.update.apply(self.params, norm, self.first_step + j // self.m)
        self.states = self._state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        self.versions.updated()

    def _sync_sequence_parallel(self) -> None:
        if self.tp_comm.size > 1:
            sync_replicated_grads(self.params, self.tp_comm, self.run.parallelism.sequence_parallel)

    def _state_bytes(self) -> StateBytes:
        """The model states' bytes, measured on the steps the tracker records (a walk over
        every tensor: framework/train/trainer.py, tracks_activations) or until the optimizer's
        states exist; the last measurement otherwise (they do not change between steps)."""
        from framework.metrics.memory import master_bytes, model_state_bytes

        last = getattr(self, "states", None)
        if last is not None and last.optimizer_bytes and not self.tracker.enabled:
            return last
        return StateBytes(**(self.zero.state_bytes(self.optimizer) if self.zero
                             else model_state_bytes(self.module, self.optimizer)),
                          master_bytes=master_bytes(self.optimizer))

    def _local_loss(self):
        """The last stage's mean loss over this step's micro-batches, else None. Reduced by
        the logging rank at its gather, not here: a collective per step would be a sync
        point that partially flushes the asynchronous schedules."""
        losses = self.executor.take_losses()
        return to_host(torch.stack(list(losses.values())).double().mean(), "step's loss").item() if losses else None
