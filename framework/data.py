"""Corpora, tokenizers, packing and dp-sharded sampling.

`prepare` runs once in the launching process (before any rank starts): it reads the corpus
through `datasets`, tokenizes it, packs it into one token array and caches it as .npy keyed
by the data config. Ranks memory-map that file (`TokenData.load`), so N ranks do not
tokenize N times or race on the datasets cache.

The cache is checked, not trusted: beside `<name>-<key>.npy` a `<name>-<key>.json` records
what it was built from (sources, tokenizer and vocabulary size, dtype) and what it holds
(token count, file size, sha256 of the .npy). Every `prepare` verifies an existing cache
against it: metadata readable, same build inputs, same size (a truncated file), loadable
with the recorded length, same checksum (bytes overwritten in place). Any failure prints
one warning naming the file and the reason, deletes the cache and rebuilds it; so does a
cache without metadata (an older version's, or a build cut off before its metadata).
Jobs preparing the same cache at once serialize on a flock'ed `<name>-<key>.lock`: they
verify under a shared lock, and rebuild under an exclusive one after checking again (another
job may have rebuilt it meanwhile); files are written to per-pid temporaries and renamed, the
.npy first, so no job reads a half-written cache. The packing does not depend on
`data.seq_len` (one token stream, cut into sequences at load time), so seq_len is neither in
the key nor a build input: the metadata records the building run's seq_len as information only.

Sampling (`ShardedSampler`) treats training as one stream of epochs, each a seeded
permutation of the samples. Step k takes stream positions [k*G, (k+1)*G) for the global
batch G; dp rank r takes the r-th contiguous slice of it, cut into micro-batches. So every
dp layout with the same G sees the same samples in the same step as one process does, and
within an epoch no sample is dropped or repeated across ranks (a step may straddle an
epoch boundary instead of dropping the epoch's tail; such a step can then meet a sample
once from each epoch).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .config import ConfigError, DataConfig, RunConfig
from .validate import check_text_field, first_line, local_data_files, validate_prepared

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
    files = sorted(_py_files(root))
    if not files:
        raise ConfigError("data.name", "pycode", f"no .py sources under {root}",
                          "use data=synthetic, or data=hf with a local file")
    return files[:max_files] if max_files else files


def _py_files(root: Path) -> Iterator[str]:
    """*.py under root, pruning site-packages as it walks: `prepare` lists the stdlib on every run
    (the cache records its files), and walking installed packages only to drop them took ~1 s."""
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (os.path.join(parent, n) for n in names if n.endswith(".py"))


def _load_texts(d: DataConfig, cache: Path) -> list[str]:
    from datasets import load_dataset

    hf_cache = str(cache / "hf")
    if d.name == "pycode":
        ds = load_dataset("text", data_files=stdlib_files(d.max_files), sample_by="document",
                          split="train", cache_dir=hf_cache)
    else:
        try:
            ds = load_dataset(d.path, data_files=d.data_files, split=d.split, cache_dir=hf_cache)
        except Exception as e:  # noqa: BLE001 - datasets raises many types for a bad file or name
            raise ConfigError("data.data_files" if d.data_files else "data.path", d.data_files or d.path,
                              f"could not be loaded by datasets.load_dataset({d.path!r}) ({first_line(e)})",
                              "check the file's format matches the loader (json lines for json), or the dataset "
                              "name and split") from None
    check_text_field(d, ds.column_names)
    return [t for t in ds["text" if d.name == "pycode" else d.text_field] if t]


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
    """Once per job, before any rank starts: the verified (or freshly built) token cache."""
    d = run.data
    if d.name == "synthetic":
        return _checked(run, PreparedData(None, d.vocab_size, d.num_samples))
    tok = get_tokenizer(d.tokenizer)
    cache = cache_dir(d)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{d.name}-{_cache_key(d)}.npy"
    meta = _verified_or_built(run, tok, path, _build_inputs(d, tok))
    n = (meta["num_tokens"] - 1) // d.seq_len
    return _checked(run, PreparedData(str(path), tok.vocab_size, n))


# ---- the checked token cache (see the module docstring) ----

CACHE_FORMAT = 1  # bump when the metadata or the packing changes: old caches then rebuild


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


def _sources(d: DataConfig) -> dict:
    """What the corpus is read from. pycode lists every file with its size, so a Python
    upgraded in place (same stdlib path, changed files) rebuilds the cache."""
    if d.name == "pycode":
        return {"stdlib": [[f, os.path.getsize(f)] for f in stdlib_files(d.max_files)]}
    return {"path": d.path, "data_files": d.data_files, "split": d.split, "text_field": d.text_field,
            "local_files": _local_files(d.data_files)}


def _local_files(data_files) -> list:
    """Local data files with size and modification time: a file edited in place rebuilds the
    cache (remote ones, URLs, are named by data_files alone)."""
    files = sorted({m for matches in local_data_files(data_files).values() for m in matches})
    return [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files]


def _build_inputs(d: DataConfig, tok) -> dict:
    """Everything the packed tokens depend on. Not seq_len: packing is one stream for any seq_len."""
    return {"format": CACHE_FORMAT, "name": d.name, "sources": _sources(d), "tokenizer": d.tokenizer,
            "vocab_size": tok.vocab_size, "dtype": _token_dtype(tok.vocab_size).name}


def meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def lock_path(path: Path) -> Path:
    return path.with_suffix(".lock")


@contextmanager
def _locked(path: Path, mode: int):
    """flock the cache's lock file. The lock file itself is never deleted: removing it while
    another job waits on it would let a third job lock a fresh file and build concurrently."""
    with open(lock_path(path), "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _verified_or_built(run: RunConfig, tok, path: Path, inputs: dict) -> dict:
    """The cache's metadata, after verifying the cache or (re)building it."""
    with _locked(path, fcntl.LOCK_SH):  # many jobs may verify at once; none builds meanwhile
        meta, problem = _verify(path, inputs)
    if problem is None:
        return meta
    with _locked(path, fcntl.LOCK_EX):
        meta, problem = _verify(path, inputs)  # again: a job may have rebuilt it while we waited
        if problem is None:
            return meta
        if path.exists():  # a missing cache is simply built; an existing bad one is reported
            print(f"warning: token cache {path} {problem}; rebuilding", file=sys.stderr, flush=True)
        # With the exclusive lock no other job is writing, so per-pid temporaries left here are
        # from builds that died: remove them with the bad cache.
        for p in [path, meta_path(path), *path.parent.glob(f"{path.stem}.tmp*")]:
            p.unlink(missing_ok=True)
        return _build(run, tok, path, inputs)


def _verify(path: Path, inputs: dict) -> tuple[Optional[dict], Optional[str]]:
    """(metadata, None) for a sound cache, else (None, why not) as a phrase for the warning."""
    if not path.exists():
        return None, "does not exist"
    meta, problem = _read_meta(path)
    if problem is None:
        problem = _mismatch(meta, inputs) or _size_problem(path, meta) or _load_problem(path, meta)
    if problem is None and _sha256(path) != meta["sha256"]:
        problem = "does not match its sha256 checksum (its bytes changed after it was built)"
    return (meta, None) if problem is None else (None, problem)


_META_FIELDS = {"inputs": dict, "num_tokens": int, "bytes": int, "sha256": str}


def _read_meta(path: Path) -> tuple[Optional[dict], Optional[str]]:
    m = meta_path(path)
    if not m.exists():
        return None, f"has no metadata file {m.name} (an older version's cache, or an interrupted build)"
    try:
        meta = json.loads(m.read_text())
    except (OSError, ValueError) as e:
        return None, f"has an unreadable metadata file {m.name} ({e})"
    bad = [k for k, t in _META_FIELDS.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad:
        return None, f"has an invalid metadata file {m.name} (missing or mistyped: {', '.join(bad)})"
    return meta, None


def _mismatch(meta: dict, inputs: dict) -> Optional[str]:
    built = meta["inputs"]
    changed = sorted(k for k in set(built) | set(inputs) if built.get(k) != inputs.get(k))
    return f"was built from other inputs (changed: {', '.join(changed)})" if changed else None


def _size_problem(path: Path, meta: dict) -> Optional[str]:
    size, want = path.stat().st_size, meta["bytes"]
    if size < want:
        return f"is truncated ({size} of {want} bytes)"
    return f"has {size} bytes, {want} expected" if size != want else None


def _load_problem(path: Path, meta: dict) -> Optional[str]:
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        return f"cannot be loaded ({e})"
    if tokens.ndim != 1 or len(tokens) != meta["num_tokens"] or tokens.dtype.name != meta["inputs"]["dtype"]:
        return (f"holds {tokens.shape} {tokens.dtype} tokens, metadata says "
                f"({meta['num_tokens']},) {meta['inputs']['dtype']}")
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _build(run: RunConfig, tok, path: Path, inputs: dict) -> dict:
    """Pack the corpus into `path`, then write its metadata. Both go through per-pid temporaries
    and an atomic rename, the metadata last: a cache whose metadata exists is complete."""
    tokens = _pack(_load_texts(run.data, path.parent), tok).astype(inputs["dtype"])
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, tokens)
    meta = {"inputs": inputs, "num_tokens": len(tokens), "bytes": tmp.stat().st_size, "sha256": _sha256(tmp),
            "info": {"built_with_seq_len": run.data.seq_len}}  # information only, never checked
    os.replace(tmp, path)
    tmp_meta = meta_path(path).with_suffix(f".tmp{os.getpid()}.json")
    tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp_meta, meta_path(path))
    return meta


def _checked(run: RunConfig, p: PreparedData) -> PreparedData:
    validate_prepared(run, p.vocab_size, p.num_samples)
    return p


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
