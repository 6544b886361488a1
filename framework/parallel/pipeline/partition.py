"""Blocks -> pipeline stages. The embedding lives on the first stage, the head on the last.

Methods (`parallelism.partition`):
- `uniform`: contiguous, sizes differing by at most one, earlier stages taking the extra.
- `parameters`: contiguous, balancing each stage's parameter count (embedding and head
  included, as DeepSpeed's `partition_method="parameters"`).
- `type:<regex>`: balance the number of blocks whose class name matches (DeepSpeed's
  `type:GPT2Block`); blocks that do not match weigh nothing.
- an explicit list `[3, 5, 5, 1]`: blocks per stage (torchgpipe's `balance`).
Every stage must hold at least one block.
"""

from __future__ import annotations

import re
from typing import Any, Sequence


class PartitionError(ValueError):
    pass


def uniform(n_blocks: int, stages: int) -> list[range]:
    if stages > n_blocks:
        raise PartitionError(f"{stages} stages for {n_blocks} blocks: a stage would hold no block")
    base, extra = divmod(n_blocks, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def from_balance(balance: Sequence[int], n_blocks: int, stages: int) -> list[range]:
    if len(balance) != stages or sum(balance) != n_blocks or min(balance) < 1:
        raise PartitionError(f"balance {list(balance)} must list {stages} positive block counts summing to {n_blocks}")
    out, start = [], 0
    for size in balance:
        out.append(range(start, start + size))
        start += size
    return out


def balanced(weights: Sequence[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[range]:
    """Contiguous split minimising the heaviest stage (exact, by dynamic programming)."""
    n = len(weights)
    if stages > n:
        raise PartitionError(f"{stages} stages for {n} blocks: a stage would hold no block")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int, s: int) -> float:  # blocks i..j-1 on stage s
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][j]: first j blocks on s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                c = max(best[s - 1][i], cost(i, j, s - 1))
                if c < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][j], j))
        j = cut[s][j]
    return bounds[::-1]


def partition(method: Any, blocks: Sequence, stages: int, embedding_params: int = 0, head_params: int = 0) -> list[range]:
    n = len(blocks)
    if isinstance(method, (list, tuple)):
        return from_balance([int(b) for b in method], n, stages)
    if method == "uniform":
        return uniform(n, stages)
    if method == "parameters":
        weights = [sum(p.numel() for p in b.parameters()) for b in blocks]
        return balanced(weights, stages, embedding_params, head_params)
    if isinstance(method, str) and method.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1.0 if pattern.search(_block_type(b)) else 0.0 for b in blocks]
        if not any(weights):
            raise PartitionError(f"no block type matches {method[5:]!r} (types: {sorted({_block_type(b) for b in blocks})})")
        return balanced(weights, stages)
    raise PartitionError(f"unknown partition method {method!r}")


def _block_type(block) -> str:
    """The transformers layer class (GPT2Block, LlamaDecoderLayer), not our wrapper's."""
    return type(getattr(block, "layer", block)).__name__
