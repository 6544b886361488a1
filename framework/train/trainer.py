"""One rank's training run: build a runner for the layout, then loop over steps.

A runner does one optimizer step (or, for asynchronous pipelines, one step's share of the
never-flushed schedule) and reports loss, grad norm, timings and model-state bytes as a
`StepResult`; `train_step` adds the step's data time and this rank's counters into a
`StepRecord` (both in framework/report/records.py):
- `AccumulationRunner` (pp = 1, framework/train/accumulation.py): micro-batches accumulated under
  DDP's no_sync (one gradient all-reduce per step), or ZeRO / FSDP2 over dp.
- `PipelineRunner` (pp > 1): the schedule's action list (framework/parallel/pipeline/).
Records are gathered to the logging rank every log interval (not every step, so logging
adds no sync point to each step). It runs past ~300 lines: building the runner and the step record
share every part of a step; issue 49 splits the house by concern.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from framework import checkpoint
from framework.device import take_syncs
from framework.train.accumulation import AccumulationRunner
from framework.config import RunConfig
from framework.data import ShardedSampler, TokenData
from framework.train.evaluate import HeldOut, evaluate
from framework.report.export import save_final_model, transformers_tokenizer
from framework.report.sinks import RunLogger
from framework.timestamps import now
from framework.metrics.comm_ledger import CommLedger, ledger_path
from framework.metrics.memory import (ActivationTracker, current_rss_bytes, device_memory, fragmentation_bytes,
                                      peak_rss_bytes)
from framework.metrics.model_states import formula_report
from framework.metrics.peak import resolve_rank_peak
from framework.comm.activation_partition import Partition
from framework.models import build_model
from framework.optim.build import lr_at
from framework.comm.expert_parallel import EPComm
from framework.train.pipeline_runner import PipelineRunner
from framework.schedules import Op
from framework.models import recompute
from framework.metrics.compiles import compiled_frames
from framework.models.compile import compile_blocks
from framework.models import fp8
from framework.parallel import context_parallel
from framework.comm.tp_comm import TPComm
from framework.metrics.breakdown import busy_s, rank_parts, serialise_pairs
from framework.metrics.noise import CpuClock
from framework.comm.comm_timer import CommTimer
from framework.precision import autocast_context
from framework.report.records import RunInfo, StepRecord, StepResult
from framework.train.signals import Stopped, StopSignals
from framework.topology import ParallelContext


class InjectedFault(RuntimeError):
    """Raised by debug.fail_rank to test that a crashed rank ends the whole job."""


def build_runner(run: RunConfig, info: RunInfo, ctx: ParallelContext, first_step: int = 0):
    vocab = run.model.vocab_size or info.vocab_size
    ctx.timer = CommTimer(ctx.device)  # every dimension's communication spans: the step-time breakdown
    tp_comm = TPComm(ctx.tp_group, ctx.dims.tp, ctx.coords.tp, timer=ctx.timer)
    tp_comm.delay_s = run.debug.tp_delay_ms / 1e3
    d = ctx.dims
    ctx.timer.delay = {dim: ms / 1e3 for dim, ms, at in (("dp", run.debug.dp_delay_ms, ctx.coords.dp),
                                                         ("ep", run.debug.ep_delay_ms, d.ep_rank(ctx.coords)))
                       if ms and at == 0}  # debug: rank 0 of the dimension is the slow one
    ep_comm = (EPComm(ctx.ep_group, d.ep, d.ep_rank(ctx.coords), ctx.device, ctx.timer, ctx.groups.get("ep_side"))
               if d.ep > 1 else None)
    # On the meta device: the runner materialises what this rank keeps (its stages, its tp
    # shards, ZeRO unit by unit), never the whole model (framework/models/materialise.py).
    model = build_model(run.model, vocab, run.trainer.seed, ctx.device, run.trainer.activation_checkpointing,
                        tp_comm, run.parallelism.sequence_parallel, run.trainer.precision, on_meta=True,
                        whole_first=run.debug.materialise_whole, ep_comm=ep_comm)
    if run.trainer.partition_activations:  # ZeRO-R's Pa (+cpu): 1/tp of each checkpointed block input
        model.partition = Partition(tp_comm, run.trainer.cpu_checkpointing, run.trainer.contiguous_checkpoints)
    cp = None
    if d.cp > 1:  # attention over the cp group, ids / labels / positions of this rank's tokens
        cp_comm = TPComm(ctx.cp_group, d.cp, d.cp_rank(ctx.coords), timer=ctx.timer, dim="cp")
        cp = context_parallel.ContextParallel(cp_comm, run.data.seq_len,
                                              run.parallelism.cp_balance, ctx.device, run.parallelism.cp_comm,
                                              ctx.group_ranks["cp"], run.parallelism.overlap_cp_ring)
        context_parallel.install(model, cp)
    if run.precision.fp8 != "none":  # before recompute and compile wrap the blocks (torchtitan's order)
        fp8.install(model.blocks, run.precision.fp8, fp8.emulated(run.precision.fp8_emulate, ctx.device),
                    run.precision.fp8_all_gather)
    if run.trainer.recompute == "selective":  # after cp: it wraps the attention function in use
        recompute.install(model)
    if run.trainer.compile == "blocks":  # after every wrapper of the blocks (models/compile.py)
        compile_blocks(model, run.trainer.compile_backend)
    tracker = ActivationTracker()  # the runner sets its parameters once they are final

    def forward_context(mb, chunk):
        stack = contextlib.ExitStack()
        stack.enter_context(tracker.forward((mb, chunk)))
        stack.enter_context(autocast_context(run, ctx.device))
        return stack

    if run.parallelism.pp == 1:
        runner = AccumulationRunner(run, ctx, model, tracker, tp_comm)
    else:
        runner = PipelineRunner(run, ctx, model, tracker, forward_context, tp_comm, first_step)
    runner.context = cp  # its bytes and seconds: the step record's cp_* fields
    return runner, model


class Batches:
    """Micro-batches by (data step, index), loaded on demand and dropped once used."""

    def __init__(self, run: RunConfig, info: RunInfo, ctx: ParallelContext):
        self.data = TokenData.load(run, info.tokens_path)
        self.sampler = ShardedSampler(self.data.num_samples, run.trainer.micro_batch_size, run.schedule.microbatches,
                                      ctx.dims.data_rank(ctx.coords), ctx.dims.data, run.trainer.seed)
        self.m, self.device = run.schedule.microbatches, ctx.device

    def load(self, keys: list[tuple[int, int]]) -> dict:
        by_step = {s: self.sampler.step_indices(s) for s in {s for s, _ in keys}}
        return {(s, j): tuple(t.to(self.device) for t in self.data.batch(by_step[s][j])) for s, j in keys}


def _keys(runner, step: int, m: int) -> tuple[list, Callable]:
    """Which micro-batches a step needs, and how the runner names them."""
    if runner.is_async:  # the run's micro-batch ids, possibly of the next step (warm-up runs ahead)
        first = runner.first_step  # a resumed run's list counts from its first step
        ids = sorted({a.microbatch for a in runner.step_actions(step) if a.op is Op.F})
        return [(first + j // m, j % m) for j in ids], lambda j: (first + j // m, j % m)
    return [(step, j) for j in range(m)], lambda j: (step, j)


def tracks_activations(step: int, runner, run: RunConfig) -> bool:
    """Whether step `step` (0-based) runs the saved-activation tracker (metrics.activations):
    `sampled` records the first step, every log_interval-th and the last, and every step of an
    asynchronous pipeline (its micro-batches span steps: a forward untracked in one step
    would be missing from the next step's live bytes). activation_peak_bytes is the peak over
    the recorded steps."""
    if run.metrics.activations == "every" or runner.is_async:
        return True
    return (not runner.tracker.steps_recorded or (step + 1) % run.trainer.log_interval == 0
            or step + 1 == run.trainer.steps)


def train_step(step: int, runner, batches: Batches, run: RunConfig, ctx: ParallelContext) -> StepRecord:
    """`step`: steps done before this one (0-based, what the sampler and the lr read); the
    record carries the step's number, step + 1 (the one numbering users see)."""
    cpu = CpuClock(with_node=ctx.rank == 0)  # framework/metrics/noise.py: the machine's load
    cpu.start()
    runner.tracker.enabled = tracks_activations(step, runner, run)
    runner.tracker.steps_recorded += runner.tracker.enabled
    take_syncs()  # the step's own sync points from here (not the last step's checkpoint or eval)
    frames = compiled_frames()[0] if run.trainer.compile != "none" else None
    # One clock (the CommTimer's): begin_step anchors it (CUDA: waits for the idle stream),
    # every mark inside the step is an event read after it, and the step ends with one wait.
    clock = ctx.timer.clock
    ctx.timer.begin_step()
    t0 = time.time()
    keys, key_of = _keys(runner, step, run.schedule.microbatches)
    loaded = batches.load(keys)
    if run.debug.data_delay_ms:  # a known cost inside the step's data part (tests the breakdown)
        time.sleep(run.debug.data_delay_ms / 1e3)
    loaded_mark = clock.mark()
    lr = lr_at(runner.update.lr_index(step), run)  # before the step: an overflow there moves the index
    out: StepResult = runner.step(step, lambda j: loaded[key_of(j)])
    t2 = now(ctx.device)  # the step's end: the host waits for the stream once
    t1 = clock.seconds(loaded_mark)
    spans = ctx.timer.take()
    actions = [(r.action, r.start, r.compute_start, r.end) for r in out.records]
    # parallelism.overlap_dualpipe: each pair's threads as two records in turn, its exposed spans
    actions, cut = serialise_pairs(actions, out.pairs, spans, ctx.timer.last_side if ctx.timer else set())
    parts, inside = rank_parts(t0, t1, t2, out.started, out.pipeline_s, out.optimizer_s, actions, cut)
    if actions:  # busy is compute alone: a tp collective or an all-to-all inside an action is not
        out.busy_s = busy_s(parts)
        out.bubble = 1.0 - out.busy_s / out.window_s
    return StepRecord(step=step + 1, loss=out.loss, lr=lr, grad_norm=out.grad_norm,
                      loss_scale=out.loss_scale, overflow=out.overflow, skipped_steps=out.skipped_steps,
                      step_time_s=t2 - t0, data_s=t1 - t0, fwd_bwd_s=out.pipeline_s, optimizer_s=out.optimizer_s,
                      bubble=out.bubble, busy_s=out.busy_s, window_s=out.window_s,
                      activation_peak_bytes=runner.tracker.peak_bytes, weight_version_bytes=out.weight_version_bytes,
                      p2p_buffer_peak_bytes=out.p2p_buffer_peak_bytes, tp_comm_bytes=runner.tp_comm.take_bytes(),
                      **(runner.context.take(spans) if runner.context is not None else {}),
                      # the sums are reduced over dp and tp already: one report per stage is enough
                      moe=out.moe if ctx.coords.dp == 0 and ctx.coords.tp == 0 else None, **_a2a(runner, spans),
                      actions=actions, action_comm_s=inside, states=out.states, parts=parts, comm_spans=spans,
                      comm_total=dict(ctx.timer.totals) if ctx.timer is not None else {}, **cpu.take(),
                      host_syncs=take_syncs(), compiles=None if frames is None else compiled_frames()[0] - frames,
                      fragmentation_bytes=fragmentation_bytes(ctx.device))


def _announce(saver, logger) -> None:
    """A completed checkpoint's console line (rank 0 says it)."""
    if not logger.is_logger:
        saver.completed.clear()  # only rank 0 tells: nothing piles up elsewhere
        return
    for line in saver.finished_lines():
        logger.say(line)


def _a2a(runner, timed: list) -> dict:
    comm = getattr(runner, "ep_comm", None)
    if comm is None:
        return {}
    sent, seconds, spans = comm.take_a2a(timed)
    return {"a2a_bytes": sent, "a2a_s": seconds, "a2a_spans": spans}


def rank_memory(runner, last: StepRecord, run: RunConfig, device: torch.device) -> dict:
    rss = peak_rss_bytes()
    st = last.states
    mem = {"params_bytes": st.params_bytes, "grads_bytes": st.grads_bytes, "master_bytes": st.master_bytes,
           "optimizer_bytes": st.optimizer_bytes}
    mem["weight_version_bytes"] = last.weight_version_bytes
    mem["model_state_bytes"] = sum(mem.values())
    mem["p2p_buffer_peak_bytes"] = last.p2p_buffer_peak_bytes
    mem.update(formula_report(runner, run), zero_transient_peak_bytes=st.zero_transient_peak_bytes)
    mem.update(activation_peak_bytes=runner.tracker.peak_bytes, rss_peak_bytes=rss, **device_memory(device))
    if run.trainer.compile != "none":  # torch's own count of its compile seconds (metrics/compiles.py)
        mem["compile_s"] = compiled_frames()[1]
    mem["memory_peak_bytes"] = mem.get("cuda_max_reserved_bytes", rss)
    return mem


def train(run: RunConfig, info: RunInfo, ctx: ParallelContext, job_dir: str,
          stop: Optional[StopSignals] = None) -> Optional[dict]:
    """Run every step on this rank; the logging rank returns the summary, others None.
    `stop`: the rank's signal handler; with checkpointing on, a SIGTERM / SIGINT saves a
    checkpoint at the next step boundary the ranks agree on, then raises Stopped."""
    info = resolve_rank_peak(run, info, ctx.device, announce=ctx.rank == 0)  # CUDA: the table, looked up here
    ctx.recorder.note("build model, runner and data")
    rss_before_build = current_rss_bytes()
    first = checkpoint.read_meta(info.resume_from)["step"] if info.resume_from else 0
    runner, full = build_runner(run, info, ctx, first)
    # Materialisation draws each module under its own seed (forked generator): the stream
    # training reads (dropout) starts from trainer.seed here, the same on every rank.
    torch.manual_seed(run.trainer.seed)
    io = {}  # what this rank's checkpoint load and last save cost (summary.json's ranks)
    if info.resume_from:
        io["checkpoint_load"] = checkpoint.load(info.resume_from, runner, full, ctx, run)
        if hasattr(runner, "weights_loaded"):
            runner.weights_loaded()
    # Start-up memory: the model built (this rank's part only) and the checkpoint loaded,
    # before any training step allocates gradients, optimizer states or activations.
    startup = {"rss_before_build_bytes": rss_before_build, "startup_rss_peak_bytes": peak_rss_bytes()}
    batches = Batches(run, info, ctx)
    heldout = HeldOut(run, info.val_tokens_path, info.val_num_samples, ctx) if run.trainer.eval_interval else None
    logger = RunLogger(run, job_dir, ctx, info,
                       checkpoint.history(info.resume_from, first) if info.resume_from and ctx.rank == 0 else [],
                       first_step=first + 1)
    saving = run.trainer.checkpoint_interval > 0
    saver = checkpoint.Saver(run, ctx, job_dir, info.resume_from) if saving else None
    if saving and stop is not None:
        stop.defer()
    ledger = CommLedger(ctx.rank, ctx.groups, ctx.group_ranks) if run.debug.comm_ledger else None
    try:
        pending: list[StepRecord] = []
        rec: Optional[StepRecord] = None
        for step in range(first, run.trainer.steps):
            k = step + 1  # the step's number: 1-based everywhere users see it (after it, k steps are done)
            if run.debug.fail_rank == ctx.rank and k == run.debug.fail_step:
                raise InjectedFault(f"injected fault on rank {ctx.rank} at step {k} "
                                    f"(debug.fail_rank; unix time {time.time():.3f})")
            ctx.recorder.note(f"step {k}")
            logger.step_started(k)
            with ledger or contextlib.nullcontext():
                rec = train_step(step, runner, batches, run, ctx)
            if rec.step not in logger.kept:  # the trace keeps a few steps: send only theirs to rank 0
                rec.a2a_spans, rec.comm_spans = [], []
            logger.step_done(rec.step_time_s)
            if heldout is not None and (k % run.trainer.eval_interval == 0 or k == run.trainer.steps):
                ctx.recorder.note(f"evaluate after step {k} (held-out data)")
                t0 = time.time()
                rec.val_loss = evaluate(runner, heldout, run, ctx)
                rec.eval_s = time.time() - t0
                runner.tp_comm.take_bytes()  # evaluation's tp traffic is not the next step's
                if runner.context is not None:  # nor its cp traffic and attention time
                    runner.context.take()
                _a2a(runner, [])  # nor its all-to-alls (its timer spans: dropped at the next step's start)
            pending.append(rec)
            # The first step too, so the console shows numbers before log_interval steps.
            if k == first + 1 or k % run.trainer.log_interval == 0 or k == run.trainer.steps:
                ctx.recorder.note("gather records to rank 0 (log group)", wait=True)
                logger.gather_and_log(pending)
                pending = []
            if saving:
                saver.poll()  # a background write that failed is told here, on every rank
                _announce(saver, logger)
                signum = _agreed_stop(stop, ctx)
                last = k == run.trainer.steps  # a stop agreed here finishes the job normally
                if (signum and not last) or k % run.trainer.checkpoint_interval == 0:
                    if pending:  # the checkpoint's metrics.jsonl holds every step up to it
                        logger.gather_and_log(pending)
                        pending = []
                    saver.save(runner, full, k, run.model.vocab_size or info.vocab_size,
                               logger.partial_path if ctx.rank == 0 else None)
                    _announce(saver, logger)  # a synchronous write is done now; a background one later
                if signum and not last:
                    saver.wait()  # written and marked complete before the rank exits
                    logger.say(f"stopped by {signal.Signals(signum).name}: checkpoint saved after step {k}")
                    raise Stopped(signum)
                if signum:
                    logger.say(f"{signal.Signals(signum).name} at the last step: finishing the job normally")
        if ledger is not None:
            ledger.steps = run.trainer.steps - first
            ledger.write(ledger_path(job_dir, ctx.rank))
        if saver is not None:
            saver.wait()
            _announce(saver, logger)
            io["checkpoint_save"] = saver.last
        if run.trainer.save_checkpoint:
            ctx.recorder.note("save checkpoint (gather to rank 0)", wait=True)
            save_final_model(runner, full, ctx, job_dir, transformers_tokenizer(run))
        ctx.recorder.note("gather memory to rank 0, write summary", wait=True)
        summary = logger.finish({**rank_memory(runner, rec, run, ctx.device), **startup, **io})  # last: marks completion
        # A stop during or after the last step's agreement: the training is done, so the job
        # finished (summary.json completed); the rank still exits as stopped, since the
        # launcher is stopping and would not read a returned summary (elastic would hold
        # the rank until its SIGKILL).
        late_stop = stop.requested if saving and stop is not None else None
    except BaseException:
        # Said before W&B's finish (which may take a while): the watchdog then knows this is
        # a failure being reported, not a hang, and its peers stay blocked on it until the
        # rank's record is written (framework.train.worker).
        ctx.recorder.note("rank failed (finishing the checkpoint write in flight, closing the logger)")
        if saver is not None:  # the checkpoint being written completes first (its own group)
            saver.drain(min(60.0, run.trainer.hang_timeout_s / 2))
        raise
    finally:
        if stop is not None:
            stop.undefer()
        logger.close()
    if late_stop:
        raise Stopped(late_stop)
    return summary


def _agreed_stop(stop: Optional[StopSignals], ctx: ParallelContext) -> int:
    """The stop signal any rank has received (0: none), the same on every rank: signals reach
    ranks at different moments, so they must agree on the step boundary to stop at. One
    8-byte all-reduce on the (gloo, CPU) logging group per step, only with checkpointing on."""
    flag = torch.tensor([stop.requested or 0 if stop is not None else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.log_group)
    return int(flag.item())
