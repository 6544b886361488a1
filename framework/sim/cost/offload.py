"""ZeRO-Offload's price and ZeRO-Infinity's capacities on a hardware profile's host side.

The step, as framework/optim/master.py runs `parallelism.offload_optimizer=true` (Ren et
al., 2021), all on the critical path (no overlap with the backward, as DeepSpeed's
`overlap_comm` would give): the rank's gradient shard goes to the host over the GPU's link
(`host_link_GBps`, one way), the host steps AdamW over it (`host_adamw_GBps`: bytes read and
written per second for one GPU's share of the host), the updated parameters come back over
the link. Per element of the shard, in the parameters' dtype p (2 for 16-bit, 4, 8 in fp64
verification) and the states' s (4, 8 in fp64): p down, p up, and on the host the gradient's
copy in s written, scaled in place by the clip and loss-scale factor (read and written: the
default trainer.grad_clip=1.0 always passes one) and read by the step, the master, m and v read
and written: 10 s. With the NVMe tier
(`parallelism.offload_device=nvme`, framework/optim/swap.py) the states (m and v: 2 s per
element) are read from the node's drives and written back each step, at the drives' rates
shared by the node's GPUs, before and after the host's step: the steady state of states
larger than the page cache (smaller ones stay cached and cost no reads).

Capacity (`largest_params`): the parameters one node of the profile holds the model states of,
ZeRO 3 over its GPUs, by the ZeRO papers' accounting per parameter (2 + 2 bytes of 16-bit
parameters and gradients, K = 12 of fp32 master, m and v: 16 in all; Rajbhandari et al.,
2020, sec. 5) and nothing else (no activations, buffers, working sets or fragmentation): an
upper bound, one number per tier:
- none: all 16 bytes in the node's GPU memory;
- cpu: this framework's ZeRO-Offload: the 12 in host memory, parameters and gradients (4) on
  the GPUs (ZeRO-Offload's own streams the gradients to the host too: 2 on the GPUs);
- infinity-cpu, infinity-nvme: ZeRO-Infinity's (Rajbhandari et al., 2021) with all 16 bytes in
  host memory, or on the node's NVMe; priced, not run by this framework.
"""

from __future__ import annotations

from framework.config import ConfigError

STEP_ACCESSES = 10  # the host step's state-sized reads and writes per element (docstring)
NVME_STATES = 2  # AdamW's m and v: what the NVMe tier keeps on the drive (the masters stay in host memory)
STATE_BYTES = 12  # fp32 master, m, v per parameter
WORKING_BYTES = 4  # 16-bit parameters and gradients per parameter


def offload_step_s(prof, shard: float, param_bytes: int, tensors: float, nvme_ranks: int = 0) -> float:
    """Seconds of the offloaded update of a rank's `shard` parameters (`tensors` of them
    copied one by one: the profile's per-tensor host time each); `nvme_ranks`: with the NVMe
    tier, the ranks of a node whose states share its drives (0: host memory)."""
    if prof.host_link_GBps is None or prof.host_adamw_GBps is None:
        raise ConfigError("hardware.host_link_GBps", prof.host_link_GBps,
                          f"profile {prof.name} has no host side: parallelism.offload_optimizer=true cannot be priced",
                          "add host_link_GBps and host_adamw_GBps to the profile (docs/cost_model.md#offload)")
    state_bytes = 8 if param_bytes == 8 else 4
    link = 2 * shard * param_bytes / (prof.host_link_GBps * 1e9)
    host = shard * STEP_ACCESSES * state_bytes / (prof.host_adamw_GBps * 1e9)
    out = link + host + tensors * prof.host_us.get("optimizer_tensor", 0.0) * 1e-6
    if nvme_ranks:
        if prof.nvme_read_GBps is None or prof.nvme_write_GBps is None:
            raise ConfigError("hardware.nvme_read_GBps", prof.nvme_read_GBps,
                              f"profile {prof.name} has no NVMe rates: parallelism.offload_device=nvme cannot be priced",
                              "add nvme_read_GBps and nvme_write_GBps to the profile (docs/cost_model.md#offload)")
        states = shard * NVME_STATES * state_bytes * nvme_ranks  # the node's ranks share its drives
        out += states / (prof.nvme_read_GBps * 1e9) + states / (prof.nvme_write_GBps * 1e9)
    return out


def param_drive_s(prof, shard: float, param_bytes: int, nvme_ranks: int, microbatches: int) -> tuple[float, float]:
    """ZeRO 3's parameter slices on the drives (`parallelism.offload_params`, param_swap.py):
    (reads, writes) in seconds per step for the `shard` parameters of each of a node's
    `nvme_ranks` ranks: each slice read before each of its gathers (a forward and a backward
    per micro-batch: 2 x microbatches) and written once after the update, at the node's rates."""
    node = shard * param_bytes * nvme_ranks
    return 2 * microbatches * node / (prof.nvme_read_GBps * 1e9), node / (prof.nvme_write_GBps * 1e9)


def checkpoint_copy_s(prof, numel: int, act_bytes: int, blocks: int) -> float:
    """Pa+cpu (trainer.cpu_checkpointing): one pass's copies of `blocks` checkpoint slices of
    `numel` elements over the host link, down in the forward or up in the backward; issued on
    the compute stream (framework/comm/activation_partition.py), so in its order."""
    if prof.host_link_GBps is None:
        raise ConfigError("hardware.host_link_GBps", None,
                          f"profile {prof.name} has no host side: trainer.cpu_checkpointing=true cannot be priced",
                          "add host_link_GBps to the profile (docs/cost_model.md#offload)")
    return blocks * numel * act_bytes / (prof.host_link_GBps * 1e9)


def largest_params(prof, offload: str) -> float:
    """The most parameters whose model states one node of `prof` holds, ZeRO 3 over its GPUs,
    with `offload` none | cpu | infinity-cpu | infinity-nvme (module docstring); 0 where the
    profile lacks the tier."""
    gpus = prof.memory_gib * 2 ** 30 * prof.gpus_per_node
    host = (prof.host_memory_gib or 0.0) * 2 ** 30
    nvme = (prof.nvme_gib or 0.0) * 2 ** 30
    tiers = {"none": gpus / (STATE_BYTES + WORKING_BYTES), "cpu": min(gpus / WORKING_BYTES, host / STATE_BYTES),
             "infinity-cpu": host / (STATE_BYTES + WORKING_BYTES), "infinity-nvme": nvme / (STATE_BYTES + WORKING_BYTES)}
    if offload not in tiers:
        raise ValueError(f"offload {offload!r}: one of {', '.join(tiers)}")
    return tiers[offload]
