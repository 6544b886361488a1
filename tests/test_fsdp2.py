"""parallelism.zero_impl=fsdp2 (torch's fully_shard, framework/parallel/fsdp2.py) reproduces
plain data parallelism, composes with tp, holds ZeRO-3's per-rank bytes (with FSDP2's dim-0
padding, exactly), keeps the framework's parameter attributes, checkpoints layout-free in
both directions with our ZeRO, and is rejected before launch where it does not apply.

fp64 equivalence as tests/test_zero.py: zero 2 and 3 at dp 2 and 4 against zero = 0 at
dp 2 (same global batch, 8 sequences): per-step losses, gradient norms and final parameters
to rtol 1e-9. The vocabulary (257 byte-level ids) does not divide by dp, so the embedding's
dim-0 chunks are uneven (129 / 128 rows at dp 2, 65 x 3 + 62 at dp 4): the gradient norm
summed from the local chunks over dp is the single model's, or these runs would differ.
"""

import math

import pytest
import torch

from .conftest import FP64, TINY, assert_config_error, assert_same_training, compose, final_params, read_metrics, run_local
from .distributed import run_ranks

FSDP2 = "parallelism.zero_impl=fsdp2"
DP = {2: ["parallelism=dp2", "schedule.microbatches=2"], 4: ["parallelism=dp4", "schedule.microbatches=1"]}
CASES = [(dp, z) for dp in (2, 4) for z in (2, 3)]
CKPT = ["trainer.checkpoint_interval=2", "trainer.keep_checkpoints=null"]  # step_2 kept to resume from
EVAL = "trainer.eval_interval=3"  # held-out loss after the last step: FSDP2's forward without backward


def _common(data_cache):
    return [*TINY, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", "trainer.steps=3",
            "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3", "schedule=flush"]


def _run(tmp_path_factory, name, *overrides):
    job = tmp_path_factory.mktemp(name)
    return run_local(job, *overrides), read_metrics(job), final_params(job), job


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    c = _common(data_cache)
    out = {"ref": _run(tmp_path_factory, "dp2_zero0", *c, *DP[2], "parallelism.zero=0", *CKPT, EVAL, FP64)}
    for dp, z in CASES:  # dp 2 zero 3 also saves step_2, which our zero 3 resumes below, and evaluates
        out[dp, z] = _run(tmp_path_factory, f"fsdp2_dp{dp}_zero{z}", *c, *DP[dp], f"parallelism.zero={z}", FSDP2,
                          *(CKPT + [EVAL] if (dp, z) == (2, 3) else []), FP64)
    step2 = out[2, 3][3] / "checkpoints" / "step_2"
    out["fsdp2->ours"] = _run(tmp_path_factory, "ours_resumes_fsdp2", *c, *DP[2], "parallelism.zero=3",
                              f"trainer.resume={step2}", FP64)
    step2 = out["ref"][3] / "checkpoints" / "step_2"
    out["dp->fsdp2"] = _run(tmp_path_factory, "fsdp2_resumes_dp", *c, *DP[4], "parallelism.zero=2", FSDP2,
                            f"trainer.resume={step2}", FP64)
    return out


@pytest.mark.parametrize("dp,zero", CASES, ids=[f"dp{d}-zero{z}" for d, z in CASES])
def test_fsdp2_reproduces_data_parallel(runs, dp, zero):
    run, ref = runs[dp, zero], runs["ref"]
    assert_same_training(run[1], run[2], ref[1], ref[2])
    assert run[0]["zero"] == zero


def test_fsdp2_evaluates_as_data_parallel(runs):
    got, want = runs[2, 3][0]["val_loss"], runs["ref"][0]["val_loss"]
    assert got is not None and got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("name", ["fsdp2->ours", "dp->fsdp2"])
def test_checkpoints_cross_between_fsdp2_and_our_layouts(runs, name):
    """fsdp2 dp 2 zero 3's step_2 resumed by our zero 3; dp 2 (DDP)'s step_2 resumed by fsdp2
    at dp 4 zero 2: each equal to the uninterrupted run (the first two rows are the saved history)."""
    run, ref = runs[name], runs["ref"]
    assert [m["step"] for m in run[1]] == [1, 2, 3]
    assert_same_training(run[1], run[2], ref[1], ref[2])


def _shapes(data_cache, psi: int) -> list[torch.Size]:
    """The single model's parameter shapes (each once): the rank's FSDP2 units hold all of them."""
    from framework.launch.job import meta_model

    shapes = [p.shape for p in meta_model(compose(*_common(data_cache)), 257).parameters()]
    assert sum(math.prod(s) for s in shapes) == psi
    return shapes


def fsdp2_state_bytes(shapes, dp: int, rank: int, word: int) -> dict[str, int]:
    """FSDP2's exact per-rank bytes: parameters and gradients in buffers of ceil(rows / dp)
    rows per parameter (padded), AdamW's two states shaped like the local chunk (unpadded,
    rows [r*c, (r+1)*c) clipped), plus one fp32 `step` scalar per parameter."""
    padded = sum(-(-s[0] // dp) * math.prod(s[1:]) for s in shapes)
    mine = sum(max(0, min(s[0], (rank + 1) * -(-s[0] // dp)) - rank * -(-s[0] // dp)) * math.prod(s[1:])
               for s in shapes)
    return {"params_bytes": word * padded, "grads_bytes": word * padded,
            "optimizer_bytes": 2 * word * mine + 4 * len(shapes)}


@pytest.mark.parametrize("dp,zero", CASES, ids=[f"dp{d}-zero{z}" for d, z in CASES])
def test_model_state_bytes_are_zero3s_with_fsdp2_padding(runs, data_cache, dp, zero):
    """Between steps FSDP2 holds stage 3's layout at zero 2 too (its optimizer steps the
    shards), so the formula it meets is stage 3's, 16 psi / dp (x2 in fp64), within 1 %; the
    exact value adds its per-parameter dim-0 padding. The summary's paper's-form column is the
    configured stage's (2: 4 psi + 12 psi / dp), above what FSDP2 holds; its configuration
    formula is stage 3's (element padding, not FSDP2's rows: within 1 %)."""
    from framework.metrics.model_states import zero_model_states

    summary = runs[dp, zero][0]
    shapes = _shapes(data_cache, summary["ranks"][0]["psi"])
    for r in summary["ranks"]:
        psi = r["psi"]
        exact = fsdp2_state_bytes(shapes, dp, r["rank"], word=8)
        assert {k: r[k] for k in exact} == exact, r["rank"]
        measured = sum(exact.values())
        formula = sum(zero_model_states(3, psi, dp, 2.0, word=8).values())
        assert formula == 16 * psi / dp * 2
        assert abs(measured - formula) < 0.01 * formula  # the last rank's short chunks: a little below
        assert r["model_state_formula_paper_bytes"] == sum(zero_model_states(zero, psi, dp, 2.0, word=8).values())
        assert abs(r["model_state_formula_bytes"] - measured) < 0.01 * measured
        assert r["zero_transient_peak_bytes"] > 0  # gathered units during forward / backward
    if zero == 2:  # every block gathered at once after the forward. Not always above zero 3's peak:
        # zero 3's backward holds the next block's prefetched all-gather output (as large as
        # its parameters) beside the current block (measured equal at dp 4, one micro-batch).
        assert summary["zero_transient_peak_bytes_max"] >= runs[dp, 3][0]["zero_transient_peak_bytes_max"]


def _tp_args(data_cache, *layout):
    return [*_common(data_cache), "model.n_layer=4", "model.n_head=4", *layout, FP64]


def test_fsdp2_composes_with_tp(tmp_path_factory, data_cache, shared_run):
    """dp 2 x tp 2 at zero 3 against the single process (the same run as test_zero.py's
    composed reference). Each tp rank's local shards are sharded over dp (2-D); tp-sharded
    parameters must keep `tp_shard`, or tp rank 1's shards would drop out of the grad norm."""
    ref = shared_run(*_tp_args(data_cache, "parallelism=single", "schedule.microbatches=4"))
    run = _run(tmp_path_factory, "fsdp2_dp2_tp2", *_tp_args(data_cache, "parallelism=dp2", "parallelism.tp=2",
                                                             "parallelism.zero=3", "schedule.microbatches=2", FSDP2))
    assert_same_training(run[1], run[2], ref[1], ref[2])


def _attrs_rank(rank: int, world: int, run, info) -> dict:
    """Build the runner (dp 1 x tp 2 here, FSDP2 over the size-1 dp group), take a step, then
    gather for export: which parameters carry tp_shard, before (a second, meta model) and after."""
    from framework.models import build_model
    from framework.parallel.fsdp2 import FSDP2 as Backend
    from framework.comm.tensor_parallel import is_tp_sharded
    from framework.comm.tp_comm import TPComm
    from framework.topology import ParallelContext, ParallelDims
    from framework.train.trainer import Batches, build_runner, train_step
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    p = run.parallelism
    ctx = ParallelContext.create(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp), rank, torch.device("cpu"))
    plain = build_model(run.model, info.vocab_size, 0, "cpu", tp_comm=TPComm(ctx.tp_group, ctx.dims.tp, ctx.coords.tp),
                        on_meta=True)
    want = sorted(n for n, q in plain.named_parameters() if hasattr(q, "tp_shard"))
    runner, _ = build_runner(run, info, ctx)
    assert isinstance(runner.zero, Backend)
    train_step(0, runner, Batches(run, info, ctx), run, ctx)
    named = dict(runner.module.named_parameters())
    out = {"want": want, "dtensor": all(isinstance(q, DTensor) for q in named.values()),
           "sharded": sorted(n for n, q in named.items() if hasattr(q, "tp_shard")),
           "counted": sorted(n for n, q in named.items() if is_tp_sharded(q))}
    runner.zero.gather_all()
    out["gathered"] = sorted(n for n, q in runner.module.named_parameters()
                             if hasattr(q, "tp_shard") and not isinstance(q, DTensor))
    return out


def test_tp_attributes_survive_fully_shard(data_cache):
    from framework.data import prepare
    from framework.launch.job import run_info

    run = compose(*_common(data_cache), "parallelism=tp2", "parallelism.zero=3", FSDP2, FP64)
    prepare(run)
    for r in run_ranks(_attrs_rank, run.world_size, run, run_info(run, "cpu"), timeout=300):
        assert r["dtensor"] and len(r["want"]) > 0
        assert r["sharded"] == r["counted"] == r["gathered"] == r["want"]


def test_bf16_mixed_shards_are_the_fp32_master(tmp_path_factory, data_cache, runs):
    """bf16-mixed: FSDP2 all-gathers bf16 copies for compute and keeps fp32 shards (the master
    weights), fp32 gradients (reduce_dtype) and fp32 AdamW states: 16 psi / dp bytes, the ZeRO
    paper's mixed-precision stage 3, with the padding. Losses follow the fp64 run to bf16's
    precision; the exported weights are the bf16 compute copy (FSDP2 gathers in param_dtype)."""
    summary, metrics, params, _ = _run(tmp_path_factory, "fsdp2_bf16_mixed", *_common(data_cache), *DP[2],
                                       "parallelism.zero=3", FSDP2, "trainer.precision=bf16-mixed")
    shapes = _shapes(data_cache, summary["ranks"][0]["psi"])
    for r in summary["ranks"]:
        assert {k: r[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")} == \
            fsdp2_state_bytes(shapes, 2, r["rank"], word=4)
        assert r["model_state_formula_bf16_bytes"] == pytest.approx(16 * r["psi"] / 2)
    ref = torch.tensor([m["loss"] for m in runs["ref"][1]], dtype=torch.float64)
    got = torch.tensor([m["loss"] for m in metrics], dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=0.0)  # bf16 matmuls: ~3 significant digits
    assert (got != ref).all()  # it did compute in bf16
    assert all(t.dtype == torch.bfloat16 for t in params.values())


BAD = [
    (["parallelism=dp2", "parallelism.zero=1", FSDP2], "parallelism.zero=1", "no optimizer-state-only stage"),
    (["parallelism=dp2", FSDP2], "parallelism.zero_impl='fsdp2'", "nothing for FSDP2 to shard"),
    (["parallelism=dp2_pp2", "parallelism.zero=3", FSDP2], "parallelism.zero_impl='fsdp2'", "pipeline"),
    (["parallelism=dp2", "parallelism.zero=3", FSDP2, "parallelism.offload_optimizer=true"],
     "parallelism.offload_optimizer=True", "CPUOffloadPolicy"),
    (["parallelism=dp2", "parallelism.zero=2", FSDP2, "trainer.precision=fp16-mixed"],
     "trainer.precision='fp16-mixed'", "loss scaling"),
    (["parallelism=dp2", "parallelism.tp=2", "parallelism.zero=3", FSDP2, "parallelism.sequence_parallel=true"],
     "parallelism.sequence_parallel=True", "DTensors"),
    (["parallelism=dp2", "parallelism.zero=2", FSDP2, "trainer.activation_checkpointing=true"],
     "trainer.recompute='full'", "not yet verified"),
    (["parallelism=dp2", "parallelism.zero=2", FSDP2, "trainer.recompute=selective"],
     "trainer.recompute='selective'", "not yet verified"),
    (["parallelism=dp2", "parallelism.zero=2", "parallelism.zero_impl=deepspeed"], "parallelism.zero_impl='deepspeed'",
     "unknown name"),
]


@pytest.mark.parametrize("overrides,head,problem", BAD, ids=[b[1] + "-" + b[2].split()[0] for b in BAD])
def test_what_fsdp2_does_not_support_is_rejected_before_launch(overrides, head, problem):
    assert_config_error(overrides, head, problem)


def test_fsdp2_layouts_are_labelled_by_the_states_they_hold():
    """FSDP2's zero 2 holds stage 3's model states between steps (its optimizer steps the
    sharded parameters): the flat W&B keys and the layout label say so, and ours keep z<n>."""
    from framework.report.wandb_sink import layout_keys

    keys = {(impl, z): layout_keys(compose("parallelism=dp2", f"parallelism.zero={z}", f"parallelism.zero_impl={impl}"))
            for impl, z in [("ours", 2), ("ours", 3), ("fsdp2", 2), ("fsdp2", 3)]}
    assert [keys[k]["zero_states"] for k in keys] == [2, 3, 3, 3]
    assert [keys[k]["zero_impl"] for k in keys] == ["ours", "ours", "fsdp2", "fsdp2"]
    assert [keys[k]["layout"].split("-flush")[0] for k in keys] == [
        "dp2-tp1-pp1-z2", "dp2-tp1-pp1-z3", "dp2-tp1-pp1-fsdp2-z2-holds-z3", "dp2-tp1-pp1-fsdp2-z3"]
