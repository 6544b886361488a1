"""A causal LM as embedding | blocks | head: the unit every parallel layout cuts up.

`SplitLM` holds (a slice of) a transformers model's modules, not copies: the embedding
(token + position embedding), a list of transformer blocks and the head (final norm + LM
head). Composed in order they compute exactly the transformers model's forward and loss
(tests/test_models.py). A pipeline stage is a SplitLM with the embedding only on the first
stage and the head only on the last.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels are already shifted (labels[t] = input[t+1]).

    Upcast to fp32 as transformers' ForCausalLMLoss does, so bf16 runs score alike; to at
    least fp32, so fp64 verification runs stay fp64.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class SplitLM(nn.Module):
    def __init__(self, embedding: Optional[nn.Module], blocks: list[nn.Module], head: Optional[nn.Module],
                 hf_model: Optional[nn.Module] = None, checkpoint_blocks: bool = False,
                 loss_fn: Callable = lm_loss):
        super().__init__()
        self.loss_fn = loss_fn  # the vocab-parallel cross-entropy under tensor parallelism
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.checkpoint_blocks = checkpoint_blocks
        # ZeRO-R's Pa / Pa+cpu (framework/comm/activation_partition.py): a Partition whose
        # checkpoint keeps 1/tp of each block input; None: torch's checkpoint keeps it whole
        self.partition = None
        # context parallelism (framework/parallel/context_parallel.py): the first stage keeps
        # this rank's tokens of the ids, the last its tokens of the labels; None: all of them
        self.context = None
        # Kept outside the module tree: registering it would list every parameter twice in
        # state_dict. It gives the transformers names for checkpoints and comparisons.
        object.__setattr__(self, "_hf", hf_model)

    @property
    def hf_model(self) -> Optional[nn.Module]:
        return self._hf

    def stage(self, blocks: range, first: bool, last: bool) -> SplitLM:
        """A pipeline stage: blocks[i] for i in `blocks`, the embedding if first, the head if
        last; the same modules (not copies) and the same loss."""
        stage = SplitLM(self.embedding if first else None, [self.blocks[i] for i in blocks],
                        self.head if last else None, self.hf_model, self.checkpoint_blocks, self.loss_fn)
        stage.context, stage.partition = self.context, self.partition
        return stage

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        slab = None  # MD: this micro-batch's partitioned checkpoints in one slab (activation_partition.py)
        for i, block in enumerate(self.blocks):
            if self.checkpoint_blocks and torch.is_grad_enabled():
                if self.partition is not None and h.requires_grad:
                    if slab is None:
                        slab = self.partition.slab(len(self.blocks) - i, h)
                    h = self.partition.checkpoint(block, h, slab)
                else:  # non-reentrant: works with DDP's no_sync and with saved-tensor hooks
                    h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return h

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, H) elsewhere. Returns the
        loss on the last stage when labels are given, logits (B, T, V) without, else (B, T, H)."""
        if self.context is not None:  # (B, T) -> this cp rank's (B, T / cp) tokens
            x = self.context.shard(x) if self.embedding is not None else x
            labels = self.context.shard(labels) if labels is not None and self.head is not None else labels
        h = self.embedding(x) if self.embedding is not None else x  # (B, T, H)
        h = self.run_blocks(h)
        if self.head is None:
            return h
        logits = self.head(h)  # (B, T, V)
        return logits if labels is None else self.loss_fn(logits, labels)


class HFBlock(nn.Module):
    """One transformers decoder layer as a hidden -> hidden module.

    No attention mask is passed: transformers' SDPA path then runs causal attention, the
    same as the full model does for unpadded, packed sequences.
    """

    def __init__(self, layer: nn.Module, rotary: Optional[nn.Module] = None):
        super().__init__()
        self.layer = layer
        # Llama's rotary embedding has no parameters (inv_freq is a non-persistent buffer),
        # so sharing one instance across blocks adds nothing to the state dict.
        self.rotary = rotary
        self.seq_shards = 1  # sequence parallelism: h holds T/seq_shards positions, attention all T
        self.positions: Optional[torch.Tensor] = None  # context parallelism: the tokens' places in the sequence

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            out = self.layer(h)
        else:
            pos = (torch.arange(h.size(1) * self.seq_shards, device=h.device) if self.positions is None
                   else self.positions.to(h.device)).unsqueeze(0)  # (1, T)
            out = self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out
