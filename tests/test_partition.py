"""Blocks -> stages: uniform, parameters, type:<regex>, explicit balance, and the errors."""

import pytest
from torch import nn

from framework.config import ModelConfig
from framework.models import build_model
from framework.parallel.pipeline.partition import PartitionError, balanced, partition, uniform
from framework.schedules import StageMap
from framework.parallel.pipeline.stage import build_chunks, stage_ranges


def test_uniform_gives_earlier_stages_the_extra_block():
    assert uniform(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(PartitionError, match="would hold no block"):
        uniform(3, 4)


def test_parameters_balances_counts_including_embedding_and_head():
    blocks = [nn.Linear(10, 10) for _ in range(6)]  # 110 parameters each
    assert partition("parameters", blocks, 2) == [range(0, 3), range(3, 6)]
    # a heavy embedding on stage 0 pushes blocks to stage 1
    assert partition("parameters", blocks, 2, embedding_params=440) == [range(0, 1), range(1, 6)]


def test_balanced_minimises_the_heaviest_stage():
    assert balanced([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]


def test_type_regex_counts_matching_blocks_only():
    model = build_model(ModelConfig(arch="gpt2", n_layer=4, n_embd=16, n_head=2, max_positions=8), 50, 0)
    assert partition("type:GPT2Block", list(model.blocks), 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(PartitionError, match="no block type matches 'Llama'"):
        partition("type:Llama", list(model.blocks), 2)


def test_explicit_balance_like_torchgpipe():
    assert partition([3, 5, 5, 1], [None] * 14, 4) == [range(0, 3), range(3, 8), range(8, 13), range(13, 14)]
    with pytest.raises(PartitionError, match="summing to 14"):
        partition([3, 5, 5, 2], [None] * 14, 4)
    with pytest.raises(PartitionError, match="positive"):
        partition([0, 14], [None] * 14, 2)


def test_chunks_own_their_blocks_and_free_the_rest():
    full = build_model(ModelConfig(arch="gpt2", n_layer=4, n_embd=16, n_head=2, max_positions=8), 50, 0)
    ranges = stage_ranges("uniform", full, 4)  # pp = 2, v = 2: rank 1 holds stages 1 and 3
    chunks = build_chunks(full, ranges, StageMap(2, 2), pp_rank=1)
    assert [len(c.blocks) for c in chunks] == [1, 1] and chunks[0].embedding is None and chunks[1].head is not None
    owned = {id(p) for c in chunks for p in c.parameters()}
    freed = [p for p in full.hf_model.parameters() if id(p) not in owned]
    assert freed and all(p.numel() == 0 for p in freed)
    assert full.hf_model.transformer.wte.weight.numel() > 0  # tied with the head this rank holds
