"""RunConfig, the whole schema: every group, and the `search`, `sweep`, `sim` and `hardware`
groups that belong to no other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.config.model import DataConfig, ModelConfig
from framework.config.parallelism import ParallelismConfig, ScheduleConfig
from framework.config.rules import _HW, _LABEL, _TABLE, MAX_COUNT, MAX_RANKS, key
from framework.config.trainer import DebugConfig, LoggerConfig, MetricsConfig, PrecisionConfig, TrainerConfig


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
    # The host side (ZeRO-Offload's and ZeRO-Infinity's prices; null: not given, offload not priced):
    host_link_GBps: Optional[float] = key(None, gt=0, le=1e6, **_HW)  # GPU <-> host, one way, per GPU, sustained
    host_adamw_GBps: Optional[float] = key(None, gt=0, le=1e6, **_HW)  # the host's optimizer step, bytes/s per GPU
    host_memory_gib: Optional[float] = key(None, gt=0, le=1 << 30, **_HW)  # per node
    nvme_read_GBps: Optional[float] = key(None, gt=0, le=1e6, **_HW)  # per node, sequential
    nvme_write_GBps: Optional[float] = key(None, gt=0, le=1e6, **_HW)  # per node, sequential
    nvme_gib: Optional[float] = key(None, gt=0, le=1 << 40, **_HW)  # per node


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
