"""GPT-2 (Radford et al., 2019) from transformers' GPT2LMHeadModel, split for parallelism."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from framework.config import ModelConfig
from framework.models.split import HFBlock, SplitLM


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.seq_shard = (0, 1)  # (rank, shards): sequence parallelism keeps T/shards positions
        self.positions = None  # context parallelism: the ids' places in the whole sequence

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rank, shards = self.seq_shard
        pos = (torch.arange(input_ids.size(1), device=input_ids.device) if self.positions is None
               else self.positions.to(input_ids.device))
        pos = pos.chunk(shards)[rank]  # (T/shards,)
        return self.drop(self.wte(input_ids) + self.wpe(pos))  # (B, T/shards, H)


class GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))  # (B, T, V)


def keep_dtype(model: GPT2LMHeadModel) -> None:
    """fp64 verification mode: nothing to adjust; GPT-2's LayerNorm and SDPA attention compute
    in the parameters' dtype (checked in tests/test_equivalence.py)."""


def hf_config(m: ModelConfig, vocab_size: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size, n_positions=m.max_positions, n_embd=m.n_embd, n_layer=m.n_layer,
        n_head=m.n_head, n_inner=m.n_inner, resid_pdrop=m.dropout, embd_pdrop=m.dropout,
        attn_pdrop=m.dropout, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
        # GPT-2's defaults (50256) lie outside smaller vocabularies (the byte tokenizer's 257),
        # which transformers 5 warns about on every build: the last id ends a document there.
        bos_token_id=min(50256, vocab_size - 1), eos_token_id=min(50256, vocab_size - 1),
    )


def model_sizes(c: GPT2Config, moe=None) -> dict:
    """The ModelConfig keys a GPT2Config sets (hf_config's inverse): a pretrained run records
    its checkpoint's real sizes, not its preset's."""
    return dict(n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, n_inner=c.n_inner, n_kv_head=None,
                max_positions=c.n_positions, vocab_size=c.vocab_size, tie_embeddings=bool(c.tie_word_embeddings))


def split(model: GPT2LMHeadModel, checkpoint_blocks: bool = False) -> SplitLM:
    t = model.transformer
    return SplitLM(GPT2Embedding(t.wte, t.wpe, t.drop), [HFBlock(b) for b in t.h],
                   GPT2Head(t.ln_f, model.lm_head), hf_model=model, checkpoint_blocks=checkpoint_blocks)


MODEL_CLASS = GPT2LMHeadModel


def init_module(hf: GPT2LMHeadModel, path: str, module: nn.Module) -> None:
    """What GPT2PreTrainedModel._init_weights does to this module from its parent's call:
    the residual projections (attention and MLP c_proj) drawn with std / sqrt(2 n_layer)
    (GPT-2 paper; framework/models/materialise.py initialises module by module)."""
    if path.endswith(("attn.c_proj", "mlp.c_proj")):
        c = hf.config
        torch.nn.init.normal_(module.weight, mean=0.0, std=c.initializer_range / math.sqrt(2 * c.n_layer))

# Tensor-parallel plan (styles in framework/comm/tensor_parallel.py). `c_attn` is the fused
# [q | k | v] projection: split per head in each third, so a rank holds whole heads of all three.
# c_attn and c_fc are the only readers of their region's input, so they enter it themselves
# (with sequence parallelism they then keep only the input's shard for backward).
TP_PLAN = {
    "transformer.wte": "vocab_embedding",
    "transformer.h.*.attn": "heads",
    "transformer.h.*.attn.c_attn": "colwise_qkv_entry",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise_entry",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "vocab_head",
}


def localize_heads(attn: nn.Module, tp: int) -> None:
    """GPT2Attention splits c_attn's output by split_size: with n_head/tp heads per rank."""
    attn.num_heads //= tp
    attn.split_size //= tp
    attn.embed_dim //= tp


def tp_sizes(c) -> dict[str, int]:
    """What tensor parallelism splits, by the config key that sets it."""
    return {"model.n_head": c.n_head, "model.n_inner": c.n_inner or 4 * c.n_embd}
