"""Every config group composes and validates; every bad value gets one clear error."""

from __future__ import annotations

import pytest
from hydra.errors import MissingConfigException

from framework.config import ConfigError
from framework.data import prepare
from framework.launch import resolve_device
from framework.validate import validate

from .conftest import ROOT, assert_config_error, compose, run_cli

WORLD = {"single": 1, "dp2": 2, "dp4": 4, "pp2": 2, "pp4": 4, "dp2_pp2": 4, "tp2": 2, "tp4": 4, "tp2_pp2": 4,
         "3d_2x2x2": 8, "zero1": 2, "zero2": 2, "zero3": 2, "3d_zero1": 8}
GROUPS = {
    "model": ["gpt2-tiny", "gpt2", "gpt2-medium", "llama-tiny"],
    "data": ["pycode", "synthetic", "hf"],
    "parallelism": ["single", "dp2", "dp4", "pp2", "pp4", "dp2_pp2", "tp2", "tp4", "tp2_pp2", "3d_2x2x2",
                    "zero1", "zero2", "zero3", "3d_zero1"],
    "schedule": ["flush", "gpipe", "interleaved", "1f1b", "2bw"],
    "optimizer": ["adamw", "sgd"],
    "logger": ["wandb", "none"],
    "experiment": ["smoke", "gpt2_squad", "dp_scaling"],
}


def test_conf_folder_matches_the_groups_under_test():
    on_disk = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in (ROOT / "conf").iterdir() if g.is_dir()}
    on_disk.pop("trainer")
    assert on_disk == {g: sorted(opts) for g, opts in GROUPS.items()}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group, option):
    run = compose(f"{group}={option}")
    validate(run)
    if group == "parallelism":
        assert run.world_size == WORLD[option]
    if group == "model":
        assert run.model.name == option


def test_defaults_are_the_main_job():
    run = compose()
    assert (run.model.name, run.data.name, run.device) == ("gpt2-tiny", "pycode", "auto")
    assert (run.parallelism.pp, run.parallelism.dp, run.schedule.name) == (2, 1, "flush")  # a 2-stage pipeline
    assert run.global_batch == run.trainer.micro_batch_size * run.schedule.microbatches


def test_async_presets_untie_the_embedding():
    assert compose("schedule=1f1b").model.tie_embeddings is False
    assert compose("schedule=2bw", "model=gpt2").model.tie_embeddings is False
    assert compose("schedule=flush").model.tie_embeddings is True


BAD = [
    (["parallelism.world_size=3"], "parallelism.world_size=3", "dp*tp*pp"),
    (["model.n_head=3"], "model.n_head=3", "does not divide model.n_embd=128"),
    (["model=llama-tiny", "model.n_kv_head=3"], "model.n_kv_head=3", "must divide n_head"),
    (["data.seq_len=512"], "data.seq_len=512", "above the model's positions"),
    (["trainer.global_batch_size=10"], "trainer.global_batch_size=10", "not divisible"),
    (["trainer.global_batch_size=64"], "trainer.global_batch_size=64", "schedule.microbatches=8"),
    (["model.arch=gpt3"], "model.arch='gpt3'", "unknown name"),
    (["data.name=books"], "data.name='books'", "unknown name"),
    (["schedule.name=zb"], "schedule.name='zb'", "unknown name"),
    (["parallelism=single", "schedule.name=1f1b"], "schedule.name='1f1b'", "pp = 1"),
    (["parallelism=single", "schedule.virtual_stages=2"], "schedule.virtual_stages=2", "pp > 1"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'", "unknown name"),
    (["logger.mode=loud"], "logger.mode='loud'", "unknown name"),
    (["device=tpu"], "device='tpu'", "unknown name"),
    (["launcher=slurm"], "launcher='slurm'", "unknown name"),
    (["objective=speed"], "objective='speed'", "unknown name"),
    (["optimizer._target_=torch.optim.Nope"], "optimizer._target_='torch.optim.Nope'", "cannot be imported"),
    (["optimizer._target_=torch.nn.Linear"], "optimizer._target_='torch.nn.Linear'", "not a torch.optim"),
    (["optimizer.lr=0"], "optimizer.lr=0", "positive"),
    (["parallelism.dp=0"], "parallelism.dp=0", "positive integer"),
    (["parallelism.pp=-1"], "parallelism.pp=-1", "positive integer"),
    (["trainer.steps=0"], "trainer.steps=0", "positive integer"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0", "positive integer"),
    (["schedule.microbatches=0"], "schedule.microbatches=0", "positive integer"),
    (["data.seq_len=0"], "data.seq_len=0", "positive integer"),
    (["model.n_layer=0"], "model.n_layer=0", "positive integer"),
    (["parallelism=tp2", "model.dropout=0.1"], "model.dropout=0.1", "same dropout masks"),
    (["parallelism=tp2", "parallelism.sequence_parallel=true", "data.seq_len=33"], "data.seq_len=33",
     "splits the sequence over tp=2"),
    (["parallelism.zero=4"], "parallelism.zero=4", "0, 1, 2 or 3"),
    (["trainer.min_lr_ratio=2"], "trainer.min_lr_ratio=2.0", "[0, 1]"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0", ">= 0"),
    (["model.dropout=1.0"], "model.dropout=1.0", "[0, 1)"),
    (["metrics.skip_first=40"], "metrics.skip_first=40", "at least one"),
    (["debug.fail_rank=2"], "debug.fail_rank=2", "no such rank"),
    (["debug.stage_delay_ms=-5"], "debug.stage_delay_ms=-5.0", ">= 0"),
    (["parallelism=pp2", "debug.stage_delay_ms=5", "debug.delay_pp_rank=2"], "debug.delay_pp_rank=2",
     "one pipeline rank"),
    (["data=hf", "data.path=null"], "data.path=None", "needs a dataset"),
]


@pytest.mark.parametrize("overrides,head,problem", BAD, ids=[b[1] for b in BAD])
def test_each_bad_value_has_a_clear_error(overrides, head, problem):
    assert_config_error(overrides, head, problem)


def test_wrong_type_and_unknown_key_are_schema_errors():
    with pytest.raises(ConfigError, match=r"trainer\.steps.*Fix: "):
        compose("trainer.steps=many")
    with pytest.raises(ConfigError, match=r"trainer\.bogus.*Fix: "):
        compose("+trainer.bogus=1")


def test_unknown_group_option_names_the_choices():
    with pytest.raises(MissingConfigException, match="gpt5") as e:
        compose("model=gpt5")
    assert "gpt2-tiny" in str(e.value)  # Hydra lists the available options


def test_cuda_ranks_beyond_gpus_is_an_error():
    import torch

    with pytest.raises(ConfigError, match=r"^device='cuda': .* CUDA device"):
        resolve_device("cuda", torch.cuda.device_count() + 1)


def test_data_checks_vocab_and_sample_count(data_cache):
    with pytest.raises(ConfigError, match=r"^model\.vocab_size=100: smaller than the tokenizer's vocabulary \(257\)"):
        prepare(compose("data.max_files=5", f"data.cache_dir={data_cache}", "model.vocab_size=100"))
    with pytest.raises(ConfigError, match=r"^data\.num_samples=8: .*fewer than the global batch 32"):
        prepare(compose("data=synthetic", "data.num_samples=8"))


TP_SIZES = [
    (["parallelism=single", "parallelism.tp=3"], "model.n_head=4 does not divide over tp=3"),
    (["model=llama-tiny", "parallelism=tp4"], "model.n_kv_head=2 does not divide over tp=4"),
    (["parallelism=tp2", "model.n_inner=65"], "model.n_inner=65 does not divide over tp=2"),
]


@pytest.mark.parametrize("overrides,problem", TP_SIZES, ids=[p for _, p in TP_SIZES])
def test_tensor_parallel_sizes_must_divide(overrides, problem):
    """Checked on the built (meta) model before launch, so pretrained checkpoints are covered."""
    from framework.job import check_tensor_parallel, meta_model

    run = compose(*overrides)
    validate(run)
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(run, meta_model(run, 257))
    assert str(e.value).startswith(f"parallelism.tp={run.parallelism.tp}: {problem}"), str(e.value)
    assert "Fix: use parallelism.tp in [" in str(e.value)


def test_cli_rejects_bad_input_before_any_rank_starts(tmp_path):
    r = run_cli([f"hydra.run.dir={tmp_path}", "parallelism.dp=0"])
    assert r.returncode != 0
    assert "config error: parallelism.dp=0: must be a positive integer. Fix:" in r.stderr
    assert not (tmp_path / "config.yaml").exists()  # nothing was launched or prepared
    r = run_cli([f"hydra.run.dir={tmp_path}", "parallelism=tp4", "model.n_head=2", "data=synthetic"])
    assert r.returncode != 0 and "config error: parallelism.tp=4: model.n_head=2 does not divide" in r.stderr
    assert not (tmp_path / "config.yaml").exists()
