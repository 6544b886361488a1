"""The precision policy (framework/precision.py) is the one place trainer.precision becomes
dtypes: the modes build what they say, the alias is the same mode, and no module under
framework/parallel/ or the trainer chooses a dtype by the mode's name."""

import re
from pathlib import Path

import torch

from framework.models import build_model
from framework.precision import PRECISIONS, policy_of

from .conftest import ROOT, compose


def test_each_mode_builds_and_computes_in_its_dtypes():
    for mode, params, logits in (("fp32", torch.float32, torch.float32), ("fp64", torch.float64, torch.float64),
                                 ("bf16", torch.float32, torch.bfloat16)):
        run = compose("model=gpt2-tiny", f"trainer.precision={mode}")
        model = build_model(run.model, 64, run.trainer.seed, precision=mode)
        assert {p.dtype for p in model.parameters()} == {params}, mode
        hidden = torch.randn(2, 8, run.model.n_embd, dtype=params)
        with policy_of(run).autocast_context(torch.device("cpu")):
            out = torch.nn.functional.linear(hidden, next(model.parameters()).new_ones(4, run.model.n_embd))
        assert out.dtype == logits, mode
    assert policy_of("bf16") is policy_of("bf16-autocast") and "bf16" in PRECISIONS
    assert policy_of("fp64").comm_bytes == 8 and policy_of("bf16").comm_bytes == 4  # p2p stays fp32 under autocast


MODE_CHOICE = re.compile(r"precision\s*(==|!=|in\b)|torch\.(float64|bfloat16|float16|half|double)\b|\"(fp64|bf16|fp16)\"")


def test_no_dtype_is_chosen_by_the_mode_outside_the_policy():
    """The issue's acceptance grep: parallel/ and the trainer ask the policy."""
    files = [*sorted((ROOT / "framework" / "parallel").rglob("*.py")), ROOT / "framework" / "trainer.py"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(Path(p).read_text().splitlines(), 1) if MODE_CHOICE.search(line)]
    assert found == []
