"""`trainer.compile=blocks`: each transformer block compiled with torch.compile, as
torchtitan's `apply_compile` does (per block, so one compiled graph serves every block of a
shape, and the parallel layers between blocks stay eager).

Order: after the model is cut into stages and its blocks are wrapped (tensor-parallel
linears, context parallelism's attention, selective recomputation's wrapped core), before
the first forward; `nn.Module.compile` compiles the block in place (its parameters and
state-dict names unchanged, so checkpoints and ZeRO's flat views are the eager run's).
Full recomputation (`SplitLM`) checkpoints the compiled block. What cannot be traced (a
collective inside a custom autograd function) breaks the graph and runs eagerly: the values
are the eager run's either way (tests/test_compile.py, fp64).

Compilation happens in the first forward and backward of each block shape: the steps that
compile are reported (framework/metrics/compiles.py: `compiles` per step, frames dynamo
compiled; `compile_s`, torch's own wall time of its compiles) and left out of the measured medians
(validate/compile.py refuses metrics.skip_first=0); after warm-up `compiles` stays 0, or
the row says which step recompiled (a resumed run compiles again in its first step: with
fewer steps left than metrics.skip_first its summary's `compiles_measured` shows it).
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module, backend: str) -> int:
    """Compile every transformer block of `model` (a SplitLM: `blocks`) in place; returns
    how many were marked."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"trainer.compile=blocks found no transformer blocks in {type(model).__name__}")
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)

