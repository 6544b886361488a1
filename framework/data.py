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

Held-out data (trainer.eval_interval, framework/evaluate.py): documents no training step
sees. pycode: the last data.val_files stdlib files (sorted); training reads the first
data.max_files of the others. hf: data.val_split, or the last data.val_fraction of the
training split's (non-empty) documents, round(fraction * documents) and at least one.
synthetic: eval_batches global batches of tokens drawn with another seed. The training
stream leaves the held-out documents out whether or not evaluation is on, so turning it on
never changes training; the held-out tokens get a second checked cache (`<name>-val-<key>`),
built only when evaluation is on.

Over ~300 lines: issue 20 (checkpoints and data past one node) rewrites this module and
splits it into a package by concern; split then, not twice.
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
HELDOUT_SEED_STREAM = 1  # synthetic held-out tokens: default_rng([seed, 1]), training's is default_rng(seed)


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


def stdlib_files(max_files: Optional[int], val_files: int = 0) -> list[str]:
    """The training files: the running Python's standard-library sources, sorted, without
    site-packages and without the `val_files` held out at the end; the first max_files."""
    files = _all_stdlib_files()
    rest = files[:len(files) - val_files]
    if not rest:
        raise ConfigError("data.val_files", val_files, f"holds out all {len(files)} stdlib files, none is left "
                          "to train on", f"use data.val_files < {len(files)}, e.g. 20")
    return rest[:max_files] if max_files else rest


def heldout_files(val_files: int) -> list[str]:
    """pycode's held-out files: the last `val_files` of the sorted stdlib sources."""
    files = _all_stdlib_files()
    return files[len(files) - min(val_files, len(files)):] if val_files > 0 else []


def _all_stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_py_files(root))
    if not files:
        raise ConfigError("data.name", "pycode", f"no .py sources under {root}",
                          "use data=synthetic, or data=hf with a local file")
    return files


def _py_files(root: Path) -> Iterator[str]:
    """*.py under root, pruning site-packages as it walks: `prepare` lists the stdlib on every run
    (the cache records its files), and walking installed packages only to drop them took ~1 s."""
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (os.path.join(parent, n) for n in names if n.endswith(".py"))


def _files(d: DataConfig, part: str) -> list[str]:
    """pycode's files of `part` ("train" | "val")."""
    return heldout_files(d.val_files) if part == "val" else stdlib_files(d.max_files, d.val_files)


def _split(d: DataConfig, part: str) -> str:
    """The hf split a part's documents come from."""
    return d.val_split if part == "val" and d.val_split else d.split


def held_out_count(documents: int, fraction: float) -> int:
    """Documents data.val_fraction holds out of the training split: round(f * n), at least one."""
    return max(1, round(documents * fraction)) if fraction > 0 else 0


def _load_texts(d: DataConfig, cache: Path, part: str = "train") -> list[str]:
    from datasets import load_dataset

    hf_cache = str(cache / "hf")
    if d.name == "pycode":
        ds = load_dataset("text", data_files=_files(d, part), sample_by="document", split="train", cache_dir=hf_cache)
    else:
        try:
            ds = load_dataset(d.path, data_files=d.data_files, split=_split(d, part), cache_dir=hf_cache)
        except Exception as e:  # noqa: BLE001 - datasets raises many types for a bad file or name
            if _split(d, part) != d.split:
                raise ConfigError("data.val_split", d.val_split, f"could not be loaded by datasets.load_dataset("
                                  f"{d.path!r}) ({first_line(e)})", "name a split the dataset has (a local directory "
                                  "as data.path: its files named by split, e.g. train.jsonl, validation.jsonl)") from None
            raise ConfigError("data.data_files" if d.data_files else "data.path", d.data_files or d.path,
                              f"could not be loaded by datasets.load_dataset({d.path!r}) ({first_line(e)})",
                              "check the file's format matches the loader (json lines for json), or the dataset "
                              "name and split") from None
    check_text_field(d, ds.column_names)
    texts = [t for t in ds["text" if d.name == "pycode" else d.text_field] if t]
    if d.name != "hf" or _split(d, part) != d.split:
        return texts
    keep = len(texts) - held_out_count(len(texts), d.val_fraction)  # the fraction's documents are the last
    return texts[keep:] if part == "val" else texts[:keep]


def _pack(texts: list[str], tok) -> np.ndarray:
    """Concatenate documents, each followed by end-of-document, into one token stream."""
    parts = []
    for t in texts:
        parts += [tok.encode(t), np.array([tok.eos_token_id], dtype=np.int32)]
    return np.concatenate(parts)


def cache_dir(d: DataConfig) -> Path:
    return Path(d.cache_dir or os.path.expanduser("~/.cache/framework"))


def _cache_key(d: DataConfig, part: str = "train") -> str:
    """Named by the fields the part's tokens are built from (the metadata checks them exactly)."""
    unused = ("cache_dir", "seq_len", "num_samples", "vocab_size", "val_split" if part == "train" else "max_files")
    fields = {k: v for k, v in asdict(d).items() if k not in unused}
    if d.name == "pycode":
        fields["stdlib"] = sysconfig.get_paths()["stdlib"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


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
    path = cache / f"{d.name}-{_cache_key(d)}.npy"
    meta = _verified_or_built(run, tok, path, _build_inputs(d, tok))
    p = PreparedData(str(path), tok.vocab_size, (meta["num_tokens"] - 1) // d.seq_len)
    if evaluating:
        val_path = cache / f"{d.name}-val-{_cache_key(d, 'val')}.npy"
        val_meta = _verified_or_built(run, tok, val_path, _build_inputs(d, tok, "val"), "val")
        p.val_tokens_path, p.val_num_samples = str(val_path), (val_meta["num_tokens"] - 1) // d.seq_len
    return _checked(run, p)


def synthetic_heldout_samples(run: RunConfig) -> int:
    """Synthetic held-out sequences: exactly what one evaluation reads (every evaluation reads
    the same ones), so none wraps around."""
    return run.trainer.eval_batches * run.global_batch


# ---- the checked token cache (see the module docstring) ----

CACHE_FORMAT = 1  # bump when the metadata or the packing changes: old caches then rebuild


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


def _sources(d: DataConfig, part: str = "train") -> dict:
    """What the part's documents are read from. pycode lists every file with its size, so a
    Python upgraded in place (same stdlib path, changed files) rebuilds the cache, and so does
    one built before the held-out files were left out. hf names a held-out fraction (which
    documents of the split a part keeps) when there is one, so a change rebuilds."""
    if d.name == "pycode":
        out = {"stdlib": [[f, os.path.getsize(f)] for f in _files(d, part)]}
    else:
        out = {"path": d.path, "data_files": d.data_files, "split": _split(d, part), "text_field": d.text_field,
               "local_files": _local_files(d.data_files)}
        if d.val_fraction > 0 and _split(d, part) == d.split:
            out["held_out_fraction"] = d.val_fraction
    return {**out, "part": "held out"} if part == "val" else out


def _local_files(data_files) -> list:
    """Local data files with size and modification time: a file edited in place rebuilds the
    cache (remote ones, URLs, are named by data_files alone)."""
    files = sorted({m for matches in local_data_files(data_files).values() for m in matches})
    return [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files]


def _build_inputs(d: DataConfig, tok, part: str = "train") -> dict:
    """Everything the packed tokens depend on. Not seq_len: packing is one stream for any seq_len."""
    return {"format": CACHE_FORMAT, "name": d.name, "sources": _sources(d, part), "tokenizer": d.tokenizer,
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


def _verified_or_built(run: RunConfig, tok, path: Path, inputs: dict, part: str = "train") -> dict:
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
        return _build(run, tok, path, inputs, part)


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


def _build(run: RunConfig, tok, path: Path, inputs: dict, part: str) -> dict:
    """Pack the part's documents into `path`, then write its metadata. Both go through per-pid
    temporaries and an atomic rename, the metadata last: a cache whose metadata exists is complete."""
    tokens = _pack(_load_texts(run.data, path.parent, part), tok).astype(inputs["dtype"])
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
    validate_prepared(run, p.vocab_size, p.num_samples, p.val_num_samples)
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
