"""Gradients land where they are reduced (issue "the framework off the critical path",
item 1: "DDP and ZeRO reduce from the same buffers: no flatten copy per step").

ZeRO 2 and 3 (framework/parallel/zero_unit.py): a unit's gradients are views of one flat
buffer opened as its backward starts, so the reduce-scatter reads what autograd wrote; a
pipeline's dp all-reduce (framework/parallel/grads.py's GradBuffer) reads its buffer in
place. Both on 2 gloo ranks in one launch: the same parameter count split into 4 and into
64 tensors copies no gradient in the backward and the reduction (the flatten copy was a
`copy_` per tensor), and the reduced values are the two ranks' mean."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .distributed import run_ranks
from .test_update_ops import _Ops  # counts dispatched ops by name

ELEMENTS = 256


class _Block(nn.Module):
    """ELEMENTS weights in n tensors; out = x * w (elementwise), so d out / d w = x."""

    def __init__(self, n: int):
        super().__init__()
        self.parts = nn.ParameterList(nn.Parameter(torch.randn(ELEMENTS // n, dtype=torch.float64)) for _ in range(n))

    def forward(self, x):
        return x * torch.cat(list(self.parts))


def _zero_case(rank: int, stage: int, n: int) -> dict:
    from framework.parallel.zero import Zero

    torch.manual_seed(0)
    model = nn.Sequential(_Block(n), _Block(n))
    ctx = SimpleNamespace(dims=SimpleNamespace(dp=2), coords=SimpleNamespace(dp=rank), dp_group=dist.group.WORLD)
    zero = Zero(stage, [[b] for b in model], ctx)
    zero.start_step()
    x = torch.arange(ELEMENTS, dtype=torch.float64) * (rank + 1)
    zero.start_microbatch()
    with _Ops() as mode:
        model(x).sum().backward()
        zero.finish_backward()
    # each block's gradient is the other's weights times x: gathered here for the reference
    zero.gather_all()
    w = [torch.cat([p.detach() for p in b.parts]) for b in model]
    return {"ops": mode.ops, "grads": [s.grad.clone() for s in zero.shards], "w": w,
            "open": [f.grads_open for f in zero.flat], "bytes": [f.grad_full.untyped_storage().nbytes() for f in zero.flat]}


def _buffer_case(rank: int, n: int, dtype) -> dict:
    from framework.parallel.grads import GradBuffer, finish_all_reduce

    torch.manual_seed(0)
    block = _Block(n)
    buffer = GradBuffer(list(block.parts))
    buffer.attach()
    x = torch.arange(ELEMENTS, dtype=torch.float64) * (rank + 1)
    for _ in range(2):  # two micro-batches accumulate into the views
        block(x).sum().backward()
    with _Ops() as mode:
        buffer.all_reduce(dist.group.WORLD, 2, dtype)
    grads = [p.grad for p in block.parts]
    reduced = torch.cat(grads).clone()
    with _Ops() as issued:  # the overlap's form: issued, then waited for
        finish_all_reduce(buffer.start_all_reduce(dist.group.WORLD, 2, dtype), 2)
    return {"ops": mode.ops, "issued_ops": issued.ops, "grad": reduced,
            "views": all(g.untyped_storage().data_ptr() == buffer.flats[0].untyped_storage().data_ptr() for g in grads)}


def _unused_unit(rank: int) -> dict:
    """Stage 2: a unit whose output's gradient hook opened its buffer, but whose parameters
    took no part in this forward (an expert given no token)."""
    from framework.parallel.zero import Zero

    class Skipped(_Block):
        def forward(self, x):
            return x * 2.0  # its weights unused

    torch.manual_seed(0)
    model = nn.Sequential(_Block(4), Skipped(4))
    ctx = SimpleNamespace(dims=SimpleNamespace(dp=2), coords=SimpleNamespace(dp=rank), dp_group=dist.group.WORLD)
    zero = Zero(2, [[b] for b in model], ctx)
    zero.start_step()
    zero.start_microbatch()
    model(torch.arange(ELEMENTS, dtype=torch.float64)).sum().backward()
    zero.finish_backward()
    return {"open": [f.grads_open for f in zero.flat], "bytes": [f.grad_full.untyped_storage().nbytes()
                                                                 for f in zero.flat if f.grad_full is not None]}


def _on_rank(rank: int, world: int) -> dict:
    out = {"unused": _unused_unit(rank)}
    for n in (4, 64):
        for stage in (2, 3):
            out["zero", stage, n] = _zero_case(rank, stage, n)
        for dtype in (None, torch.float64, torch.float32):  # own dtype; own named; narrower (a copy)
            out["buffer", dtype, n] = _buffer_case(rank, n, dtype)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_rank, 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reduces_the_buffer_autograd_wrote(ranks, stage):
    for rank, got in enumerate(ranks):
        few, many = got["zero", stage, 4], got["zero", stage, 64]
        # no gradient copied on the way (the flatten copy was a copy_ per tensor): the copies
        # left are the collective's own, at most one per unit (gloo's reduce-scatter is an
        # all-reduce whose own slice is copied out), as many for 4 tensors as for 64
        assert few["ops"]["copy_"] == many["ops"]["copy_"] <= 2, (few["ops"], many["ops"])
        assert few["ops"]["_to_copy"] == many["ops"]["_to_copy"]
        # the full gradient's storage is gone once reduced (stage 2's memory), kept as views
        assert few["open"] == many["open"] == [False, False]
        assert few["bytes"] == many["bytes"] == [0, 0]
        for case in (few, many):
            # block 0's gradient: x * w1, block 1's: x * w0, x = arange * (rank + 1): the mean
            # over the ranks is 1.5 * arange * w; each rank holds its half (stage 2 and 3: slices)
            x = torch.arange(ELEMENTS, dtype=torch.float64) * 1.5
            want = [x * case["w"][1], x * case["w"][0]]
            half = ELEMENTS // 2
            for g, full in zip(case["grads"], want):
                torch.testing.assert_close(g, full[rank * half:(rank + 1) * half], rtol=1e-12, atol=0)


def test_a_grad_buffer_is_reduced_where_autograd_accumulated(ranks):
    for got in ranks:
        for n in (4, 64):
            x = torch.arange(ELEMENTS, dtype=torch.float64)
            for dtype in (None, torch.float64, torch.float32):
                case = got["buffer", dtype, n]
                assert case["views"]  # the gradients are the buffer's views
                # two micro-batches of x * (rank + 1), averaged over ranks 1 and 2: 3 x
                torch.testing.assert_close(case["grad"], 3 * x, rtol=1e-6 if dtype == torch.float32 else 1e-15, atol=0)
            same = got["buffer", None, n]["ops"]
            assert "cat" not in same and "copy_" not in same and "_to_copy" not in same, same
            assert got["buffer", torch.float64, n]["ops"] == same  # its own dtype named: the same
            assert got["buffer", None, n]["issued_ops"] == same  # issued and waited for: the same
            narrow = got["buffer", torch.float32, n]["ops"]
            assert narrow["_to_copy"] == 1 and narrow["copy_"] == 1, narrow  # one copy and one back
        assert got["buffer", None, 4]["ops"] == got["buffer", None, 64]["ops"]


def test_a_unit_opened_by_its_hook_and_given_no_gradient_is_freed(ranks):
    for got in ranks:
        assert got["unused"]["open"] == [False, False] and got["unused"]["bytes"] == [0, 0], got["unused"]
