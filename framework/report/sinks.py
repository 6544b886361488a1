"""Sinks for one run: console, files in the job directory, and W&B. Rank 0 logs for all.

Every rank keeps its own step records (`StepRecord`, framework/report/records.py); `gather_and_log`
gathers them to rank 0 once per log interval and rank 0 merges them into one row per step
(`_merge`; every key is defined in docs/metrics.md): the loss over the step's tokens, the
slowest rank's step time and the throughput from it, model FLOP/s and MFU (an mfu above 1
is a bug in the FLOPs or the peak: warned, and summary.json says mfu_above_one), the bubble
(mean, max and per rank), fp16's loss scale, bytes per dimension, cp's and MoE's metrics
(framework/metrics/cp.py, moe.py) and the step-time breakdown (metrics/breakdown.py).
Files: metrics.jsonl (one object per step; written as metrics.jsonl.partial and renamed
when the run completes), summary.json (written last, atomically: its presence means the
run completed), and for pipelines trace.json (the actions of at most metrics.trace_steps + 1
steps spread over the run, Chrome trace format; metrics.timeline.kept_steps) and
timeline.png (one of them). Summary statistics are medians over steps after
metrics.skip_first; the asynchronous schedules' bubble is over the whole run instead (their
start-up and drain, in the first and last steps, are the bubble).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

import torch
import torch.distributed as dist

from framework.config import RunConfig
from framework.files import write_atomic
from framework.metrics import breakdown, compiles, memory, noise
from framework.metrics.noise import median_or_none
from framework.metrics.bubble import analytic_at_measured, analytic_label
from framework.metrics.cp import step_metrics as cp_metrics
from framework.metrics.flops import executed_flops_per_token, mfu
from framework.metrics.moe import step_metrics
from framework.metrics.moe import summary as moe_summary
from framework.metrics.replay import FlatPredictor, RunPredictor, predicted_keys, summary_prediction
from framework.schedules import resolve
from framework.metrics.timeline import kept_steps, write_run_timeline, write_trace
from framework.precision import policy_of
from framework.report.progress import Progress, grad_field
from framework.report.records import RunInfo, StepRecord
from framework.topology import ParallelContext
from framework.report.wandb_sink import wandb_mode  # noqa: F401 (also imported from here)
from framework.report.wandb_sink import declare_metrics, init_run, job_type, layout_keys, wandb_config, wandb_row

MEDIAN_KEYS = ("step_time_s", "tokens_per_s", "tflops", "mfu", "data_s", "fwd_bwd_s", "optimizer_s",
               "bubble_fraction", "bubble_fraction_max", "tp_comm_bytes", "cp_comm_bytes", "cp_comm_s",
               "cp_attention_imbalance", *breakdown.KEYS)
# Of each step's row, what rank 0 keeps for the summary: a few numbers, not every rank's lists.
KEPT_KEYS = MEDIAN_KEYS + ("step", "loss", "mfu", "val_loss", "bubble_fraction_analytic", "rank_bubble_fraction",
                           "loss_scale", "skipped_steps", "other_cpu_share", "moe_load_max_over_mean",
                           "moe_dropped_fraction", "a2a_s", "compiles")
# W&B's own summary of a metric defaults to its last value; summary.json's medians (after
# warm-up) and last loss are written by finish() instead, so W&B computes none for these.
SUMMARY_FROM_FINISH = MEDIAN_KEYS + ("loss", "val_loss", "memory_peak_bytes")


class RunLogger:
    def __init__(self, run: RunConfig, job_dir: str, ctx: ParallelContext, info: RunInfo,
                 history: Optional[list[str]] = None, first_step: int = 1):
        """`history`: a resumed run's earlier metrics.jsonl rows (from its checkpoint); they
        start the file, so it covers the whole run. The summary is over this process's steps.
        `first_step`: the first step (1-based) this process runs."""
        self.run, self.job_dir, self.ctx, self.info = run, job_dir, ctx, info
        self.is_logger = ctx.rank == 0
        self.records: list[dict] = []
        self.actions, self.comm_spans = {}, {}  # kept step -> per-rank actions (pipelines), comm spans (comm_timer.py)
        self.kept = kept_steps(first_step, run.trainer.steps, first_step + run.metrics.skip_first,
                               run.metrics.trace_steps)
        self.busy_window: Optional[list[list[float]]] = None  # per rank [Σ busy, Σ window] over the run
        self.predictor: Optional[RunPredictor] = None  # pipelines (and pp 1 with ep > 1): the replay of this run
        self.wandb, self.completed = None, False
        self.progress: Optional[Progress] = None
        if self.is_logger:
            self.progress = Progress(run.trainer.steps, first_step, job_dir)
            self.partial_path = os.path.join(job_dir, "metrics.jsonl.partial")
            self.jsonl = open(self.partial_path, "w")
            self.jsonl.writelines(history or [])
            self.jsonl.flush()
            ctx.recorder.note("W&B init (rank 0)")
            self.wandb = self._init_wandb()
            if run.parallelism.pp > 1:
                s = run.schedule
                self.predictor = RunPredictor(resolve(s), run.parallelism.pp, s.microbatches, s.virtual_stages,
                                              run.trainer.steps - first_step + 1,
                                              [ctx.dims.coords(r) for r in range(run.world_size)],
                                              info.p2p_message_bytes, ctx.device.type,
                                              first_step + run.metrics.skip_first)
            elif run.parallelism.ep > 1:  # no pipeline, but an all-to-all the simulator's ep what-if calibrates on
                self.predictor = FlatPredictor(first_step + run.metrics.skip_first)

    def _init_wandb(self):
        lg = self.run.logger
        if lg.name != "wandb":
            return None
        # Probed and bounded: an unreachable server means an offline run, never a lost job.
        run = init_run(wandb_mode(lg.mode), self.job_dir, project=lg.project, entity=lg.entity, group=lg.group,
                       name=lg.run_name, config=wandb_config(self.run), reinit="finish_previous",
                       job_type=job_type(self.run))
        if run is None:
            return None
        declare_metrics(run, SUMMARY_FROM_FINISH)
        return run

    def _merge(self, per_rank: list[StepRecord]) -> dict:
        """The ranks' records of one step -> its metrics.jsonl row (keys documented above)."""
        r0 = per_rank[0]
        # Ranks holding a loss: every rank when pp = 1, the last stages otherwise; each is the
        # mean over equally many tokens, so their mean is the global batch's loss.
        losses = [r.loss for r in per_rank if r.loss is not None]
        step_time = max(r.step_time_s for r in per_rank)
        tps = self.run.tokens_per_step / step_time
        moe = step_metrics([r.moe for r in per_rank], self.run.model.moe)
        tflops, achieved_mfu = self._mfu(r0.step, tps, moe.get("moe_dropped_fraction", 0.0))
        return {
            "step": r0.step, "loss": sum(losses) / len(losses), "lr": r0.lr,
            # null on a step skipped for overflow (its norm is inf or nan: no JSON number)
            "grad_norm": None if r0.overflow else max(r.grad_norm for r in per_rank),
            "rank_grad_norm": [None if r0.overflow else r.grad_norm for r in per_rank],  # the max hides a low rank
            "host_syncs": max(sum(r.host_syncs.values()) for r in per_rank),  # the step's syncs (framework/device.py)
            "rank_host_syncs": [r.host_syncs for r in per_rank],
            **compiles.step_row(per_rank),  # trainer.compile: frames compiled in the step (metrics/compiles.py)
            # fp16-mixed's loss scaler: the same on every rank (the overflow flag is all-reduced
            # over every rank, framework/train/update.py); absent in the modes without one
            **({"loss_scale": r0.loss_scale, "overflow": r0.overflow, "skipped_steps": r0.skipped_steps}
               if r0.loss_scale is not None else {}),
            "step_time_s": step_time, "tokens_per_s": tps,
            "tflops": tflops, "mfu": achieved_mfu,
            "data_s": max(r.data_s for r in per_rank), "fwd_bwd_s": max(r.fwd_bwd_s for r in per_rank),
            "optimizer_s": max(r.optimizer_s for r in per_rank),
            # pp = 1: no stage waits on another, so no bubble by definition (runners report 0).
            "bubble_fraction": sum(r.bubble for r in per_rank) / len(per_rank),
            "bubble_fraction_max": max(r.bubble for r in per_rank),
            "bubble_fraction_analytic": self._analytic([r.actions for r in per_rank])[0],
            "activation_peak_bytes": max(r.activation_peak_bytes for r in per_rank),
            "weight_version_bytes": max(r.weight_version_bytes for r in per_rank),
            **memory.fragmentation_row([r.fragmentation_bytes for r in per_rank]),  # CUDA only
            "tp_comm_bytes": max(r.tp_comm_bytes for r in per_rank),
            "rank_tp_comm_bytes": [r.tp_comm_bytes for r in per_rank],
            **cp_metrics(per_rank, self.ctx.dims.groups("cp")),  # framework/metrics/cp.py
            **self._breakdown(per_rank),
            "rank_step_time_s": [r.step_time_s for r in per_rank],
            "other_cpu_share": noise.other_cpu_share(per_rank, step_time),  # framework/metrics/noise.py
            "rank_bubble_fraction": [r.bubble for r in per_rank],
            # the two terms of each rank's measured bubble (1 - busy / window), in seconds
            "rank_busy_s": [r.busy_s for r in per_rank],
            "rank_window_s": [r.window_s for r in per_rank],
            # MoE models (framework/metrics/moe.py): routing per layer, all-to-all with ep > 1
            **moe,
            **({"a2a_bytes": max(r.a2a_bytes for r in per_rank), "a2a_s": max(r.a2a_s for r in per_rank)}
               if self.run.parallelism.ep > 1 else {}),
            # only in the rows of steps after which the held-out set was evaluated
            **({"val_loss": r0.val_loss, "eval_s": max(r.eval_s for r in per_rank)} if r0.val_loss is not None else {}),
        }

    def _breakdown(self, per_rank: list[StepRecord]) -> dict:
        p, totals = self.run.parallelism.pp, [r.comm_total for r in per_rank]
        if p == 1:
            return breakdown.row([r.parts for r in per_rank], totals)
        smap = resolve(self.run.schedule).stage_map(p, self.run.schedule.virtual_stages)
        return breakdown.row(breakdown.split_waits(per_rank, smap, self.ctx.dims.groups("pp")), totals)

    def _analytic(self, per_rank: list) -> tuple[float, dict]:
        """(The schedule's analytic bubble at these action records' median op times, those
        times); before launch's equal-times value when there are none (pp = 1)."""
        s, pp = self.run.schedule, self.run.parallelism.pp
        return analytic_at_measured(resolve(s), pp, s.microbatches, s.virtual_stages, self.run.trainer.steps,
                                    per_rank, [self.ctx.dims.coords(r).pp for r in range(len(per_rank))],
                                    self.info.bubble_fraction_analytic)

    def _mfu(self, step: int, tokens_per_s: float, dropped: float) -> tuple[Optional[float], Optional[float]]:
        """(TFLOP/s per rank, MFU) with this rank's resolved peak, counting the expert
        assignments the step executed (`dropped`: the share its capacity dropped); (None, None)
        without a peak."""
        info = self.info
        if info.peak_flops_per_rank is None:
            return None, None
        fpt = executed_flops_per_token(info.flops_per_token, info.expert_flops_per_token, dropped)
        achieved = mfu(tokens_per_s, fpt, self.run.world_size, info.peak_flops_per_rank)
        if achieved > 1:
            print(f"WARNING: step {step}: mfu {achieved:.3f} > 1 against a peak of "
                  f"{info.peak_flops_per_rank / 1e12:.3f} TFLOP/s per rank ({info.peak_source}): the FLOPs "
                  "per token or the peak is wrong", file=sys.stderr, flush=True)
        return tokens_per_s * fpt / self.run.world_size / 1e12, achieved

    def gather_and_log(self, pending: list[StepRecord]) -> None:
        gathered = [None] * self.run.world_size if self.is_logger else None
        dist.gather_object(pending, gathered, dst=0, group=self.ctx.log_group)
        if not self.is_logger:
            return
        for i in range(len(pending)):
            per_rank = [rank_recs[i] for rank_recs in gathered]
            rec = self._merge(per_rank)
            if self.predictor is not None:
                self.predictor.add(rec["step"], per_rank)
                if i == len(pending) - 1:  # at log intervals: the replay of the medians so far
                    rec.update(predicted_keys(self.predictor.predict(per_rank)[1]))
            self.records.append({k: rec[k] for k in KEPT_KEYS if k in rec})  # what the summary reads
            if rec["step"] in self.kept and any(r.comm_spans for r in per_rank):
                self.comm_spans[rec["step"]] = [r.comm_spans for r in per_rank]
            if self.run.parallelism.pp > 1:
                if rec["step"] in self.kept:  # bounded: never every step of a long run
                    self.actions[rec["step"]] = [r.actions for r in per_rank]
                if self.busy_window is None:
                    self.busy_window = [[0.0, 0.0] for _ in per_rank]
                for acc, r in zip(self.busy_window, per_rank, strict=True):
                    acc[0] += r.busy_s
                    acc[1] += r.window_s
            self.jsonl.write(json.dumps(rec) + "\n")
            if self.wandb is not None:
                self.wandb.log(wandb_row(rec), step=rec["step"])
        self.jsonl.flush()
        if pending:
            self._print(rec)

    def _print(self, r: dict) -> None:
        self.progress.gathered(r, f"step {r['step']:>4}/{self.run.trainer.steps} | loss {r['loss']:.4f} "
                               f"| lr {r['lr']:.2e} | {grad_field(r)} | {r['tokens_per_s']:,.0f} tok/s "
                               f"| {r['step_time_s'] * 1e3:.0f} ms/step "
                               f"| mfu {'n/a' if r['mfu'] is None else format(r['mfu'], '.1%')}"
                               + (f" | bubble {r['bubble_fraction']:.2f} ({analytic_label(self.info.bubble_analytic_source)} "
                                  f"{r['bubble_fraction_analytic']:.2f})" if self.run.parallelism.pp > 1 else ""))

    def step_started(self, k: int) -> None:
        if self.progress is not None:
            self.progress.step_started(k)

    def step_done(self, seconds: float) -> None:
        if self.progress is not None:
            self.progress.step_done(seconds)

    def say(self, text: str) -> None:
        """A line of the logging rank's (console and run.log); other ranks say nothing."""
        if self.progress is not None:
            self.progress.say(text)

    def finish(self, rank_memory: dict) -> Optional[dict]:
        """Gather each rank's memory, write summary.json and finalise metrics.jsonl."""
        gathered = [None] * self.run.world_size if self.is_logger else None
        mem = {"rank": self.ctx.rank, **self.ctx.dims.named(self.ctx.coords), **rank_memory, "pid": os.getpid()}
        dist.gather_object(mem, gathered, dst=0, group=self.ctx.log_group)
        if not self.is_logger:
            return None
        summary = self._summary(gathered)
        noise.with_gpu(summary, noise.gpu_other_processes(self.ctx.device, {r.pop("pid") for r in gathered}))
        if self.run.parallelism.pp > 1:
            self._write_timeline(summary)
        elif self.comm_spans:  # no pipeline: the trace holds the communication alone
            write_trace({}, os.path.join(self.job_dir, "trace.json"), self.comm_spans)
        self.jsonl.close()
        os.replace(self.partial_path, os.path.join(self.job_dir, "metrics.jsonl"))
        write_atomic(os.path.join(self.job_dir, "summary.json"), json.dumps(summary, indent=2))
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.completed = True
        return summary

    def _summary(self, ranks: list[dict]) -> dict:
        # A resumed run may have fewer steps left than metrics.skip_first: then its last step.
        measured = self.records[min(self.run.metrics.skip_first, len(self.records) - 1):]
        med = {k: median_or_none([r[k] for r in measured]) for k in MEDIAN_KEYS}
        med.update(noise.summary(measured))  # the spread, the machine's load, the flag
        med.update(moe_summary(measured))  # MoE: load, drops, the all-to-all's share
        n_ranks = len(ranks)
        per_rank = [statistics.median(r["rank_bubble_fraction"][i] for r in measured) for i in range(n_ranks)]
        if not resolve(self.run.schedule).flushes and self.busy_window:
            per_rank = [1 - busy / window for busy, window in self.busy_window]  # whole run: fill and drain
            med["bubble_fraction"], med["bubble_fraction_max"] = sum(per_rank) / n_ranks, max(per_rank)
        for r, b in zip(ranks, per_rank, strict=True):
            r["bubble_fraction"] = b
        run, info = self.run, self.info
        actions = [[rec for r in measured for rec in self.actions.get(r["step"], [[]] * n_ranks)[i]]
                   for i in range(n_ranks)]  # the kept measured steps' records, per rank
        analytic, op_times = self._analytic(actions)
        return {
            "status": "completed", "loss": self.records[-1]["loss"], "loss_first": self.records[0]["loss"],
            **med, "steps": run.trainer.steps, "measured_steps": len(measured),
            # the schedule's declared bubble at this run's median op times (op_time_s), and at
            # T_F = T_I = T_W (what the dry run shows); its source: "closed form" | "schedule model"
            "bubble_fraction_analytic": analytic, "bubble_analytic_source": info.bubble_analytic_source,
            "bubble_fraction_analytic_equal_times": info.bubble_fraction_analytic, "op_time_s": op_times,
            **self._prediction(med),
            "schedule": run.schedule.name, "microbatches": run.schedule.microbatches,
            "virtual_stages": run.schedule.virtual_stages,
            **memory.memory_summary(ranks), "offload_optimizer": run.parallelism.offload_optimizer,
            "precision": policy_of(run).mode,
            **compiles.summary(self.records, measured),  # trainer.compile: warm-up and measured frames
            **({"loss_scale": self.records[-1]["loss_scale"], "skipped_steps": self.records[-1]["skipped_steps"]}
               if "loss_scale" in self.records[-1] else {}),
            "layout": layout_keys(run)["layout"],
            "world_size": run.world_size, "dp": run.parallelism.dp, "tp": run.parallelism.tp,
            "pp": run.parallelism.pp, "cp": run.parallelism.cp, "zero": run.parallelism.zero,
            "sequence_parallel": run.parallelism.sequence_parallel and run.parallelism.tp > 1,
            "global_batch": run.global_batch, "micro_batch_size": run.trainer.micro_batch_size,
            "tokens_per_step": run.tokens_per_step, "flops_per_token": info.flops_per_token,
            "model_params": info.model_params,  # framework.report.compare warns when a sweep's jobs differ in it
            "peak_tflops_per_rank": None if info.peak_flops_per_rank is None else info.peak_flops_per_rank / 1e12,
            "peak_source": info.peak_source,
            "mfu_above_one": any(r["mfu"] is not None and r["mfu"] > 1 for r in self.records),
            "val_loss": next((r["val_loss"] for r in reversed(self.records) if "val_loss" in r), None),
            "device": self.ctx.device.type, "resumed_from": info.resume_from,
            "cpu_threads_per_rank": torch.get_num_threads() if self.ctx.device.type == "cpu" else None,
            "first_step": self.records[0]["step"], "ranks": ranks,  # 1, or k + 1 after resuming step_<k>
        }

    def _prediction(self, med: dict) -> dict:
        if self.predictor is None:
            return {}
        keys, self.prediction = summary_prediction(self.predictor, med, self.job_dir)
        return keys

    def _write_timeline(self, summary: dict) -> None:
        self.ctx.recorder.note("write trace.json and timeline.png (rank 0)")
        skip = min(self.run.metrics.skip_first, len(self.records) - 1)
        write_run_timeline(self.run, self.job_dir, self.actions, self.records[skip:], summary,
                           getattr(self, "prediction", None), self.wandb, self.comm_spans)

    def close(self) -> None:
        """Always runs (finally): a failed run's W&B run is marked failed and closed."""
        if not self.is_logger:
            return
        self.progress.close()
        if not self.jsonl.closed:
            self.jsonl.close()
        if self.wandb is not None:
            self.ctx.recorder.note("W&B finish (rank 0)")
            self.wandb.finish(exit_code=0 if self.completed else 1)
