"""Per-rank materialisation (framework/models/materialise.py): the model is built on the meta
device and each rank allocates only what it keeps, with the values the single process has
(the equivalence tests run on it unchanged); pretrained tensors are read per slice."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from framework.config import ModelConfig
from framework.models import ARCHS, build_hf_model, build_model
from framework.models.materialise import PretrainedWeights
from framework.parallel.pipeline.schedules import StageMap
from framework.parallel.pipeline.stage import build_chunks, stage_ranges
from framework.parallel.tensor_parallel import shard_tensor
from framework.parallel.tp_comm import TPComm

from .conftest import TINY, run_local

CONFIGS = {"gpt2": ModelConfig(arch="gpt2", n_layer=2, n_embd=64, n_head=4, max_positions=32),
           "llama": ModelConfig(arch="llama", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, n_inner=128,
                                max_positions=32, tie_embeddings=False)}


@pytest.mark.parametrize("arch", CONFIGS)
def test_init_follows_transformers_scheme(arch):
    """Same names and shapes as transformers' own model, and each tensor drawn as its
    _init_weights draws it: constants equal, random ones with the same std (GPT-2's scaled
    residual projections included), and deterministic for a seed."""
    cfg = CONFIGS[arch]
    ours, again = build_hf_model(cfg, 101, seed=3), build_hf_model(cfg, 101, seed=3)
    other = build_hf_model(cfg, 101, seed=4)
    torch.manual_seed(0)
    ref = ARCHS[arch].MODEL_CLASS(ARCHS[arch].hf_config(cfg, 101))
    mine, theirs = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    for n, p in mine.items():
        q = theirs[n]
        assert p.shape == q.shape and torch.equal(p, dict(again.named_parameters())[n]), n
        if q.std() == 0:
            assert torch.equal(p, q), n
        else:
            assert abs(p.std() / q.std() - 1) < 0.1 and not torch.equal(p, dict(other.named_parameters())[n]), n
    if arch == "gpt2":
        assert mine["transformer.h.0.attn.c_proj.weight"].std() < 0.6 * mine["transformer.h.0.attn.c_attn.weight"].std()


def test_a_pipeline_rank_materialises_only_its_stage():
    cfg = ModelConfig(arch="gpt2", n_layer=4, n_embd=32, n_head=2, max_positions=16)
    whole = dict(build_hf_model(cfg, 50, seed=1).named_parameters())
    meta = build_model(cfg, 50, seed=1, on_meta=True)
    assert all(p.is_meta for p in meta.parameters())
    chunks = build_chunks(meta, stage_ranges("uniform", meta, 2), StageMap(2), pp_rank=1)
    kept = {id(p) for c in chunks for p in c.parameters()}
    for n, p in meta.hf_model.named_parameters():
        assert not p.is_meta, n
        if id(p) in kept:
            assert torch.equal(p, whole[n]), n
        else:
            assert p.numel() == 0, n
    assert "transformer.h.3.mlp.c_fc.weight" in {n for n, p in meta.hf_model.named_parameters() if id(p) in kept}


def test_tensor_parallel_shards_come_from_the_same_values_and_pretrained_slices(tmp_path):
    """tp rank 1 of 2: every shard equals the single model's tensor cut by its TPShard, both
    from the seeded init and read per slice from safetensors (vocab padding rows zero)."""
    cfg = ModelConfig(arch="gpt2", n_layer=1, n_embd=32, n_head=4, max_positions=16)
    whole = build_hf_model(cfg, 51, seed=2)  # 51 rows: padded to 52 over tp 2
    full = dict(whole.named_parameters())
    whole.save_pretrained(tmp_path)
    for pretrained in (None, str(tmp_path)):
        c = ModelConfig(**{**cfg.__dict__, "pretrained": pretrained})
        model = build_model(c, 51, seed=2, tp_comm=TPComm(None, 2, 1))
        sharded = 0
        for n, p in model.hf_model.named_parameters():
            spec = getattr(p, "tp_shard", None)
            want = shard_tensor(full[n], spec) if spec is not None else full[n]
            assert torch.equal(p.detach(), want), (pretrained, n)
            sharded += spec is not None
        assert sharded >= 5
    reader = PretrainedWeights(str(tmp_path), "transformer")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["vocab_size"] == 51
    wte = build_model(ModelConfig(**{**cfg.__dict__, "pretrained": str(tmp_path)}), 51, 0, tp_comm=TPComm(None, 2, 1),
                      on_meta=True).hf_model.transformer.wte.weight
    part = reader.local("transformer.wte.weight", wte)
    assert part.shape == (26, 32) and torch.equal(part[-1], torch.zeros(32)) and torch.equal(part[:-1], full[
        "transformer.wte.weight"][26:])


def test_a_hub_style_checkpoint_without_the_base_prefix_loads(tmp_path):
    """GPT-2 hub files name tensors without "transformer." (h.0.attn..., wte.weight)."""
    from safetensors.torch import save_file

    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    ref = GPT2LMHeadModel(cfg)
    state = {n.removeprefix("transformer."): p.detach().clone() for n, p in ref.named_parameters()}
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg.save_pretrained(tmp_path)
    got = build_hf_model(ModelConfig(arch="gpt2", pretrained=str(tmp_path)), 40, 0)
    for n, p in ref.named_parameters():
        assert torch.equal(dict(got.named_parameters())[n], p), n


# 8 blocks of width 1024: 101M parameters, 403 MB in fp32; a pp4 rank keeps 2 blocks (101 MB).
BIG = [*TINY, "model.n_layer=8", "model.n_embd=1024", "model.n_head=16", "model.max_positions=32", "data=synthetic",
       "data.num_samples=64", "trainer.steps=1", "trainer.micro_batch_size=1", "parallelism=pp4", "schedule=flush",
       "schedule.microbatches=4"]


def test_a_ranks_start_up_peak_is_well_below_the_whole_model(tmp_path):
    """Measured in real ranks: what building costs a pp4 rank (start-up peak RSS minus RSS
    before the build) is its own quarter plus small transients, well below the whole model;
    with debug.materialise_whole (every rank builds it all first) it is the whole model."""
    per_rank = run_local(tmp_path / "per_rank", *BIG)
    whole = run_local(tmp_path / "whole", *BIG, "debug.materialise_whole=true")
    model_bytes = sum(r["params_bytes"] for r in per_rank["ranks"])  # the stages partition the model
    assert model_bytes > 380e6
    for mine, old in zip(per_rank["ranks"], whole["ranks"], strict=True):
        cost = mine["startup_rss_peak_bytes"] - mine["rss_before_build_bytes"]
        old_cost = old["startup_rss_peak_bytes"] - old["rss_before_build_bytes"]
        assert cost < 0.5 * model_bytes, (mine["rank"], cost, mine["params_bytes"])
        assert old_cost > 0.9 * model_bytes, (old["rank"], old_cost)
