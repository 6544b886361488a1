"""Building a token cache: documents -> one packed token stream in a .npy, with its metadata.

Documents are concatenated, each followed by end-of-document, into one token stream, written
as it is made: documents are read a batch at a time (framework/data/sources.py), tokenized in
chunks of about CHUNK_BYTES of text, and each chunk's tokens are appended to the .npy after a
fixed-size header that is written last, when the length is known. Memory is bounded by a few
chunks, not by the corpus.

A corpus of PARALLEL_MIN_BYTES of text or more is tokenized by a pool of processes (one per
available CPU, at most MAX_PROCESSES), each taking whole chunks; chunks are written in order,
so the file is byte-identical to a single-process build. Smaller corpora stay in this process
(a pool's start-up would cost more than it saves). A parallel build announces itself on
stderr, and any build still running prints a progress line every PROGRESS_INTERVAL_S.

The .npy and its metadata are written to per-pid temporaries and renamed, the .npy first, so
a cache whose metadata exists is complete and no job reads a half-written one.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from framework.config import RunConfig
from framework.data.cache import content_record, write_meta
from framework.data.sources import Documents, load_part

CHUNK_BYTES = 1 << 18  # text per tokenization task: 256 KiB, a few MB of memory in flight
PARALLEL_MIN_BYTES = 16 << 20  # the whole stdlib (~30 MB) is tokenized in parallel, data=pycode's 400 files not
MAX_PROCESSES = 32
PROGRESS_INTERVAL_S = 5.0


def build_cache(run: RunConfig, tok, path: Path, inputs: dict, part: str) -> dict:
    """Pack the part's documents into `path`, then write its metadata (see the module docstring)."""
    docs = load_part(run.data, path.parent, part)
    dtype = np.dtype(inputs["dtype"])
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    processes = tokenizer_processes(docs.text_bytes)
    progress = _Progress(path.name, docs, processes)
    try:
        encoded = encoded_chunks(chunks(docs, CHUNK_BYTES), tok, dtype, processes)
        num_tokens = write_npy(tmp, dtype, progress.counted(encoded))
        meta = {"inputs": inputs, "num_tokens": num_tokens, **content_record(tmp),
                "info": {"built_with_seq_len": run.data.seq_len}}  # information only, never checked
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    progress.done(num_tokens)
    os.replace(tmp, path)
    write_meta(path, meta)
    return meta


def tokenizer_processes(text_bytes: int) -> int:
    if text_bytes < PARALLEL_MIN_BYTES:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_PROCESSES, -(-text_bytes // CHUNK_BYTES)))


def chunks(docs: Documents, chunk_bytes: int) -> Iterator[list[str]]:
    """The documents in order, grouped into lists of about chunk_bytes characters."""
    chunk, size = [], 0
    for batch in docs.batches():
        for text in batch:
            chunk.append(text)
            size += len(text)
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def encode(tok, texts: list[str], dtype: np.dtype) -> np.ndarray:
    """One chunk's token stream: each document's tokens, then end-of-document."""
    eos = np.array([tok.eos_token_id], dtype=np.int32)
    parts = [a for text in texts for a in (tok.encode(text), eos)]
    return np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)


def encoded_chunks(texts: Iterable[list[str]], tok, dtype: np.dtype, processes: int
                   ) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, tokens) per chunk, in the chunks' order, from `processes` processes. At most
    2 * processes chunks are in flight (Pool.imap would read the whole corpus ahead)."""
    if processes <= 1:
        for chunk in texts:
            yield len(chunk), encode(tok, chunk, dtype)
        return
    # fork: workers inherit the loaded tokenizer instead of loading it again (nor pickling it).
    with multiprocessing.get_context("fork").Pool(processes, _set_worker_tokenizer, (tok,)) as pool:
        pending: deque = deque()
        for chunk in texts:
            pending.append((len(chunk), pool.apply_async(_encode_in_worker, (chunk, dtype))))
            if len(pending) >= 2 * processes:
                n, result = pending.popleft()
                yield n, result.get()
        while pending:
            n, result = pending.popleft()
            yield n, result.get()


_worker_tokenizer = None  # a pool worker's tokenizer, set once by the pool's initializer; never read by the parent


def _set_worker_tokenizer(tok) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok


def _encode_in_worker(texts: list[str], dtype: np.dtype) -> np.ndarray:
    return encode(_worker_tokenizer, texts, dtype)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def write_npy(path: Path, dtype: np.dtype, chunks: Iterable[tuple[int, np.ndarray]]) -> int:
    """Append each chunk's tokens after a placeholder header, then write the header: the file
    np.save would write for the whole array. Returns the token count."""
    reserved = len(_npy_header(dtype, 0))
    count = 0
    with open(path, "wb") as f:
        f.write(b"\0" * reserved)
        for _, tokens in chunks:
            f.write(tokens.tobytes())
            count += len(tokens)
        header = _npy_header(dtype, count)
        # numpy pads a header to a multiple of 64 bytes: 128 for any 1-D length under 10**50
        assert len(header) == reserved, (len(header), reserved)
        f.seek(0)
        f.write(header)
    return count


class _Progress:
    """Documents and tokens done, to stderr: at the start of a parallel build and every
    PROGRESS_INTERVAL_S; a last line when it printed any."""

    def __init__(self, name: str, docs: Documents, processes: int):
        self.name, self.total, self.start = name, docs.count, time.monotonic()
        self.last, self.printed, self.docs = self.start, False, 0
        if processes > 1:
            self._print(f"{docs.count:,} documents ({docs.text_bytes / 1e6:.1f} MB of text), {processes} processes")

    def counted(self, chunks: Iterable[tuple[int, np.ndarray]]) -> Iterator[tuple[int, np.ndarray]]:
        tokens = 0
        for n, chunk in chunks:
            self.docs, tokens = self.docs + n, tokens + len(chunk)
            if time.monotonic() - self.last >= PROGRESS_INTERVAL_S:
                self.last = time.monotonic()
                self._print(f"{self.docs:,} of {self.total:,} documents ({100 * self.docs // max(self.total, 1)}%), "
                            f"{tokens:,} tokens, {self.last - self.start:.0f} s")
            yield n, chunk

    def done(self, tokens: int) -> None:
        if self.printed:
            self._print(f"done: {self.docs:,} documents, {tokens:,} tokens in {time.monotonic() - self.start:.1f} s")

    def _print(self, what: str) -> None:
        print(f"tokenizing {self.name}: {what}", file=sys.stderr, flush=True)
        self.printed = True
