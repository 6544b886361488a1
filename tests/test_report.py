"""framework.report's judgements on a sweep, on hand-made rows: the fairness warning and the
best job by the sweep's objective."""

from __future__ import annotations

from pathlib import Path

from framework.report import best, fairness_warnings, headline


def _row(job: str, status: str = "completed", **metrics) -> dict:
    return {"job": job, "overrides": f"parallelism=layout{job}", "status": status, **metrics}


def _sweep(tmp_path: Path, objective: str, jobs: int) -> Path:
    for j in range(jobs):
        (tmp_path / str(j)).mkdir(parents=True)
        (tmp_path / str(j) / "config.yaml").write_text(f"objective: {objective}\n")
    return tmp_path


def test_jobs_that_differ_in_batch_are_warned_about():
    rows = [_row("0", global_batch=32, tokens_per_step=2048), _row("1", global_batch=64, tokens_per_step=4096),
            _row("2", "failed", global_batch=8)]  # a failed job has no numbers to compare
    warnings = fairness_warnings(rows)
    assert len(warnings) == 2
    assert warnings[0].startswith("WARNING: the jobs differ in global_batch (job 0: 32, job 1: 64)")
    assert "Fix: set trainer.global_batch_size" in warnings[0] and "tokens_per_step" in warnings[1]
    assert fairness_warnings([_row("0", global_batch=32, tokens_per_step=2048),
                              _row("1", global_batch=32, tokens_per_step=2048)]) == []


def test_best_follows_the_objective_direction(tmp_path):
    rows = [_row("0", tokens_per_s=100.0, loss=3.0), _row("1", tokens_per_s=300.0, loss=4.0),
            _row("2", "rejected", tokens_per_s=None)]
    sweep = _sweep(tmp_path / "a", "tokens_per_s", 3)
    assert best(sweep, rows) == (rows[1], "tokens_per_s")  # maximised
    sweep = _sweep(tmp_path / "b", "loss", 3)
    assert best(sweep, rows) == (rows[0], "loss")  # minimised
    assert headline(sweep, rows) == ["best by loss: job 0 (parallelism=layout0): loss = 3"]
