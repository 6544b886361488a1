"""bf16-mixed and fp16-mixed (framework/optim/master.py, framework/train/update.py, framework/train/loss_scale.py):
layouts match the single process at a tolerance derived from bf16's precision, and their fp32
masters at a fraction of the update (test_bf16_mixed_masters_follow_the_single_process); fp16-mixed's
skipped step equals a hand-written single-process run whose batch was skipped; every rank
skips alike; resume is bit-exact with the masters and the scaler; p2p travels in 16 bits.

The tolerance (bf16: 8 significant bits, unit roundoff u = 2**-9). Layouts differ only in
the order of sums (gradients over dp and micro-batches, tp partial matmuls), so their losses
and gradient norms differ by the rounding of bf16 terms in another order: each term carries
a relative error of at most u, the two runs' errors differ by at most 2u = 2**-8 relative
(measured: losses 6e-5, norms 1.5e-3 at most). Parameters are the rounding of fp32 masters:
where the masters differ by little, the bf16 values differ by at most one bf16 spacing (2**-7
relative, twice u); where a rounding flipped the sign of a tiny gradient, AdamW's update
(at most lr per step in size) went the other way: at most 2 lr per step more.
"""

import glob
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from . import wandb_reader
from .conftest import TINY, final_params, read_metrics, run_local

U = 2.0 ** -9  # bf16's unit roundoff
LR, STEPS = 3e-3, 4


def _base(data_cache, steps=STEPS):
    return [*TINY, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", f"trainer.steps={steps}",
            "trainer.warmup_steps=1", "trainer.save_checkpoint=true", f"optimizer.lr={LR}", "schedule=flush",
            "trainer.log_interval=1"]


LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "pp2": ["parallelism=pp2", "schedule.microbatches=4"],
           "tp2": ["parallelism=tp2", "schedule.microbatches=4"],
           "zero1": ["parallelism=zero1", "schedule.microbatches=2"],
           "zero3": ["parallelism=zero3", "schedule.microbatches=2"]}


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, data_cache):
    """Constant lr after the warm-up step (each step moves the masters as much: a step lost is
    a quarter of the update), and the last step's checkpoint, which holds the fp32 masters."""
    out = {}
    for name, layout in LAYOUTS.items():
        job = tmp_path_factory.mktemp(f"bf16_{name}")
        summary = run_local(job, *_base(data_cache), *layout, "trainer.precision=bf16-mixed",
                            "trainer.min_lr_ratio=1", f"trainer.checkpoint_interval={STEPS}")
        out[name] = (summary, read_metrics(job), final_params(job), job)
    return out


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "single"])
def test_bf16_mixed_layouts_match_the_single_process(bf16_runs, layout):
    _, ref_m, ref_p, _ = bf16_runs["single"]
    summary, m, p, _ = bf16_runs[layout]
    assert summary["precision"] == "bf16-mixed"
    for a, b in zip(m, ref_m, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2 * U)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2 * U)
    assert p.keys() == ref_p.keys()
    for k in ref_p:
        assert p[k].dtype == torch.bfloat16  # the exported parameters are the 16-bit model's
        diff = (p[k].double() - ref_p[k].double()).abs()
        bound = 2 * 2 * U * ref_p[k].double().abs() + 2 * LR * STEPS
        assert bool((diff <= bound).all()), (layout, k, float(diff.max()))


def test_bf16_mixed_masters_follow_the_single_process(bf16_runs):
    """The fp32 masters of the last step's checkpoint: the check above allows 2 lr per step,
    more than 4 AdamW steps move an element, so it passes a layout that lost a step. Here the
    masters are within 1/8 of the single process's update (masters minus initial weights) in
    norm, each tensor within 1/2 of its own (measured: 1.3% dp / pp / ZeRO to 3.7% tp; 16% per
    tensor). Not 2u of it: AdamW normalises each element, so where a gradient is within its
    2u rounding error of 0 the step can go the other way (GPT-2's key bias: its exact gradient
    is 0, its update rounding noise, 41% off under tp). Never stepped: 100% off; one of the
    four constant-lr steps lost: about 25% (docs/precision.md)."""
    ref_job = bf16_runs["single"][3]
    ref, init = _stored(ref_job / "checkpoints" / f"step_{STEPS}", "model/"), _initial(ref_job)
    norm = lambda ts: math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))  # noqa: E731
    update = {k: ref[k] - init[k] for k in ref}
    assert ref.keys() == init.keys() and all(t.dtype == torch.float32 for t in ref.values())
    for layout in (k for k in LAYOUTS if k != "single"):
        got = _stored(bf16_runs[layout][3] / "checkpoints" / f"step_{STEPS}", "model/")
        assert got.keys() == ref.keys(), layout
        off = norm(got[k] - ref[k] for k in ref)
        assert off <= norm(update.values()) / 8, (layout, off / norm(update.values()))
        for k in ref:
            if not k.endswith("attn.c_attn.bias"):  # holds the key bias (see above)
                off = norm([got[k] - ref[k]])
                assert off <= norm([update[k]]) / 2, (layout, k, off / norm([update[k]]))


def _initial(job: Path) -> dict[str, torch.Tensor]:
    """The weights every layout starts from (materialised under the seed, layout-free), as
    the fp32 masters hold them (model/<name>) before the first step."""
    from framework.config import read_config
    from framework.models import build_model

    run = read_config(str(job / "config.yaml"))
    info = json.loads((job / "run_info.json").read_text())
    model = build_model(run.model, info["vocab_size"], run.trainer.seed, precision=run.trainer.precision)
    return {f"model/{n}": p.detach().float() for n, p in model.hf_model.named_parameters()}


def test_master_weights_in_every_layout(bf16_runs, tmp_path, data_cache):
    """Every rank of every layout holds fp32 masters of exactly what it steps (the formula's
    bytes: 4 per element it steps, 1/N of them under ZeRO), and 16-bit parameters; an
    asynchronous pipeline's stashed weight versions are 16-bit too."""
    job = tmp_path / "async"
    async_summary = run_local(job, *_base(data_cache), "parallelism=pp2", "schedule=1f1b", "schedule.microbatches=4",
                              "model.tie_embeddings=false", "trainer.precision=bf16-mixed")
    for name, summary in [*((k, v[0]) for k, v in bf16_runs.items()), ("pp2-1f1b", async_summary)]:
        for r in summary["ranks"]:
            assert r["master_bytes"] == r["model_state_formula"]["master_bytes"] > 0, name
            stashed = r["weight_version_bytes"]  # async: snapshots beside the model states the formula counts
            assert r["model_state_bytes"] - stashed == r["model_state_formula_bytes"], name
            # fp32 masters of the same elements as the bf16 parameters, but where ZeRO-1 keeps
            # whole parameters and shards the master
            assert (r["master_bytes"] == 2 * r["params_bytes"]) == (name != "zero1"), name
    versions = max(r["weight_version_bytes"] for r in async_summary["ranks"])
    assert versions > 0 and versions % 2 == 0
    stage0 = async_summary["ranks"][0]
    assert versions <= 2 * stage0["params_bytes"]  # at most p - s = 2 bf16 snapshots of stage 0's weights


def test_pipeline_messages_travel_in_bf16(bf16_runs):
    summary, _, _, job = bf16_runs["pp2"]
    info = json.loads((job / "run_info.json").read_text())
    assert info["p2p_message_bytes"] == 2 * 32 * 32 * 2  # micro-batch 2 x seq 32 x hidden 32, 2 bytes each
    assert summary["p2p_buffer_peak_bytes_max"] % info["p2p_message_bytes"] == 0
    assert summary["p2p_buffer_peak_bytes_max"] > 0


def _stored(path: Path, prefixes) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores under `prefixes`, read back with DCP in this process."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items() if k.startswith(prefixes)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


# ---- fp16-mixed: the loss scaler's skip ----

def _reference(job: Path, run_args: list, skip: int):
    """A single-process fp16-mixed run written here, not through framework/train/update.py or
    framework/optim/master.py: scaled loss, fp16 gradients unscaled into fp32 masters, clip by the
    unscaled global norm, AdamW on the masters, parameters rounded from them; the step
    `skip` (1-based) is left out entirely (no update, no lr step). Returns the losses of the
    steps run and the final fp16 parameters by name."""
    from framework.config import read_config
    from framework.data import ShardedSampler, TokenData
    from framework.models import build_model
    from framework.optim.build import build_optimizer, lr_at

    run = read_config(str(job / "config.yaml"))
    info = json.loads((job / "run_info.json").read_text())
    model = build_model(run.model, info["vocab_size"], run.trainer.seed, precision=run.trainer.precision)
    torch.manual_seed(run.trainer.seed)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = build_optimizer(run.optimizer, masters)  # torch's AdamW with the run's arguments
    data = TokenData.load(run, info["tokens_path"])
    m = run.schedule.microbatches
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, m, 0, 1, run.trainer.seed)
    scale, applied, losses = run.precision.loss_scale.initial, 0, []
    for step in range(run.trainer.steps):
        if step + 1 == skip:
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(applied, run)
        total = 0.0
        for x, y in sampler.microbatches(data, step):
            loss = model(x, y) / m
            (loss * scale).backward()
            total += loss.item()
        losses.append(total)
        grads = [p.grad.float() / scale for p in params]
        # The global norm as torch's clip_grad_norm_ takes it (one multi-tensor norm of the
        # scaled fp16 gradients accumulated in fp32, their squares summed, over the scale): the
        # same reduction order as the framework's, so bit for bit can hold; a per-tensor
        # pow().sum() rounds differently in the last bit, and clipping carries that into the weights.
        norms = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)
        norm = torch.stack(norms).pow(2).sum().sqrt() / scale
        coef = torch.clamp(run.trainer.grad_clip / (norm + 1e-6), max=1.0)
        for mp, g in zip(masters, grads, strict=True):
            mp.grad = g * coef
        opt.step()
        with torch.no_grad():
            for p, mp in zip(params, masters, strict=True):
                p.copy_(mp)
                p.grad = None
        applied += 1
    names = {id(p): n for n, p in model.hf_model.named_parameters()}
    return losses, {names[id(p)]: p.detach() for p in params if id(p) in names}


def test_a_skipped_step_equals_a_run_without_its_batch(tmp_path, data_cache):
    """Single process, 4 steps, inf at step 2 (hysteresis 2: the scale stays): steps 1, 3, 4
    equal the hand-written run that never saw batch 2 (final fp16 weights bit for bit), and
    not the one that did."""
    job = tmp_path / "skip"
    args = [*_base(data_cache), *LAYOUTS["single"], "trainer.precision=fp16-mixed", "debug.inf_grad_step=2"]
    summary = run_local(job, *args, "logger=wandb", "logger.mode=offline")
    rows = read_metrics(job)
    assert [r["overflow"] for r in rows] == [False, True, False, False]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert rows[1]["grad_norm"] is None and all(r["loss_scale"] == 65536.0 for r in rows)
    assert summary["skipped_steps"] == 1 and summary["loss_scale"] == 65536.0 and summary["precision"] == "fp16-mixed"
    logged = wandb_reader.history(glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))[0])
    assert [(h["overflow"], h["skipped_steps"], h["loss_scale"]) for h in logged] == [
        (r["overflow"], r["skipped_steps"], r["loss_scale"]) for r in rows]
    assert "grad overflow (step skipped) | scale 65536 (skipped 1)" in (job / "run.log").read_text()
    assert rows[2]["lr"] == rows[1]["lr"]  # the skipped step did not move the schedule
    losses, params = _reference(job, args, skip=2)
    got = [r["loss"] for i, r in enumerate(rows) if i != 1]
    assert got == pytest.approx(losses, rel=1e-6)  # the step's loss summed in fp32 there, in Python floats here
    # Bit for bit although the update is written twice: both paths run the same model kernels
    # in the same order, and where they differ they only scale by the loss scale, a power of two
    # (exact: g * (coef / s) and (g / s) * coef round once, alike; the norm of the scaled
    # gradients over s is the norm of the unscaled ones, sqrt of x * 4^k being 2^k sqrt(x)).
    final = final_params(job)
    assert params.keys() <= final.keys() and all(torch.equal(final[k], v) for k, v in params.items())  # bit for bit
    _, unskipped = _reference(job, args, skip=0)
    moved = sum(int((final[k] != unskipped[k]).sum()) for k in unskipped)
    assert moved > sum(v.numel() for v in unskipped.values()) / 2  # with batch 2 most weights end elsewhere


def test_every_rank_skips_and_the_scale_halves_once_hysteresis_is_spent(tmp_path, data_cache):
    """dp 2 x pp 2 (the inf loss enters on the last rank only), hysteresis 1: at step 2 no
    rank moves a weight or a state (checkpoints after steps 1 and 2 are equal), the scale
    halves, and the run trains on. The inf loss reaches every rank's gradients through the dp
    reduction, so this cannot show the flag's own reduction: tests/test_overflow_skip.py does."""
    job = tmp_path / "ranks"
    run_local(job, *_base(data_cache, 3), "parallelism=dp2_pp2", "schedule.microbatches=2",
              "trainer.precision=fp16-mixed", "debug.inf_grad_step=2", "precision.loss_scale.hysteresis=1",
              "trainer.checkpoint_interval=1", "trainer.keep_checkpoints=null")
    rows = read_metrics(job)
    assert [r["loss_scale"] for r in rows] == [65536.0, 65536.0, 32768.0]
    assert [r["overflow"] for r in rows] == [False, True, False]

    def state(step):
        return _stored(job / "checkpoints" / f"step_{step}", ("model/", "optim/", "scaler/", "update/"))

    one, two, three = state(1), state(2), state(3)
    weights = [k for k in one if k.startswith(("model/", "optim/"))]
    assert len(weights) > 20 and all(torch.equal(one[k], two[k]) for k in weights)
    assert not torch.equal(two["model/transformer.h.0.mlp.c_fc.weight"], three["model/transformer.h.0.mlp.c_fc.weight"])
    assert two["model/transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32  # the masters are stored
    assert float(two["scaler/scale"]) == 32768.0 and float(two["update/skipped_steps"]) == 1.0


# ---- resume ----

RESUME = {"bf16-mixed-zero3": ["parallelism=zero3", "schedule.microbatches=2", "trainer.precision=bf16-mixed"],
          "fp16-mixed-pp2": ["parallelism=pp2", "schedule.microbatches=4", "trainer.precision=fp16-mixed",
                             "debug.inf_grad_step=1", "precision.loss_scale.hysteresis=1",
                             "precision.loss_scale.growth_interval=2"]}


@pytest.mark.parametrize("case", RESUME)
def test_mixed_resume_is_bit_exact(tmp_path, data_cache, case):
    """A rank fault at step 4 after step_2 was saved; resume=auto equals the uninterrupted run
    bit for bit: the masters, AdamW's states and (fp16) the scaler with its trackers and the
    skipped step (the scale halved at step 1 and grows at step 3, after the resume)."""
    from .test_checkpoint import _fail

    args = [*_base(data_cache), *RESUME[case], "trainer.checkpoint_interval=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_local(whole, *args)
    _fail(cut, *args, "debug.fail_rank=1", "debug.fail_step=4")
    run_local(cut, *args, "trainer.resume=auto")
    ref, got = read_metrics(whole), read_metrics(cut)
    keys = ("loss", "grad_norm", "lr") + (("loss_scale", "skipped_steps") if "fp16" in case else ())
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in ref]
    if "fp16" in case:
        assert [r["loss_scale"] for r in ref] == [65536.0, 32768.0, 32768.0, 65536.0]
    a, b = final_params(whole), final_params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _loss_from_checkpoint(job: Path, step: int) -> float:
    """Step `step`'s loss (1-based) computed here from the weights `job`'s step_<step - 1>
    stores, in the precision of `job`'s config: each dp rank's micro-batches in turn, the rank's
    loss summed in fp32 as a rank does, averaged over ranks as the logging rank does."""
    from framework.config import read_config
    from framework.data import ShardedSampler, TokenData
    from framework.models import build_model

    run = read_config(str(job / "config.yaml"))
    info = json.loads((job / "run_info.json").read_text())
    model = build_model(run.model, info["vocab_size"], run.trainer.seed, precision=run.trainer.precision)
    stored = _stored(job / "checkpoints" / f"step_{step - 1}", "model/")
    with torch.no_grad():
        for name, p in model.hf_model.named_parameters():  # the tied head is the embedding
            p.copy_(stored[f"model/{name}"])
    data, m, dp = TokenData.load(run, info["tokens_path"]), run.schedule.microbatches, run.parallelism.dp
    losses = []
    for r in range(dp):
        sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, m, r, dp, run.trainer.seed)
        with torch.no_grad():
            losses.append(sum((model(x, y) / m for x, y in sampler.microbatches(data, step - 1)),
                              torch.zeros(())).item())
    return sum(losses) / dp


def test_a_bf16_mixed_checkpoint_resumes_in_fp32(tmp_path, data_cache):
    """The stated rule: modes of one state dtype resume each other's checkpoints (the weights
    stored are the fp32 masters); fp64 resumes only fp64 (tests/test_checkpoint.py). The fp32
    run starts from the stored masters themselves: its first step's loss is the loss of those
    weights, computed here (a run that kept its initial weights is 5% off)."""
    args = [*_base(data_cache), *LAYOUTS["dp2"], "trainer.checkpoint_interval=2"]
    job = tmp_path / "cross"
    _from = "trainer.precision=bf16-mixed"
    from .test_checkpoint import _fail

    _fail(job, *args, _from, "debug.fail_rank=1", "debug.fail_step=3")
    summary = run_local(job, *args, "trainer.precision=fp32", "trainer.resume=auto")
    assert summary["first_step"] == 3 and summary["precision"] == "fp32"
    rows = read_metrics(job)
    assert all(math.isfinite(r["loss"]) for r in rows)
    # the same fp32 kernels on the same micro-batches; only the order of the ranks' final
    # sums differs (a few fp32 roundings, 1e-7 relative)
    assert rows[2]["step"] == 3 and rows[2]["loss"] == pytest.approx(_loss_from_checkpoint(job, 3), rel=1e-6)
    assert final_params(job)["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32


def test_the_inf_enters_where_the_head_is_under_v_placement(tmp_path, data_cache):
    """zbv puts the head on pp rank 0: the injected inf still reaches every rank's norm."""
    job = tmp_path / "zbv"
    run_local(job, *_base(data_cache, 2), "parallelism=pp2", "schedule=zbv", "schedule.microbatches=4",
              "trainer.precision=fp16-mixed", "debug.inf_grad_step=2", "model.n_layer=4")
    assert [r["overflow"] for r in read_metrics(job)] == [False, True]
