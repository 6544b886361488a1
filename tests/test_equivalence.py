"""Every dp layout reproduces the single-process run for the same global batch (fp32).

Global batch = micro_batch_size x microbatches x dp is held at 8 sequences: one process
accumulating 4 micro-batches, dp = 2 accumulating 2, dp = 4 with 1. Losses at every step
and the final parameters must agree to float32 round-off (the only difference is the
order in which gradient contributions are summed).
"""

import pytest
import torch

from .conftest import TINY, final_params, read_metrics, run_local

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)  # observed max |diff| ~2e-6; one lr step is 3e-3
LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "dp4": ["parallelism=dp4", "schedule.microbatches=1"]}
MODELS = {"gpt2": ["model=gpt2-tiny"],
          "llama": ["model=llama-tiny", "model.n_kv_head=1", "model.n_inner=64"]}


def _common(data_cache):
    return [*TINY, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", "trainer.steps=6",
            "trainer.warmup_steps=2", "trainer.save_checkpoint=true", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = {}
    for model, model_args in MODELS.items():
        for layout in (("single", "dp2", "dp4") if model == "gpt2" else ("single", "dp2")):
            job = tmp_path_factory.mktemp(f"{model}_{layout}")
            summary = run_local(job, *model_args, *LAYOUTS[layout], *_common(data_cache))
            out[model, layout] = (summary, read_metrics(job), final_params(job))
    return out


@pytest.mark.parametrize("model,layout", [("gpt2", "dp2"), ("gpt2", "dp4"), ("llama", "dp2")])
def test_dp_reproduces_single_process_losses_and_parameters(runs, model, layout):
    ref_summary, ref_metrics, ref_params = runs[model, "single"]
    summary, metrics, params = runs[model, layout]
    assert summary["world_size"] == int(layout[2:]) and summary["global_batch"] == ref_summary["global_batch"] == 8
    ref_loss = torch.tensor([m["loss"] for m in ref_metrics])
    loss = torch.tensor([m["loss"] for m in metrics])
    assert len(loss) == 6
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
    assert ref_loss[-1] < ref_loss[0]  # and it trains
    assert params.keys() == ref_params.keys()
    moved = 0
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, **PARAM_TOL, msg=name)
        moved += 1
    assert moved > 10


def test_grad_norms_agree_too(runs):
    ref = [m["grad_norm"] for m in runs["gpt2", "single"][1]]
    for layout in ("dp2", "dp4"):
        torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in runs["gpt2", layout][1]]),
                                   torch.tensor(ref), rtol=1e-4, atol=1e-6)
