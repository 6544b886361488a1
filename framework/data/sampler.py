"""dp-sharded sampling: which samples each dp rank reads at each step.

Training is one stream of epochs, each a seeded permutation of the samples. Step k takes
stream positions [k*G, (k+1)*G) for the global batch G; dp rank r takes the r-th contiguous
slice of it, cut into micro-batches. So every dp layout with the same G sees the same
samples in the same step as one process does, and within an epoch no sample is dropped or
repeated across ranks (a step may straddle an epoch boundary instead of dropping the
epoch's tail; such a step can then meet a sample once from each epoch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from framework.data.tokens import TokenData


class ShardedSampler:
    """Sample indices for one dp rank: step -> list of micro-batches (see the module docstring)."""

    def __init__(self, num_samples: int, micro_batch_size: int, microbatches: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.n, self.mbs, self.m = num_samples, micro_batch_size, microbatches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch = micro_batch_size * microbatches * dp_size
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs when G <= n
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def stream(self, start: int, count: int) -> np.ndarray:
        pos = np.arange(start, start + count)
        return np.array([self._perm(int(p // self.n))[p % self.n] for p in pos], dtype=np.int64)

    def step_indices(self, step: int) -> list[np.ndarray]:
        per_rank = self.mbs * self.m
        start = step * self.global_batch + self.dp_rank * per_rank
        idx = self.stream(start, per_rank)
        return [idx[j * self.mbs:(j + 1) * self.mbs] for j in range(self.m)]

    def microbatches(self, data: TokenData, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.step_indices(step):
            yield data.batch(idx)
