"""Typed run configuration: the schema every worker reads, and `load_config` that builds it.

Hydra composes YAML groups into a DictConfig in the launching process only. `load_config`
merges that into these dataclasses (OmegaConf type checks, unknown keys are errors) and
returns plain dataclass instances, so `framework/` never indexes a raw dict. Semantic
checks live in `framework/validate/`.

One file past ~300 lines on purpose: it is the whole schema, one dataclass per config group
(the precision group's live beside the policy, framework/precision.py); split further, a
reader would lose the one place that lists every key.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from framework.parallel.pipeline.schedules.base import DEFAULT as DEFAULT_SCHEDULE
from framework.precision import PrecisionConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the key, the value and the fix."""

    def __init__(self, key: str, value: Any, problem: str, fix: str):
        self.key, self.value = key, value
        end = " " if problem.endswith("?") else ". "  # "no such key. Did you mean x? Fix: ..."
        super().__init__(f"{key}={value!r}: {problem}{end}Fix: {fix}")


@dataclass
class MoEConfig:
    """Routed experts (model.arch=qwen3_moe; docs/moe.md). Ignored by dense architectures."""

    experts: int = 4  # routed experts per MoE layer
    top_k: int = 2  # experts each token is sent to
    expert_inner: Optional[int] = None  # an expert's MLP width; null = n_embd
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1 (Qwen3-MoE, Mixtral)
    # Routing and balancing (framework/models/moe_routing.py; docs/moe.md "Routing and balancing").
    score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3): how logits become routing scores
    capacity_factor: Optional[float] = None  # null (or .inf) = dropless; else ceil(cf * seq_len * k / E) per sequence and expert
    drop_policy: str = "probs"  # over capacity, keep the highest-score (probs) or earliest (position) tokens
    aux_losses: list[dict[str, Any]] = field(default_factory=list)  # [{type: aux | seq_aux | z, coeff: 0.01}]
    experts_impl: str = "auto"  # auto (grouped on CUDA when it can) | loop (per-expert matmuls) | grouped
    bias_update_rate: float = 0.0  # DeepSeek-V3 auxiliary-loss-free balancing: expert bias step; 0 = off


@dataclass
class ModelConfig:
    name: str = "gpt2-tiny"
    arch: str = "gpt2"  # gpt2 | llama | qwen3_moe
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_kv_head: Optional[int] = None  # llama grouped-query attention; null = n_head
    n_inner: Optional[int] = None  # MLP width; null = 4 * n_embd (gpt2) / llama default
    max_positions: int = 128
    vocab_size: Optional[int] = None  # null = the data's tokenizer vocabulary
    dropout: float = 0.0
    tie_embeddings: bool = True
    pretrained: Optional[str] = None  # hub name or local path; weights replace random init
    moe: MoEConfig = field(default_factory=MoEConfig)  # qwen3_moe: the routed experts


@dataclass
class DataConfig:
    name: str = "pycode"  # pycode | synthetic | hf
    seq_len: int = 64
    tokenizer: str = "bytes"  # "bytes" (no download) or a transformers tokenizer name / path
    max_files: Optional[int] = 400  # pycode: first N stdlib files (sorted); null = all
    path: Optional[str] = None  # hf: dataset name, local dir, or loader ("json", "text")
    data_files: Optional[str] = None  # hf: local file(s) for a loader
    text_field: str = "text"  # hf: column holding the text
    split: str = "train"
    num_samples: int = 4096  # synthetic: number of sequences
    vocab_size: int = 256  # synthetic: token ids drawn from [0, vocab_size)
    cache_dir: Optional[str] = None  # packed-token cache; null = ~/.cache/framework
    # Held-out data for trainer.eval_interval (val_loss); no training step ever sees it.
    val_files: int = 20  # pycode: the last N stdlib files (sorted), never trained on
    val_split: Optional[str] = None  # hf: a split of the dataset to evaluate on (e.g. validation) ...
    val_fraction: float = 0.0  # ... or this last fraction of the training split's documents, held out


@dataclass
class ParallelismConfig:
    name: str = "single"
    dp: Optional[int] = 1  # null = world_size / (tp * pp) (a layout search fixes the world size)
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep ranks carved out of dp (docs/moe.md)
    zero: int = 0
    zero_impl: str = "ours"  # ZeRO back end: ours (framework/parallel/zero.py) | fsdp2 (torch's fully_shard, zero 2 / 3)
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step in host memory (zero >= 1)
    sequence_parallel: bool = False  # tp > 1: norms / dropout on sequence shards (no-op at tp = 1)
    world_size: Optional[int] = None  # null = dp * tp * pp; set it to assert the launch size (or to derive dp)
    partition: Any = "uniform"  # blocks -> stages: uniform | parameters | type:<regex> | [n0, n1, ...]


@dataclass
class ScheduleConfig:
    name: str = DEFAULT_SCHEDULE  # a name in the schedule registry (framework/parallel/pipeline/schedules/)
    microbatches: Optional[int] = 1  # per step per dp rank; with pp = 1 accumulation steps (csv: null = the file's)
    virtual_stages: Optional[int] = 1  # model chunks per pipeline rank (as the schedule declares; csv: null = file's)
    csv: Optional[str] = None  # name=csv: a schedule in torch's compute-only CSV format (one row per pp rank)
    modules: list = field(default_factory=list)  # Python files / modules that register more schedules
    memory_limit_microbatches: Optional[int] = None  # zb-auto: most micro-batches alive per rank (null = pp)
    op_times: Optional[dict] = None  # zb-auto: {F, I, W: seconds (or a list per pp rank), comm}; null = sim.from's


@dataclass
class TrainerConfig:
    steps: int = 30
    micro_batch_size: Optional[int] = 4  # null = derived from global_batch_size (then microbatches is fixed)
    # Sequences per optimizer step: when set, schedule.microbatches is derived for each layout
    # (micro_batch_size fixed), so a sweep over layouts keeps tokens per step equal.
    global_batch_size: Optional[int] = None
    warmup_steps: int = 3  # linear lr warm-up, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    precision: str = "fp32"  # fp32 | bf16-autocast (alias bf16) | bf16-mixed | fp16-mixed | fp64; framework/precision.py
    activation_checkpointing: bool = False
    seed: int = 1234
    log_interval: int = 5
    save_checkpoint: bool = False  # write final_model.pt (full state dict) in the job dir
    # A rank that makes no progress this long ends the job (launcher's watchdog, hang.txt);
    # the process-group timeout is this plus framework.train.worker.PG_TIMEOUT_MARGIN_S.
    hang_timeout_s: float = 300.0
    # Distributed checkpoints (framework/checkpoint/): every N steps to checkpoints/step_<k>/; 0 = off.
    checkpoint_interval: int = 0
    checkpoint_async: bool = True  # the step waits for a host copy of the rank's part, not the file system
    keep_checkpoints: Optional[int] = 2  # newest complete checkpoints kept; null = all
    resume: Optional[str] = None  # null | auto (newest complete checkpoint in the job dir, else start) | a path
    eval_interval: int = 0  # steps between held-out evaluations (val_loss); 0 = off
    eval_batches: int = 4  # global batches of held-out sequences per evaluation


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    mode: str = "auto"  # auto | online | offline | disabled
    project: str = "parallel-lm"
    entity: Optional[str] = None
    group: Optional[str] = None  # null = sweep dir / experiment name
    run_name: Optional[str] = None  # null = the command-line overrides


@dataclass
class MetricsConfig:
    skip_first: int = 3  # warm-up steps left out of the summary medians
    trace_steps: int = 16  # pipelines: steps whose action records are kept (trace.json, timeline, op times)
    peak_tflops: Optional[float] = None  # per rank; null = datasheet table (CUDA) or cached matmul probe (CPU)


@dataclass
class DebugConfig:
    fail_rank: Optional[int] = None  # inject a fault: this rank raises ...
    fail_step: int = 1  # ... at the start of this step (1-based, as every step number)
    stage_delay_ms: float = 0.0  # sleep this long inside every forward and backward compute ...
    delay_pp_rank: int = 0  # ... of this pipeline rank (tests the measured bubble)
    coalesced_p2p: bool = False  # emulate NCCL: batch_isend_irecv returns ONE Work per batch
    # Every rank first builds the whole model, then keeps its part: the start-up before
    # per-rank materialisation, kept to measure what that saves (experiments/startup_memory).
    materialise_whole: bool = False
    # Checkpoint writes see a file system of this many bytes (the checkpoints directory):
    # past it they fail with ENOSPC, as a full disk would. null = the real disk.
    checkpoint_disk_bytes: Optional[int] = None
    inf_grad_step: Optional[int] = None  # fp16-mixed: an inf loss on one head-holding rank at this step (1-based)
    # With inf_grad_step: instead of the inf loss, this global rank alone puts one inf into one
    # of its gradients after every reduction, just before the overflow flag (tests that the
    # flag is reduced over every rank: framework/train/update.py).
    inf_grad_rank: Optional[int] = None


@dataclass
class SearchConfig:
    """Layout searches (conf/hparams_search/layout.yaml) and any sweep."""

    # The dry-run planner's per-rank model-state estimate (framework.launch.plan) above this is a
    # rejected job, before any rank starts; null = no budget.
    memory_budget_bytes: Optional[float] = None
    # What a failed or rejected job returns to a sweeper; null = NaN (Optuna: a failed trial).
    failed_value: Optional[float] = None
    # run: launch every candidate | simulate: predict each from sim.from (no launch), then
    # launch only the top_k by predicted step time (framework/sim/sweep.py)
    mode: str = "run"
    top_k: int = 1


@dataclass
class SimConfig:
    """The simulator (docs/simulator.md). The command-line key is `sim.from`, stored as
    `source` (a Python keyword cannot name a field)."""

    source: Optional[str] = None  # a finished pipeline (or pp 1, ep > 1) job whose calibration.json predicts this run


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.optim.AdamW", "lr": 3e-4})
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    device: str = "auto"  # auto | cpu | cuda; resolved once in framework/device.py
    launcher: str = "local"  # local: start the ranks here | external: write the job dir for torchrun
    dry_run: bool = False  # print and write plan.json; start no rank
    objective: str = "loss"  # summary.json key returned to a Hydra sweeper

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.tp * p.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all dp ranks."""
        return self.trainer.micro_batch_size * self.schedule.microbatches * self.parallelism.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.data.seq_len


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config into the schema; a wrong key or type is a ConfigError."""
    schema = OmegaConf.structured(RunConfig)
    cfg = _sim_from(cfg)
    try:
        merged = OmegaConf.merge(schema, cfg)
        run = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        value = getattr(e, "value", None)
        if value is None and key != "config":  # an unknown key's error carries no value: show the given one
            value = OmegaConf.select(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg, key, default=None)
        reason = str(e).splitlines()[0]  # OmegaConf appends full_key / object_type lines
        raise ConfigError(key, value, f"does not fit the schema ({reason})",
                          "see docs/configuration.md for the keys and their types") from None
    assert isinstance(run, RunConfig)
    derive_layout(run)
    return run


def _sim_from(cfg):
    """`sim.from=<job dir>` (the documented key) -> the schema's sim.source."""
    sim = cfg.get("sim") if hasattr(cfg, "get") else None
    if sim is None or "from" not in sim:
        return cfg
    cfg = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    with open_dict(cfg):
        cfg.sim.source = cfg.sim.pop("from")
    return cfg


def derive_layout(run: RunConfig) -> None:
    """Fill the sizes left to derive, so everything downstream reads plain ints:
    parallelism.dp = world_size / (tp * pp) when dp is null, and with
    trainer.global_batch_size either schedule.microbatches (micro_batch_size set: the
    default) or trainer.micro_batch_size (null). Sizes that are not positive are left for
    framework.validate to name."""
    p, t, s = run.parallelism, run.trainer, run.schedule
    _clamp_skip_first(run)
    _sizes_from_csv(s)
    if p.dp is None:
        if p.world_size is None or p.tp < 1 or p.pp < 1 or p.world_size % (p.tp * p.pp):
            raise ConfigError("parallelism.dp", None, f"null derives dp = world_size / (tp * pp), but world_size = "
                              f"{p.world_size} and tp * pp = {p.tp}*{p.pp}",
                              "set parallelism.dp, or a parallelism.world_size divisible by tp * pp")
        p.dp = p.world_size // (p.tp * p.pp)
    g = t.global_batch_size
    if g is None:
        if t.micro_batch_size is None:
            raise ConfigError("trainer.micro_batch_size", None, "null derives it from trainer.global_batch_size, "
                              "which is null too", "set trainer.micro_batch_size, or trainer.global_batch_size")
        return
    if g < 1 or p.dp < 1:
        return  # validate names it
    if t.micro_batch_size is None:
        t.micro_batch_size = _share(g, s.microbatches, p.dp, "microbatches", "trainer.micro_batch_size",
                                    "set trainer.micro_batch_size")
    else:
        s.microbatches = _share(g, t.micro_batch_size, p.dp, "micro_batch_size", "schedule.microbatches",
                                "change trainer.micro_batch_size")


def _sizes_from_csv(s: ScheduleConfig) -> None:
    """schedule=csv: micro-batches and chunks left null are the file's (a file that cannot be
    read is left for framework.validate to name)."""
    from framework.parallel.pipeline.schedules import CSV, csv_schedule

    if s.name != CSV or not s.csv or (s.microbatches is not None and s.virtual_stages is not None):
        return

    try:
        extra = csv_schedule(s.csv)[0].extra
    except (OSError, ValueError):
        return
    s.microbatches = extra["microbatches"] if s.microbatches is None else s.microbatches
    s.virtual_stages = extra["virtual_stages"] if s.virtual_stages is None else s.virtual_stages


def _clamp_skip_first(run: RunConfig) -> None:
    """A short run (trainer.steps=3 with the default metrics.skip_first=3) summarises its
    last step instead of failing: one line says so."""
    m, steps = run.metrics, run.trainer.steps
    if isinstance(m.skip_first, int) and isinstance(steps, int) and 1 <= steps <= m.skip_first:
        import sys

        print(f"note: metrics.skip_first={m.skip_first} would leave none of trainer.steps={steps} to summarise; "
              f"using metrics.skip_first={steps - 1}", file=sys.stderr)
        m.skip_first = steps - 1


def _share(global_batch: int, fixed: int, dp: int, fixed_name: str, derived: str, other_fix: str) -> int:
    """global_batch / (fixed * dp), or a ConfigError when it does not divide."""
    per = fixed * dp
    if fixed < 1 or global_batch % per:
        raise ConfigError("trainer.global_batch_size", global_batch, f"not divisible by {fixed_name} * dp = "
                          f"{fixed}*{dp} ({derived} is derived from it)",
                          f"use a multiple of {max(per, 1)}, or {other_fix}")
    return global_batch // per


def check_overrides(run: RunConfig, overrides: list[str]) -> None:
    """A size given on the command line that derive_layout replaced is a contradiction,
    not a preference: say so instead of running another batch than asked for."""
    given = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    for key, now in (("schedule.microbatches", run.schedule.microbatches),
                     ("trainer.micro_batch_size", run.trainer.micro_batch_size),
                     ("parallelism.dp", run.parallelism.dp)):
        if key in given and given[key] not in ("null", str(now)):
            raise ConfigError(key, given[key], f"trainer.global_batch_size={run.trainer.global_batch_size} / "
                              f"parallelism.world_size={run.parallelism.world_size} derive {key}={now}",
                              f"leave {key} out (it is derived), or set the size it is derived from to null")


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def read_config(path: str) -> RunConfig:
    """Workers load the resolved config the launching process wrote (no Hydra here)."""
    return load_config(OmegaConf.load(path))
