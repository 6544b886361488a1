"""Model builders: transformers models with random init (or pretrained weights), split into
embedding | blocks | head (see split.py)."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from framework.config import ModelConfig
from framework.precision import policy_of
from framework.models import gpt2, llama, qwen3_moe
from framework.models.checks import HF_MODEL_TYPES, check_model_type, check_tp_sizes
from framework.models.materialise import PretrainedWeights, RandomInit, materialise, materialise_buffers
from framework.models.split import SplitLM, lm_loss

ARCHS = {"gpt2": gpt2, "llama": llama, "qwen3_moe": qwen3_moe}


def param_dtype(precision: str) -> torch.dtype:
    """The parameters' dtype under a trainer.precision mode (framework/precision.py decides)."""
    return policy_of(precision).param_dtype


def meta_hf_model(m: ModelConfig, vocab_size: int, precision: str = "fp32"):
    """The transformers model on the meta device, in the run's parameter dtype: shapes and
    names, no memory. A pretrained model takes its checkpoint's config.json."""
    arch = ARCHS[m.arch]
    with torch.device("meta"):
        if m.pretrained:
            from transformers import AutoConfig, AutoModelForCausalLM

            hf_cfg = AutoConfig.from_pretrained(m.pretrained)
            if hf_cfg.model_type != HF_MODEL_TYPES[m.arch]:  # validate checked it; a hub name may change since
                check_model_type(m, hf_cfg.model_type)
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
        else:
            model = arch.MODEL_CLASS(arch.hf_config(m, vocab_size))
    dtype = param_dtype(precision)
    if dtype != torch.float32:
        model = model.to(dtype)
        arch.keep_dtype(model)
    return model


def values_for(m: ModelConfig, vocab_size: int, seed: int):
    """Where a rank's parameter values come from (framework/models/materialise.py): the
    pretrained checkpoint's safetensors, else the seeded per-module initialisation."""
    if m.pretrained:
        path = _local_checkpoint(m.pretrained)
        if path is not None:
            return PretrainedWeights(path, meta_hf_model(m, vocab_size).base_model_prefix)
        return _WholeCheckpoint(m)  # .bin weights: no per-slice reads
    return RandomInit(meta_hf_model(m, vocab_size), seed, ARCHS[m.arch].init_module)


def _local_checkpoint(name: str) -> Optional[str]:
    """The directory holding the checkpoint's safetensors (a local path, or the HF cache's
    snapshot of a hub name), or None when it only has .bin weights."""
    path = name
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
    has = any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))
    return path if has else None


class _WholeCheckpoint:
    """A checkpoint without safetensors: transformers loads it whole, once per rank."""

    def __init__(self, m: ModelConfig):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(m.pretrained, attn_implementation="sdpa", dtype=torch.float32)
        self.state = dict(model.named_parameters())

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        from framework.models.materialise import _local

        return _local(self.state.pop(name).detach(), p).clone()  # popped: the whole model is not kept


def build_hf_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu", precision: str = "fp32"):
    """The whole transformers model with its values (the seeded init or the pretrained
    weights), exactly those every rank gives the parameters it keeps. `device="meta"`: the
    shapes only.

    fp64 initialises (or loads) exactly as fp32 does and only then casts, so an fp64 run
    starts from the fp32 run's weights and the two can be compared."""
    model = meta_hf_model(m, vocab_size, precision)
    if str(device) != "meta":
        materialise(model, model.parameters(), values_for(m, vocab_size, seed), device)
        materialise_buffers(model, device)
    return model


def build_model(m: ModelConfig, vocab_size: int, seed: int, device="cpu", checkpoint_blocks: bool = False,
                tp_comm=None, sequence_parallel: bool = False, precision: str = "fp32",
                on_meta: bool = False, whole_first: bool = False, ep_comm=None) -> SplitLM:
    """The model split into embedding | blocks | head; with `tp_comm` (a TPComm of size > 1)
    the architecture's TP plan is applied first, so every rank shards the very weights the
    single-process run starts from.

    `on_meta`: parameters stay on the meta device and the caller materialises the ones it
    keeps with `model.fill(params)` (the pipeline stage; ZeRO unit by unit); buffers are
    made here. Otherwise every parameter gets its values. `whole_first`: every parameter
    gets its values before tp sharding (debug.materialise_whole: the old start-up).
    `ep_comm` (an EPComm of size > 1): the experts of every MoE layer are split over it
    (framework/comm/expert_parallel.py) before anything is materialised."""
    arch = ARCHS[m.arch]
    hf = meta_hf_model(m, vocab_size, precision)
    # Train mode only matters for dropout; from_pretrained returns eval mode, random init train.
    hf.train(m.dropout > 0)
    materialise_buffers(hf, device)
    values = values_for(m, vocab_size, seed)
    if whole_first:
        materialise(hf, hf.parameters(), values, device)
    moe = None
    if hasattr(arch, "install_moe"):  # before materialising: expert parallelism reshapes the experts
        sp = tp_comm is not None and tp_comm.size > 1 and sequence_parallel  # tokens split over tp
        moe = arch.install_moe(hf, m, device, ep_comm, tp_comm.group if sp else None)
    if tp_comm is None or tp_comm.size == 1:
        model = arch.split(hf, checkpoint_blocks)
    else:
        from framework.comm.tensor_parallel import apply_plan

        check_tp_sizes(arch.tp_sizes(hf.config), tp_comm.size)  # validated on the meta model; cheap to repeat
        apply_plan(hf, arch.TP_PLAN, tp_comm, sequence_parallel, arch.localize_heads)  # meta shards
        model = arch.split(hf, checkpoint_blocks)
        model.loss_fn = model.head.lm_head.loss  # vocab-parallel cross-entropy on sharded logits
        if sequence_parallel:
            if hasattr(model.embedding, "seq_shard"):
                model.embedding.seq_shard = (tp_comm.rank, tp_comm.size)
            for block in model.blocks:
                block.seq_shards = tp_comm.size
    # model.fill(params): give these (meta) parameters their values on `device`; a no-op for
    # parameters that have them. Runners call it for what they keep (pipeline stages, ZeRO units).
    model.fill = functools.partial(materialise, hf, values=values, device=device)
    model.ep_comm, model.moe = ep_comm, moe  # moe: the MoERuntime (framework/models/moe_layer.py)
    if not on_meta:
        model.fill(hf.parameters())
    return model


def with_pretrained_sizes(m: ModelConfig) -> ModelConfig:
    """`m` with the sizes of its pretrained checkpoint's config.json in place of the preset's,
    so config.yaml, the banner and W&B say what the run trains."""
    from dataclasses import replace

    from transformers import AutoConfig

    # `m.moe`: what a MoE checkpoint's config does not fix (the routing options) is kept
    return replace(m, **ARCHS[m.arch].model_sizes(AutoConfig.from_pretrained(m.pretrained), m.moe))


def num_positions(hf_model) -> int:
    c = hf_model.config
    return getattr(c, "n_positions", None) or c.max_position_embeddings


__all__ = ["build_model", "build_hf_model", "meta_hf_model", "materialise", "values_for", "param_dtype", "SplitLM", "lm_loss", "num_positions", "ARCHS",
           "with_pretrained_sizes"]
