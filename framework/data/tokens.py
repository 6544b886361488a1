"""Token data as ranks hold it: the verified cache memory-mapped (never read whole), or
synthetic tokens drawn from the run's seed; sample i is tokens[i*T : i*T + T + 1].

Synthetic held-out tokens are `eval_batches` global batches drawn from a seed stream the
training tokens never use.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from framework.config import RunConfig

HELDOUT_SEED_STREAM = 1  # synthetic held-out tokens: default_rng([seed, 1]), training's is default_rng(seed)


def _mmap_tokens(tokens_path: str) -> np.ndarray:
    """Memory-map the cache `prepare` verified; a failure names the file (numpy's does not)."""
    try:
        return np.load(tokens_path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise RuntimeError(f"token cache {tokens_path} cannot be loaded ({e}); "
                           "it changed after prepare verified it: rerun to rebuild it") from e


class TokenData:
    """Packed sequences: sample i is tokens[i*T : i*T + T + 1] -> (inputs, next-token labels)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    @classmethod
    def load(cls, run: RunConfig, tokens_path: Optional[str]) -> TokenData:
        d = run.data
        if tokens_path is None:
            rng = np.random.default_rng(run.trainer.seed)
            tokens = rng.integers(0, d.vocab_size, size=d.num_samples * d.seq_len + 1, dtype=np.int64)
        else:
            tokens = _mmap_tokens(tokens_path)
        return cls(tokens, d.seq_len)

    @classmethod
    def load_heldout(cls, run: RunConfig, val_tokens_path: Optional[str], val_num_samples: int) -> TokenData:
        """The held-out tokens `prepare` made; synthetic ones are drawn here, from a seed
        stream the training tokens never use."""
        d = run.data
        if val_tokens_path is None:
            rng = np.random.default_rng([run.trainer.seed, HELDOUT_SEED_STREAM])
            tokens = rng.integers(0, d.vocab_size, size=val_num_samples * d.seq_len + 1, dtype=np.int64)
        else:
            tokens = _mmap_tokens(val_tokens_path)
        return cls(tokens, d.seq_len)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64) for i in indices])
        x = torch.from_numpy(rows[:, :-1].copy())  # (B, T)
        y = torch.from_numpy(rows[:, 1:].copy())  # (B, T)
        return x, y
