"""Shared helpers: compose configs like run.py does, and run jobs through the real launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from framework.config import RunConfig, load_config
from framework.job import run_job

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")

# A model small enough for many multi-process runs on 2 CPU cores.
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=32", "logger=none",
        "trainer.micro_batch_size=2", "trainer.log_interval=2", "metrics.skip_first=0",
        "metrics.peak_tflops=1.0"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


def compose(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return load_config(hydra_compose("config", overrides=list(overrides)))


def assert_config_error(overrides: list[str], head: str, problem: str) -> None:
    """Validation rejects the overrides with `key=value: problem. Fix: ...`."""
    from framework.config import ConfigError
    from framework.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(*overrides))
    msg = str(e.value)
    assert msg.startswith(head + ":"), msg
    assert problem in msg and "Fix: " in msg, msg


def run_local(job_dir: Path, *overrides: str) -> dict:
    """Compose, validate and launch through framework.job (the path run.py takes)."""
    return run_job(compose(*overrides), str(job_dir))


def read_metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(job_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(job_dir / "final_model.pt", weights_only=True)


def assert_same_training(metrics: list[dict], params: dict, ref_metrics: list[dict], ref_params: dict) -> None:
    """Per-step losses (rtol 1e-5), gradient norms (1e-4) and final parameters (1e-5) of a
    parallel run equal the reference run's: float32 round-off from summation order only."""
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics]),
                               torch.tensor([m["loss"] for m in ref_metrics]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in metrics]),
                               torch.tensor([m["grad_norm"] for m in ref_metrics]), rtol=1e-4, atol=1e-6)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5, msg=name)


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
