"""fp16-mixed's skip on overflow, proved where it can fail (framework/train/update.py).

`debug.inf_grad_rank=R` with `debug.inf_grad_step=2` puts one inf into one gradient element
on global rank R alone, after every gradient reduction and just before the overflow flag:
a tp shard on one pipeline stage, a ZeRO slice, one ep rank's expert weight. No collective
carries it to a peer, so only the flag's own all-ranks reduction can make the others skip.
The inf loss of `debug.inf_grad_step` alone (tests/test_mixed_precision.py) cannot show
that: it poisons every rank's gradients through the dp reduction.

Each layout runs 3 steps on its gloo ranks through the trainer's own pieces (build_runner,
train_step), and every rank returns what the job's files cannot show per rank: its step
records (overflow, loss scale, skipped steps), its own part of the flag, and whether its
weights, fp32 masters, optimizer states and MoE expert biases moved across each step.
Hysteresis 1: the overflow halves the scale at once. Removing the flag's reduction (a
purely local check) fails every layout here: see REPORT-overflow.md for the mutation run.
FSDP2 is absent: it rejects fp16-mixed before launch (framework/validate/fsdp2.py).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import TINY, assert_config_error, compose
from .distributed import run_ranks

STEP, STEPS = 2, 3  # the overflowed step (1-based) of a 3-step run
FP16 = ["trainer.precision=fp16-mixed", "precision.loss_scale.hysteresis=1", f"debug.inf_grad_step={STEP}",
        f"trainer.steps={STEPS}", "data=synthetic", "trainer.warmup_steps=1", "optimizer.lr=3e-3"]
MOE = [*TINY, "model=moe-tiny", "model.n_kv_head=1", "model.moe.expert_inner=16", "model.moe.bias_update_rate=0.01"]
# name -> (overrides, the injecting rank); ranks are arange(world).view(pp, dp, tp)
LAYOUTS = {
    # pp 0, dp 1, tp 1: a tp shard of the first stage's (not the head's), second replica
    "dp2_tp2_pp2": ([*TINY, "parallelism=3d_2x2x2", "schedule=flush", "schedule.microbatches=2"], 3),
    "zero1_dp2_pp2": ([*TINY, "parallelism=dp2_pp2", "parallelism.zero=1", "schedule=flush",
                       "schedule.microbatches=2"], 1),  # pp 0, dp 1: its ZeRO slice
    "zero3_dp2_tp2": ([*TINY, "parallelism=zero3", "parallelism.tp=2", "schedule.microbatches=2"], 2),  # dp 1, tp 0
    # dp 4 = edp 2 x ep 2; dp rank 2 = edp 1, ep 0: rank 0 holds the same experts, rank 3 the others
    "ep2_dp4": ([*MOE, "parallelism=dp4", "parallelism.ep=2", "schedule.microbatches=1"], 2),
}


def _state(runner) -> list[torch.Tensor]:
    """What a step moves on this rank: the stepped tensors (whole, tp shards or ZeRO slices),
    their fp32 masters and the optimizer's states."""
    opt = runner.optimizer
    out = [p.detach() for p in runner.params] + [m.detach() for m in getattr(opt, "master", [])]
    out += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return [t.clone() for t in out]


def _biases(runner) -> list[torch.Tensor]:
    return [b.clone() for n, b in runner.module.named_buffers() if n.endswith("expert_bias")]


def _moved(before: list, after: list) -> bool:
    """Any tensor changed (the first step also creates the optimizer's states)."""
    return len(before) != len(after) or not all(torch.equal(a, b) for a, b in zip(before, after))


def _rank(rank: int, world: int, run, info) -> list[dict]:
    from framework.topology import ParallelContext, ParallelDims
    from framework.train.trainer import Batches, build_runner, train_step

    torch.set_num_threads(1)
    p = run.parallelism
    ctx = ParallelContext.create(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep), rank, torch.device("cpu"))
    runner, _ = build_runner(run, info, ctx)
    torch.manual_seed(run.trainer.seed)  # as framework.train.trainer.train
    batches = Batches(run, info, ctx)
    out = []
    for step in range(run.trainer.steps):
        state, biases = _state(runner), _biases(runner)
        rec = train_step(step, runner, batches, run, ctx)
        out.append({"overflow": rec.overflow, "local": bool(runner.update.local_overflow),
                    "loss_scale": rec.loss_scale, "skipped_steps": rec.skipped_steps,
                    "moved": _moved(state, _state(runner)), "biases": len(biases),
                    "biases_moved": _moved(biases, _biases(runner))})
    return out


@pytest.fixture(scope="module")
def runs():
    """Each layout once, on demand; the tests below read the same runs."""
    from framework.launch.job import run_info
    from framework.validate import validate

    done: dict[str, tuple] = {}

    def get(name: str) -> tuple[list[list[dict]], int]:
        if name not in done:
            overrides, inject = LAYOUTS[name]
            run = compose(*overrides, *FP16, f"debug.inf_grad_rank={inject}")
            validate(run)
            done[name] = (run_ranks(_rank, run.world_size, run, run_info(run, "cpu"), timeout=180), inject)
        return done[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_skips_the_step_one_rank_overflowed(runs, name):
    """Only rank R's own gradients held the inf (the local flags), yet every rank flagged the
    step, counted it, halved the scale, and left its weights, masters and optimizer states
    exactly as they were; the steps around it moved them (the comparison has teeth)."""
    ranks, inject = runs(name)
    for r, recs in enumerate(ranks):
        assert [x["local"] for x in recs] == [False, r == inject, False], r
        assert [x["overflow"] for x in recs] == [False, True, False], r
        assert [x["skipped_steps"] for x in recs] == [0, 1, 1], r
        assert [x["loss_scale"] for x in recs] == [65536.0, 65536.0, 32768.0], r
        assert [x["moved"] for x in recs] == [True, False, True], r


def test_the_moe_bias_update_skips_the_overflowed_step(runs):
    """DeepSeek-V3's expert biases (model.moe.bias_update_rate) move after every applied step
    and on no rank after the overflowed one, though rank R alone held the inf."""
    ranks, _ = runs("ep2_dp4")
    for r, recs in enumerate(ranks):
        assert all(x["biases"] == 2 for x in recs), r  # one per MoE layer
        assert [x["biases_moved"] for x in recs] == [True, False, True], r


@pytest.mark.parametrize("overrides, head, problem", [
    (["trainer.precision=fp16-mixed", "debug.inf_grad_rank=0"], "debug.inf_grad_rank=0", "debug.inf_grad_step"),
    (["trainer.precision=fp16-mixed", "parallelism=dp2", "debug.inf_grad_step=1", "debug.inf_grad_rank=2"],
     "debug.inf_grad_rank=2", "must be < world_size (world_size=2)"),
    (["trainer.precision=bf16-mixed", "debug.inf_grad_step=1", "debug.inf_grad_rank=0"], "debug.inf_grad_step=1",
     "corrupt the weights"),
])
def test_the_injection_is_checked_before_launch(overrides, head, problem):
    assert_config_error(overrides, head, problem)
