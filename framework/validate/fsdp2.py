"""`parallelism.zero_impl=fsdp2` (framework/parallel/fsdp2.py): what it composes with, checked
before launch. Each rejection says why; `zero_impl=ours` supports every case named here."""

from __future__ import annotations

from framework.config import ConfigError, RunConfig
from framework.precision import policy_of

ZERO_IMPLS = ("ours", "fsdp2")


def check_fsdp2(run: RunConfig) -> None:
    p, key = run.parallelism, "parallelism.zero_impl"
    if p.zero == 0:
        raise ConfigError(key, p.zero_impl, "chooses the ZeRO back end, and parallelism.zero=0 is plain data "
                          "parallelism (DDP): nothing for FSDP2 to shard", "set parallelism.zero=2 or 3, or zero_impl=ours")
    if p.zero == 1:
        raise ConfigError("parallelism.zero", 1, "FSDP2 always shards the parameters (its optimizer steps the "
                          "sharded DTensors): it has no optimizer-state-only stage",
                          "use parallelism.zero=2 or 3 with zero_impl=fsdp2, or zero_impl=ours for ZeRO-1")
    if p.pp > 1:
        raise ConfigError(key, p.zero_impl, f"the pipeline runner (parallelism.pp={p.pp}) drives zero.py's units "
                          "itself, and FSDP2's ZeRO-2/3 would reduce-scatter each micro-batch's gradients of a "
                          "pipeline (as zero.py's stages 2-3, rejected with pp > 1 too)",
                          "use pp=1 (dp and tp) with fsdp2, or zero_impl=ours with parallelism.zero=1 and pp")
    if p.offload_optimizer:
        raise ConfigError("parallelism.offload_optimizer", True, "FSDP2's host offload (CPUOffloadPolicy) moves "
                          "parameters and gradients too and is not wired here",
                          "use zero_impl=ours for ZeRO-Offload, or offload_optimizer=false")
    if policy_of(run).loss_scaling:
        raise ConfigError("trainer.precision", run.trainer.precision, "dynamic loss scaling is built for "
                          "zero_impl=ours only (its overflow check and unscale read zero.py's flat shards, not "
                          "FSDP2's DTensor gradients)", "use bf16-mixed, fp32 or bf16-autocast with fsdp2, or "
                          "zero_impl=ours")
    if p.sequence_parallel and p.tp > 1:
        raise ConfigError("parallelism.sequence_parallel", True, "the tp sum of the replicated parameters' "
                          "gradients (tensor_parallel.sync_replicated_grads) flattens plain tensors, and FSDP2's "
                          "gradients are DTensors", "use sequence_parallel=false with fsdp2, or zero_impl=ours")
    if run.trainer.recompute != "none":
        raise ConfigError("trainer.recompute", run.trainer.recompute, "not yet verified against the single process "
                          "with zero_impl=fsdp2 (the recomputed forward runs inside FSDP2's backward hooks)",
                          "set trainer.recompute=none, or use zero_impl=ours (zero 2)")
