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
from framework.schedules import StageMap
from framework.parallel.pipeline.stage import build_chunks, stage_ranges
from framework.comm.tensor_parallel import shard_tensor
from framework.comm.tp_comm import TPComm


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


def test_a_ranks_start_up_peak_is_well_below_the_whole_model():
    """Counted, not measured: the peak bytes of live CPU tensors (tests/live_bytes.py) while
    each pp 4 rank builds its part, as the trainer does (the meta model, then `build_chunks`),
    is its own stage's parameters plus at most one module's drawn tensors (materialise.py's
    transient), below half the model; with `whole_first` (debug.materialise_whole, the old
    start-up) every rank's peak is the whole model. Resident memory in real ranks (101M and
    355M parameters) is measured in experiments/startup_memory: RSS moves with the C
    allocator and the machine, these counts do not."""
    from .live_bytes import LiveBytes

    cfg = ModelConfig(arch="gpt2", n_layer=8, n_embd=128, n_head=4, max_positions=32)
    whole = build_hf_model(cfg, 1000, seed=1)
    model_bytes = sum(p.nbytes for p in whole.parameters())
    module_bytes = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in whole.modules())
    for whole_first in (False, True):
        for rank in range(4):
            with LiveBytes() as live:
                meta = build_model(cfg, 1000, seed=1, on_meta=True, whole_first=whole_first)
                chunks = build_chunks(meta, stage_ranges("uniform", meta, 4), StageMap(4), pp_rank=rank)
            own = sum(p.nbytes for p in {id(p): p for c in chunks for p in c.parameters()}.values())
            if whole_first:
                assert live.peak >= model_bytes, (rank, live.peak, model_bytes)
            else:
                assert own <= live.peak <= own + module_bytes, (rank, live.peak, own, module_bytes)
                assert live.peak < 0.5 * model_bytes, (rank, live.peak, model_bytes)
