"""Model builders: transformers models with random init (or pretrained weights), split into
embedding | blocks | head (see split.py)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import gpt2, llama
from .split import SplitLM, lm_loss

ARCHS = {"gpt2": gpt2, "llama": llama}
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama"}


def param_dtype(precision: str) -> torch.dtype:
    """The one place the parameter dtype is decided: fp64 in verification mode, else fp32
    (bf16 autocasts the matmuls; its parameters and optimizer states stay fp32)."""
    return torch.float64 if precision == "fp64" else torch.float32


def build_hf_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu", precision: str = "fp32"):
    """The transformers model. Seeded so every rank (and the reference) starts identical.

    fp64 initialises (or loads) exactly as fp32 does and only then casts, so an fp64 run
    starts from the fp32 run's weights and the two can be compared."""
    arch = ARCHS[m.arch]
    if m.pretrained:
        model = _load_pretrained(m, device)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = arch.MODEL_CLASS(arch.hf_config(m, vocab_size))
    dtype = param_dtype(precision)
    if dtype != torch.float32:
        model = model.to(dtype)
        arch.keep_dtype(model)
    return model


def _load_pretrained(m: ModelConfig, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(m.pretrained)
    if hf_cfg.model_type != HF_MODEL_TYPES[m.arch]:  # validate checked it; a hub name may change since
        from ..validate import check_model_type

        check_model_type(m, hf_cfg.model_type)
    model = AutoModelForCausalLM.from_pretrained(m.pretrained, attn_implementation="sdpa",
                                                 torch_dtype=torch.float32)
    return model.to(device)


def build_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu", checkpoint_blocks: bool = False,
                tp_comm=None, sequence_parallel: bool = False, precision: str = "fp32") -> SplitLM:
    """The seeded model split into embedding | blocks | head; with `tp_comm` (a TPComm of
    size > 1) the architecture's TP plan is applied first, so every rank shards the very
    weights the single-process run starts from."""
    arch = ARCHS[m.arch]
    hf = build_hf_model(m, vocab_size, seed, device, precision)
    # Train mode only matters for dropout; from_pretrained returns eval mode, random init train.
    hf.train(m.dropout > 0)
    if tp_comm is None or tp_comm.size == 1:
        return arch.split(hf, checkpoint_blocks)
    from ..parallel.tensor_parallel import apply_plan
    from ..validate import check_tp_sizes

    check_tp_sizes(arch.tp_sizes(hf.config), tp_comm.size)  # validated on the meta model; cheap to repeat
    apply_plan(hf, arch.TP_PLAN, tp_comm, sequence_parallel, arch.localize_heads)
    model = arch.split(hf, checkpoint_blocks)
    model.loss_fn = model.head.lm_head.loss  # vocab-parallel cross-entropy on sharded logits
    if sequence_parallel:
        if hasattr(model.embedding, "seq_shard"):
            model.embedding.seq_shard = (tp_comm.rank, tp_comm.size)
        for block in model.blocks:
            block.seq_shards = tp_comm.size
    return model


def with_pretrained_sizes(m: ModelConfig) -> ModelConfig:
    """`m` with the sizes of its pretrained checkpoint's config.json in place of the preset's,
    so config.yaml, the banner and W&B say what the run trains."""
    from dataclasses import replace

    from transformers import AutoConfig

    return replace(m, **ARCHS[m.arch].model_sizes(AutoConfig.from_pretrained(m.pretrained)))


def num_positions(hf_model) -> int:
    c = hf_model.config
    return getattr(c, "n_positions", None) or c.max_position_embeddings


__all__ = ["build_model", "build_hf_model", "param_dtype", "SplitLM", "lm_loss", "num_positions", "ARCHS",
           "with_pretrained_sizes"]
