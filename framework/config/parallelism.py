"""The `parallelism` and `schedule` groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from framework.config.rules import _CP, _LABEL, _ZB_AUTO, MAX_MICROBATCHES, MAX_RANKS, PAIRED, key
from framework.schedules.base import DEFAULT as DEFAULT_SCHEDULE
from framework.schedules.base import pairs_forward_backward


_OFFLOAD = dict(when=lambda r: r.parallelism.offload_optimizer, when_text="parallelism.offload_optimizer=true",
                base=("parallelism.zero=1", "parallelism.offload_optimizer=true"))
_NVME = dict(when=lambda r: r.parallelism.states_on_drive,
             when_text="parallelism.offload_device=nvme",
             base=(*_OFFLOAD["base"], "parallelism.offload_device=nvme", "parallelism.nvme_path=/tmp/offload"))

_PARAMS = dict(when=lambda r: _NVME["when"](r) and r.parallelism.zero == 3 and r.parallelism.zero_impl == "ours",
               when_text="parallelism.offload_device=nvme with parallelism.zero=3 and parallelism.zero_impl=ours",
               base=("parallelism=zero3", "parallelism.offload_optimizer=true", "parallelism.offload_device=nvme",
                     "parallelism.nvme_path=/tmp/offload"))


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
    # where the offloaded optimizer states live: cpu (host memory) | nvme (ZeRO-Infinity: a file under
    # nvme_path, stepped unit by unit through host buffers; the masters stay in host memory: optim/swap.py)
    offload_device: str = key("cpu", choices=("cpu", "nvme"), **_OFFLOAD)
    nvme_path: Optional[str] = key(None, nonempty=True, free="a directory on the drive (created if absent)", **_NVME)
    # ZeRO-Infinity's parameter offload: each rank's ZeRO 3 parameter slices on the drive too, read
    # before each unit's all-gather (the next one ahead), written after the update (optim/param_swap.py)
    offload_params: bool = key(False, **_PARAMS)
    sequence_parallel: bool = False  # tp > 1: norms / dropout on sequence shards (no-op at tp = 1)
    # ZeRO-R's constant-size buffers (CB): every fused gradient reduction (DDP's buckets, our ZeRO's
    # reduce-scatters, the pipeline's dp all-reduce) through buffers of this many MiB, whatever the
    # model's size; null: each its own (DDP 25, a ZeRO unit whole, a pipeline's dense buffer whole)
    bucket_mb: Optional[float] = key(None, gt=0, le=1 << 20)
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

    @property
    def states_on_drive(self) -> bool:
        """ZeRO-Infinity's NVMe tier holds the optimizer's states (framework/optim/swap.py)."""
        return self.offload_optimizer and self.offload_device == "nvme"

    @property
    def params_on_drive(self) -> bool:
        """And ZeRO 3's parameter slices too (`offload_params`, framework/optim/param_swap.py)."""
        return self.states_on_drive and self.offload_params and self.zero == 3 and self.zero_impl == "ours"


@dataclass
class ScheduleConfig:
    # a name in the schedule registry (framework/schedules/)
    name: str = key(DEFAULT_SCHEDULE, free="the registry's names: framework/validate/schedule.py")
    # per step per dp rank; with pp = 1 accumulation steps (csv: null = the file's)
    microbatches: Optional[int] = key(1, ge=1, le=MAX_MICROBATCHES)
    # model chunks per pipeline rank (as the schedule declares; csv: null = file's)
    virtual_stages: Optional[int] = key(1, ge=1, le=1 << 10)
    # name=csv: a schedule in torch's compute-only CSV format (one row per pp rank)
    csv: Optional[str] = key(None, nonempty=True, free="a file: read by framework/schedules/"
                             "csv_format.py", when=lambda r: r.schedule.name == "csv", when_text="schedule=csv",
                             base=("schedule=csv",))
    # Python files / modules that register more schedules
    modules: list = key(factory=list, free="files or modules: imported by framework/validate/schedule.py")
    # zb-auto: most micro-batches alive per rank (null = pp)
    memory_limit_microbatches: Optional[int] = key(None, ge=1, le="schedule.microbatches", **_ZB_AUTO)
    # zb-auto: {F, I, W: seconds (or a list per pp rank), comm}; null = sim.from's
    op_times: Optional[dict] = key(None, free="a dict of durations: framework/validate/schedule.py", **_ZB_AUTO)
