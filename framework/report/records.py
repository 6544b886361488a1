"""Typed records of one training step, from a runner to the logging rank.

  StateBytes  the model states a rank holds between steps (exact, storage-deduplicated)
  StepResult  what a runner's `step()` returns (framework/train/accumulation.py: AccumulationRunner;
              framework/train/pipeline_runner.py: PipelineRunner)
  RunInfo     what the launching process derives once before launch (run_info.json)
  StepRecord  one rank's record of one step, built by `trainer.train_step`, gathered to
              the logging rank (pickled by `dist.gather_object`) and merged there into the
              metrics.jsonl row (framework/report/sinks.py, `RunLogger._merge`)

Plain dataclasses without imports from the rest of the framework, so runners, trainer and
logging all import them without cycles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from framework.parallel.pipeline.executor import ActionRecord


@dataclass
class StateBytes:
    """Model states this rank holds after its last update (framework.metrics.memory
    `model_state_bytes`, or ZeRO's `state_bytes` over its flat buffers)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    zero_transient_peak_bytes: int = 0  # ZeRO only: peak of gathered units / full gradients
    master_bytes: int = 0  # the optimizer's copy of the parameters (fp32 master weights; ZeRO-Offload's host copy)


@dataclass
class StepResult:
    """One step of a runner. Defaults are the values of a runner without that quantity
    (pp = 1: no bubble, no action records, no weight versions, no p2p buffers)."""

    loss: Optional[float]  # this rank's mean over the step's tokens; None on a stage without the head
    grad_norm: float
    pipeline_s: float  # forward and backward of every micro-batch (pipelines: up to the flush)
    optimizer_s: float  # gradient reduction, clipping and the update
    states: StateBytes
    bubble: float = 0.0  # 1 - busy_s / window_s
    busy_s: float = 0.0  # compute time in the bubble window
    window_s: float = 0.0
    records: list[ActionRecord] = field(default_factory=list)  # the executor's timed actions
    weight_version_bytes: int = 0  # asynchronous schedules: peak bytes of stashed weights
    p2p_buffer_peak_bytes: int = 0
    loss_scale: Optional[float] = None  # fp16-mixed: the scale this step's backward ran at
    overflow: bool = False  # fp16-mixed: the step's gradients overflowed, so it was skipped
    skipped_steps: int = 0  # fp16-mixed: overflowed steps so far (cumulative)
    moe: Optional[dict] = None  # MoE models: per-layer routing sums of the step (framework/models/moe_layer.py)
    started: float = 0.0  # unix time pipeline_s began (the first action's first mark; pp = 1: the first forward)
    # parallelism.overlap_dualpipe: per overlapped pair, (index of its F in records, F's compute
    # start, end, B's compute start, end), unix s (breakdown.serialise_pairs reads them)
    pairs: list = field(default_factory=list)


@dataclass
class StepRecord:
    """One rank's step, as the logging rank merges it (field names as in metrics.jsonl
    where the merged row has the same quantity)."""

    step: int
    loss: Optional[float]
    lr: float
    grad_norm: float
    step_time_s: float  # data + fwd/bwd + optimizer, wall time
    data_s: float
    fwd_bwd_s: float
    optimizer_s: float
    bubble: float
    busy_s: float
    window_s: float
    activation_peak_bytes: int
    weight_version_bytes: int
    p2p_buffer_peak_bytes: int
    tp_comm_bytes: int
    actions: list[tuple[str, float, float, float]]  # (action, start, compute_start, end), unix seconds
    states: StateBytes
    loss_scale: Optional[float] = None
    overflow: bool = False
    moe: Optional[dict] = None  # StepResult.moe
    # context parallelism (ContextParallel.take; 0 at cp = 1): bytes this rank sent in the cp
    # group's collectives, seconds inside them, and its attention compute (forward + backward
    # seconds of the attention functions less cp_comm_s)
    cp_comm_bytes: int = 0
    cp_comm_s: float = 0.0
    cp_attention_s: float = 0.0
    a2a_bytes: int = 0  # expert parallelism: bytes this rank sent by all-to-all
    a2a_s: float = 0.0  # and seconds inside all-to-all (its CommTimer spans)
    a2a_spans: list[tuple[str, float, float]] = field(default_factory=list)  # each call: (what, start, end)
    skipped_steps: int = 0
    val_loss: Optional[float] = None  # held-out loss after this step (trainer.eval_interval), same on every rank
    eval_s: float = 0.0  # its wall time (not part of step_time_s)
    # the step-time breakdown (framework/metrics/breakdown.py): part -> seconds, summing to step_time_s
    parts: dict = field(default_factory=dict)
    comm_spans: list = field(default_factory=list)  # (dim, what, start, end) of kept steps only (the trace)
    comm_total: dict = field(default_factory=dict)  # dim -> seconds of communication, hidden or not (comm_timer.py)
    action_comm_s: list = field(default_factory=list)  # per action: communication seconds inside its compute
    host_syncs: dict = field(default_factory=dict)  # the step's sync points, by reason (framework/device.py)
    compiles: Optional[int] = None  # trainer.compile: frames torch.compile compiled during the step (models/compile.py)
    # how much to trust the step (framework/metrics/noise.py): this process's CPU seconds, its
    # node, the node's CPUs and (rank 0) the node's busy CPU seconds during the step
    cpu_s: float = 0.0
    host: str = ""
    cpus: int = 1
    node_busy_s: Optional[float] = None
    # CUDA: the caching allocator's reserved minus allocated bytes at the step's end (ZeRO-R's
    # fragmentation, framework/metrics/memory.py); None on a CPU
    fragmentation_bytes: Optional[int] = None


@dataclass
class RunInfo:
    """Derived once before launch and handed to every rank."""

    tokens_path: Optional[str]
    vocab_size: int
    num_samples: int
    flops_per_token: float
    # None for fp64 (no MFU), and for CUDA until each rank looks its GPU up at start-up
    # (framework.metrics.peak.resolve_rank_peak replaces the pending value).
    peak_flops_per_rank: Optional[float]
    peak_source: str  # "config" | "table" | "probe" | "none" (fp64) | "pending" (CUDA, before the ranks) | "no matrix unit: ..." (MFU n/a)
    bubble_fraction_analytic: float
    resume_from: Optional[str] = None  # the checkpoint this run continues (framework.checkpoint)
    val_tokens_path: Optional[str] = None  # held-out tokens (trainer.eval_interval; None: synthetic or off)
    val_num_samples: int = 0
    model_params: Optional[int] = None  # the whole model's parameters, each counted once (a tied embedding once)
    p2p_message_bytes: int = 0  # one pipeline activation / gradient message (the simulator's transfer size)
    # MoE: the routed experts' share of flops_per_token (6 R k / E), less by the fraction a
    # step's capacity dropped (framework.metrics.flops.executed_flops_per_token)
    expert_flops_per_token: float = 0.0
    # where bubble_fraction_analytic comes from: "closed form" | "schedule model" (a simulation
    # of the schedule's graph; framework/metrics/bubble.py analytic_source)
    bubble_analytic_source: str = "closed form"
