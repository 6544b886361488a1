"""Building a token cache: documents -> one packed token stream in a .npy, with its metadata.

Documents are concatenated, each followed by end-of-document, into one token stream. The
.npy and its metadata are written to per-pid temporaries and renamed, the .npy first, so a
cache whose metadata exists is complete and no job reads a half-written one.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..config import RunConfig
from .cache import meta_path, sha256
from .sources import load_texts


def _pack(texts: list[str], tok) -> np.ndarray:
    """Concatenate documents, each followed by end-of-document, into one token stream."""
    parts = []
    for t in texts:
        parts += [tok.encode(t), np.array([tok.eos_token_id], dtype=np.int32)]
    return np.concatenate(parts)


def build_cache(run: RunConfig, tok, path, inputs: dict, part: str) -> dict:
    """Pack the part's documents into `path`, then write its metadata. Both go through per-pid
    temporaries and an atomic rename, the metadata last: a cache whose metadata exists is complete."""
    tokens = _pack(load_texts(run.data, path.parent, part), tok).astype(inputs["dtype"])
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, tokens)
    meta = {"inputs": inputs, "num_tokens": len(tokens), "bytes": tmp.stat().st_size, "sha256": sha256(tmp),
            "info": {"built_with_seq_len": run.data.seq_len}}  # information only, never checked
    os.replace(tmp, path)
    tmp_meta = meta_path(path).with_suffix(f".tmp{os.getpid()}.json")
    tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp_meta, meta_path(path))
    return meta
