"""Qwen3-MoE from transformers 5 (`Qwen3MoeForCausalLM`), split for parallelism: routed experts.

Each decoder layer's MLP is a sparse MoE block: a top-k router (`Qwen3MoeTopKRouter`:
softmax over `model.moe.experts` logits, the k largest, renormalised to sum to 1 when
`model.moe.norm_topk_prob`) and the experts as one fused module (`gate_up_proj` (E, 2I, H),
`down_proj` (E, H, I)), run here by transformers' per-expert loop (`experts_implementation=
"eager"`: the CPU path; grouped GEMM is not used, see docs/moe.md). Attention is Llama's with
q / k norms, so the split is Llama's: embed_tokens | decoder layers with the shared rotary
embedding | norm + lm_head.

Every sparse block runs framework/models/moe_layer.py's forward (`install_moe`): the routing
options of `model.moe`, aux losses, statistics, and with expert parallelism its experts split
over the ep group, tokens dispatched and combined by framework/comm/expert_parallel.py. Tensor
parallelism splits attention as Llama's plan does; the MoE block is not split over tp (its
experts and router are replicated over tp, like the norms).
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeRMSNorm, Qwen3MoeSparseMoeBlock,
                                                               Qwen3MoeTopKRouter)

from framework.config import ModelConfig, MoEConfig
from framework.comm.expert_parallel import shard_experts
from framework.models.moe_layer import MoERuntime
from framework.models.llama import TP_PLAN as LLAMA_TP_PLAN
from framework.models.llama import _rms_norm
from framework.models.llama import localize_heads as llama_localize_heads
from framework.models.llama import split as llama_split


def hf_config(m: ModelConfig, vocab_size: int) -> Qwen3MoeConfig:
    moe = m.moe
    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=m.n_embd, num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
        num_key_value_heads=m.n_kv_head or m.n_head, head_dim=m.n_embd // m.n_head,
        intermediate_size=m.n_inner or 4 * m.n_embd, moe_intermediate_size=moe.expert_inner or m.n_embd,
        num_experts=moe.experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=m.max_positions,
        attention_dropout=m.dropout, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
        experts_implementation="eager", output_router_logits=False,
    )


def model_sizes(c: Qwen3MoeConfig, moe: MoEConfig = MoEConfig()) -> dict:
    """The ModelConfig keys a Qwen3MoeConfig sets (hf_config's inverse); the routing options
    the checkpoint does not fix (score, capacity, aux losses, bias) are kept from `moe`."""
    return dict(n_layer=c.num_hidden_layers, n_embd=c.hidden_size, n_head=c.num_attention_heads,
                n_kv_head=c.num_key_value_heads, n_inner=c.intermediate_size,
                max_positions=c.max_position_embeddings, vocab_size=c.vocab_size,
                tie_embeddings=bool(c.tie_word_embeddings),
                moe=dataclasses.replace(moe, experts=c.num_experts, top_k=c.num_experts_per_tok,
                                        expert_inner=c.moe_intermediate_size,
                                        norm_topk_prob=bool(c.norm_topk_prob)))


def _router(self: Qwen3MoeTopKRouter, hidden_states: torch.Tensor):
    """Qwen3MoeTopKRouter.forward with the softmax in at least fp32 (transformers': exactly
    fp32, which would round an fp64 verification run's routing weights to fp32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    probs = F.softmax(router_logits, dtype=torch.promote_types(router_logits.dtype, torch.float32), dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), index


init_module = None  # transformers' _init_weights per module (the experts' normal init included)


def keep_dtype(model: Qwen3MoeForCausalLM) -> None:
    """fp64: RMSNorm and the router's softmax upcast to at least fp32, not to exactly fp32."""
    for module in model.modules():
        if isinstance(module, Qwen3MoeRMSNorm):
            module.forward = types.MethodType(_rms_norm, module)
        elif isinstance(module, Qwen3MoeTopKRouter):
            module.forward = types.MethodType(_router, module)


# Llama's split: the same module names (embed_tokens, layers with the shared rotary, norm, lm_head).
split = llama_split


MODEL_CLASS = Qwen3MoeForCausalLM
# Llama's plan without the MLP entries: attention, embedding and head split over tp; the
# sparse MoE block replicated over tp (docs/moe.md).
TP_PLAN = {**{k: v for k, v in LLAMA_TP_PLAN.items() if ".mlp" not in k},
           "model.layers.*.self_attn.q_norm": "head_norm", "model.layers.*.self_attn.k_norm": "head_norm"}
localize_heads = llama_localize_heads


def install_moe(hf: Qwen3MoeForCausalLM, m: ModelConfig, device, ep_comm=None, sp_group=None) -> MoERuntime:
    """Every sparse block runs framework/models/moe_layer.py's forward (our routing options,
    aux losses and statistics); with `ep_comm` its experts are split over the ep group."""
    if ep_comm is not None and ep_comm.size > 1:
        for module in hf.modules():
            if isinstance(module, Qwen3MoeSparseMoeBlock):
                shard_experts(module.experts, ep_comm)
    runtime = MoERuntime(m.moe, ep_comm if ep_comm is not None and ep_comm.size > 1 else None, sp_group)
    runtime.install(hf, Qwen3MoeSparseMoeBlock, device)
    return runtime


def tp_sizes(c) -> dict[str, int]:
    return {"model.n_head": c.num_attention_heads, "model.n_kv_head": c.num_key_value_heads}
