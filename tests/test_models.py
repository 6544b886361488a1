"""embedding | blocks | head composes to exactly the transformers model's forward and loss.

Bitwise in fp32, and rightly: the split model calls transformers' own modules (the same
kernels in the same order, on the same shapes), and `lm_loss` is the one cross-entropy
call transformers' loss makes; activation checkpointing recomputes the same kernels."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from framework.config import ModelConfig, MoEConfig
from framework.models import build_model, lm_loss

CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", n_layer=3, n_embd=48, n_head=4, max_positions=64),
    "llama": ModelConfig(arch="llama", n_layer=3, n_embd=48, n_head=4, n_kv_head=2, n_inner=96,
                         max_positions=64, tie_embeddings=False),
    "qwen3_moe": ModelConfig(arch="qwen3_moe", n_layer=3, n_embd=48, n_head=4, n_kv_head=2, max_positions=64,
                             tie_embeddings=False, moe=MoEConfig(experts=4, top_k=2, expert_inner=32)),
}


@pytest.mark.parametrize("arch", CONFIGS)
def test_split_forward_and_loss_equal_the_transformers_model(arch):
    split = build_model(CONFIGS[arch], vocab_size=101, seed=0)
    hf = split.hf_model
    ids = torch.randint(0, 101, (3, 20), generator=torch.Generator().manual_seed(1))
    ref = hf(ids, labels=ids)  # transformers shifts the labels itself
    logits = split(ids)
    assert torch.equal(logits, ref.logits)
    ours = lm_loss(logits[:, :-1], ids[:, 1:])
    assert torch.equal(ours, ref.loss)
    assert torch.equal(split(ids[:, :-1], ids[:, 1:]), lm_loss(split(ids[:, :-1]), ids[:, 1:]))


@pytest.mark.parametrize("arch", CONFIGS)
def test_split_gradients_equal_the_transformers_model(arch):
    split = build_model(CONFIGS[arch], vocab_size=101, seed=0)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    split.hf_model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in split.hf_model.named_parameters()}
    split.zero_grad()
    lm_loss(split(ids)[:, :-1], ids[:, 1:]).backward()
    for n, p in split.hf_model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0, msg=n)


def test_parameters_are_shared_not_copied_and_tied_once():
    split = build_model(CONFIGS["gpt2"], vocab_size=101, seed=0)
    hf_ids = {id(p) for p in split.hf_model.parameters()}
    assert {id(p) for p in split.parameters()} == hf_ids
    assert split.head.lm_head.weight is split.embedding.wte.weight
    assert len(split.blocks) == 3


def test_same_seed_same_weights_and_activation_checkpointing_is_exact():
    a = build_model(CONFIGS["llama"], 101, seed=5)
    b = build_model(CONFIGS["llama"], 101, seed=5, checkpoint_blocks=True)
    ids = torch.randint(0, 101, (2, 16))
    la, lb = a(ids[:, :-1], ids[:, 1:]), b(ids[:, :-1], ids[:, 1:])
    la.backward(), lb.backward()
    assert torch.equal(la, lb)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)


def test_pretrained_weights_load_from_a_local_directory(tmp_path):
    real = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=64, n_embd=48, n_layer=2, n_head=4))
    real.save_pretrained(tmp_path)
    cfg = ModelConfig(arch="gpt2", pretrained=str(tmp_path))
    split = build_model(cfg, vocab_size=999, seed=0)  # sizes come from the checkpoint
    assert len(split.blocks) == 2
    for (n, p), q in zip(real.state_dict().items(), split.hf_model.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_pretrained_of_another_architecture_is_a_config_error(tmp_path):
    from framework.config import ConfigError

    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"is a gpt2 model \(config.json\), not model.arch=llama"):
        build_model(ModelConfig(arch="llama", pretrained=str(tmp_path)), 50, 0)
