"""Issue 30's reported config holes, one test each (the files' are in test_bad_files.py, the
commands' in test_command_errors.py): each case was accepted silently, accepted and then
crashed a rank, or misleading, and is now a one-line config error naming its key, before
any rank starts. In-process (tests/prelaunch.py) except the one that needs run.py's own
summary.json."""

from __future__ import annotations

import json

import pytest

from framework.config import ConfigError

from .conftest import run_cli
from .prelaunch import prelaunch

BASE = ["data=synthetic", "logger=none", "launcher=external", "metrics.peak_tflops=1", "trainer.steps=4"]

CASES = [
    # silent: trained with an infinite op time
    (["parallelism=pp2", "schedule=zb-auto"], "schedule.op_times={F: inf, I: 1, W: 1}", "schedule.op_times.F",
     "must be finite seconds"),
    # silent: the injected overflow never fired (past the run's last step)
    (["trainer.precision=fp16-mixed"], "debug.inf_grad_step=50", "debug.inf_grad_step", "must be <= trainer.steps"),
    # silent: loss-scaling keys ignored under fp64
    (["trainer.precision=fp64"], "precision.loss_scale.initial=1024", "precision.loss_scale.initial",
     "has no effect in this run: it acts only with trainer.precision=fp16-mixed"),
    # silent: a zb-auto key under another schedule
    (["parallelism=pp2", "schedule=zbh1"], "schedule.memory_limit_microbatches=2", "schedule.memory_limit_microbatches",
     "acts only with schedule=zb-auto"),
    # accepted, then the first save failed in a rank
    (["trainer.checkpoint_interval=2"], "debug.checkpoint_disk_bytes=-5", "debug.checkpoint_disk_bytes",
     "must be >= 1"),
    # misleading: Hydra's "Key 'moe' is not in struct", no summary
    (["model=gpt2-tiny"], "model.moe.top_k=4", "model.moe.top_k", "acts only with model.arch=qwen3_moe"),
    # misleading: Hydra's "Could not override" for a typo under a group
    ([], "trainer.checkpoint_intervall=3", "trainer.checkpoint_intervall", "Did you mean trainer.checkpoint_interval"),
    # a huge count that a dry run would allocate for
    (["parallelism=pp2"], "schedule.microbatches=99999999999", "schedule.microbatches", "must be <= 2**16"),
    # a global batch that derives an impossible micro-batch count names the key the user set
    ([], "trainer.global_batch_size=1000000000", "trainer.global_batch_size", "derives schedule.microbatches"),
    # a bool key given a number (OmegaConf would take 2 for true)
    ([], "trainer.activation_checkpointing=2", "trainer.activation_checkpointing", "must be true or false"),
    # a list key given a dict (Hydra's composition error before)
    ([], "schedule.modules={a: 1}", "schedule.modules", "must be a list"),
]


@pytest.mark.parametrize("base,arg,key,problem", CASES, ids=[c[1].split("=")[0] for c in CASES])
def test_a_reported_hole_is_a_config_error(base, arg, key, problem, tmp_path):
    with pytest.raises(ConfigError) as e:
        prelaunch(BASE + base, arg, str(tmp_path / "job"))
    assert e.value.key == key and problem in str(e.value) and "Fix: " in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_key_the_preset_does_not_list_is_rejected_by_run_py_with_a_summary(tmp_path):
    """`model.moe.top_k=4` on a dense model: Hydra used to stop it ("not in struct") before
    run.py could write summary.json; now the schema gets it and the job is `rejected`."""
    job = tmp_path / "job"
    r = run_cli(["logger=none", "data=synthetic", "model.moe.top_k=4", f"hydra.run.dir={job}"], timeout=120)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["config error: model.moe.top_k=4: has no effect in this run: it acts only with "
                     "model.arch=qwen3_moe. Fix: leave model.moe.top_k out, or set model.arch=qwen3_moe"], r.stderr
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "rejected" and summary["reason"].startswith("model.moe.top_k=4:")


def test_the_same_key_on_a_model_with_experts_is_taken(tmp_path):
    prelaunch(BASE + ["model=moe-tiny"], "model.moe.bias_update_rate=0.01", str(tmp_path / "job"))


def test_a_key_spelled_out_at_its_default_is_taken_where_it_has_no_effect(tmp_path):
    """A sweep that writes `parallelism.overlap_cp_ring=false` beside cp_comm=a2a changes
    nothing, so it is no error; the same key set to true there is one (it would do nothing)."""
    base = BASE + ["model=llama-tiny", "parallelism=dp2", "parallelism.cp=2", "parallelism.cp_comm=a2a"]
    prelaunch(base, "parallelism.overlap_cp_ring=false", str(tmp_path / "default"))
    with pytest.raises(ConfigError, match="has no effect in this run: it acts only with"):
        prelaunch(base, "parallelism.overlap_cp_ring=true", str(tmp_path / "on"))


def test_a_range_errors_example_lies_inside_the_range(tmp_path):
    """data.seq_len's default (64) is above model.max_positions 16: the example must not be it."""
    with pytest.raises(ConfigError) as e:
        prelaunch(BASE + ["model.max_positions=16"], "data.seq_len=64", str(tmp_path / "job"))
    text = str(e.value)
    assert "must be <= model.max_positions (model.max_positions=16)" in text, text
    assert "e.g. data.seq_len=16" in text and "its default" not in text, text
