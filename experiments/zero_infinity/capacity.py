"""The planning line: the most parameters one node trains the model states of, per offload
tier (framework/sim/cost/offload.py's largest_params: ZeRO 3 over the node's GPUs, 16 bytes of
model states per parameter by the ZeRO papers' accounting, nothing else: an upper bound),
beside the ZeRO-Offload and ZeRO-Infinity papers' claims.

Usage (repository root, CPU, a second): python experiments/zero_infinity/capacity.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from omegaconf import OmegaConf  # noqa: E402

from framework.sim.cost.hardware import Profile  # noqa: E402
from framework.sim.cost.offload import largest_params  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf" / "hardware"
TIERS = ("none", "cpu", "infinity-cpu", "infinity-nvme")


def profile(name: str) -> Profile:
    d = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    for base in d.pop("defaults", []):
        if base != "_self_":
            d = {**OmegaConf.to_container(OmegaConf.load(CONF / f"{base}.yaml")), **d}
    return Profile.from_dict(d)


# The papers' machines, from their datasheets: a DGX-2 (16 V100 32 GB, 1.5 TB of system
# memory, 30 TB of NVMe: 8 x 3.84 TB) and one V100 32 GB in a host with enough memory.
DGX2 = Profile(name="dgx-2", peak_tflops={"fp16": 125.0}, memory_GBps=900.0, kernel_us=5.0, memory_gib=32e9 / 2 ** 30,
               gpus_per_node=16, host_memory_gib=1.5e12 / 2 ** 30, nvme_gib=30.72e12 / 2 ** 30)
V100 = Profile(name="one V100 32 GB", peak_tflops={"fp16": 125.0}, memory_GBps=900.0, kernel_us=5.0,
               memory_gib=32e9 / 2 ** 30, gpus_per_node=1, host_memory_gib=1.5e12 / 2 ** 30)
CLAIMS = {"dgx-2": "ZeRO-Infinity: fine-tunes 1 trillion parameters on one DGX-2 (NVMe tier)",
          "one V100 32 GB": "ZeRO-Offload: trains 13 billion parameters on one V100 (gradients on the host too)"}

print("| node | GPUs x GiB | host GiB | NVMe GiB | " + " | ".join(f"{t} (B params)" for t in TIERS) + " | the papers |")
print("|---|---|---|---|" + "---|" * len(TIERS) + "---|")
for prof in [profile("h200"), profile("h100-sxm"), profile("a100-dgx"), DGX2, V100]:
    row = [f"{largest_params(prof, t) / 1e9:,.1f}" for t in TIERS]
    print(f"| {prof.name} | {prof.gpus_per_node} x {prof.memory_gib:.1f} | {prof.host_memory_gib or 0:,.0f} | "
          f"{prof.nvme_gib or 0:,.0f} | " + " | ".join(row) + f" | {CLAIMS.get(prof.name, '-')} |")
