"""Blocks -> pipeline stages. The embedding lives on the first stage, the head on the last.

Only `uniform` exists until the pipeline issue adds `parameters`, `type:<regex>` and an
explicit balance list; the dry run already uses it to say which blocks each stage holds.
"""

from __future__ import annotations


def uniform(n_blocks: int, stages: int) -> list[range]:
    """Contiguous ranges, sizes differing by at most one, earlier stages taking the extra."""
    if stages > n_blocks:
        raise ValueError(f"{stages} stages for {n_blocks} blocks: a stage would hold no block")
    base, extra = divmod(n_blocks, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
