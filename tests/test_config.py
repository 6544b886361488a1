"""Every config group composes and validates; every bad value gets one clear error."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest
import torch
import yaml
from hydra.errors import MissingConfigException

from framework.config import ConfigError, ScheduleConfig
from framework.data import prepare
from framework.validate import check_job_dir, validate, validate_model

from .conftest import ROOT, assert_config_error, compose, run_cli

WORLD = {"single": 1, "dp2": 2, "dp4": 4, "pp2": 2, "pp4": 4, "dp2_pp2": 4, "tp2": 2, "tp4": 4, "tp2_pp2": 4,
         "3d_2x2x2": 8, "zero1": 2, "zero2": 2, "zero3": 2, "3d_zero1": 8}
GROUPS = {
    "model": ["gpt2-tiny", "gpt2", "gpt2-medium", "llama-tiny", "moe-tiny", "moe-mixtral", "gpt-1.7b", "gpt-3.6b",
              "gpt-7.5b", "gpt-18b", "gpt-39b", "gpt-76b", "gpt-145b", "gpt-310b", "gpt-530b", "gpt-1t", "gpt3-175b",
              "llama3-8b", "llama3-70b", "llama3-405b"],
    "data": ["pycode", "synthetic", "hf"],
    "parallelism": ["single", "dp2", "dp4", "pp2", "pp4", "dp2_pp2", "tp2", "tp4", "tp2_pp2", "3d_2x2x2",
                    "zero1", "zero2", "zero3", "3d_zero1"],
    "schedule": ["flush", "gpipe", "interleaved", "1f1b", "2bw", "zbh1", "zbh2", "interleaved-zb", "zbv", "dualpipev",
                 "zb-auto", "csv"],
    "optimizer": ["adamw", "sgd"],
    "logger": ["wandb", "none"],
    "experiment": ["smoke", "gpt2_squad", "dp_scaling"],
    "hparams_search": ["layout"],
    "hardware": ["none", "a100-dgx", "h100-sxm", "h200", "cpu-local"],
}


def test_conf_folder_matches_the_groups_under_test():
    on_disk = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in (ROOT / "conf").iterdir() if g.is_dir()}
    on_disk.pop("trainer")
    assert on_disk == {g: sorted(opts) for g, opts in GROUPS.items()}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group, option, monkeypatch, tmp_path):
    # data=hf names hub files (the gpt2 tokenizer): resolving them needs the network or the
    # HF cache, which this test of composition must not; test_unresolvable_hub_name_* covers it.
    monkeypatch.setattr("framework.validate.paths._hub_name", lambda *args: None)
    # 1f1b / 2bw cannot keep gpt2-tiny's tied embedding, and their presets leave the model alone
    untie = ["model.tie_embeddings=false"] if group == "schedule" and option in ("1f1b", "2bw") else []
    if option == "csv":  # the schedule from a file: one the framework dumps
        from framework.schedules import build_schedule, dump_csv, get

        dump_csv(build_schedule("zbh1", 2, 4), get("zbh1").stage_map(2, 1), str(tmp_path / "s.csv"))
        untie = [f"schedule.csv={tmp_path / 's.csv'}"]
    run = compose(f"{group}={option}", *untie)
    validate(run)
    if group == "parallelism":
        assert run.world_size == WORLD[option]
    if group == "model":
        assert run.model.name == option


def test_a_short_run_summarises_its_last_step(capsys):
    """`trainer.steps=3` alone (metrics.skip_first defaults to 3) runs: the warm-up is cut to
    2 with one line saying so; a run long enough is left alone."""
    run = compose("trainer.steps=3")
    validate(run)
    assert run.metrics.skip_first == 2
    assert "note: metrics.skip_first=3 would leave none of trainer.steps=3 to summarise; using " \
           "metrics.skip_first=2" in capsys.readouterr().err
    assert compose("trainer.steps=4").metrics.skip_first == 3 and "note:" not in capsys.readouterr().err


def test_defaults_are_the_main_job():
    run = compose()
    assert (run.model.name, run.data.name, run.device) == ("gpt2-tiny", "pycode", "auto")
    assert (run.parallelism.pp, run.parallelism.dp, run.schedule.name) == (2, 1, "flush")  # a 2-stage pipeline
    assert run.global_batch == run.trainer.micro_batch_size * run.schedule.microbatches


def test_global_batch_size_derives_microbatches_for_each_layout():
    """Fair comparisons: the global batch stays, micro-batches follow the layout (mbs fixed)."""
    for layout, m in (("single", 8), ("dp2", 4), ("dp4", 2), ("pp2", 8), ("tp2", 8), ("3d_2x2x2", 4)):
        run = compose(f"parallelism={layout}", "trainer.global_batch_size=64")
        assert run.schedule.microbatches == m and run.global_batch == 64 and run.trainer.micro_batch_size == 8, layout
    # micro_batch_size=null: the micro-batch size follows instead (a search over microbatches)
    run = compose("parallelism=dp2", "trainer.global_batch_size=64", "trainer.micro_batch_size=null",
                  "schedule.microbatches=8")
    assert (run.trainer.micro_batch_size, run.schedule.microbatches, run.global_batch) == (4, 8, 64)
    # dp=null: the rest of a fixed world size
    run = compose("parallelism.dp=null", "parallelism.world_size=8", "parallelism.tp=2", "parallelism.pp=2")
    assert run.parallelism.dp == 2 and run.world_size == 8


def test_a_derived_size_given_on_the_command_line_is_a_contradiction():
    from framework.config import check_overrides

    overrides = ["parallelism=dp2", "trainer.global_batch_size=64", "schedule.microbatches=8"]
    with pytest.raises(ConfigError) as e:
        check_overrides(compose(*overrides), overrides)
    assert str(e.value).startswith("schedule.microbatches='8': trainer.global_batch_size=64") and "derive" in str(e.value)
    check_overrides(compose(*overrides[:2], "schedule.microbatches=4"), [*overrides[:2], "schedule.microbatches=4"])


def test_schedule_presets_set_only_schedule_keys():
    """A layout search picks schedules; it must never change the model (or anything else):
    every schedule preset is a plain group file of the schedule's own keys."""
    keys = {f.name for f in fields(ScheduleConfig)}
    models = {m: compose(f"model={m}").model for m in ("gpt2-tiny", "gpt2", "llama-tiny")}  # composed once
    for option in GROUPS["schedule"]:
        text = (ROOT / "conf" / "schedule" / f"{option}.yaml").read_text()
        assert "@package" not in text, option
        assert set(yaml.safe_load(text)) <= keys, option
        for model, alone in models.items():
            assert compose(f"schedule={option}", f"model={model}").model == alone, option


BAD = [
    (["parallelism.world_size=3"], "parallelism.world_size=3", "dp*cp*tp*pp"),
    (["model.n_head=3"], "model.n_head=3", "does not divide model.n_embd=128"),
    (["model=llama-tiny", "model.n_kv_head=3"], "model.n_kv_head=3", "must divide n_head"),
    (["data.seq_len=512"], "data.seq_len=512", "must be <= model.max_positions (model.max_positions=256)"),
    (["trainer.global_batch_size=10"], "trainer.global_batch_size=10", "not divisible"),
    (["trainer.micro_batch_size=null"], "trainer.micro_batch_size=None", "null derives it"),
    (["parallelism.dp=null"], "parallelism.dp=None", "world_size = None"),
    (["parallelism.dp=null", "parallelism.world_size=3"], "parallelism.dp=None", "tp * pp * cp = 1*2*1"),
    (["model.arch=gpt3"], "model.arch='gpt3'", "unknown name"),
    (["data.name=books"], "data.name='books'", "unknown name"),
    (["schedule.name=zb"], "schedule.name='zb'", "unknown name"),
    (["parallelism=single", "schedule.name=1f1b"], "schedule.name='1f1b'", "pp = 1"),
    (["parallelism=single", "schedule.virtual_stages=2"], "schedule.virtual_stages=2", "chunk(s) per rank"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'", "unknown name"),
    (["logger.mode=loud"], "logger.mode='loud'", "unknown name"),
    (["device=tpu"], "device='tpu'", "unknown name"),
    (["launcher=slurm"], "launcher='slurm'", "unknown name"),
    (["objective=speed"], "objective='speed'", "unknown name"),
    (["optimizer._target_=torch.optim.Nope"], "optimizer._target_='torch.optim.Nope'", "cannot be imported"),
    (["optimizer._target_=torch.nn.Linear"], "optimizer._target_='torch.nn.Linear'", "not a torch.optim"),
    (["optimizer.lr=0"], "optimizer.lr=0", "positive"),
    (["parallelism.dp=0"], "parallelism.dp=0", "must be >= 1"),
    (["parallelism.pp=-1"], "parallelism.pp=-1", "must be >= 1"),
    (["trainer.steps=0"], "trainer.steps=0", "must be >= 1"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0", "must be >= 1"),
    (["schedule.microbatches=0"], "schedule.microbatches=0", "must be >= 1"),
    (["data.seq_len=0"], "data.seq_len=0", "must be >= 1"),
    (["model.n_layer=0"], "model.n_layer=0", "must be >= 1"),
    (["parallelism=tp2", "model.dropout=0.1"], "model.dropout=0.1", "same dropout masks"),
    (["parallelism=tp2", "parallelism.sequence_parallel=true", "data.seq_len=33"], "data.seq_len=33",
     "splits the sequence over tp=2"),
    (["parallelism.zero=4"], "parallelism.zero=4", "must be <= 3"),
    (["parallelism=tp2_pp2", "schedule=dualpipev", "schedule.microbatches=4", "parallelism.overlap_dualpipe=true"],
     "parallelism.tp=2", "only ep's collectives have a group per thread"),
    # refused on CUDA until the pair's F thread has a stream of its own (NCCL could deadlock)
    (["model=moe-tiny", "parallelism=dp2_pp2", "parallelism.ep=2", "schedule=dualpipev", "schedule.microbatches=4",
      "parallelism.overlap_dualpipe=true", "device=cuda"], "parallelism.overlap_dualpipe=True",
     "a cycle NCCL deadlocks on"),
    # trainer.compile: what recompiles every step, or is not proved
    (["trainer.compile=blocks", "metrics.skip_first=0"], "metrics.skip_first=0", "compiles every block"),
    (["trainer.compile=blocks", "parallelism=dp2", "parallelism.zero=3"], "parallelism.zero_impl='ours'",
     "recompiled in every measured step"),
    (["trainer.compile=blocks", "model=moe-tiny"], "trainer.compile='blocks'", "recompiles on them"),
    (["trainer.compile=blocks", "parallelism.cp=2", "parallelism.cp_comm=a2a", "parallelism=single"],
     "trainer.compile='blocks'", "not proved equal"),
    (["trainer.min_lr_ratio=2"], "trainer.min_lr_ratio=2.0", "must be <= 1"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0", ">= 0"),
    (["model.dropout=1.0"], "model.dropout=1.0", "must be < 1"),
    (["metrics.skip_first=-1"], "metrics.skip_first=-1", "must be >= 0"),  # too large is clamped (test_run)
    (["debug.fail_rank=2"], "debug.fail_rank=2", "must be < world_size (world_size=2)"),
    (["debug.stage_delay_ms=-5"], "debug.stage_delay_ms=-5.0", ">= 0"),
    (["parallelism=pp2", "debug.stage_delay_ms=5", "debug.delay_pp_rank=2"], "debug.delay_pp_rank=2",
     "must be < parallelism.pp (parallelism.pp=2)"),
    (["data=hf", "data.path=null"], "data.path=None", "needs a dataset"),
    (["trainer.seed=-1"], "trainer.seed=-1", "must be >= 0"),
    (["trainer.seed=4294967296"], "trainer.seed=4294967296", "must be < 2**32"),
    # nan fails every comparison, so each float key is checked for being finite first
    (["optimizer.lr=nan"], "optimizer.lr=nan", "finite positive"),
    (["optimizer.lr=inf"], "optimizer.lr=inf", "finite positive"),
    (["trainer.grad_clip=nan"], "trainer.grad_clip=nan", "must be a number, not nan"),
    (["trainer.grad_clip=inf"], "trainer.grad_clip=inf", "must be a finite number"),
    (["trainer.min_lr_ratio=nan"], "trainer.min_lr_ratio=nan", "not nan"),
    (["model.dropout=nan"], "model.dropout=nan", "not nan"),
    (["debug.stage_delay_ms=nan"], "debug.stage_delay_ms=nan", ">= 0"),
    (["debug.stage_delay_ms=inf"], "debug.stage_delay_ms=inf", ">= 0"),
    (["trainer.hang_timeout_s=nan"], "trainer.hang_timeout_s=nan", "> 0"),
    (["trainer.hang_timeout_s=inf"], "trainer.hang_timeout_s=inf", "> 0"),
    (["trainer.hang_timeout_s=0"], "trainer.hang_timeout_s=0.0", "> 0"),
    (["metrics.peak_tflops=nan"], "metrics.peak_tflops=nan", "not nan"),
    (["metrics.peak_tflops=inf"], "metrics.peak_tflops=inf", "must be a finite number"),
    (["metrics.peak_tflops=0"], "metrics.peak_tflops=0.0", "must be > 0"),
    # optimizer arguments: unknown names, and values torch rejects (or that make nan)
    (["+optimizer.betaz=[0.9,0.99]"], "optimizer.betaz=[0.9, 0.99]",
     "not an argument of torch.optim.AdamW. Fix: use one of lr, betas, eps, weight_decay"),
    (["optimizer=sgd", "+optimizer.betas=[0.9,0.99]"], "optimizer.betas=[0.9, 0.99]",
     "not an argument of torch.optim.SGD"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5]", "Invalid beta parameter at index 1: 1.5"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]",
     "torch.optim.AdamW rejects it (IndexError: tuple index out of range)"),
    (["optimizer.weight_decay=nan"], "optimizer.weight_decay=nan", "Invalid weight_decay value: nan"),
    (["optimizer.eps=nan"], "optimizer.eps=nan", "Invalid epsilon value: nan"),
    (["optimizer.eps=0"], "optimizer.eps=0", "leaves a parameter non-finite"),
    (["optimizer=sgd", "optimizer.momentum=nan"], "optimizer.momentum=nan", "leaves a parameter non-finite"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum=-1", "Invalid momentum value: -1"),
    (["optimizer=sgd", "optimizer.weight_decay=nan"], "optimizer.weight_decay=nan", "leaves a parameter non-finite"),
    (["optimizer=sgd", "optimizer.weight_decay=inf"], "optimizer.weight_decay=inf", "leaves a parameter non-finite"),
    (["optimizer.implementation=fast"], "optimizer.implementation='fast'", "is not an implementation"),
    (["optimizer.implementation=fused", "+optimizer.foreach=true"], "optimizer.foreach=True",
     "is set beside optimizer.implementation=fused"),
    (["optimizer._target_=torch.optim.LBFGS", "optimizer.implementation=fused", "~optimizer.betas",
      "~optimizer.eps", "~optimizer.weight_decay"], "optimizer.implementation='fused'", "has no fused kernel"),
    # one node: 4 CPU ranks per core (at least 8); one CUDA rank per GPU
    (["device=cpu", "parallelism.dp=5000"], "launcher='local'", "10000 CPU ranks (dp 5000 x tp 1 x pp 2)"),
    (["device=cuda", f"parallelism.dp={torch.cuda.device_count() + 1}"], "launcher='local'",
     "CUDA device(s) (device=cuda)"),
    # paths: missing files fail here, not in the ranks
    (["data=hf", "data.path=json", "data.data_files=/no/such/dir/*.jsonl", "data.tokenizer=bytes"],
     "data.data_files='/no/such/dir/*.jsonl'", "matches no file"),
    (["model.pretrained=/no/such/checkpoint"], "model.pretrained='/no/such/checkpoint'", "no such directory"),
    (["data.tokenizer=./no/such/tokenizer"], "data.tokenizer='./no/such/tokenizer'", "no such directory"),
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
    """Checked by validate (framework.validate.environment.check_node_capacity) before anything is prepared."""
    with pytest.raises(ConfigError, match=r"^launcher='local': \d+ CUDA ranks .* CUDA device.*Fix: use launcher=ext"):
        validate(compose("device=cuda", "parallelism=single", f"parallelism.dp={torch.cuda.device_count() + 1}"))


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
    from framework.launch.job import meta_model

    run = compose(*overrides)
    validate(run)
    with pytest.raises(ConfigError) as e:
        validate_model(run, meta_model(run, 257))
    assert str(e.value).startswith(f"parallelism.tp={run.parallelism.tp}: {problem}"), str(e.value)
    assert "Fix: use parallelism.tp in [" in str(e.value)


def test_cli_rejects_bad_input_before_any_rank_starts(tmp_path):
    r = run_cli([f"hydra.run.dir={tmp_path}", "parallelism.dp=0"])
    assert r.returncode != 0
    assert "config error: parallelism.dp=0: must be >= 1. Fix:" in r.stderr
    assert not (tmp_path / "config.yaml").exists()  # nothing was launched or prepared
    r = run_cli([f"hydra.run.dir={tmp_path}", "parallelism=tp4", "model.n_head=2", "data=synthetic"])
    assert r.returncode != 0 and "config error: parallelism.tp=4: model.n_head=2 does not divide" in r.stderr
    assert not (tmp_path / "config.yaml").exists()


def test_node_capacity_leaves_external_launches_and_dry_runs_alone():
    validate(compose("device=cpu", "parallelism.dp=5000", "dry_run=true"))
    validate(compose("device=cpu", "parallelism.dp=5000", "launcher=external"))
    validate(compose("device=cpu", "parallelism=3d_2x2x2"))  # 8 ranks on any machine (the suite does this)


# ---- model.pretrained / data.tokenizer / data.data_files / the job directory ----

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT-2 as save_pretrained writes it (config.json + model.safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("ckpt")
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=128, n_embd=16, n_layer=2, n_head=2)).save_pretrained(path)
    return path


def _copy_checkpoint(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _pretrained_error(path) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(f"model.pretrained={path}"))
    msg = str(e.value)
    assert msg.startswith(f"model.pretrained='{path}': ") and ". Fix: use " in msg
    return msg


def test_a_complete_local_checkpoint_validates(checkpoint):
    validate(compose(f"model.pretrained={checkpoint}"))


def test_a_missing_or_empty_checkpoint_directory_is_named(tmp_path):
    assert "no such directory" in _pretrained_error(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert "is an empty directory" in _pretrained_error(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    assert "is a file, not a directory" in _pretrained_error(tmp_path / "file")


def test_checkpoint_config_must_be_json_with_a_model_type(checkpoint, tmp_path):
    bad = _copy_checkpoint(checkpoint, tmp_path / "bad")
    (bad / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _pretrained_error(bad)
    (bad / "config.json").write_text(json.dumps({"n_embd": 16}))
    assert "config.json has no model_type" in _pretrained_error(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "mpt"}))
    assert "is a mpt model (config.json), not model.arch=gpt2. Fix: use a gpt2 or llama or qwen3_moe checkpoint" in \
        _pretrained_error(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "is a llama model (config.json), not model.arch=gpt2. Fix: use model.arch=llama" in _pretrained_error(bad)
    no_config = _copy_checkpoint(checkpoint, tmp_path / "no_config", skip=("config.json",))
    assert "has no config.json" in _pretrained_error(no_config)


def test_checkpoint_without_weights_is_named(checkpoint, tmp_path):
    bare = _copy_checkpoint(checkpoint, tmp_path / "bare", skip=("model.safetensors",))
    assert "has config.json but no weights" in _pretrained_error(bare)


def test_truncated_safetensors_is_caught_from_its_header(checkpoint, tmp_path):
    cut = _copy_checkpoint(checkpoint, tmp_path / "cut")
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)
    msg = _pretrained_error(cut)
    assert f"model.safetensors is {size - 100} bytes but its header describes {size}: truncated" in msg
    os.truncate(weights, 5)
    assert "model.safetensors is truncated" in _pretrained_error(cut)


def test_sharded_and_bin_checkpoints(checkpoint, tmp_path):
    sharded = _copy_checkpoint(checkpoint, tmp_path / "sharded")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert "model.safetensors.index.json lists missing shards: model-00002-of-00002.safetensors" in \
        _pretrained_error(sharded)
    legacy = _copy_checkpoint(checkpoint, tmp_path / "legacy", skip=("model.safetensors",))
    (legacy / "pytorch_model.bin").write_bytes(b"not a zip")
    assert "pytorch_model.bin is unreadable or not a zip archive" in _pretrained_error(legacy)
    torch.save({"w": torch.zeros(1)}, legacy / "pytorch_model.bin")
    validate(compose(f"model.pretrained={legacy}"))


def test_unresolvable_hub_name_is_a_config_error():
    """Offline: the hub probe fails in seconds; online: transformers says the repo is missing."""
    name = "no-such-org-7f3a/no-such-model-7f3a"
    assert_config_error([f"model.pretrained={name}"], f"model.pretrained='{name}'",
                        "is not a local directory and could not be loaded from the hub or the local HF cache")
    assert_config_error(["data=hf", f"data.tokenizer={name}"], f"data.tokenizer='{name}'",
                        "is not a local directory and could not be loaded from the hub or the local HF cache")


def test_tokenizer_directory_needs_tokenizer_files(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "README").write_text("x")
    assert_config_error(["data=hf", f"data.tokenizer={tmp_path / 'tok'}"], f"data.tokenizer='{tmp_path / 'tok'}'",
                        "has no tokenizer files")
    (tmp_path / "tok" / "tokenizer.json").write_text("{truncated")
    assert_config_error(["data=hf", f"data.tokenizer={tmp_path / 'tok'}"], f"data.tokenizer='{tmp_path / 'tok'}'",
                        "tokenizer.json is not valid JSON")


def test_data_files_may_be_globs_and_urls(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    base = ["data=hf", "data.path=json", "data.tokenizer=bytes"]
    validate(compose(*base, f"data.data_files={tmp_path}/*.jsonl"))
    validate(compose(*base, "data.data_files=https://example.com/train.jsonl"))
    assert_config_error([*base, f"data.data_files={tmp_path}/*.csv"], f"data.data_files='{tmp_path}/*.csv'",
                        "matches no file")


def test_job_dir_must_be_creatable_and_writable(tmp_path):
    check_job_dir(str(tmp_path / "new" / "job"))
    assert (tmp_path / "new" / "job").is_dir() and not list((tmp_path / "new" / "job").iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^hydra\.run\.dir='.*/file/job': cannot be created .*Fix: choose a"):
        check_job_dir(str(tmp_path / "file" / "job"))
    if os.path.isdir("/proc/self"):  # not writable, even for root
        with pytest.raises(ConfigError, match=r"^hydra\.run\.dir='/proc/self': is not writable"):
            check_job_dir("/proc/self")


PRECISION_BAD = [
    (["trainer.precision=fp64", "precision.reduce_dtype=fp32"], "precision.reduce_dtype='fp32'", "verifies layouts"),
    (["precision.reduce_dtype=bf16"], "precision.reduce_dtype='bf16'", "unknown name. Fix: use one of fp32, param"),
    (["trainer.precision=fp16-mixed", "parallelism=pp2", "schedule=1f1b", "model.tie_embeddings=false"],
     "trainer.precision='fp16-mixed'", "never flushes"),
    (["trainer.precision=bf16-mixed", "debug.inf_grad_step=2"], "debug.inf_grad_step=2", "corrupt the weights"),
    (["trainer.precision=fp16-mixed", "debug.inf_grad_step=0"], "debug.inf_grad_step=0", "must be >= 1"),
    (["trainer.precision=fp16-mixed", "precision.loss_scale.backoff_factor=1.5"],
     "precision.loss_scale.backoff_factor=1.5", "must be < 1"),
    (["trainer.precision=fp16-mixed", "precision.loss_scale.backoff_factor=0.3"],
     "precision.loss_scale.backoff_factor=0.3", "a power of two"),
    (["trainer.precision=fp16-mixed", "precision.loss_scale.initial=1000"],
     "precision.loss_scale.initial=1000.0", "a power of two"),
    (["trainer.precision=fp16-mixed", "precision.loss_scale.min_scale=1e9"], "precision.loss_scale.min_scale=1000000000.0",
     "must be <= precision.loss_scale.initial"),
    (["trainer.precision=fp16-mixed", "precision.loss_scale.hysteresis=0"], "precision.loss_scale.hysteresis=0",
     "must be >= 1"),
    (["trainer.precision=fp64", "precision.fp8=tensorwise"], "precision.fp8='tensorwise'", "verifies layouts at rtol"),
    (["trainer.precision=fp16-mixed", "precision.fp8=rowwise"], "precision.fp8='rowwise'", "loss scaling is not proved"),
    (["model=moe-tiny", "trainer.precision=bf16-mixed", "precision.fp8=tensorwise"], "precision.fp8='tensorwise'", "grouped GEMMs have no FP8 path"),
    (["device=cpu", "trainer.precision=bf16-mixed", "precision.fp8=tensorwise", "precision.fp8_emulate=false"], "precision.fp8_emulate=False",
     "no FP8 matrix units"),
    (["trainer.precision=bf16-mixed", "parallelism=dp2", "parallelism.zero=3", "parallelism.zero_impl=fsdp2",
      "precision.fp8=rowwise",
      "precision.fp8_all_gather=true"], "precision.fp8_all_gather=True", "one scale for the whole tensor"),
    (["trainer.precision=bf16-mixed", "parallelism=dp2", "parallelism.zero=3", "precision.fp8=tensorwise",
      "precision.fp8_all_gather=true"],
     "precision.fp8_all_gather=True", "has no FSDP2 gather"),
    (["trainer.precision=fp32", "precision.fp8=tensorwise"], "precision.fp8='tensorwise'", "would run in fp32"),
    (["trainer.precision=bf16-mixed", "parallelism=pp2", "schedule=zbh1", "precision.fp8=tensorwise"],
     "precision.fp8='tensorwise'", "every linear's backward would run twice"),
    (["trainer.precision=bf16-mixed", "parallelism=dp2", "parallelism.zero=3", "parallelism.zero_impl=fsdp2",
      "precision.fp8=tensorwise", "precision.fp8_all_gather=true", "trainer.save_checkpoint=true"],
     "precision.fp8_all_gather=True", "e4m3 roundings of the masters"),
]


@pytest.mark.parametrize("overrides,head,problem", PRECISION_BAD, ids=[b[1] for b in PRECISION_BAD])
def test_bad_precision_keys_are_rejected(overrides, head, problem):
    assert_config_error(overrides, head, problem)
