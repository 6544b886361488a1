"""Selective recomputation (`trainer.recompute=selective`; Korthikanti et al., 2022, sec. 5):
the attention core (Q Kᵀ, softmax, dropout, the product with V) runs under a non-reentrant
torch.utils.checkpoint, so autograd keeps only its inputs and backward runs it again.
(`full`, the old `activation_checkpointing`, checkpoints each whole block: split.py.)

It wraps whichever attention function the model already uses (transformers' SDPA, or context
parallelism's, which then repeats its K / V gather or its ring in backward), registered under
a new name in transformers' attention interface, so the models are not copied. What it saves
depends on that function: SDPA's flash kernels never store the (T x T) probabilities, so it
frees little beyond the log-sum-exp there; the ring's blockwise products store them, and it
frees those (framework/sim/cost/activations.py counts both).
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def _recomputed(fn):
    def core(module, query, key, value, attention_mask, **kwargs):
        return checkpoint(fn, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)
    return core


def install(model: nn.Module) -> None:
    """Every attention module of the model: its current attention function, recomputed."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            current = module.config._attn_implementation
            if current.endswith("+recomputed"):
                continue  # the config is shared by every layer: wrapped once
            name = f"{current}+recomputed"
            AttentionInterface.register(name, _recomputed(ALL_ATTENTION_FUNCTIONS[current]))
            module.config._attn_implementation = name
