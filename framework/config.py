"""Typed run configuration: the schema every worker reads, and `load_config` that builds it.

Hydra composes YAML groups into a DictConfig in the launching process only. `load_config`
merges that into these dataclasses (OmegaConf type checks, unknown keys are errors) and
returns plain dataclass instances, so `framework/` never indexes a raw dict. Each key
states its Rule (`key(default, ge=..., choices=..., when=...)`): its range, its choices and
the condition under which it acts, enforced for every key by framework/validate/ranges.py
and fuzzed key by key by tests/test_schema_fuzz.py; the checks a rule cannot say live in
`framework/validate/`.

One file past ~300 lines on purpose: it is the whole schema, one dataclass per config group
with each key's rule; split further, a reader would lose the one place that lists every key
and what it accepts.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from framework.parallel.pipeline.schedules.base import AUTO as AUTO_SCHEDULE
from framework.parallel.pipeline.schedules.base import DEFAULT as DEFAULT_SCHEDULE
from framework.parallel.pipeline.schedules.base import REGISTRY, pairs_forward_backward
from framework.precision import PRECISIONS


class ConfigError(ValueError):
    """A bad configuration value; the message names the key, the value and the fix."""

    def __init__(self, key: str, value: Any, problem: str, fix: str):
        self.key, self.value = key, value
        end = " " if problem.endswith("?") else ". "  # "no such key. Did you mean x? Fix: ..."
        super().__init__(f"{key}={value!r}: {problem}{end}Fix: {fix}")


@dataclass(frozen=True)
class Rule:
    """What one key accepts and when it acts: the schema's half of validation. The generic
    check (framework/validate/ranges.py) enforces it on every run before launch, and
    tests/test_schema_fuzz.py fuzzes every key from it, so a new key is checked and fuzzed
    once it states its rule. A bound is a number or another key's path ("trainer.steps",
    "world_size"); `when` is the condition under which the key has any effect: a key given
    on the command line while it does not hold is refused (it would be silently ignored)."""

    ge: Any = None
    gt: Any = None
    le: Any = None
    lt: Any = None
    inf: bool = False  # a float key to which inf means something (capacity_factor: dropless)
    choices: tuple = ()  # the names a string key accepts
    nonempty: bool = False  # a string key that must not be ""
    when: Optional[Callable[[Any], bool]] = None  # run -> does this key act?
    when_text: str = ""  # the condition as the user would set it ("trainer.precision=fp16-mixed")
    base: tuple = ()  # overrides under which the key acts (the fuzz runs this key's cases there)
    free: str = ""  # no range or choice to state: why, and which check owns the value


def key(default: Any = None, *, factory: Optional[Callable[[], Any]] = None, **rule: Any) -> Any:
    """A schema field with its Rule."""
    meta = {"rule": Rule(**rule)}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def rule_of(f) -> Rule:
    return f.metadata.get("rule", Rule())


# Counts past these are typos, and a dry run would allocate in proportion to them.
MAX_RANKS = 1 << 17  # ~131k ranks per dimension and in all (the largest runs use ~100k GPUs)
MAX_COUNT = 1 << 20
MAX_WIDTH = 1 << 20
MAX_MICROBATCHES = 1 << 16
MAX_GLOBAL_BATCH = 1 << 30
_MOE = dict(when=lambda r: r.model.arch == "qwen3_moe", when_text="model.arch=qwen3_moe", base=("model=moe-tiny",))
_FP16 = dict(when=lambda r: r.trainer.precision == "fp16-mixed", when_text="trainer.precision=fp16-mixed",
             base=("trainer.precision=fp16-mixed",))
_FP8 = dict(when=lambda r: r.precision.fp8 != "none", when_text="precision.fp8=tensorwise or rowwise",
            base=("precision.fp8=tensorwise", "trainer.precision=bf16-mixed"))
_SYNTHETIC = dict(when=lambda r: r.data.name == "synthetic", when_text="data=synthetic")
_PYCODE = dict(when=lambda r: r.data.name == "pycode", when_text="data=pycode", base=("data=pycode",))
_HF = dict(when=lambda r: r.data.name == "hf", when_text="data=hf", base=("data=hf", "data.path=json"))
_ZB_AUTO = dict(when=lambda r: r.schedule.name == AUTO_SCHEDULE, when_text=f"schedule={AUTO_SCHEDULE}",
                base=(f"schedule={AUTO_SCHEDULE}",))
_CHECKPOINTS = dict(when=lambda r: r.trainer.checkpoint_interval > 0, when_text="trainer.checkpoint_interval > 0",
                    base=("trainer.checkpoint_interval=2",))
_WANDB = dict(when=lambda r: r.logger.name == "wandb", when_text="logger=wandb",
              base=("logger=wandb", "logger.mode=disabled"))
_CP = dict(when=lambda r: r.parallelism.cp > 1, when_text="parallelism.cp > 1", base=("parallelism.cp=2",))
_LABEL = "a free label (only shown)"
PAIRED = [n for n, s in REGISTRY.items() if s.pairs]  # the schedules parallelism.overlap_dualpipe acts on


@dataclass
class MoEConfig:
    """Routed experts (model.arch=qwen3_moe; docs/moe.md). Ignored by dense architectures."""

    experts: int = key(4, ge=1, le=MAX_COUNT, **_MOE)  # routed experts per MoE layer
    top_k: int = key(2, ge=1, le="model.moe.experts", **_MOE)  # experts each token is sent to
    expert_inner: Optional[int] = key(None, ge=1, le=MAX_WIDTH, **_MOE)  # an expert's MLP width; null = n_embd
    # renormalise the k routing weights to sum to 1 (Qwen3-MoE, Mixtral)
    norm_topk_prob: bool = key(True, **_MOE)
    # Routing and balancing (framework/models/moe_routing.py; docs/moe.md "Routing and balancing").
    score: str = key("softmax", choices=("softmax", "sigmoid"), **_MOE)  # sigmoid: DeepSeek-V3
    # null (or .inf) = dropless; else ceil(cf * seq_len * k / E) per sequence and expert
    capacity_factor: Optional[float] = key(None, gt=0, inf=True, **_MOE)
    # over capacity, keep the highest-score (probs) or earliest (position) tokens
    drop_policy: str = key("probs", choices=("probs", "position"), **_MOE)
    # [{type: aux | seq_aux | z, coeff: 0.01}]
    aux_losses: list[dict[str, Any]] = key(factory=list, free="a list of dicts: framework/validate/expert.py",
                                           **_MOE)
    # auto (grouped on CUDA when it can) | loop (per-expert matmuls) | grouped
    experts_impl: str = key("auto", choices=("auto", "loop", "grouped"), **_MOE)
    bias_update_rate: float = key(0.0, ge=0, **_MOE)  # DeepSeek-V3 auxiliary-loss-free balancing: expert bias step; 0 = off


@dataclass
class ModelConfig:
    name: str = key("gpt2-tiny", free=_LABEL)
    arch: str = key("gpt2", choices=("gpt2", "llama", "qwen3_moe"))
    n_layer: int = key(2, ge=1, le=4096)
    n_embd: int = key(64, ge=1, le=MAX_WIDTH)
    n_head: int = key(4, ge=1, le="model.n_embd")
    n_kv_head: Optional[int] = key(None, ge=1, le="model.n_head")  # llama grouped-query attention; null = n_head
    n_inner: Optional[int] = key(None, ge=1, le=MAX_WIDTH)  # MLP width; null = 4 * n_embd (gpt2) / llama default
    max_positions: int = key(128, ge=1, le=MAX_WIDTH)
    vocab_size: Optional[int] = key(None, ge=1, le=1 << 24)  # null = the data's tokenizer vocabulary
    dropout: float = key(0.0, ge=0, lt=1)
    tie_embeddings: bool = True
    # hub name or local path; weights replace random init
    pretrained: Optional[str] = key(None, nonempty=True, free="a hub name or a directory: framework/validate/paths.py")
    moe: MoEConfig = field(default_factory=MoEConfig)  # qwen3_moe: the routed experts


@dataclass
class DataConfig:
    name: str = key("pycode", choices=("pycode", "synthetic", "hf"))
    seq_len: int = key(64, ge=1, le="model.max_positions")
    # "bytes" (no download) or a transformers tokenizer name / path
    tokenizer: str = key("bytes", nonempty=True, free="a tokenizer name: loaded when the data is prepared")
    max_files: Optional[int] = key(400, ge=1, le=MAX_COUNT, **_PYCODE)  # pycode: first N stdlib files (sorted); null = all
    # hf: dataset name, local dir, or loader ("json", "text")
    path: Optional[str] = key(None, nonempty=True, free="a dataset name or loader: framework/validate/paths.py", **_HF)
    # hf: local file(s) for a loader
    data_files: Optional[str] = key(None, nonempty=True, free="local files: framework/validate/paths.py", **_HF)
    text_field: str = key("text", nonempty=True, free="a column: checked on the loaded dataset", **_HF)
    split: str = key("train", nonempty=True, free="a split name: checked when the dataset loads", **_HF)
    num_samples: int = key(4096, ge=1, le=MAX_COUNT, **_SYNTHETIC)  # synthetic: number of sequences
    vocab_size: int = key(256, ge=1, le=1 << 24, **_SYNTHETIC)  # synthetic: token ids drawn from [0, vocab_size)
    # packed-token cache; null = ~/.cache/framework
    cache_dir: Optional[str] = key(None, nonempty=True, free="a directory: framework/validate/paths.py")
    # Held-out data for trainer.eval_interval (val_loss); no training step ever sees it.
    val_files: int = key(20, ge=0, le=MAX_COUNT, **_PYCODE)  # pycode: the last N stdlib files (sorted), never trained on
    # hf: a split of the dataset to evaluate on (e.g. validation) ...
    val_split: Optional[str] = key(None, nonempty=True, free="a split name: checked when the dataset loads", **_HF)
    val_fraction: float = key(0.0, ge=0, lt=1, **_HF)  # ... or this last fraction of the training split's documents, held out


@dataclass
class ParallelismConfig:
    name: str = key("single", free=_LABEL)
    dp: Optional[int] = key(1, ge=1, le=MAX_RANKS)  # null = world_size / (tp * pp * cp) (a layout search fixes the world size)
    tp: int = key(1, ge=1, le=MAX_RANKS)
    pp: int = key(1, ge=1, le=MAX_RANKS)
    # expert parallel: each MoE layer's experts split over ep ranks carved out of dp (docs/moe.md)
    ep: int = key(1, ge=1, le=MAX_RANKS)  # and divides dp: framework/validate/expert.py
    zero: int = key(0, ge=0, le=3)
    # ZeRO back end: ours (framework/parallel/zero.py) | fsdp2 (torch's fully_shard, zero 2 / 3)
    zero_impl: str = key("ours", choices=("ours", "fsdp2"))
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step in host memory (zero >= 1)
    sequence_parallel: bool = False  # tp > 1: norms / dropout on sequence shards (no-op at tp = 1)
    # dp reduction under backward (Megatron's overlap_grad_reduce): pipelines, each chunk's all-reduce
    # (ZeRO 1: reduce-scatter) after its last backward; our ZeRO at pp = 1, each unit's reduce-scatter
    # as its gradients complete. pp = 1 without ZeRO uses torch DDP, which always overlaps
    overlap_grad_reduce: bool = key(False, when=lambda r: r.parallelism.pp > 1 or (
        r.parallelism.zero > 0 and r.parallelism.zero_impl == "ours"),
        when_text="parallelism.pp > 1, or parallelism.zero >= 1 with parallelism.zero_impl=ours")
    # ZeRO 3 (ours and fsdp2): the next unit's all-gather issued as a unit starts, forward and backward
    overlap_param_gather: bool = key(False, when=lambda r: r.parallelism.zero == 3, when_text="parallelism.zero=3",
                                     base=("parallelism=zero3",))
    # context parallel: each sequence cut over cp ranks (framework/parallel/context_parallel.py);
    # gradients and ZeRO over dp x cp; checked in framework/validate/context.py
    cp: int = key(1, ge=1, le=MAX_RANKS)
    cp_comm: str = key("allgather", choices=("allgather", "ring", "a2a"), **_CP)  # K / V gathered, ringed, or heads <-> seq
    cp_balance: str = key("headtail", choices=("headtail", "contiguous"), **_CP)  # which 2 cp chunks a rank holds
    # cp_comm=ring: each pass's K / V transfer under a block's attention, its gradient's under its backward
    overlap_cp_ring: bool = key(False, when=lambda r: r.parallelism.cp > 1 and r.parallelism.cp_comm == "ring",
                                when_text="parallelism.cp > 1 and parallelism.cp_comm=ring",
                                base=("parallelism.cp=2", "parallelism.cp_comm=ring"))
    # schedules with F / B pairs (dualpipev): each pair's F and B run side by side, so one's
    # all-to-all (ep) runs under the other's compute (DualPipe's overlap; executor.py)
    overlap_dualpipe: bool = key(False, when=lambda r: r.parallelism.pp > 1 and pairs_forward_backward(r.schedule.name),
                                 when_text=f"a schedule with forward / backward pairs (schedule={'|'.join(PAIRED)})",
                                 base=("parallelism=pp2", f"schedule={PAIRED[0]}", "schedule.microbatches=4"))
    # null = dp * cp * tp * pp; set it to assert the launch size (or to derive dp)
    world_size: Optional[int] = key(None, ge=1, le=MAX_RANKS)
    # blocks -> stages: uniform | parameters | type:<regex> | [n0, n1, ...]
    partition: Any = key("uniform", free="a method or a list: checked on the meta model (validate_model)")

    @property
    def replicas(self) -> int:
        """The ranks a parameter is replicated over (per tp and pp coordinate): dp x cp. Its
        gradients are averaged, and ZeRO shards it, over them."""
        return self.dp * self.cp


@dataclass
class ScheduleConfig:
    # a name in the schedule registry (framework/parallel/pipeline/schedules/)
    name: str = key(DEFAULT_SCHEDULE, free="the registry's names: framework/validate/schedule.py")
    # per step per dp rank; with pp = 1 accumulation steps (csv: null = the file's)
    microbatches: Optional[int] = key(1, ge=1, le=MAX_MICROBATCHES)
    # model chunks per pipeline rank (as the schedule declares; csv: null = file's)
    virtual_stages: Optional[int] = key(1, ge=1, le=1 << 10)
    # name=csv: a schedule in torch's compute-only CSV format (one row per pp rank)
    csv: Optional[str] = key(None, nonempty=True, free="a file: read by framework/parallel/pipeline/schedules/"
                             "csv_format.py", when=lambda r: r.schedule.name == "csv", when_text="schedule=csv",
                             base=("schedule=csv",))
    # Python files / modules that register more schedules
    modules: list = key(factory=list, free="files or modules: imported by framework/validate/schedule.py")
    # zb-auto: most micro-batches alive per rank (null = pp)
    memory_limit_microbatches: Optional[int] = key(None, ge=1, le="schedule.microbatches", **_ZB_AUTO)
    # zb-auto: {F, I, W: seconds (or a list per pp rank), comm}; null = sim.from's
    op_times: Optional[dict] = key(None, free="a dict of durations: framework/validate/schedule.py", **_ZB_AUTO)


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
    # timer's: framework/metrics/comm_timer.py), one key per dimension so one run can slow both
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
class SearchConfig:
    """Layout searches (conf/hparams_search/layout.yaml) and any sweep."""

    # The dry-run planner's per-rank model-state estimate (framework.launch.plan) above this is a
    # rejected job, before any rank starts; null = no budget.
    memory_budget_bytes: Optional[float] = key(None, gt=0)
    # What a failed or rejected job returns to a sweeper; null = NaN (Optuna: a failed trial).
    failed_value: Optional[float] = key(None, free="any finite score")
    # run: launch every candidate | simulate: predict each from sim.from (no launch), then
    # launch only the top_k by predicted step time (framework/sim/sweep.py)
    mode: str = key("run", choices=("run", "simulate"))
    top_k: int = key(1, ge=1, le=MAX_COUNT, when=lambda r: r.search.mode == "simulate",
                     when_text="search.mode=simulate")


@dataclass
class SweepConfig:
    """Repeats of a `-m` sweep (framework/launch/repeats.py, framework/report/repeats.py)."""

    # each configuration run this many times, interleaved (A B C A B C); the report gives
    # intervals and says which configurations are not distinguishable
    repeats: int = key(1, ge=1, le=100)
    repeat: int = key(0, ge=0, lt="sweep.repeats")  # this job's repeat (set by the sweep)


@dataclass
class SimConfig:
    """The simulator (docs/simulator.md). The command-line key is `sim.from`, stored as
    `source` (a Python keyword cannot name a field)."""

    # a finished pipeline (or pp 1, ep > 1) job whose calibration.json predicts this run
    source: Optional[str] = key(None, nonempty=True, free="a job directory: its calibration.json is read before launch")


_HW = dict(when=lambda r: r.hardware.name != "none", when_text="hardware=<a profile in conf/hardware/>",
           base=("hardware=h100-sxm",))
_TABLE = "a table or map: framework/sim/cost/hardware.py checks its shape"


@dataclass
class HardwareConfig:
    """The cost model's device and cluster (conf/hardware/; docs/cost_model.md): none = no
    cost model. Datasheet profiles state efficiencies; measured ones (python -m
    framework.sim.bench) tables."""

    name: str = key("none", free=_LABEL)
    source: str = key("", free=_LABEL, **_HW)  # where its numbers come from
    device_name: str = key("", free=_LABEL, **_HW)
    peak_source: str = key("", free=_LABEL, **_HW)
    gpus: int = key(8, ge=1, le=MAX_RANKS, **_HW)  # in the cluster (a layout's world size must fit)
    gpus_per_node: int = key(8, ge=1, le=1024, **_HW)
    memory_gib: float = key(80.0, gt=0, le=1 << 20, **_HW)  # per GPU
    memory_GBps: float = key(1000.0, gt=0, le=1e6, **_HW)  # sustained copy
    kernel_us: float = key(5.0, ge=0, le=1e6, **_HW)  # a kernel's floor
    host_overlaps: bool = key(True, **_HW)  # GPU: host and kernels overlap; CPU: they add
    attention_efficiency: float = key(0.5, gt=0, le=1, **_HW)  # of peak, without an attention table
    peak_tflops: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # dtype -> datasheet TFLOP/s
    gemm_tflops: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # dtype -> [[m, n, k, TFLOP/s], ...]
    gemm_efficiency: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # {max, half_dim} without a table
    memory_bound_GBps: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # op -> GB/s
    attention_tflops: list[Any] = key(factory=list, free=_TABLE, **_HW)  # [[s, head_dim, fwd, fwd+bwd], ...]
    host_us: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # arch -> {F, B}; optimizer_tensor
    links: dict[str, Any] = key(factory=dict, free=_TABLE, **_HW)  # intra / inter -> {alpha_us, GBps}


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


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: dict[str, Any] = key(factory=lambda: {"_target_": "torch.optim.AdamW", "lr": 3e-4},
                                    free="torch's arguments: framework/validate/optimizer.py builds it")
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    device: str = key("auto", choices=("auto", "cpu", "cuda"))  # resolved once in framework/device.py
    # local: start the ranks here | external: write the job dir for torchrun
    launcher: str = key("local", choices=("local", "external"))
    dry_run: bool = False  # print and write plan.json; start no rank
    # summary.json key returned to a Hydra sweeper (framework/report/sinks.py says what each means)
    objective: str = key("loss", choices=("loss", "tokens_per_s", "step_time_s", "mfu", "memory_peak_bytes",
                                          "bubble_fraction"))

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.cp * p.tp * p.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all dp ranks."""
        return self.trainer.micro_batch_size * self.schedule.microbatches * self.parallelism.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.data.seq_len


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config into the schema; a wrong key or type is a ConfigError."""
    schema = _schema()
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


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema as an OmegaConf node, built once (merge copies it, never changes it)."""
    return OmegaConf.structured(RunConfig)


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
    parallelism.dp = world_size / (tp * pp * cp) when dp is null, and with
    trainer.global_batch_size either schedule.microbatches (micro_batch_size set: the
    default) or trainer.micro_batch_size (null). Sizes that are not positive are left for
    framework.validate to name."""
    p, t, s = run.parallelism, run.trainer, run.schedule
    _clamp_skip_first(run)
    _sizes_from_csv(s)
    _recompute(t)
    if p.dp is None:
        if p.world_size is None or min(p.tp, p.pp, p.cp) < 1 or p.world_size % (p.tp * p.pp * p.cp):
            raise ConfigError("parallelism.dp", None, f"null derives dp = world_size / (tp * pp * cp), but world_size = "
                              f"{p.world_size} and tp * pp * cp = {p.tp}*{p.pp}*{p.cp}",
                              "set parallelism.dp, or a parallelism.world_size divisible by tp * pp * cp")
        p.dp = p.world_size // (p.tp * p.pp * p.cp)
    g = t.global_batch_size
    if g is None:
        if t.micro_batch_size is None:
            raise ConfigError("trainer.micro_batch_size", None, "null derives it from trainer.global_batch_size, "
                              "which is null too", "set trainer.micro_batch_size, or trainer.global_batch_size")
        return
    if not 1 <= g <= MAX_GLOBAL_BATCH or p.dp < 1:
        return  # framework.validate names it
    if t.micro_batch_size is None:
        t.micro_batch_size = _share(g, s.microbatches, p.dp, "microbatches", "trainer.micro_batch_size",
                                    "set trainer.micro_batch_size")
    else:
        s.microbatches = _share(g, t.micro_batch_size, p.dp, "micro_batch_size", "schedule.microbatches",
                                "change trainer.micro_batch_size")
        if s.microbatches > MAX_MICROBATCHES:
            raise ConfigError("trainer.global_batch_size", g, f"derives schedule.microbatches={s.microbatches} "
                              f"(micro_batch_size {t.micro_batch_size} x dp {p.dp}), above its limit "
                              f"{MAX_MICROBATCHES}", "a smaller global batch, or a larger trainer.micro_batch_size")


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


def _recompute(t) -> None:
    """trainer.activation_checkpointing=true is trainer.recompute=full by its old name: each is
    set from the other, so code reading either sees the same mode."""
    if t.activation_checkpointing and t.recompute == "selective":
        raise ConfigError("trainer.activation_checkpointing", True, "is the old name of trainer.recompute=full and "
                          "contradicts trainer.recompute=selective",
                          "drop trainer.activation_checkpointing and set trainer.recompute=full or selective")
    if t.activation_checkpointing:
        t.recompute = "full"
    t.activation_checkpointing = t.recompute == "full"


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
    """Workers load the resolved config the launching process wrote (no Hydra here). A file
    that is not YAML (a damaged job directory given to sim.from or the simulator) is a
    ConfigError naming the file."""
    import yaml

    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(path, None, f"is not a YAML config ({type(e).__name__})",
                          "give a job directory whose config.yaml this framework wrote") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(path, None, "is not a YAML mapping of config keys",
                          "give a job directory whose config.yaml this framework wrote")
    return load_config(cfg)
