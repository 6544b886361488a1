"""The `trainer` group and its neighbours: `logger`, `metrics`, `debug`, `precision` (with
`precision.loss_scale`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from framework.config.rules import (_CHECKPOINTS, _FP8, _FP16, _LABEL, _WANDB, MAX_COUNT, MAX_GLOBAL_BATCH,
                                    key)
from framework.precision import PRECISIONS

_PA = dict(when=lambda r: r.trainer.recompute == "full" and r.parallelism.tp > 1,
           when_text="trainer.recompute=full and parallelism.tp > 1",
           base=("trainer.recompute=full", "parallelism.tp=2"))


@dataclass
class TrainerConfig:
    steps: int = key(30, ge=1, le=1 << 40)
    # null = derived from global_batch_size (then microbatches is fixed)
    micro_batch_size: Optional[int] = key(4, ge=1, le=MAX_COUNT)
    # Sequences per optimizer step: when set, schedule.microbatches is derived for each layout
    # (micro_batch_size fixed), so a sweep over layouts keeps tokens per step equal.
    global_batch_size: Optional[int] = key(None, ge=1, le=MAX_GLOBAL_BATCH)
    warmup_steps: int = key(3, ge=0, le=1 << 40)  # linear lr warm-up, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = key(0.1, ge=0, le=1)
    grad_clip: float = key(1.0, ge=0)  # global grad-norm clip; 0 disables
    # fp32 | bf16-autocast (alias bf16) | bf16-mixed | fp16-mixed | fp64; framework/precision.py
    precision: str = key("fp32", choices=PRECISIONS)
    # none | selective (the attention core recomputed in backward) | full (each block recomputed)
    recompute: str = key("none", choices=("none", "selective", "full"))
    activation_checkpointing: bool = False  # the old name of recompute=full (derive_layout keeps them in step)
    # ZeRO-R's Pa: under recompute=full and tp > 1 each tp rank keeps 1/tp of every block input,
    # all-gathered before the block is recomputed (framework/comm/activation_partition.py)
    partition_activations: bool = key(False, **_PA)
    # Pa+cpu: those slices in host memory (pinned, copied without blocking on CUDA)
    cpu_checkpointing: bool = key(False, when=lambda r: r.trainer.partition_activations,
                                  when_text="trainer.partition_activations=true",
                                  base=(*_PA["base"], "trainer.partition_activations=true"))
    # ZeRO-R's MD for them (DeepSpeed's contiguous_memory_optimization): a micro-batch's slices in one
    # slab, kept and reused between steps (framework/comm/activation_partition.py)
    contiguous_checkpoints: bool = key(False, when=lambda r: r.trainer.partition_activations,
                                       when_text="trainer.partition_activations=true",
                                       base=(*_PA["base"], "trainer.partition_activations=true"))
    # none | blocks: each transformer block torch.compile'd (torchtitan's apply_compile; framework/models/compile.py)
    compile: str = key("none", choices=("none", "blocks"))
    # inductor (generated kernels; on CPU gcc builds C++) | aot_eager (the same traced graphs, eager kernels)
    compile_backend: str = key("inductor", choices=("inductor", "aot_eager"), when=lambda r: r.trainer.compile != "none",
                               when_text="trainer.compile=blocks", base=("trainer.compile=blocks",))
    seed: int = key(1234, ge=0, lt=1 << 32)  # numpy's default_rng takes [0, 2**32)
    log_interval: int = key(5, ge=1, le=1 << 40)
    save_checkpoint: bool = False  # write final_model.pt (full state dict) in the job dir
    # A rank that makes no progress this long ends the job (launcher's watchdog, hang.txt);
    # the process-group timeout is this plus framework.train.worker.PG_TIMEOUT_MARGIN_S.
    hang_timeout_s: float = key(300.0, gt=0, le=365 * 86400)
    # Distributed checkpoints (framework/checkpoint/): every N steps to checkpoints/step_<k>/; 0 = off.
    checkpoint_interval: int = key(0, ge=0, le=1 << 40)
    # the step waits for a host copy of the rank's part, not the file system
    checkpoint_async: bool = key(True, **_CHECKPOINTS)
    keep_checkpoints: Optional[int] = key(2, ge=1, le=MAX_COUNT, **_CHECKPOINTS)  # newest complete checkpoints kept; null = all
    # null | auto (newest complete checkpoint in the job dir, else start) | a path
    resume: Optional[str] = key(None, nonempty=True, free="auto or a checkpoint: framework/checkpoint (resolve_resume)")
    eval_interval: int = key(0, ge=0, le=1 << 40)  # steps between held-out evaluations (val_loss); 0 = off
    eval_batches: int = key(4, ge=1, le=MAX_COUNT, when=lambda r: r.trainer.eval_interval > 0,
                            when_text="trainer.eval_interval > 0", base=("trainer.eval_interval=2",))
    # CPU ranks' intra-op threads; null = the node's cores split over its ranks in a single run,
    # 1 in a sweep (framework/device.py cpu_threads: every job of a sweep the same per rank)
    cpu_threads_per_rank: Optional[int] = key(None, ge=1, le=4096)


@dataclass
class LoggerConfig:
    name: str = key("wandb", choices=("wandb", "none"))
    mode: str = key("auto", choices=("auto", "online", "offline", "disabled"), **_WANDB)
    project: str = key("parallel-lm", nonempty=True, free=_LABEL, **_WANDB)
    entity: Optional[str] = key(None, free=_LABEL, **_WANDB)
    group: Optional[str] = key(None, free=_LABEL, **_WANDB)  # null = sweep dir / experiment name
    run_name: Optional[str] = key(None, free=_LABEL, **_WANDB)  # null = the command-line overrides


@dataclass
class MetricsConfig:
    skip_first: int = key(3, ge=0, lt="trainer.steps")  # warm-up steps left out of the summary medians
    # pipelines: steps whose action records are kept (trace.json, timeline, op times)
    trace_steps: int = key(16, ge=1, le=MAX_COUNT)
    # per rank; null = datasheet table (CUDA) or cached matmul probe (CPU)
    peak_tflops: Optional[float] = key(None, gt=0)
    # the saved-activation tracker (activation_peak_bytes): `sampled` runs its hook on the first
    # step and every trainer.log_interval-th (asynchronous pipelines: every step), `every` on all
    activations: str = key("sampled", choices=("sampled", "every"))


@dataclass
class DebugConfig:
    fail_rank: Optional[int] = key(None, ge=0, lt="world_size")  # inject a fault: this rank raises ...
    # ... at the start of this step (1-based, as every step number)
    fail_step: int = key(1, ge=1, le="trainer.steps")
    # sleep this long inside every forward and backward compute ...
    stage_delay_ms: float = key(0.0, ge=0, le=600_000)
    # ... of this pipeline rank (tests the measured bubble)
    delay_pp_rank: int = key(0, ge=0, lt="parallelism.pp", when=lambda r: r.debug.stage_delay_ms > 0,
                             when_text="debug.stage_delay_ms > 0", base=("debug.stage_delay_ms=1",))
    # tp rank 0 sleeps this long before each tp collective (the others wait inside it: tests
    # that the step-time breakdown counts that wait as comm_tp, not compute)
    tp_delay_ms: float = key(0.0, ge=0, le=600_000, when=lambda r: r.parallelism.tp > 1, when_text="parallelism.tp > 1")
    # the same for dp rank 0 before each dp span and ep rank 0 before each ep span (the
    # timer's: framework/comm/comm_timer.py), one key per dimension so one run can slow both
    dp_delay_ms: float = key(0.0, ge=0, le=600_000, when=lambda r: r.parallelism.replicas > 1,
                             when_text="parallelism.dp x parallelism.cp > 1", base=("parallelism=dp2_pp2",))
    ep_delay_ms: float = key(0.0, ge=0, le=600_000, when=lambda r: r.parallelism.ep > 1,
                             when_text="parallelism.ep > 1", base=("model=moe-tiny", "parallelism=dp2_pp2", "parallelism.ep=2"))
    # every rank sleeps this long while it loads each step's micro-batches (tests the breakdown's data)
    data_delay_ms: float = key(0.0, ge=0, le=600_000)
    # emulate NCCL: batch_isend_irecv returns ONE Work per batch
    coalesced_p2p: bool = key(False, when=lambda r: r.parallelism.pp > 1, when_text="parallelism.pp > 1")
    # Every rank first builds the whole model, then keeps its part: the start-up before
    # per-rank materialisation, kept to measure what that saves (experiments/startup_memory).
    materialise_whole: bool = False
    # Checkpoint writes see a file system of this many bytes (the checkpoints directory):
    # past it they fail with ENOSPC, as a full disk would. null = the real disk.
    checkpoint_disk_bytes: Optional[int] = key(None, ge=1, **_CHECKPOINTS)
    # The NVMe offload's drive has room for this many bytes (framework/optim/swap.py): a larger
    # reservation fails with ENOSPC, as a full drive would. null = the real drive's free space.
    offload_disk_bytes: Optional[int] = key(None, ge=1, when=lambda r: r.parallelism.states_on_drive,
                                            when_text="parallelism.offload_device=nvme",
                                            base=("parallelism.zero=1", "parallelism.offload_optimizer=true",
                                                  "parallelism.offload_device=nvme", "parallelism.nvme_path=/tmp/offload"))
    # fp16-mixed: an inf loss on one head-holding rank at this step (1-based)
    inf_grad_step: Optional[int] = key(None, ge=1, le="trainer.steps", **_FP16)
    # With inf_grad_step: instead of the inf loss, this global rank alone puts one inf into one
    # of its gradients after every reduction, just before the overflow flag (tests that the
    # flag is reduced over every rank: framework/train/update.py).
    # Every rank records what each collective of a training step hands to torch.distributed,
    # per dimension (job_dir/comm_ledger/rank_<r>.json: framework/metrics/comm_ledger.py).
    # Slow: every tensor operator passes through Python while it is on.
    comm_ledger: bool = False
    inf_grad_rank: Optional[int] = key(None, ge=0, lt="world_size", when=lambda r: r.debug.inf_grad_step is not None,
                                       when_text="debug.inf_grad_step set",
                                       base=("trainer.precision=fp16-mixed", "debug.inf_grad_step=2"))


@dataclass
class LossScaleConfig:
    """fp16-mixed's dynamic loss scaler (framework/train/loss_scale.py). Defaults: DeepSpeed's
    (initial 2**16; Megatron starts at 2**32, ~17 skipped steps before the first update);
    the rest are both libraries' (x2 after 1000 clean steps, x0.5 on overflow, hysteresis 2,
    minimum 1). Powers of two by hand (framework/validate/precision.py)."""

    initial: float = key(65536.0, gt=0, **_FP16)
    growth_factor: float = key(2.0, ge=1, **_FP16)
    backoff_factor: float = key(0.5, gt=0, lt=1, **_FP16)
    growth_interval: int = key(1000, ge=1, le=1 << 40, **_FP16)  # clean steps before the scale grows
    # the hysteresis-th overflow since the scale last grew backs off (2: one is tolerated)
    hysteresis: int = key(2, ge=1, le=1 << 20, **_FP16)
    min_scale: float = key(1.0, gt=0, le="precision.loss_scale.initial", **_FP16)  # an overflow at this scale stops the run


@dataclass
class PrecisionConfig:
    """Keys beside trainer.precision (framework/precision.py)."""

    # gradient collectives: null = the mode's (fp32 when mixed) | fp32 | param
    reduce_dtype: Optional[str] = key(None, choices=("fp32", "param"))
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    # none | tensorwise | rowwise: the blocks' linears on FP8 operands (torchao; framework/models/fp8.py)
    fp8: str = key("none", choices=("none", "tensorwise", "rowwise"))
    # null: emulated off CUDA, FP8 GEMMs on CUDA (sm 8.9+) | true: emulated anywhere | false: never emulated
    fp8_emulate: Optional[bool] = key(None, **_FP8)
    fp8_all_gather: bool = key(False, **_FP8)  # FSDP2 gathers tensorwise FP8 weights (1 byte per element)
