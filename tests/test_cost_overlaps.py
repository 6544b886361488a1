"""The overlaps the published systems run with, priced on hand-worked cases
(framework/sim/cost/overlaps.py): Megatron-Core's tp_comm_overlap and the distributed
optimizer's overlap_param_gather. A flat profile (every GEMM at 100 TFLOP/s, no kernel
floor in play) makes each GEMM's time its FLOPs / 1e14."""

from __future__ import annotations

import pytest

from framework.config import ModelConfig
from framework.sim.cost.hardware import Profile
from framework.sim.cost.price import Job, price
from framework.sim.cost.shapes import Layout, ModelShape

LLAMA = ModelShape.of(ModelConfig(arch="llama", n_layer=4, n_embd=1024, n_head=8, n_inner=4096,
                                  tie_embeddings=False), 512)


def flat(intra_GBps: float = 300.0, inter_GBps: float = 1000.0, gpus_per_node: int = 8) -> Profile:
    return Profile(name="flat", peak_tflops={"bf16": 100.0}, memory_GBps=1000.0, kernel_us=1e-3, gpus_per_node=gpus_per_node,
                   gemm_efficiency={"max": 1.0, "half_dim": 0}, host_overlaps=True,
                   links={"intra": {"alpha_us": 0, "GBps": intra_GBps}, "inter": {"alpha_us": 5, "GBps": inter_GBps}})


def test_tp_collectives_hide_behind_their_own_gemms_on_a_hand_computed_case():
    """Llama h 1024, 8 heads (as many KV), MLP 4096, tp 2 + SP, one sequence of 4,096 tokens.
    Each of a block's SP collectives moves half the gathered (4096 x 1024 bf16) tensor over a
    link of 20.97152 GB/s: 200 us. Per block and tp rank the GEMMs (2 t k n / 1e14 s): q 42.950
    and kv 85.899 us (attention in: 128.849), o 42.950, gate_up 343.597, down 171.799 in F;
    I and W as much again each. Beside each linear its collectives hide up to the linear's
    own time: F hides 128.849 + 42.950 + 200 + 171.799 = 543.598 us of its 800; B (I + W)
    200 + 85.899 + 200 + 200 = 685.899 us of its 800 (under zbh1, whose W runs later, I's
    alone: 543.598 again). Four blocks, two micro-batches: the step
    shrinks by 8 x 1229.497 us, and the embedding's and head's collectives stay exposed."""
    us = 1e-6
    prof = flat(intra_GBps=4096 * 1024 * 2 / 2 / 200e-6 / 1e9)
    lay = Layout(1, 4096, tp=2, sp=True)
    off, on = (price(prof, Job(LLAMA, lay, microbatches=2, tp_comm_overlap=o)) for o in (False, True))
    hidden_f, hidden_b = 543.59738368 * us, 685.89934592 * us
    assert on.comm_hidden_s["tp"] == pytest.approx(2 * 4 * (hidden_f + hidden_b), rel=1e-9)
    assert off.step_s - on.step_s == pytest.approx(on.comm_hidden_s["tp"], rel=1e-9)
    assert on.comm_s["tp"] + on.comm_hidden_s["tp"] == pytest.approx(off.comm_s["tp"], rel=1e-9)
    block_tp = 2 * 4 * 8 * 200 * us  # 8 collectives a block (F and B), 4 blocks, 2 micro-batches
    assert off.comm_s["tp"] > block_tp and on.comm_s["tp"] > block_tp - on.comm_hidden_s["tp"]
    assert on.stage_s[(0, 0, "F")] == pytest.approx(off.stage_s[(0, 0, "F")] - 4 * hidden_f, rel=1e-9)
    # a schedule that splits the backward runs W later: B's collectives hide under I's GEMMs
    # alone, as F's under F's (the same 543.598 us a block)
    split = price(prof, Job(LLAMA, lay, microbatches=2, schedule="zbh1", tp_comm_overlap=True))
    assert split.comm_hidden_s["tp"] == pytest.approx(2 * 4 * 2 * hidden_f, rel=1e-9)
    # Megatron's overlap needs sequence parallelism: without it nothing hides
    plain = Layout(1, 4096, tp=2)
    assert price(prof, Job(LLAMA, plain, tp_comm_overlap=True)).step_s == price(prof, Job(LLAMA, plain)).step_s


def test_the_parameter_gather_hides_under_the_next_forward_on_a_hand_computed_case():
    """ZeRO 1 at dp 2 across nodes (5 us, 1000 GB/s): the updated bf16 parameters'
    all-gather, unit by unit (4 blocks + the embedding with the head: 5 units of P =
    4 x 16 779 264 + 1 049 600 parameters), takes u ps + 5 us each: 68 166 656 ps + 25 us
    = 93.166656 us. With overlap_param_gather one unit's share stays exposed and the other
    four run under the first micro-batch's forward (milliseconds here): 4/5 hidden. On a
    link 10^4 times slower the forward is what bounds it: exactly the forward hides."""
    lay = Layout(2, 1024)
    assert LLAMA.total_params() == 4 * 16_779_264 + 1_049_600
    gather = 93.166656e-6
    off, on = (price(flat(gpus_per_node=1), Job(LLAMA, lay, dp=2, microbatches=4, zero=1, param_gather_overlap=o))
               for o in (False, True))
    assert off.comm_s["dp"] == pytest.approx(161.333312e-6 + gather, rel=1e-9)  # the fp32 reduce-scatter: 2u ps + 25 us
    assert on.comm_hidden_s["dp"] == pytest.approx(4 / 5 * gather, rel=1e-9)
    assert off.step_s - on.step_s == pytest.approx(4 / 5 * gather, rel=1e-9)
    slow = flat(inter_GBps=0.1, gpus_per_node=1)
    off, on = (price(slow, Job(LLAMA, lay, dp=2, microbatches=4, zero=1, param_gather_overlap=o))
               for o in (False, True))
    assert on.comm_hidden_s["dp"] == pytest.approx(on.stage_s[(0, 0, "F")], rel=1e-9)
    assert off.step_s - on.step_s == pytest.approx(on.stage_s[(0, 0, "F")], rel=1e-9)
    # ZeRO 0 has no gather; ZeRO 3's per-micro-batch gathers are zero3_prefetch's
    for zero in (0, 3):
        assert price(flat(), Job(LLAMA, lay, dp=2, zero=zero, param_gather_overlap=True)).step_s == \
            price(flat(), Job(LLAMA, lay, dp=2, zero=zero)).step_s
