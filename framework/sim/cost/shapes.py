"""A model's shapes, read from `model.*` without building it (any size: a 405B preset is a
few integers), and the layout the op lists are cut for.

The architectures are the framework's three (framework/models/): `gpt2` (LayerNorm with
bias, fused QKV, biases on every linear, GELU MLP of n_inner = 4 h, learned positions),
`llama` (RMSNorm, separate q / k / v / o without bias, grouped-query attention, SwiGLU MLP,
rotary positions) and `qwen3_moe` (llama's attention plus q / k RMSNorms over head_dim,
a router and E routed SwiGLU experts in every layer, no shared expert). The defaults are
the builders': n_inner null = 4 h, n_kv_head null = n_head, expert_inner null = h.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # the dense MLP's width (the gated MLP's each of gate and up)
    vocab: int
    tied: bool
    experts: int = 0  # routed experts per layer (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    positions: int = 0  # gpt2's learned position table's rows (max_positions)
    dropout: float = 0.0  # whether recomputation repeats a block's last collective (traffic.py)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> bool:  # SwiGLU: gate and up, then down
        return self.arch != "gpt2"

    @property
    def bias(self) -> bool:
        return self.arch == "gpt2"

    @staticmethod
    def of(m: ModelConfig, vocab: int) -> ModelShape:
        moe = m.arch == "qwen3_moe"
        return ModelShape(m.arch, m.n_layer, m.n_embd, m.n_head, m.n_kv_head or m.n_head,
                          m.n_inner or 4 * m.n_embd, vocab, m.tie_embeddings,
                          m.moe.experts if moe else 0, m.moe.top_k if moe else 0,
                          (m.moe.expert_inner or m.n_embd) if moe else 0, m.max_positions if m.arch == "gpt2" else 0,
                          m.dropout)

    # --- parameters (the memory model's and the FLOP count's N) ---------------------------

    def norm_params(self) -> int:
        """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
        return 2 * self.hidden if self.arch == "gpt2" else self.hidden

    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        weights = h * h + 2 * h * kv + h * h  # q, k, v, o
        if self.bias:
            weights += h + 2 * kv + h
        if self.arch == "qwen3_moe":
            weights += 2 * self.head_dim  # q_norm, k_norm over head_dim
        return weights

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn
        if self.experts:
            return h * self.experts + self.experts * 3 * h * self.expert_ffn  # router, experts
        return (3 * h * f) if self.gated else (2 * h * f + f + h)

    def block_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def routed_params(self) -> int:
        return self.layers * self.experts * 3 * self.hidden * self.expert_ffn

    def embedding_params(self) -> int:
        """The lookup tables: tokens (and GPT-2's positions)."""
        return self.vocab * self.hidden + (self.positions * self.hidden if self.arch == "gpt2" else 0)

    def head_params(self) -> int:
        """The final norm and the LM head matmul (tied: the token table, counted here once)."""
        return self.norm_params() + self.vocab * self.hidden

    def matmul_params(self) -> int:
        """N of metrics/flops.py: everything but the lookup tables, routed experts at k / E."""
        dense = self.layers * self.block_params() + self.head_params()
        return dense - (self.routed_params() * (self.experts - self.top_k) // self.experts if self.experts else 0)

    def param_tensors(self) -> int:
        """Parameter tensors (the optimizer's per-tensor launches): per block GPT-2's 12 (two
        norms' weight and bias, four linears' weight and bias), llama's 9, qwen3_moe's 11."""
        per = {"gpt2": 12, "llama": 9, "qwen3_moe": 11}[self.arch]
        outside = (4 if self.arch == "gpt2" else 2) + (0 if self.tied else 1)
        return self.layers * per + outside

    def total_params(self) -> int:
        untied_head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.block_params() + self.embedding_params() + self.norm_params() + untied_head


@dataclass(frozen=True)
class Layout:
    """What the op lists are cut for: one micro-batch of `micro_batch` sequences of
    `seq_len` tokens on one rank of tp / sp / ep / cp, in `dtype_bytes` activations."""

    micro_batch: int
    seq_len: int
    tp: int = 1
    sp: bool = False
    ep: int = 1
    recompute: bool = False
    dtype: str = "bf16"  # the GEMMs' dtype in the profile's tables
    activation_bytes: int = 0  # bytes per activation element; 0: the GEMMs' dtype's
    cp: int = 1  # context parallel: a rank holds seq_len / cp of each sequence (its `tokens`)
    cp_comm: str = "allgather"  # ops.py's attention, traffic.py's cp collectives, activations.py
    selective: bool = False  # trainer.recompute=selective: the attention core recomputed (activations.py)
    cp_balance: str = "headtail"  # which chunks a cp rank holds (context_parallel.token_pieces)
    fp8: str = "none"  # precision.fp8: the blocks' linears' GEMMs at the profile's fp8 rate, plus their casts
    compiled: bool = False  # trainer.compile=blocks: a block's elementwise ops fused (ops.py)
    # ZeRO-R's Pa (trainer.partition_activations): a checkpointed block input kept as 1/tp slices,
    # all-gathered before its recomputation; "cpu": those slices in host memory (Pa+cpu)
    partition: str = "none"  # none | tp | cpu

    @property
    def tokens(self) -> int:
        """A micro-batch's tokens on one rank (1 / cp of each sequence)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def act_bytes(self) -> int:
        return self.activation_bytes or {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8}[self.dtype]
