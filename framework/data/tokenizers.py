"""Tokenizers: text -> token ids. `bytes` (UTF-8 bytes + end-of-document, no download) or any
transformers tokenizer by hub name or local directory."""

from __future__ import annotations

import numpy as np

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
