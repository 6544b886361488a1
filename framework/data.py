"""Corpora, tokenizers, packing and dp-sharded sampling.

`prepare` runs once in the launching process (before any rank starts): it reads the corpus
through `datasets`, tokenizes it, packs it into one token array and caches it as .npy keyed
by the data config. Ranks memory-map that file (`TokenData.load`), so N ranks do not
tokenize N times or race on the datasets cache.

Sampling (`ShardedSampler`) treats training as one stream of epochs, each a seeded
permutation of the samples. Step k takes stream positions [k*G, (k+1)*G) for the global
batch G; dp rank r takes the r-th contiguous slice of it, cut into micro-batches. So every
dp layout with the same G sees the same samples in the same step as one process does, and
within an epoch no sample is dropped or repeated across ranks (a step may straddle an
epoch boundary instead of dropping the epoch's tail; such a step can then meet a sample
once from each epoch).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional
from collections.abc import Iterator

import numpy as np
import torch

from .config import ConfigError, DataConfig, RunConfig

BYTES_VOCAB = 257  # 256 byte values + end-of-document
BYTES_EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no download, and any text round-trips."""

    vocab_size = BYTES_VOCAB
    eos_token_id = BYTES_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer (hub name or local directory)."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def get_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def stdlib_files(max_files: Optional[int]) -> list[str]:
    """The running Python's standard-library sources, sorted, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise ConfigError("data.name", "pycode", f"no .py sources under {root}",
                          "use data=synthetic, or data=hf with a local file")
    return files[:max_files] if max_files else files


def _load_texts(d: DataConfig, cache: Path) -> list[str]:
    from datasets import load_dataset

    hf_cache = str(cache / "hf")
    if d.name == "pycode":
        ds = load_dataset("text", data_files=stdlib_files(d.max_files), sample_by="document",
                          split="train", cache_dir=hf_cache)
    else:
        ds = load_dataset(d.path, data_files=d.data_files, split=d.split, cache_dir=hf_cache)
    field = "text" if d.name == "pycode" else d.text_field
    if field not in ds.column_names:
        raise ConfigError("data.text_field", field, f"not a column of {d.path} ({ds.column_names})",
                          "set data.text_field to the column that holds the text")
    return [t for t in ds[field] if t]


def _pack(texts: list[str], tok) -> np.ndarray:
    """Concatenate documents, each followed by end-of-document, into one token stream."""
    parts = []
    for t in texts:
        parts += [tok.encode(t), np.array([tok.eos_token_id], dtype=np.int32)]
    return np.concatenate(parts)


def cache_dir(d: DataConfig) -> Path:
    return Path(d.cache_dir or os.path.expanduser("~/.cache/framework"))


def _cache_key(d: DataConfig) -> str:
    fields = {k: v for k, v in asdict(d).items() if k not in ("cache_dir", "seq_len", "num_samples", "vocab_size")}
    if d.name == "pycode":
        fields["stdlib"] = sysconfig.get_paths()["stdlib"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class PreparedData:
    """What `prepare` tells the ranks: where the tokens are and the vocabulary size."""

    tokens_path: Optional[str]  # None for synthetic data (generated in each rank)
    vocab_size: int
    num_samples: int


def prepare(run: RunConfig) -> PreparedData:
    d = run.data
    if d.name == "synthetic":
        return _checked(run, PreparedData(None, d.vocab_size, d.num_samples))
    tok = get_tokenizer(d.tokenizer)
    cache = cache_dir(d)
    path = cache / f"{d.name}-{_cache_key(d)}.npy"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tokens = _pack(_load_texts(d, cache), tok)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, tokens.astype(np.uint16 if tok.vocab_size <= 65536 else np.int32))
        os.replace(tmp, path)  # atomic: a half-written cache never looks complete
    n = (len(np.load(path, mmap_mode="r")) - 1) // d.seq_len
    return _checked(run, PreparedData(str(path), tok.vocab_size, n))


def _checked(run: RunConfig, p: PreparedData) -> PreparedData:
    if run.model.vocab_size is not None and run.model.vocab_size < p.vocab_size:
        raise ConfigError("model.vocab_size", run.model.vocab_size,
                          f"smaller than the tokenizer's vocabulary ({p.vocab_size})",
                          f"set model.vocab_size >= {p.vocab_size} or null")
    if p.num_samples < run.global_batch:
        key = "data.num_samples" if run.data.name == "synthetic" else "data.seq_len"
        raise ConfigError(key, run.data.num_samples if run.data.name == "synthetic" else run.data.seq_len,
                          f"the corpus gives {p.num_samples} sequences, fewer than the global batch {run.global_batch}",
                          "use more data (data.max_files / data.num_samples), a shorter seq_len or a smaller batch")
    return p


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
            tokens = np.load(tokens_path, mmap_mode="r")
        return cls(tokens, d.seq_len)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64) for i in indices])
        x = torch.from_numpy(rows[:, :-1].copy())  # (B, T)
        y = torch.from_numpy(rows[:, 1:].copy())  # (B, T)
        return x, y


class ShardedSampler:
    """Sample indices for one dp rank: step -> list of micro-batches (see module docstring)."""

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
