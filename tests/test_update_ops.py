"""The update's dispatched ops do not grow with the number of parameter tensors (issue "the
framework off the critical path", item 1, in part): the global norm, the clip and the master
copies are multi-tensor ops. Counted in process with a TorchDispatchMode over the same
parameter count split into 4 and into 64 tensors."""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.grads import clip_grad_norm
from framework.optim.master import MasterOptimizer

ELEMENTS = 4096
ADAMW = {"_target_": "torch.optim.AdamW", "lr": 1e-3, "fused": True}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _params(n: int, dtype=torch.float32) -> list[nn.Parameter]:
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(ELEMENTS // n, dtype=dtype)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _count(fn) -> Counter:
    with _Ops() as mode:
        fn()
    return mode.ops


def test_the_norm_and_the_clip_dispatch_as_many_ops_for_4_tensors_as_for_64():
    counts = [_count(lambda ps=_params(n): clip_grad_norm(ps, 0.5)) for n in (4, 64)]
    assert counts[0] == counts[1], counts
    # and it clipped: the norm is the concatenation's, every gradient scaled to it
    ps = _params(64)
    want = torch.cat([p.grad for p in ps]).norm()
    norm = clip_grad_norm(ps, 0.5)
    torch.testing.assert_close(norm, want)
    torch.testing.assert_close(torch.cat([p.grad for p in ps]).norm(), torch.tensor(0.5), rtol=1e-5, atol=0)


def test_the_master_update_dispatches_as_many_ops_for_4_tensors_as_for_64():
    """bf16 parameters, fp32 masters in one flat buffer, fused AdamW: the copies in, the clip
    factor, the step and the copy back are one op each whatever the tensor count, and the
    transient fp32 gradients are one buffer's storage, not an `empty_like` per tensor."""
    def step(n):
        opt = MasterOptimizer(ADAMW, _params(n, torch.bfloat16), torch.float32, torch.device("cpu"))
        opt.step(torch.tensor(0.5))  # the first step builds AdamW's states (per tensor, once)
        for p in opt.params:
            p.grad = torch.randn_like(p)
        return _count(lambda: opt.step(torch.tensor(0.5)))
    few, many = step(4), step(64)
    assert few == many, (few, many)
    assert few["_fused_adamw_"] == 1 and few["_foreach_copy_"] == 2, few  # it did step


def test_the_master_update_steps_as_the_per_tensor_loop_did():
    """The multi-tensor path computes what the per-tensor one did, bit for bit."""
    ps = _params(8, torch.bfloat16)
    ref = [nn.Parameter(p.detach().float().clone()) for p in ps]
    for r, p in zip(ref, ps):
        r.grad = p.grad.float() * 0.5
    inner = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    inner.step()
    opt = MasterOptimizer(ADAMW, ps, torch.float32, torch.device("cpu"))
    opt.step(torch.tensor(0.5))
    for r, m, p in zip(ref, opt.master, ps):
        assert torch.equal(r.data, m.data)
        assert torch.equal(r.data.to(torch.bfloat16), p.data)


def _model_update_ops(n_layer: int, n_embd: int, precision: str, impl: str) -> tuple[Counter, int, int]:
    """The ops of one whole update (the global norm, the overflow flag, the clip, the
    optimizer, the copy back) of a GPT-2 of `n_layer` blocks, as the runners call it; the
    second step's (the first builds the optimizer's states, once per tensor)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from framework.optim import master
    from framework.precision import policy_of
    from framework.train.update import Update

    from .conftest import compose

    run = compose(f"trainer.precision={precision}", f"optimizer.implementation={impl}", "trainer.grad_clip=0.5")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=256, n_positions=64))
    model.to(policy_of(run).param_dtype)
    params = list(model.parameters())
    update = Update(run, master.build(run.optimizer, params, policy_of(run)), injects=False)

    def step(i):
        for p in params:
            p.grad = torch.randn_like(p)
        return update.apply(params, clip_grad_norm(params, 0.0), i)

    step(0)
    ops = _count(lambda: step(1))
    ops.pop("randn_like", None)  # the test's own gradients
    return ops, len(params), sum(p.numel() for p in params)




@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "fp32", "fp64"])
def test_a_2_block_and_a_16_block_model_dispatch_the_same_update(precision):
    """Issue 46's acceptance: 2 blocks of width 64 and 16 of width 24 (about the same
    parameters, 28 against 196 tensors) dispatch the same ops per update, under the default
    implementation (fused AdamW), in every precision: masters or none, loss scaling or none."""
    few, n_few, size_few = _model_update_ops(2, 64, precision, "auto")
    many, n_many, size_many = _model_update_ops(16, 24, precision, "auto")
    assert n_many > 6 * n_few and abs(size_many - size_few) < 0.1 * size_few, (n_few, n_many, size_few, size_many)
    assert few == many, (few, many)
    assert few["_fused_adamw_"] == 1, few


def test_the_per_tensor_adamw_dispatches_per_tensor():
    """The check above can fail: torch's for-loop AdamW (optimizer.implementation=for-loop)
    dispatches ops per tensor, so its counts differ between the two models."""
    few, n_few, _ = _model_update_ops(2, 64, "bf16-mixed", "for-loop")
    many, n_many, _ = _model_update_ops(16, 24, "bf16-mixed", "for-loop")
    assert sum(many.values()) - sum(few.values()) >= n_many - n_few


def test_the_bench_times_the_update_the_framework_runs():
    """framework/sim/bench.py's `framework_update` (the cost model's `adamw` rate and
    `host_us.optimizer_tensor`) dispatches what a run's update does: as many ops for 4
    tensors as for 64 (torch's default AdamW and clip on a CPU, which the bench timed
    before, dispatch per tensor), and it steps the parameters."""
    from framework.sim.bench import framework_update

    steps = [framework_update(_params(n)) for n in (4, 64)]
    for step in steps:
        step()  # the first step creates the states, a tensor each
    counts = [_count(step) for step in steps]
    assert counts[0] == counts[1] and sum(counts[0].values()) < 40, counts
    ps = _params(8)
    before = torch.cat([p.detach().clone() for p in ps])
    framework_update(ps)()
    assert not torch.equal(torch.cat([p.detach() for p in ps]), before)
