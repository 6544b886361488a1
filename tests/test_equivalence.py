"""Every dp layout reproduces the single-process run for the same global batch.

Global batch = micro_batch_size x microbatches x dp is held at 8 sequences: one process
accumulating 4 micro-batches, dp = 2 accumulating 2, dp = 4 with 1. In fp64 the per-step
losses, gradient norms (every rank's, `rank_grad_norm`: the logged `grad_norm` is their max)
and final parameters agree to rtol 1e-9 (the only difference is the order in which gradient
contributions are summed; tolerances in conftest.py); the fp32 run (gpt2 dp2, the cheaper
launch: dp 4 is proved in fp64) tracks the fp64 single process's losses to 1e-5.
"""

import pytest
import torch

from .conftest import (FP64, FP64_TOL, TINY, assert_same_losses_fp32, assert_same_training, compose, final_params,
                       read_metrics, run_local)

LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "dp4": ["parallelism=dp4", "schedule.microbatches=1"]}
MODELS = {"gpt2": ["model=gpt2-tiny"],
          "llama": ["model=llama-tiny", "model.n_kv_head=1", "model.n_inner=64"]}
FP32 = ("gpt2", "dp2")  # the family's one fp32 run: loss level only


def _common(data_cache):
    return [*TINY, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", "trainer.steps=6",
            "trainer.warmup_steps=2", "trainer.save_checkpoint=true", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = {}
    for model, model_args in MODELS.items():
        for layout in (("single", "dp2", "dp4") if model == "gpt2" else ("single", "dp2")):
            job = tmp_path_factory.mktemp(f"{model}_{layout}")
            precision = [] if (model, layout) == FP32 else [FP64]
            summary = run_local(job, *model_args, *LAYOUTS[layout], *_common(data_cache), *precision)
            out[model, layout] = (summary, read_metrics(job), final_params(job))
    return out


@pytest.mark.parametrize("model,layout", [("gpt2", "dp2"), ("gpt2", "dp4"), ("llama", "dp2")])
def test_dp_reproduces_single_process_losses_and_parameters(runs, model, layout):
    ref_summary, ref_metrics, ref_params = runs[model, "single"]
    summary, metrics, params = runs[model, layout]
    assert summary["world_size"] == int(layout[2:]) and summary["global_batch"] == ref_summary["global_batch"] == 8
    assert len(metrics) == 6 and ref_metrics[-1]["loss"] < ref_metrics[0]["loss"]  # and it trains
    if (model, layout) == FP32:
        assert_same_losses_fp32(metrics, ref_metrics)
    else:
        assert len(params) > 10
        assert_same_training(metrics, params, ref_metrics, ref_params)
        # every rank's norm, not only the largest (a rank whose norm is low hides under the max)
        for row, ref in zip(metrics, ref_metrics, strict=True):
            assert len(row["rank_grad_norm"]) == summary["world_size"]
            torch.testing.assert_close(torch.tensor(row["rank_grad_norm"], dtype=torch.float64),
                                       torch.full((summary["world_size"],), ref["grad_norm"], dtype=torch.float64),
                                       **FP64_TOL, msg=lambda m, step=row["step"]: f"step {step}: {m}")


@pytest.mark.parametrize("model", MODELS)
def test_fp64_mode_computes_in_fp64(model):
    """Every tensor autograd saves is fp64, and so are the loss and the gradients: nothing on
    the way (transformers' fp32 RMSNorm, the loss's upcast) rounds an fp64 run to fp32. The
    model starts from the fp32 run's very weights."""
    from framework.models import build_model

    run = compose(*TINY, *MODELS[model], FP64)
    m64 = build_model(run.model, 257, 0, precision=run.trainer.precision)
    m32 = build_model(run.model, 257, 0)
    assert all(torch.equal(a.double(), b) for a, b in zip(m32.parameters(), m64.parameters(), strict=True))
    saved = set()

    def pack(t):
        if t.is_floating_point():
            saved.add(t.dtype)
        return t

    x = torch.randint(0, 257, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m64(x, x)
    loss.backward()
    assert loss.dtype == torch.float64 and saved == {torch.float64}
    assert {p.grad.dtype for p in m64.parameters()} == {torch.float64}
