"""GPT-2 (Radford et al., 2019) from transformers' GPT2LMHeadModel, split for parallelism."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from ..config import ModelConfig
from .split import HFBlock, SplitLM


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)  # (T,)
        return self.drop(self.wte(input_ids) + self.wpe(pos))  # (B, T, H)


class GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))  # (B, T, V)


def hf_config(m: ModelConfig, vocab_size: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size, n_positions=m.max_positions, n_embd=m.n_embd, n_layer=m.n_layer,
        n_head=m.n_head, n_inner=m.n_inner, resid_pdrop=m.dropout, embd_pdrop=m.dropout,
        attn_pdrop=m.dropout, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
    )


def split(model: GPT2LMHeadModel, checkpoint_blocks: bool = False) -> SplitLM:
    t = model.transformer
    return SplitLM(GPT2Embedding(t.wte, t.wpe, t.drop), [HFBlock(b) for b in t.h],
                   GPT2Head(t.ln_f, model.lm_head), hf_model=model, checkpoint_blocks=checkpoint_blocks)


MODEL_CLASS = GPT2LMHeadModel
