"""trainer.save_checkpoint exports a transformers directory that from_pretrained loads and
model.pretrained continues from, and a pretrained run records the checkpoint's real sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from framework.data import ShardedSampler, TokenData

from .conftest import TINY, compose, final_params, read_metrics, run_local

FIRST = [*TINY, "parallelism=pp2", "trainer.steps=4", "trainer.save_checkpoint=true"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    job = tmp_path_factory.mktemp("first")
    run_local(job, *FIRST)
    return job


def test_the_export_loads_with_from_pretrained_and_holds_the_final_weights(exported):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((exported / "final_model" / "config.json").read_text())
    sizes = (cfg["model_type"], cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"])
    assert sizes == ("gpt2", 2, 32, 2, 257)
    assert (exported / "final_model" / "model.safetensors").exists() and not (exported / "final_model.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(exported / "final_model")
    state, merged = model.state_dict(), final_params(exported)
    assert set(merged) <= set(state)
    for name, tensor in merged.items():
        assert torch.equal(state[name], tensor), name  # bit for bit, merged over both stages


def _loss_of(model, job, run) -> float:
    """The step-0 loss of `run` computed by transformers alone: the same samples, micro-batches
    averaged as the framework does (each a mean over its tokens)."""
    info = json.loads((job / "run_info.json").read_text())
    data = TokenData.load(run, info["tokens_path"])
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, run.schedule.microbatches, 0, 1,
                             run.trainer.seed)
    losses = []
    with torch.no_grad():
        for idx in sampler.step_indices(0):
            x, y = data.batch(np.asarray(idx))
            logits = model(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


def test_a_run_from_the_export_starts_at_its_weights_and_records_their_sizes(exported, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = ["model=gpt2-tiny", f"model.pretrained={exported / 'final_model'}", "data.seq_len=32", "logger=none",
                 "trainer.micro_batch_size=2", "trainer.steps=1", "metrics.skip_first=0", "metrics.peak_tflops=1.0",
                 "parallelism=single"]
    run_local(tmp_path, *overrides)
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    # the preset says 4 layers of 128; the checkpoint has 2 of 32, and that is what is recorded
    assert (recorded["n_layer"], recorded["n_embd"], recorded["n_head"], recorded["vocab_size"]) == (2, 32, 2, 257)
    first_loss = read_metrics(tmp_path)[0]["loss"]
    model = AutoModelForCausalLM.from_pretrained(exported / "final_model").eval()
    expected = _loss_of(model, tmp_path, compose(*overrides))
    assert first_loss == pytest.approx(expected, rel=1e-5)
    assert first_loss < read_metrics(exported)[0]["loss"] - 0.05  # it continues from trained weights


def test_a_transformers_tokenizer_is_exported_beside_the_model(exported, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from framework.report.export import export_pretrained

    from .test_data import make_local_hf_dataset

    texts, _, tok_dir = make_local_hf_dataset(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(exported / "final_model")
    out = export_pretrained(model.state_dict(), model.config, str(tok_dir), str(tmp_path / "job"))
    ids = [AutoTokenizer.from_pretrained(d)(texts[0])["input_ids"] for d in (out, tok_dir)]
    assert ids[0] == ids[1] and len(ids[0]) > 10
    assert AutoModelForCausalLM.from_pretrained(out).config.n_embd == 32


def test_each_pipeline_end_exports_its_own_copy_of_the_tied_embedding():
    """final_model.pt's merge (save_final_model): the stage that embeds exports its copy of
    GPT-2's tied weight under the embedding's name, the last stage its copy under the head's,
    so both copies reach the file and the pipeline tests compare each with the single process;
    a rank holding both uses (here one process) exports its one copy under both names."""
    from types import SimpleNamespace

    from framework.config import ModelConfig
    from framework.models import build_model
    from framework.schedules import StageMap
    from framework.parallel.pipeline.stage import build_chunks, stage_ranges, stage_state_dict, tied_weight
    from framework.report.export import _own_tied_copy

    def part(pp_rank: int, pp: int) -> dict:  # each rank builds the model (the same seed) and keeps its stages
        full = build_model(ModelConfig(arch="gpt2", n_layer=2, n_embd=16, n_head=2, max_positions=8), 50, 0)
        chunks = build_chunks(full, stage_ranges("uniform", full, pp), StageMap(pp, 1), pp_rank)
        runner = SimpleNamespace(chunks=chunks, tied=tied_weight(full, chunks))
        return _own_tied_copy(stage_state_dict(full, chunks), runner, full)

    first, last, whole = part(0, 2), part(1, 2), part(0, 1)
    tied = {"transformer.wte.weight", "lm_head.weight"}
    assert tied & set(first) == {"transformer.wte.weight"} and tied & set(last) == {"lm_head.weight"}
    assert tied <= set(whole) and set(first) | set(last) == set(whole)
    for name, tensor in whole.items():
        assert torch.equal({**first, **last}[name], tensor), name
