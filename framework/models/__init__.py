"""Model builders: transformers models with random init (or pretrained weights), split into
embedding | blocks | head (see split.py)."""

from __future__ import annotations

import torch

from ..config import ConfigError, ModelConfig
from . import gpt2, llama
from .split import SplitLM, lm_loss

ARCHS = {"gpt2": gpt2, "llama": llama}
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama"}


def build_hf_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu"):
    """The transformers model. Seeded so every rank (and the reference) starts identical."""
    arch = ARCHS[m.arch]
    if m.pretrained:
        return _load_pretrained(m, device)
    torch.manual_seed(seed)
    with torch.device(device):
        return arch.MODEL_CLASS(arch.hf_config(m, vocab_size))


def _load_pretrained(m: ModelConfig, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(m.pretrained)
    if hf_cfg.model_type != HF_MODEL_TYPES[m.arch]:
        raise ConfigError("model.pretrained", m.pretrained, f"is a {hf_cfg.model_type} model, not {m.arch}",
                          f"use a {m.arch} checkpoint or model.arch={hf_cfg.model_type}")
    model = AutoModelForCausalLM.from_pretrained(m.pretrained, attn_implementation="sdpa",
                                                 torch_dtype=torch.float32)
    return model.to(device)


def build_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu",
                checkpoint_blocks: bool = False) -> SplitLM:
    hf = build_hf_model(m, vocab_size, seed, device)
    # Train mode only matters for dropout; from_pretrained returns eval mode, random init train.
    hf.train(m.dropout > 0)
    return ARCHS[m.arch].split(hf, checkpoint_blocks)


def num_positions(hf_model) -> int:
    c = hf_model.config
    return getattr(c, "n_positions", None) or c.max_position_embeddings


__all__ = ["build_model", "build_hf_model", "SplitLM", "lm_loss", "num_positions", "ARCHS"]
