"""The checked token cache: its name, its metadata, its lock and its verification.

Beside `<name>-<key>.npy` a `<name>-<key>.json` records what it was built from (sources,
tokenizer and vocabulary size, dtype) and what it holds: token count, file size, sha256 of
the .npy, its modification time (mtime_ns) and a sampled checksum (sha256 of 16 blocks of
64 KiB at offsets spread evenly over the file, first and last included, recorded with the
offsets; a file under 1 MiB is one block, the whole file). The full sha256 is computed once,
when the cache is built. Every later `prepare` verifies: metadata readable, same build
inputs, same size (a truncated file), loadable with the recorded length, and then
  - same mtime: the sampled checksum (reads 1 MiB, whatever the cache's size);
  - another mtime (the file was written, or copied without its times): the full sha256; if
    it still matches, the new mtime is recorded so the next start is cheap again.
So bytes overwritten in place are caught by the full checksum (writing moves the mtime), or,
if the mtime was set back, by the sampled one when they fall in a sampled block (the same
warning either way: "does not match its sha256 checksum").
Any failure prints one warning naming the file and the reason, deletes the cache and
rebuilds it; so does a cache without metadata (an older version's, or a build cut off before
its metadata), or with metadata that is not what this module writes (garbage, over
`MAX_META_BYTES`, offsets outside the file): nothing in a cache's files is trusted before it is
checked, and no number read there sizes an allocation. A cache directory that cannot be
written (validate.paths checks it before launch) or a cache that cannot be removed is a
ConfigError naming data.cache_dir. Jobs preparing the same cache at once serialize on a flock'ed
`<name>-<key>.lock`: they verify under a shared lock, and rebuild under an exclusive one after
checking again (another job may have rebuilt it meanwhile). The packing does not depend on
`data.seq_len` (one token stream, cut into sequences at load time), so seq_len is neither in
the key nor a build input.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np

from framework.config import ConfigError, DataConfig
from framework.data.sources import sources
from framework.validate.paths import CACHE_DIR_FIX

CACHE_FORMAT = 2  # bump when the metadata or the packing changes: old caches then rebuild (2: mtime, sampled)
SAMPLED_BLOCKS, SAMPLED_BLOCK_BYTES = 16, 1 << 16  # the sampled checksum reads 1 MiB
MAX_META_BYTES = 16 << 20  # a metadata file (its sources list included) is far smaller


def cache_dir(d: DataConfig) -> Path:
    return Path(d.cache_dir or os.path.expanduser("~/.cache/framework"))


def cache_key(d: DataConfig, part: str = "train") -> str:
    """Named by the fields the part's tokens are built from (the metadata checks them exactly)."""
    unused = ("cache_dir", "seq_len", "num_samples", "vocab_size", "val_split" if part == "train" else "max_files")
    fields = {k: v for k, v in asdict(d).items() if k not in unused}
    if d.name == "pycode":
        fields["stdlib"] = sysconfig.get_paths()["stdlib"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


def build_inputs(d: DataConfig, tok, part: str = "train") -> dict:
    """Everything the packed tokens depend on. Not seq_len: packing is one stream for any seq_len."""
    return {"format": CACHE_FORMAT, "name": d.name, "sources": sources(d, part), "tokenizer": d.tokenizer,
            "vocab_size": tok.vocab_size, "dtype": token_dtype(tok.vocab_size).name}


def meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def lock_path(path: Path) -> Path:
    return path.with_suffix(".lock")


@contextmanager
def _locked(path: Path, mode: int):
    """flock the cache's lock file. The lock file itself is never deleted: removing it while
    another job waits on it would let a third job lock a fresh file and build concurrently."""
    try:
        f = open(lock_path(path), "a")
    except OSError as e:
        raise ConfigError("data.cache_dir", str(path.parent), f"cannot hold the cache's lock file "
                          f"{lock_path(path).name} ({e.strerror or e})", CACHE_DIR_FIX) from None
    with f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def verified_or_built(path: Path, inputs: dict, build: Callable[[], dict]) -> dict:
    """The cache's metadata, after verifying the cache or (re)building it with `build`."""
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
            try:
                p.unlink(missing_ok=True)
            except OSError as e:  # a directory of that name, a read-only directory
                raise ConfigError("data.cache_dir", str(path.parent), f"the bad cache file {p.name} cannot be "
                                  f"removed ({e.strerror or e})", f"remove it by hand, or {CACHE_DIR_FIX}") from None
        return build()


def _verify(path: Path, inputs: dict) -> tuple[Optional[dict], Optional[str]]:
    """(metadata, None) for a sound cache, else (None, why not) as a phrase for the warning."""
    if not path.exists():
        return None, "does not exist"
    meta, problem = _read_meta(path)
    try:
        if problem is None:
            problem = (_mismatch(meta, inputs) or _check_fields(path, meta) or _size_problem(path, meta)
                       or _load_problem(path, meta) or _content_problem(path, meta))
    except OSError as e:  # unreadable (permissions, a directory of that name): rebuilt like any bad cache
        problem = f"cannot be read ({e.strerror or e})"
    return (meta, None) if problem is None else (None, problem)


def _content_problem(path: Path, meta: dict) -> Optional[str]:
    """The bytes: the full sha256 when the mtime moved, else the sampled checksum (module docstring)."""
    changed = "does not match its sha256 checksum (its bytes changed after it was built)"
    if path.stat().st_mtime_ns != meta["mtime_ns"]:
        if sha256(path) != meta["sha256"]:
            return changed
        _record_mtime(path, meta)
        return None
    sampled = meta["sampled"]
    return changed if sampled_sha256(path, sampled["offsets"], sampled["block_bytes"]) != sampled["sha256"] else None


def _record_mtime(path: Path, meta: dict) -> None:
    """Same bytes under a new mtime (copied, touched): record it. Every job doing this under the
    shared lock writes the same record; a read-only cache directory just stays on the full check."""
    meta["mtime_ns"] = path.stat().st_mtime_ns
    try:
        write_meta(path, meta)
    except OSError:
        pass


_META_FIELDS = {"inputs": dict, "num_tokens": int, "bytes": int, "sha256": str}


def _read_meta(path: Path) -> tuple[Optional[dict], Optional[str]]:
    m = meta_path(path)
    if not m.exists():
        return None, f"has no metadata file {m.name} (an older version's cache, or an interrupted build)"
    try:
        with open(m, "rb") as f:
            data = f.read(MAX_META_BYTES + 1)
        if len(data) > MAX_META_BYTES:
            return None, f"has a metadata file {m.name} over {MAX_META_BYTES >> 20} MiB (not one this module wrote)"
        meta = json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        return None, f"has an unreadable metadata file {m.name} ({str(e).splitlines()[0] if str(e) else e!r})"
    bad = [k for k, t in _META_FIELDS.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad:
        return None, f"has an invalid metadata file {m.name} (missing or mistyped: {', '.join(bad)})"
    return meta, None


def _mismatch(meta: dict, inputs: dict) -> Optional[str]:
    built = meta["inputs"]
    changed = sorted(k for k in set(built) | set(inputs) if built.get(k) != inputs.get(k))
    return f"was built from other inputs (changed: {', '.join(changed)})" if changed else None


_CHECK_FIELDS = {"mtime_ns": int, "sampled": dict}
_SAMPLED_FIELDS = {"offsets": list, "block_bytes": int, "sha256": str}


def _check_fields(path: Path, meta: dict) -> Optional[str]:
    """The quick-check record, checked after the inputs: a cache of an older format is named by
    its format, not by the fields it lacks."""
    bad = [k for k, t in _CHECK_FIELDS.items() if not isinstance(meta.get(k), t)]
    bad += [f"sampled.{k}" for k, t in _SAMPLED_FIELDS.items()
            if "sampled" not in bad and not isinstance(meta["sampled"].get(k), t)]
    if not bad and not _sane_sample(meta):
        bad = ["sampled.offsets", "sampled.block_bytes"]
    if bad:
        return f"has an invalid metadata file {meta_path(path).name} (missing or mistyped: {', '.join(bad)})"
    return None


def _sane_sample(meta: dict) -> bool:
    """The sampled checksum's record is one this module writes: at most SAMPLED_BLOCKS int
    offsets inside the recorded size, blocks of at most SAMPLED_BLOCK_BYTES (or the whole
    small file), so reading them never allocates what a damaged number says."""
    s, size = meta["sampled"], meta["bytes"]
    offsets, block = s["offsets"], s["block_bytes"]
    return (0 < len(offsets) <= SAMPLED_BLOCKS and all(type(o) is int and 0 <= o < max(size, 1) for o in offsets)
            and type(block) is int and 0 <= block <= max(SAMPLED_BLOCK_BYTES, size if offsets == [0] else 0))


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


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sampled_offsets(size: int) -> list[int]:
    """Where the sampled checksum reads: SAMPLED_BLOCKS blocks spread evenly from the first byte
    to the last block; a file that small blocks would cover is read whole, as one block."""
    if size <= SAMPLED_BLOCKS * SAMPLED_BLOCK_BYTES:
        return [0]
    last = size - SAMPLED_BLOCK_BYTES
    return [last * i // (SAMPLED_BLOCKS - 1) for i in range(SAMPLED_BLOCKS)]


def sampled_sha256(path: Path, offsets: list[int], block_bytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(block_bytes))
    return h.hexdigest()


def content_record(path: Path) -> dict:
    """What a freshly built .npy holds, for its metadata: size, mtime, the full sha256 and the
    sampled checksum with its offsets."""
    st = path.stat()
    offsets = sampled_offsets(st.st_size)
    block = st.st_size if offsets == [0] else SAMPLED_BLOCK_BYTES
    return {"bytes": st.st_size, "sha256": sha256(path), "mtime_ns": st.st_mtime_ns,
            "sampled": {"offsets": offsets, "block_bytes": block, "sha256": sampled_sha256(path, offsets, block)}}


def write_meta(path: Path, meta: dict) -> None:
    """Through a per-pid temporary and an atomic rename: readers see the old record or the new."""
    tmp = meta_path(path).with_suffix(f".tmp{os.getpid()}.json")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path(path))
