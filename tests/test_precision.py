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
    """The issue's acceptance grep: parallel/, the trainer, both runners, the master
    optimizer, the update, the checkpoints and the memory formulas ask the policy."""
    fw = ROOT / "framework"
    files = [*sorted((fw / "parallel").rglob("*.py")), *sorted((fw / "checkpoint").rglob("*.py")),
             *(fw / "train" / f for f in ("trainer.py", "pipeline_runner.py", "accumulation.py", "update.py",
                                         "loss_scale.py")), *sorted((fw / "optim").rglob("*.py")),
             fw / "metrics" / "model_states.py"]
    assert all(p.exists() for p in files)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(Path(p).read_text().splitlines(), 1) if MODE_CHOICE.search(line)]
    assert found == []


def test_mixed_modes_hold_16_bit_parameters_and_fp32_masters():
    for mode, half in (("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)):
        run = compose("model=gpt2-tiny", f"trainer.precision={mode}")
        p = policy_of(run)
        model = build_model(run.model, 64, run.trainer.seed, precision=mode)
        assert {q.dtype for q in model.parameters()} == {half}, mode
        assert (p.master_dtype, p.state_dtype, p.comm_dtype, p.compute_dtype) == (torch.float32, torch.float32, half,
                                                                                   None)
        assert p.reduce_dtype == torch.float32 and p.loss_scaling == (mode == "fp16-mixed")
        assert policy_of(compose(f"trainer.precision={mode}", "precision.reduce_dtype=param")).grad_reduce_dtype == half
    assert policy_of("fp32").master_dtype is None and policy_of("fp64").state_dtype == torch.float64


def test_the_master_keeps_updates_16_bits_would_lose():
    """Why master weights: 200 SGD steps of 1e-4 move a weight of 1.0 by 0.02; bf16 (8 bits
    of mantissa, spacing 2**-7 below 1) rounds each single step away, so a bf16 parameter
    stepped in place never moves. With an fp32 master the parameter is the rounding of
    0.98 (the nearest bf16 number, 0.98046875)."""
    from framework.optim.master import build

    spec = {"_target_": "torch.optim.SGD", "lr": 1e-4}
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt_plain, opt_mixed = build(spec, [plain], policy_of("fp32")), build(spec, [mixed], policy_of("bf16-mixed"))
    for _ in range(200):
        for p, opt in ((plain, opt_plain), (mixed, opt_mixed)):
            p.grad = torch.ones_like(p)
            opt.step()
            opt.zero_grad()
    assert torch.equal(plain.data, torch.ones(4, dtype=torch.bfloat16))
    assert opt_mixed.master[0].dtype == torch.float32
    assert torch.allclose(opt_mixed.master[0].data, torch.full((4,), 0.98), rtol=0, atol=2e-5)  # 200 fp32 roundings
    assert mixed.data.tolist() == [0.98046875] * 4 and mixed.grad is None and opt_mixed.master[0].grad is None
