"""Llama (Touvron et al., 2023) from transformers' LlamaForCausalLM, split for parallelism."""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from framework.config import ModelConfig
from framework.models.split import HFBlock, SplitLM


class LlamaEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # (B, T, H); positions enter as rotary in each block


class LlamaHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # (B, T, V)


def hf_config(m: ModelConfig, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.n_embd, intermediate_size=m.n_inner or 4 * m.n_embd,
        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
        num_key_value_heads=m.n_kv_head or m.n_head, max_position_embeddings=m.max_positions,
        attention_dropout=m.dropout, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
    )


def model_sizes(c: LlamaConfig, moe=None) -> dict:
    """The ModelConfig keys a LlamaConfig sets (hf_config's inverse)."""
    return dict(n_layer=c.num_hidden_layers, n_embd=c.hidden_size, n_head=c.num_attention_heads,
                n_kv_head=c.num_key_value_heads, n_inner=c.intermediate_size,
                max_positions=c.max_position_embeddings, vocab_size=c.vocab_size,
                tie_embeddings=bool(c.tie_word_embeddings))


def _rms_norm(self: LlamaRMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, upcasting to at least fp32 where transformers casts to fp32."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


init_module = None  # transformers' _init_weights per module is the whole Llama scheme


def keep_dtype(model: LlamaForCausalLM) -> None:
    """fp64 verification mode: transformers' RMSNorm computes in fp32, which would round every
    norm's input and incoming gradient to fp32 and put fp32 noise back into an fp64 run.
    Its own formula, upcast instead. (The rotary tables stay computed in fp32 then cast: a
    constant of the positions, identical in every layout, with no gradient.)"""
    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            module.forward = types.MethodType(_rms_norm, module)


def split(model: LlamaForCausalLM, checkpoint_blocks: bool = False) -> SplitLM:
    inner = model.model
    return SplitLM(LlamaEmbedding(inner.embed_tokens), [HFBlock(b, inner.rotary_emb) for b in inner.layers],
                   LlamaHead(inner.norm, model.lm_head), hf_model=model, checkpoint_blocks=checkpoint_blocks)


MODEL_CLASS = LlamaForCausalLM

# Tensor-parallel plan (styles in framework/comm/tensor_parallel.py). Heads are contiguous
# in q / k / v, so a plain column split gives each rank n_head/tp query heads and the
# n_kv_head/tp key-value heads they attend with (the grouped-query ratio is unchanged).
TP_PLAN = {
    "model.embed_tokens": "vocab_embedding",
    "model.layers.*.self_attn": "attention",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "mlp",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_head",
}


def localize_heads(attn: nn.Module, tp: int) -> None:
    """LlamaAttention shapes heads with view(..., -1, head_dim) and keeps num_key_value_groups,
    which tp leaves unchanged: nothing to adjust."""


def tp_sizes(c) -> dict[str, int]:
    """What tensor parallelism splits, by the config key that sets it."""
    return {"model.n_head": c.num_attention_heads, "model.n_kv_head": c.num_key_value_heads,
            "model.n_inner": c.intermediate_size}
