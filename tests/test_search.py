"""The layout search (conf/hparams_search/layout.yaml): Hydra's Optuna sweeper over layouts
of a fixed world size and global batch, maximising tokens_per_s; rejected layouts are scored
and the search goes on; the planner prunes layouts over a memory budget before launch."""

from __future__ import annotations

import json

import pytest
import yaml

from framework.config import ConfigError
from framework.launch.job import check_memory_budget, run_job
from framework.report.compare import collect, headline

from .conftest import ROOT, compose, run_cli

# Seeded TPE (the preset's seed): its first trials are random draws, here pp = 2, 1, 3. pp = 3
# does not divide a world of 2 ranks (dp = world / (tp * pp)), so one trial is rejected
# between completed ones.
SEARCH = ["-m", "hparams_search=layout", "hydra.sweeper.params=null", "parallelism.pp=choice(1,2,3)",
          "hydra.sweeper.n_trials=3", "parallelism.world_size=2", "trainer.global_batch_size=8",
          "schedule.microbatches=2", "trainer.steps=4", "metrics.skip_first=1", "data=synthetic", "data.seq_len=32",
          "logger=none", "model.n_layer=2", "model.n_embd=64"]


def test_a_three_trial_layout_search_reports_the_best_layout(tmp_path):
    r = run_cli([*SEARCH, f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = {j: json.loads((tmp_path / str(j) / "summary.json").read_text()) for j in range(3)}
    status = sorted(s["status"] for s in summaries.values())
    assert status == ["completed", "completed", "rejected"], summaries
    rejected = next(j for j, s in summaries.items() if s["status"] == "rejected")
    assert summaries[rejected]["reason"].startswith("parallelism.dp=None: null derives dp")
    assert f"job {rejected} did not complete" in r.stderr and "it scores 0.0; the sweep goes on" in r.stderr

    done = {j: s for j, s in summaries.items() if s["status"] == "completed"}
    assert {s["tokens_per_step"] for s in done.values()} == {8 * 32}  # one global batch for every layout
    # micro_batch_size=null in the preset: derived, global batch / (microbatches 2 x dp)
    assert sorted((s["dp"], s["pp"], s["micro_batch_size"]) for s in done.values()) == [(1, 2, 4), (2, 1, 2)]
    winner = max(done, key=lambda j: done[j]["tokens_per_s"])
    result = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert result["best_params"] == {"parallelism.pp": done[winner]["pp"]}
    assert result["best_value"] == pytest.approx(done[winner]["tokens_per_s"])
    # (also said: a job measured on a busy machine, tests/test_noise.py; that every layout
    # reached the same loss, tests/test_report.py)
    lines = [x for x in headline(tmp_path, collect(tmp_path)) if x.startswith(("best by ", "no winner named by "))]
    if any(s["noisy"] for s in done.values()):  # a short run on a busy machine: the ranking, no winner
        assert len(lines) == 1 and lines[0].startswith("no winner named by tokens_per_s: ") and \
            f"ranked: job {winner} " in lines[0], lines
    else:
        assert lines == [f"best by tokens_per_s: job {winner} ({_overrides(tmp_path, winner)}): "
                         f"tokens_per_s = {done[winner]['tokens_per_s']:.4g}"]


def test_a_trial_that_picks_1f1b_on_a_tied_model_is_rejected_before_launch(tmp_path):
    """The search never changes the model: schedule=1f1b leaves gpt2-tiny tied, which an
    asynchronous schedule cannot run, so the trial is rejected before any rank starts and
    scores search.failed_value."""
    search = [a for a in SEARCH if not a.startswith(("parallelism.pp=", "hydra.sweeper.n_trials="))]
    r = run_cli([*search, "parallelism.pp=2", "schedule=choice(1f1b)", "hydra.sweeper.n_trials=1",
                 f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["status"] == "rejected" and summary["reason"].startswith("model.tie_embeddings=True: schedule=1f1b")
    assert not (tmp_path / "0" / "config.yaml").exists()  # never launched
    assert "job 0 did not complete" in r.stderr and "it scores 0.0; the sweep goes on" in r.stderr
    # Its only trial was rejected: the search has no best (Optuna's own lines said "Best value: 0.0").
    result = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert result["best_params"] is None and result["best_value"] is None, result
    assert result["no_best"].startswith("no trial completed: every one of the 1 trials was rejected or failed")
    out = r.stdout + r.stderr
    assert "Best value:" not in out and "Best parameters:" not in out, out[-2000:]
    assert "no best layout: no trial completed" in r.stdout


def _overrides(sweep, job: int) -> str:
    return next(r["overrides"] for r in collect(sweep) if r["job"] == str(job))


def test_the_planner_prunes_a_layout_over_the_memory_budget_before_launch(tmp_path):
    # gpt2-tiny (0.86M parameters with the byte vocabulary): 16 bytes each under AdamW at zero
    # 0 = 13.1 MiB on one rank; ZeRO-3 over dp 2 halves it (6.6 MiB), as pp 2 nearly does (7.1 MiB).
    run = compose("parallelism=single", "search.memory_budget_bytes=1e7")
    with pytest.raises(ConfigError) as e:
        run_job(run, str(tmp_path / "job"))
    msg = str(e.value)
    assert msg.startswith("search.memory_budget_bytes=10000000.0: the dry-run planner puts 13,") and "Fix: " in msg
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "rejected" and not (tmp_path / "job" / "config.yaml").exists()  # never launched
    for fits in ("zero3", "pp2"):
        check_memory_budget(compose(f"parallelism={fits}", "search.memory_budget_bytes=1e7"))  # no error


def test_the_search_without_the_plugin_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT))
    from run import sweeper_installed

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not sweeper_installed(["hparams_search=layout"])
    assert 'Fix: pip install -e ".[sweep]"' in capsys.readouterr().err
    assert sweeper_installed(["parallelism=dp2"])


# --- parallelism.ep in the layout search (framework/launch/search_space.py) ------------------------


def _search_cfg(*overrides: str):
    """The config the Optuna sweeper hands its custom_search_space hook: the sweep's own
    composition (a sweep's choice() overrides are not applied to it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from .conftest import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose("config", overrides=["hparams_search=layout", *overrides], return_hydra_config=True)


def _trials(cfg, n: int, fixed: dict | None = None) -> list[dict]:
    """n trials of the preset's seeded TPE, each drawing the preset's params and then the hook,
    as the sweeper does (hydra_optuna_sweeper._impl.OptunaSweeperImpl._configure_trials)."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.launch.search_space import expert_parallel

    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    dists = {o.get_key_element(): create_optuna_distribution_from_override(o)
             for o in OverridesParser.create().parse_overrides(params)}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1234), direction="maximize")
    out = []
    for i in range(n):
        trial = study.ask()
        for name, dist in dists.items():
            trial._suggest(name, dist)
        for name, value in (fixed or {}).items():
            trial.set_user_attr(name, value)
        expert_parallel(cfg, trial)
        out.append(dict(trial.params))
        study.tell(trial, float(i))  # any score: TPE leaves its random start after 10 trials
    return out


def test_the_search_proposes_ep_only_for_moe_models_and_only_divisors():
    from framework.launch.search_space import ep_choices

    dense = _search_cfg()
    assert cfg_hook(dense) == "framework.launch.search_space.expert_parallel"
    assert ep_choices(dense) == [] and all("parallelism.ep" not in t for t in _trials(dense, 12))
    moe = _search_cfg("model=moe-tiny")  # 4 experts, world 4: ep must divide both
    assert ep_choices(moe) == [1, 2, 4]
    trials = _trials(moe, 24)  # past TPE's 10 random start-up trials
    assert {t["parallelism.ep"] for t in trials} == {1, 2, 4}
    assert ep_choices(_search_cfg("model=moe-tiny", "parallelism.world_size=6")) == [1, 2]  # gcd(4, 6)
    three = _search_cfg("model=moe-tiny", "model.moe.experts=3")  # gcd(3, 4) = 1: nothing to search
    assert ep_choices(three) == [1] and all("parallelism.ep" not in t for t in _trials(three, 3))
    # the command line's own ep (fixed or its own choice) is left alone
    assert all("parallelism.ep" not in t for t in _trials(moe, 3, fixed={"parallelism.ep": 2}))


def cfg_hook(cfg) -> str:
    return cfg.hydra.sweeper.custom_search_space


def test_a_trial_whose_ep_does_not_divide_its_dp_is_rejected_before_launch(tmp_path):
    """The choices are fixed for the study (Optuna refuses changing ones), so ep = 4 comes up
    beside pp = 2 (dp = 4 / 2 = 2): rejected by validation, never launched, scored as any
    rejected layout."""
    run = compose("model=moe-tiny", "parallelism.world_size=4", "parallelism.dp=null", "parallelism.pp=2",
                  "parallelism.ep=4")
    with pytest.raises(ConfigError) as e:
        run_job(run, str(tmp_path / "job"))
    assert str(e.value).startswith("parallelism.ep=4: is carved out of dp and must divide parallelism.dp=2")
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "rejected" and not (tmp_path / "job" / "config.yaml").exists()


def test_a_predicted_out_of_memory_layout_scores_the_failed_value():
    """search.mode=simulate: a candidate that does not fit predicts no speed (null, with its
    reason); the sweeper must get search.failed_value for it (0.0 in the layout preset, so
    Optuna learns to avoid it), not NaN (a failed trial; all of them: no best trial at all)."""
    import math

    from omegaconf import OmegaConf

    from run import score

    run = compose("search.mode=simulate", "objective=tokens_per_s")
    cfg = OmegaConf.create({"search": {"failed_value": 0.0}})
    oom = {"predicted_tokens_per_s": None, "reason": "out of memory: 95.0 GiB > 80.0 GiB per GPU"}
    assert score(run, oom, cfg) == 0.0
    assert score(run, {"predicted_tokens_per_s": 1234.5, "reason": None}, cfg) == 1234.5
    assert math.isnan(score(run, oom, OmegaConf.create({"search": {"failed_value": None}})))  # the default: NaN


def test_no_best_is_written_only_for_this_sweeps_own_trials(tmp_path):
    """optimization_results.yaml is rewritten when this sweep's numbered jobs all failed; not
    when one completed, not for a sweep without numbered job directories, and never for a
    study kept in a storage (Optuna resumes it: its best may be an earlier sweep's trial)."""
    from omegaconf import OmegaConf

    from framework.launch.search_result import applies, rewrite_results

    results = tmp_path / "optimization_results.yaml"
    original = "name: optuna\nbest_params:\n  parallelism.pp: 2\nbest_value: 0.0\n"
    results.write_text(original)
    rewrite_results(str(tmp_path))  # no numbered job directory: nothing known, nothing changed
    assert results.read_text() == original
    for job, status in (("0", "rejected"), ("1", "failed")):
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps({"status": status}))
    rewrite_results(str(tmp_path))
    assert yaml.safe_load(results.read_text())["best_value"] is None
    results.write_text(original)
    (tmp_path / "1" / "summary.json").write_text(json.dumps({"status": "completed"}))
    rewrite_results(str(tmp_path))
    assert results.read_text() == original
    assert applies(OmegaConf.create({"hydra": {"sweeper": {"storage": None}}}))
    assert not applies(OmegaConf.create({"hydra": {"sweeper": {"storage": "sqlite:///study.db"}}}))
