"""The `model` group (with `model.moe`) and the `data` group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.config.rules import _HF, _LABEL, _MOE, _PYCODE, _SYNTHETIC, MAX_COUNT, MAX_WIDTH, key


@dataclass
class MoEConfig:
    """Routed experts (model.arch=qwen3_moe; docs/moe.md). Ignored by dense architectures."""

    experts: int = key(4, ge=1, le=MAX_COUNT, **_MOE)  # routed experts per MoE layer
    top_k: int = key(2, ge=1, le="model.moe.experts", **_MOE)  # experts each token is sent to
    expert_inner: Optional[int] = key(None, ge=1, le=MAX_WIDTH, **_MOE)  # an expert's MLP width; null = n_embd
    # renormalise the k routing weights to sum to 1 (Qwen3-MoE, Mixtral)
    norm_topk_prob: bool = key(True, **_MOE)
    # Routing and balancing (framework/models/moe_routing.py; docs/moe.md "Routing and balancing").
    score: str = key("softmax", choices=("softmax", "sigmoid"), **_MOE)  # sigmoid: DeepSeek-V3
    # null (or .inf) = dropless; else ceil(cf * seq_len * k / E) per sequence and expert
    capacity_factor: Optional[float] = key(None, gt=0, inf=True, **_MOE)
    # over capacity, keep the highest-score (probs) or earliest (position) tokens
    drop_policy: str = key("probs", choices=("probs", "position"), **_MOE)
    # [{type: aux | seq_aux | z, coeff: 0.01}]
    aux_losses: list[dict[str, Any]] = key(factory=list, free="a list of dicts: framework/validate/expert.py",
                                           **_MOE)
    # auto (grouped on CUDA when it can) | loop (per-expert matmuls) | grouped
    experts_impl: str = key("auto", choices=("auto", "loop", "grouped"), **_MOE)
    bias_update_rate: float = key(0.0, ge=0, **_MOE)  # DeepSeek-V3 auxiliary-loss-free balancing: expert bias step; 0 = off


@dataclass
class ModelConfig:
    name: str = key("gpt2-tiny", free=_LABEL)
    arch: str = key("gpt2", choices=("gpt2", "llama", "qwen3_moe"))
    n_layer: int = key(2, ge=1, le=4096)
    n_embd: int = key(64, ge=1, le=MAX_WIDTH)
    n_head: int = key(4, ge=1, le="model.n_embd")
    n_kv_head: Optional[int] = key(None, ge=1, le="model.n_head")  # llama grouped-query attention; null = n_head
    n_inner: Optional[int] = key(None, ge=1, le=MAX_WIDTH)  # MLP width; null = 4 * n_embd (gpt2) / llama default
    max_positions: int = key(128, ge=1, le=MAX_WIDTH)
    vocab_size: Optional[int] = key(None, ge=1, le=1 << 24)  # null = the data's tokenizer vocabulary
    dropout: float = key(0.0, ge=0, lt=1)
    tie_embeddings: bool = True
    # hub name or local path; weights replace random init
    pretrained: Optional[str] = key(None, nonempty=True, free="a hub name or a directory: framework/validate/paths.py")
    moe: MoEConfig = field(default_factory=MoEConfig)  # qwen3_moe: the routed experts


@dataclass
class DataConfig:
    name: str = key("pycode", choices=("pycode", "synthetic", "hf"))
    seq_len: int = key(64, ge=1, le="model.max_positions")
    # "bytes" (no download) or a transformers tokenizer name / path
    tokenizer: str = key("bytes", nonempty=True, free="a tokenizer name: loaded when the data is prepared")
    max_files: Optional[int] = key(400, ge=1, le=MAX_COUNT, **_PYCODE)  # pycode: first N stdlib files (sorted); null = all
    # hf: dataset name, local dir, or loader ("json", "text")
    path: Optional[str] = key(None, nonempty=True, free="a dataset name or loader: framework/validate/paths.py", **_HF)
    # hf: local file(s) for a loader
    data_files: Optional[str] = key(None, nonempty=True, free="local files: framework/validate/paths.py", **_HF)
    text_field: str = key("text", nonempty=True, free="a column: checked on the loaded dataset", **_HF)
    split: str = key("train", nonempty=True, free="a split name: checked when the dataset loads", **_HF)
    num_samples: int = key(4096, ge=1, le=MAX_COUNT, **_SYNTHETIC)  # synthetic: number of sequences
    vocab_size: int = key(256, ge=1, le=1 << 24, **_SYNTHETIC)  # synthetic: token ids drawn from [0, vocab_size)
    # packed-token cache; null = ~/.cache/framework
    cache_dir: Optional[str] = key(None, nonempty=True, free="a directory: framework/validate/paths.py")
    # Held-out data for trainer.eval_interval (val_loss); no training step ever sees it.
    val_files: int = key(20, ge=0, le=MAX_COUNT, **_PYCODE)  # pycode: the last N stdlib files (sorted), never trained on
    # hf: a split of the dataset to evaluate on (e.g. validation) ...
    val_split: Optional[str] = key(None, nonempty=True, free="a split name: checked when the dataset loads", **_HF)
    val_fraction: float = key(0.0, ge=0, lt=1, **_HF)  # ... or this last fraction of the training split's documents, held out
