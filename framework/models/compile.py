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
compile are reported (`compiles` per step: frames dynamo compiled; `compile_s`: their
seconds, torch's own count) and left out of the measured medians (metrics.skip_first is
raised to cover them: framework/train/loop.py); after warm-up `compiles` stays 0, or the
run says which step recompiled.
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


def compiled_frames() -> tuple[int, float]:
    """(frames dynamo has compiled so far, seconds spent compiling) in this process."""
    from torch._dynamo.utils import counters, compile_times

    frames = int(counters["frames"]["ok"])
    seconds = 0.0
    try:
        table = compile_times(repr="csv", aggregate=True)
        names, values = table
        seconds = sum(float(v) for v in values)
    except Exception:  # torch's table changed shape: the count still stands
        pass
    return frames, seconds
