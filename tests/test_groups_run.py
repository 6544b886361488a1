"""Tests mirror the configs: every option of every group, and every experiment preset,
composes and trains a couple of steps through the real launcher."""

import math
import re
from pathlib import Path

import pytest

from .conftest import TINY, read_metrics, run_local
from .test_config import GROUPS
from .test_data import make_local_hf_dataset

SMALL = [*TINY, "model.n_layer=4", "data=synthetic", "data.num_samples=64", "trainer.steps=2",
         "trainer.warmup_steps=1", "parallelism=single", "schedule.microbatches=1"]


def _local_hf(tmp_path):
    _, path, tok = make_local_hf_dataset(tmp_path)
    return ["data.path=json", f"data.data_files={path}", "data.text_field=context", f"data.tokenizer={tok}",
            f"data.cache_dir={tmp_path / 'cache'}"]


def _overrides(group: str, option: str, tmp_path) -> list[str]:
    args = [*SMALL, f"{group}={option}"]
    if group == "model":  # full-size models at their real shape, kept short
        args = [a for a in args if not a.startswith("model.")] + ["data.seq_len=16", "trainer.micro_batch_size=1"]
    if group == "data" and option == "pycode":
        args += ["data.max_files=10", f"data.cache_dir={tmp_path / 'cache'}"]
    if (group == "data" and option == "hf") or (group == "experiment" and option == "gpt2_squad"):
        args += _local_hf(tmp_path)  # the preset's SQuAD needs the hub; same loader, local file
    if group == "experiment":  # presets override groups: keep their choices, only shorten
        args = [*TINY, "trainer.steps=2", "trainer.warmup_steps=1", f"experiment={option}"] + args[len(SMALL) + 1:]
        if option != "gpt2_squad":
            args += ["data.max_files=10", f"data.cache_dir={tmp_path / 'cache'}"]
        else:
            args = [a for a in args if not a.startswith("model.")] + ["data.seq_len=16", "trainer.micro_batch_size=1",
                                                                      "parallelism=single", "logger=none"]
    if group == "logger" and option == "wandb":
        args += ["logger.mode=offline"]
    return args


# Parallelism and schedule presets are trained by the equivalence tests under their own name
# (more steps, compared with the single process), so they are not run a second time here:
# with 8-rank layouts and twelve schedules that would cost minutes of the suite's 30.
EQUIVALENCE_TESTS = {"parallelism": ["test_equivalence.py", "test_pipeline.py", "test_tp_equivalence.py", "test_zero.py"],
                     "schedule": ["test_pipeline.py", "test_pipeline_async.py", "test_zero_bubble.py",
                                  "test_csv_schedules.py"]}
# Trained here: the models this CPU holds. The others, by their size: moe-mixtral (Mixtral
# 8x7B's shape, 46.7B) and the planning presets (Megatron's GPTs of 1.7B to 1T, GPT-3 175B,
# Llama 3 8B to 405B) are priced by tests/test_cost_model.py and dry-run in tests/test_moe.py;
# gpt2-medium (355M) is gpt2's code at other sizes, trained for real on a GPU in
# experiments/cluster_model/ (30 s of this CPU per run). test_config.py composes and
# validates every one.
TRAINED_MODELS = ("gpt2-tiny", "gpt2", "llama-tiny", "moe-tiny")
TOO_LARGE = [("model", o) for o in GROUPS["model"] if o not in TRAINED_MODELS]
# hardware: the cost model's device, read by the dry run and the simulator, never by training
# (tests/test_cost_model.py prices with each profile).
CASES = [(g, o) for g, opts in GROUPS.items() for o in opts
         if g not in EQUIVALENCE_TESTS and g != "hardware" and (g, o) not in TOO_LARGE]


@pytest.mark.parametrize("group,option", [(g, o) for g in EQUIVALENCE_TESTS for o in GROUPS[g]])
def test_every_parallelism_and_schedule_preset_is_trained_by_an_equivalence_test(group, option):
    here = Path(__file__).parent
    named = re.compile(rf"{group}={re.escape(option)}(?![\w-])")  # interleaved is not interleaved-zb
    users = [f for f in EQUIVALENCE_TESTS[group] if named.search((here / f).read_text())]
    assert users, f"{group}={option} is not run by any of {EQUIVALENCE_TESTS[group]}"


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_runs_a_couple_of_steps(group, option, tmp_path):
    summary = run_local(tmp_path, *_overrides(group, option, tmp_path))
    metrics = read_metrics(tmp_path)
    assert summary["status"] == "completed" and len(metrics) == summary["steps"] == 2
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    assert summary["tokens_per_s"] > 0 and summary["memory_peak_bytes"] > summary["model_state_bytes_max"] > 0
    if group == "logger":
        assert any((tmp_path / "wandb").glob("offline-run-*")) == (option == "wandb")


def test_bf16_and_activation_checkpointing_run_under_ddp(tmp_path):
    base = [*TINY, "data=synthetic", "data.num_samples=64", "trainer.steps=3", "trainer.warmup_steps=1",
            "parallelism=dp2", "schedule.microbatches=2"]
    fp32 = run_local(tmp_path / "fp32", *base)
    ckpt = run_local(tmp_path / "ckpt", *base, "trainer.activation_checkpointing=true")
    bf16 = run_local(tmp_path / "bf16", *base, "trainer.precision=bf16")
    # Recomputation changes no math: same losses; it keeps only block inputs for backward.
    assert [m["loss"] for m in read_metrics(tmp_path / "ckpt")] == pytest.approx(
        [m["loss"] for m in read_metrics(tmp_path / "fp32")], rel=1e-6)
    assert ckpt["activation_peak_bytes_max"] < fp32["activation_peak_bytes_max"] / 2
    # bf16 autocast: close to fp32 but not equal, and fp32 master weights (same param bytes).
    assert bf16["loss_first"] == pytest.approx(fp32["loss_first"], rel=2e-2) and bf16["loss_first"] != fp32["loss_first"]
    assert bf16["ranks"][0]["params_bytes"] == fp32["ranks"][0]["params_bytes"]
