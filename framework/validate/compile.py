"""trainer.compile (framework/models/compile.py): what compiled blocks compose with.

Proved equal to eager in fp64, with no recompilation after the first step
(tests/test_compile.py; the layouts measured one by one: experiments/compile_fp8): dp with
ZeRO 0-2, FSDP2, tp + SP, pp (flush, a split-backward and an asynchronous schedule), cp
(all-gather, ring), full and selective recomputation. Refused before launch, with the
reason: what recompiles every step or has not been proved.
"""

from __future__ import annotations

from framework.config import ConfigError, RunConfig


def check_compile(run: RunConfig) -> None:
    t, p = run.trainer, run.parallelism
    if t.compile == "none":
        return
    fix = "set trainer.compile=none"
    if run.metrics.skip_first < 1:
        raise ConfigError("metrics.skip_first", run.metrics.skip_first, "with trainer.compile=blocks the first step "
                          "compiles every block (seconds to minutes): it would be inside the measured steps",
                          "set metrics.skip_first >= 1 (the default is 3)")
    if p.zero == 3 and p.zero_impl != "fsdp2":
        raise ConfigError("parallelism.zero_impl", p.zero_impl, "with trainer.compile=blocks: our ZeRO 3 gathers and "
                          "frees each unit's parameters every micro-batch, which torch.compile's guards see as new "
                          "tensors: it recompiled in every measured step (21, 2, 1 frames in steps 1-3)",
                          f"set parallelism.zero_impl=fsdp2 (proved), or {fix}")
    if run.parallelism.cp > 1 and run.parallelism.cp_comm == "a2a":
        raise ConfigError("trainer.compile", t.compile, "with parallelism.cp_comm=a2a: Ulysses' all-to-alls inside "
                          "compiled blocks are not proved equal to eager yet (the all-gather and the ring are)",
                          f"use parallelism.cp_comm=allgather or ring, or {fix}")
    if run.model.arch == "qwen3_moe":
        raise ConfigError("trainer.compile", t.compile, "with a MoE model: the routing's per-expert token counts "
                          "change every step and torch.compile recompiles on them (ep 1: 24, 4, 0 frames in steps "
                          "1-3; ep 2: 87, 43, 3), so a measured step would include compilation (and DualPipe's "
                          "overlap, MoE only, with it)", fix)
