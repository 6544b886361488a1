"""The update's dispatched ops do not grow with the number of parameter tensors (issue "the
framework off the critical path", item 1, in part): the global norm, the clip and the master
copies are multi-tensor ops. Counted in process with a TorchDispatchMode over the same
parameter count split into 4 and into 64 tensors."""

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.grads import clip_grad_norm
from framework.train.master import MasterOptimizer

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


def test_the_master_update_adds_only_one_allocation_per_tensor():
    """bf16 parameters, fp32 masters, torch's foreach AdamW: the copies in, the clip factor and
    the copy back are one op each whatever the tensor count; what still grows is the transient
    fp32 gradients' allocation, one `empty_like` per tensor (a flat buffer is what is left)."""
    def step(n):
        opt = MasterOptimizer(ADAMW, _params(n, torch.bfloat16), torch.float32, torch.device("cpu"))
        opt.step(torch.tensor(0.5))  # the first step builds AdamW's states (per tensor, once)
        for p in opt.params:
            p.grad = torch.randn_like(p)
        return _count(lambda: opt.step(torch.tensor(0.5)))
    few, many = step(4), step(64)
    assert many["empty_like"] - few["empty_like"] == 60
    assert {k: v for k, v in many.items() if k != "empty_like"} == {k: v for k, v in few.items() if k != "empty_like"}


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
