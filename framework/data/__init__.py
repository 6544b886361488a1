"""Corpora, tokenizers, the checked token cache and dp-sharded sampling.

`prepare` runs once in the launching process (before any rank starts): it reads the corpus
through `datasets`, tokenizes it (in several processes when it is large), packs it into one
token stream and caches it as .npy keyed by the data config, streaming: no step holds the
corpus, as Python objects or as one array. Ranks memory-map that file (`TokenData.load`), so N
ranks do not tokenize N times or race on the datasets cache. Held-out data (trainer.eval_interval,
framework/train/evaluate.py) gets a second checked cache (`<name>-val-<key>`), built only when
evaluation is on.

One concern per module:
  tokenizers.py  bytes / transformers tokenizers
  sources.py     pycode / hf corpora and which documents are held out
  cache.py       the cache's name, metadata, lock and verification (full sha256 at build; at start
                 size, mtime and a sampled checksum, the full sha256 only when the mtime moved)
  build.py       documents -> packed tokens streamed into the .npy; a process pool for a large corpus
  tokens.py      TokenData: the memory-mapped (or synthetic) tokens cut into samples
  sampler.py     ShardedSampler: which samples each dp rank reads at each step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from framework.config import RunConfig
from framework.validate import validate_prepared
from framework.data.build import build_cache
from framework.data.cache import CACHE_FORMAT, build_inputs, cache_dir, cache_key, lock_path, meta_path, verified_or_built
from framework.data.sampler import ShardedSampler
from framework.data.sources import held_out_count, heldout_files, stdlib_files
from framework.data.tokenizers import BYTES_EOS, BYTES_VOCAB, ByteTokenizer, HFTokenizer, get_tokenizer
from framework.data.tokens import HELDOUT_SEED_STREAM, TokenData

__all__ = ["BYTES_EOS", "BYTES_VOCAB", "ByteTokenizer", "CACHE_FORMAT", "HELDOUT_SEED_STREAM", "HFTokenizer",
           "PreparedData", "ShardedSampler", "TokenData", "cache_dir", "get_tokenizer", "held_out_count",
           "heldout_files", "lock_path", "meta_path", "prepare", "stdlib_files", "synthetic_heldout_samples"]


@dataclass
class PreparedData:
    """What `prepare` tells the ranks: where the tokens are and the vocabulary size."""

    tokens_path: Optional[str]  # None for synthetic data (generated in each rank)
    vocab_size: int
    num_samples: int
    # Held-out tokens (trainer.eval_interval > 0; else None and 0). The path is None for
    # synthetic data too: each rank draws them (`TokenData.load_heldout`).
    val_tokens_path: Optional[str] = None
    val_num_samples: int = 0


def prepare(run: RunConfig) -> PreparedData:
    """Once per job, before any rank starts: the verified (or freshly built) token caches, the
    held-out one only when evaluation is on."""
    d = run.data
    evaluating = run.trainer.eval_interval > 0
    if d.name == "synthetic":
        val = synthetic_heldout_samples(run) if evaluating else 0
        return _checked(run, PreparedData(None, d.vocab_size, d.num_samples, None, val))
    tok = get_tokenizer(d.tokenizer)
    cache = cache_dir(d)
    cache.mkdir(parents=True, exist_ok=True)
    p = PreparedData(None, tok.vocab_size, 0)
    for part in ("train", "val") if evaluating else ("train",):
        path = cache / f"{d.name}-{'val-' if part == 'val' else ''}{cache_key(d, part)}.npy"
        inputs = build_inputs(d, tok, part)
        meta = verified_or_built(path, inputs, lambda: build_cache(run, tok, path, inputs, part))
        samples = (meta["num_tokens"] - 1) // d.seq_len
        if part == "val":
            p.val_tokens_path, p.val_num_samples = str(path), samples
        else:
            p.tokens_path, p.num_samples = str(path), samples
    return _checked(run, p)


def synthetic_heldout_samples(run: RunConfig) -> int:
    """Synthetic held-out sequences: exactly what one evaluation reads (every evaluation reads
    the same ones), so none wraps around."""
    return run.trainer.eval_batches * run.global_batch


def _checked(run: RunConfig, p: PreparedData) -> PreparedData:
    validate_prepared(run, p.vocab_size, p.num_samples, p.val_num_samples)
    return p
