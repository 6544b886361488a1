"""What the console says happened: the job directory at the start and the end, each
checkpoint saved (step, place, size, time), a resumed run's banner, MFU shown as n/a (and
warned once) where the probed peak is meaningless, a MoE run's summary line, and the
summary's "1 step" (not "1 steps")."""

from __future__ import annotations

import torch

from framework.metrics import moe, peak
from framework.report.closing import summary_lines

from .conftest import TINY, run_local


def test_the_job_directory_each_checkpoint_and_a_resume_are_told(tmp_path, capsys):
    job = tmp_path / "job"
    args = [*TINY, "parallelism=single", "data=synthetic", "trainer.steps=4", "trainer.checkpoint_interval=2"]
    run_local(job, *args)
    out = capsys.readouterr().out
    assert f"job directory {job}\n" in out and f"results in {job}: summary.json, metrics.jsonl, run.log\n" in out
    log = (job / "run.log").read_text()
    for step in (2, 4):
        line = next(x for x in log.splitlines() if x.startswith(f"checkpoint saved: step {step} -> "))
        assert str(job / "checkpoints" / f"step_{step}") in line and " MiB; the step waited " in line
    run_local(tmp_path / "again", *args[:-2], "trainer.steps=6", f"trainer.resume={job / 'checkpoints' / 'step_4'}")
    out = capsys.readouterr().out
    assert f"weights from {job / 'checkpoints' / 'step_4'})" in out and "random init" not in out
    assert f"resuming from {job / 'checkpoints' / 'step_4'} (saved after step 4): continuing at step 5" in out


def test_a_low_precision_without_a_matrix_unit_has_no_mfu(monkeypatch):
    """fp16 on this CPU: the probe gives 0.001 TFLOP/s against fp32's 0.087, so an MFU
    against it read 448 %: n/a instead, with the reason (printed once, in the banner). bf16
    at half fp32's rate is a real (slow) peak and is kept."""
    rates = {torch.float16: 1e9, torch.bfloat16: 4e10, torch.float32: 8.7e10}
    monkeypatch.setattr(peak, "cached_probe", lambda device, dtype: rates[dtype])
    got, source = peak.device_peak("fp16-mixed", torch.device("cpu"))
    assert got is None and source == ("no matrix unit: float16 matmuls run at 0.001 TFLOP/s on this cpu, under 25% "
                                      "of fp32's 0.087; MFU n/a")
    assert peak.device_peak("bf16-mixed", torch.device("cpu")) == (4e10, "probe")
    assert peak.device_peak("fp32", torch.device("cpu")) == (8.7e10, "probe")


def _summary(**extra) -> dict:
    return {"loss_first": 5.0, "loss": 4.0, "tokens_per_s": 1000.0, "step_time_s": 1.0, "mfu": None,
            "measured_steps": 1, "steps": 2, "first_step": 1, "ranks": [], **extra}


def test_a_moe_runs_summary_has_its_line_and_one_step_is_singular():
    rows = [{"step_time_s": 2.0, "a2a_s": 0.5, "moe_load_max_over_mean": 1.5, "moe_dropped_fraction": 0.01},
            {"step_time_s": 1.0, "a2a_s": 0.3, "moe_load_max_over_mean": 1.3, "moe_dropped_fraction": 0.03}]
    s = moe.summary(rows)
    assert s == {"moe_load_max_over_mean": 1.4, "moe_dropped_fraction": 0.02, "moe_a2a_share": 0.275}
    lines = summary_lines(_summary(**s)).splitlines()
    assert lines[0].endswith("mfu n/a (medians over 1 step after 1 warm-up)")
    assert "MoE: all-to-all 28% of the step | load max/mean 1.40 (the worst layer) | dropped 2.0% of assignments" in lines
    assert moe.summary([{"step_time_s": 1.0}]) == {}  # a dense model: no line
    assert moe.line({**s, "moe_a2a_share": None}).startswith("MoE: all-to-all n/a (ep = 1)")


def test_the_dry_run_labels_tp_shards_and_uses_the_runs_own_precision_form(tmp_path, capsys):
    """The issue's walk: `stage 1: ... 9.48M params` was per tp rank unsaid, and an fp32
    run's plan quoted the mixed modes' 2 + 2 + 12 form where its runs say 4 + 4 + 8."""
    from framework.launch.job import run_job

    from .conftest import compose

    assert run_job(compose("parallelism=tp2_pp2", "dry_run=true", "logger=none"), str(tmp_path / "a")) is not None
    out = capsys.readouterr().out
    assert "M params per tp rank (tp 2)" in out and "(ZeRO-0, fp32; the paper's 4 + 4 + 8 form " in out
    assert "activations " in out and "2 + 2 + 12" not in out
    run_job(compose("parallelism=pp2", "trainer.precision=bf16-mixed", "dry_run=true", "logger=none"),
            str(tmp_path / "b"))
    out = capsys.readouterr().out
    assert "(ZeRO-0, bf16-mixed; the paper's 2 + 2 + 12 form " in out and "per tp rank" not in out


def test_a_what_if_that_changes_the_rank_count_says_its_times_may_not_carry_over(pipeline_job_files):
    """The issue's walk (`parallelism.pp=4` from a pp 2 run on 2 cores predicted 12,000
    tokens/s and measured 8,919, and nothing said why it might be off); here dp 2 from a pp 2 job."""
    from framework.sim.cli import describe, what_if

    from .conftest import PIPELINE_JOB, compose

    same = what_if(str(pipeline_job_files), target=compose(*PIPELINE_JOB, "schedule=zbh1"))
    assert "rank_count_note" not in same and "WARNING" not in describe(same)
    more = what_if(str(pipeline_job_files), target=compose(*PIPELINE_JOB, "parallelism.dp=2"))
    assert describe(more).splitlines()[-1] == (
        "  WARNING: the target runs 4 ranks where the source ran 2: the source's per-rank times were measured "
        "with 2 ranks sharing the machine and may not carry over (on a CPU, ranks share its cores)")


def test_the_banners_factors_multiply_to_the_world():
    """A cp run's banner read `world 2 = dp 1 x tp 1 x pp 1`: the factors now multiply to it."""
    import math

    from framework.launch.job import world_factors

    from .conftest import compose

    for overrides in ([], ["parallelism=dp2", "parallelism.cp=2"], ["parallelism=dp4", "parallelism.cp=2"],
                      ["parallelism=tp2_pp2"], ["model=moe-tiny", "parallelism=dp4", "parallelism.ep=2"]):
        run = compose(*overrides)
        text = world_factors(run.parallelism)
        factors = [int(text.split(f"{d} ")[1].split()[0]) for d in ("dp", "cp", "tp", "pp") if f"{d} " in text]
        assert math.prod(factors) == run.world_size, (overrides, text)
    assert world_factors(compose("parallelism=single", "parallelism.cp=2").parallelism) == "dp 1 x cp 2 x tp 1 x pp 1"  # world 2


def test_layout_names_differ_by_every_cp_and_overlap_key():
    """W&B groups runs by `layout`: runs that differ in cp_comm, cp_balance, an overlap or
    sequence parallelism must not share a name (they all read dp1-tp1-pp1-z0-...-cp2-headtail)."""
    from framework.report.wandb_sink import layout_keys

    from .conftest import compose

    cp = ["model=llama-tiny", "parallelism=dp2", "parallelism.cp=2"]
    variants = [cp, [*cp, "parallelism.cp_comm=ring"], [*cp, "parallelism.cp_comm=a2a"],
                [*cp, "parallelism.cp_balance=contiguous"], [*cp, "parallelism.cp_comm=ring", "parallelism.overlap_cp_ring=true"],
                ["parallelism=dp2", "parallelism.zero=3"], ["parallelism=dp2", "parallelism.zero=3", "parallelism.overlap_param_gather=true"],
                ["parallelism=dp2", "parallelism.zero=3", "parallelism.overlap_grad_reduce=true"],
                ["parallelism=tp2"], ["parallelism=tp2", "parallelism.sequence_parallel=true"],
                ["parallelism=pp2", "schedule=dualpipev"], ["parallelism=pp2", "schedule=dualpipev", "parallelism.overlap_dualpipe=true"]]
    names = [layout_keys(compose(*v))["layout"] for v in variants]
    assert len(set(names)) == len(names), names
    assert names[4].endswith("-cp2-ring-headtail-overlap_ring"), names[4]
