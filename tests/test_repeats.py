"""`sweep.repeats=N` (framework/launch/repeats.py, framework/report/repeats.py): the jobs of
a sweep interleaved (A B A B ...), and the report's medians with intervals and its
pairwise verdicts. In process on a made sweep directory whose per-step samples are known;
one real `-m` sweep of 2 configurations x 3 repeats."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import ConfigError
from framework.launch.repeats import expand
from framework.report.compare import collect, headline
from framework.report.repeats import configuration

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_the_repeat_index_goes_first_so_the_configurations_interleave():
    argv = ["-m", "parallelism=single,dp2", "sweep.repeats=3", "logger=none"]
    assert expand(argv) == ["-m", "sweep.repeat=0,1,2", "parallelism=single,dp2", "sweep.repeats=3", "logger=none"]
    assert expand(["-m", "parallelism=single,dp2"]) == ["-m", "parallelism=single,dp2"]
    assert expand(["-m", "a=1", "sweep.repeats=1"]) == ["-m", "a=1", "sweep.repeats=1"]
    with pytest.raises(ConfigError, match="sweep.repeats=3: repeats the jobs of a sweep, and this is a single run"):
        expand(["parallelism=dp2", "sweep.repeats=3"])
    with pytest.raises(ConfigError, match="sweep.repeats=2: repeats the jobs of a basic sweep"):
        expand(["-m", "hparams_search=layout", "sweep.repeats=2"])
    with pytest.raises(ConfigError, match="sweep.repeat='given': is set by sweep.repeats"):
        expand(["-m", "sweep.repeat=0,1", "sweep.repeats=2"])
    assert configuration("sweep.repeat=2 parallelism=dp2 sweep.repeats=3") == "parallelism=dp2 sweep.repeats=3"


def _job(sweep: Path, num: int, overrides: list[str], tokens_per_s: list[float]) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    warm = [{"step": 1, "tokens_per_s": 1.0, "loss": 2.0}]  # a warm-up step: left out
    rows = warm + [{"step": i + 2, "tokens_per_s": t, "loss": 2.0} for i, t in enumerate(tokens_per_s)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "summary.json").write_text(json.dumps({
        "status": "completed", "loss": 2.0, "tokens_per_s": sorted(tokens_per_s)[len(tokens_per_s) // 2],
        "step_time_s": 1.0, "global_batch": 8, "tokens_per_step": 256, "measured_steps": len(tokens_per_s)}))


def test_the_report_gives_intervals_and_says_which_configurations_cannot_be_told_apart(tmp_path):
    """Three configurations x 3 interleaved repeats, 20 measured steps each: `fast` ~150
    tokens/s, `a` and `b` both ~100 (the same distribution: not distinguishable); `fast` is
    ~50 % faster than the better of them, and the interval says so."""
    rng = random.Random(1)
    num = 0
    for rep in range(3):
        for name, mean in (("fast", 150.0), ("a", 100.0), ("b", 100.0)):
            _job(tmp_path, num, [f"sweep.repeat={rep}", f"x={name}", "sweep.repeats=3"],
                 [rng.gauss(mean, 3.0) for _ in range(20)])
            num += 1
    lines = headline(tmp_path, collect(tmp_path))
    at = lines.index(next(x for x in lines if x.startswith("repeats: tokens/s, median [95% interval]")))
    ranked = lines[at + 1:at + 4]
    assert ranked[0].startswith("  1. x=fast sweep.repeats=3: 15") and "(3 repeats: " in ranked[0]
    pair = lines[at + 4]
    assert pair.startswith("  x=fast sweep.repeats=3 is 4") and "% faster than x=" in pair
    lo = float(pair.split("(interval ")[1].split("%")[0])
    assert 40 < lo < 55  # the interval excludes 0 and holds the true +50 %
    assert lines[at + 5].endswith("are not distinguishable" + lines[at + 5].split("are not distinguishable")[1])
    assert "x=a sweep.repeats=3 and x=b sweep.repeats=3 are not distinguishable" in lines[at + 5] or \
        "x=b sweep.repeats=3 and x=a sweep.repeats=3 are not distinguishable" in lines[at + 5]
    assert headline(tmp_path, collect(tmp_path)) == lines  # seeded: the same report every time


def test_a_real_sweep_with_three_repeats_reports_intervals(tmp_path, data_cache):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "run.py", "-m", "trainer.micro_batch_size=1,2", "sweep.repeats=3",
           *[a for a in TINY if not a.startswith("trainer.micro_batch_size")], "parallelism=single",
           "data=synthetic", "trainer.steps=4", "metrics.skip_first=1", f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    order = [(sweep / str(i) / ".hydra" / "overrides.yaml").read_text().splitlines()[:2] for i in range(6)]
    assert order == [[f"- sweep.repeat={i // 2}", f"- trainer.micro_batch_size={1 + i % 2}"] for i in range(6)]
    rep = subprocess.run([sys.executable, "-m", "framework.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert "repeats: tokens/s, median [95% interval]" in rep.stdout
    assert rep.stdout.count(" repeats: ") == 2  # each configuration's line: its 3 repeats' medians
    assert ("faster than" in rep.stdout) or ("not distinguishable" in rep.stdout)


def test_wandb_groups_a_configurations_repeats_by_job_type():
    """W&B: the repeat index and count are run keys; with repeats, a run's job_type is its
    configuration (its name without sweep.repeat=), so the grouped charts of one sweep (one
    W&B group) draw each configuration's mean and spread; W&B caps job_type at 64 characters."""
    from framework.report.wandb_sink import job_type, layout_keys

    from .conftest import compose

    run = compose("sweep.repeats=3", "sweep.repeat=2")
    run.logger.run_name = "sweep.repeat=2 parallelism=dp2 sweep.repeats=3"
    assert job_type(run) == "parallelism=dp2 sweep.repeats=3"
    assert (layout_keys(run)["repeat"], layout_keys(run)["repeats"]) == (2, 3)
    run.logger.run_name = "sweep.repeat=2 " + " ".join(f"model.n_layer={i}" for i in range(12))
    long = job_type(run)
    assert len(long) == 64 and long.startswith("model.n_layer=0 model.n_layer=1") and long[-9] == "~"
    assert job_type(compose()) is None  # no repeats: no job_type


def test_the_dashboard_draws_the_repeats_with_their_intervals(tmp_path):
    """The made sweep above, as report.html in headless chromium: the repeats panel has a bar
    per configuration and a point per repeat, names the pair it cannot tell apart, and
    passes the page's own layout checks."""
    from framework.report.compare import main
    from framework.report.dashboard_checks import read_checks

    from .test_dashboard import _render

    rng = random.Random(1)
    for num, (rep, name) in enumerate((r, n) for r in range(3) for n in ("fast", "a", "b")):
        _job(tmp_path, num, [f"sweep.repeat={rep}", f"x={name}", "sweep.repeats=3"],
             [rng.gauss({"fast": 150.0}.get(name, 100.0), 3.0) for _ in range(20)])
    assert main([str(tmp_path)]) == 0
    checks = read_checks(_render(tmp_path / "report.html"))
    title = next(t for t in checks["titles"] if t.startswith("Repeats: tokens/s per configuration"))
    assert "not distinguishable: x=" in title and "~ x=" in title
    assert checks["empty_plots"] == checks["titles_under_toolbar"] == checks["titles_cut"] == [], checks
