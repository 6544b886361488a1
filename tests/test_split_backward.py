"""Split backward (framework/parallel/pipeline/split_backward.py): I then W computes what
the fused backward B computes, bit for bit in fp32, when a stage runs its W's in its I's
order: the stage input's gradient and every weight gradient, on a middle stage, the last
stage (from the loss), the first stage (no input gradient: its I does nothing, its W runs
the whole backward), with activation checkpointing, and with a tied embedding whose two
uses sit in two chunks of one rank (a V's rank 0). All in one process: the stages are
slices of one GPT-2 or Llama, fed recorded inputs and output gradients.

Bitwise is the right check: I and W run the very matmuls autograd's fused backward runs,
and with W's in I's order each weight gradient is accumulated in the same order; reordered
W's change that order, so they are compared to fp32 round-off instead."""

import pytest
import torch

from framework.config import ModelConfig
from framework.models import build_model
from framework.parallel.pipeline.split_backward import backward_input, backward_weight

VOCAB, B, T = 97, 2, 16


def _model(arch: str, checkpoint: bool = False):
    m = ModelConfig(arch=arch, n_layer=4, n_embd=32, n_head=4, max_positions=T,
                    **({"n_kv_head": 2, "n_inner": 64} if arch == "llama" else {}))
    return build_model(m, VOCAB, seed=0, checkpoint_blocks=checkpoint)


def _inputs(g: int, n: int, hidden: int, last: bool):
    gen = torch.Generator().manual_seed(g)
    xs = [torch.randint(0, VOCAB, (B, T), generator=gen) if g == 0 else torch.randn(B, T, hidden, generator=gen)
          for _ in range(n)]
    ys = [torch.randint(0, VOCAB, (B, T), generator=gen) for _ in range(n)]
    grads = [None if last else torch.randn(B, T, hidden, generator=gen) for _ in range(n)]
    return xs, ys, grads


def _forward(stage, x, y, last):
    x = x.clone().requires_grad_(True) if x.is_floating_point() else x
    return x, (stage(x, y) if last else stage(x))


def _grads(stage):
    return {n: p.grad.clone() for n, p in stage.named_parameters()}


def _run(stage, g, last, split, n=3):
    """n micro-batches through one stage, 1F1B-like (F0 F1 B0 F2 B1 B2); returns the
    input gradients and the parameter gradients."""
    stage.zero_grad(set_to_none=True)
    params = [p for p in stage.parameters() if p.requires_grad]
    xs, ys, grads = _inputs(g, n, stage.hf_model.config.hidden_size, last)
    live, dx, pending = {}, {}, []
    order = ["F0", "F1", "B0", "F2", "B1", "B2"]
    for step in order:
        j = int(step[1:])
        if step[0] == "F":
            live[j] = _forward(stage, xs[j], ys[j], last)
            continue
        x, out = live.pop(j)
        if split:
            dx[j], w = backward_input(out, grads[j], x if x.is_floating_point() else None, params)
            pending.append(w)
            backward_weight(pending.pop(0))  # W right after its I: I's order
        else:
            torch.autograd.backward(out, grads[j])
            dx[j] = x.grad if x.is_floating_point() else None
    return dx, _grads(stage)


def _assert_bitwise(a, b):
    (dx_a, g_a), (dx_b, g_b) = a, b
    assert dx_a.keys() == dx_b.keys()
    for j in dx_a:
        assert (dx_a[j] is None) == (dx_b[j] is None)
        if dx_a[j] is not None:
            assert torch.equal(dx_a[j], dx_b[j]), j
    assert g_a.keys() == g_b.keys() and g_a
    for n in g_a:
        assert torch.equal(g_a[n], g_b[n]), n


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_input_then_weight_equals_the_fused_backward_bit_for_bit(arch, where, checkpoint):
    full = _model(arch, checkpoint)
    g = {"first": 0, "middle": 1, "last": 3}[where]
    stage = full.stage(range(g, g + 1), first=g == 0, last=g == 3)
    fused = _run(stage, g, g == 3, split=False)
    split = _run(stage, g, g == 3, split=True)
    _assert_bitwise(split, fused)
    if where != "first":  # the input gradient is real, and I alone produced it
        assert all(v.abs().sum() > 0 for v in split[0].values())
    else:
        assert all(v is None for v in split[0].values())


def _v_rank0(full, split: bool, reorder: bool = False):
    """A V's rank 0 with pp = 2 in one process: chunk 0 = stage 0 (the embedding), chunk 1 =
    stage 3 (the head) of 4; the tied weight is used by both. Stages 1-2 (another rank) are
    stood in for by the identity: chunk 1's input is chunk 0's output. Per micro-batch: F on
    chunk 0, F and I (or B) on chunk 1, then chunk 0's I (or B), as ZB-V runs them; W's after
    each I (I's order), or all of chunk 1's W's before chunk 0's (reordered)."""
    c0, c1 = full.stage(range(0, 1), first=True, last=False), full.stage(range(3, 4), first=False, last=True)
    full.hf_model.zero_grad(set_to_none=True)
    p0, p1 = [p for p in c0.parameters()], [p for p in c1.parameters()]
    xs, ys, _ = _inputs(0, 3, 32, True)
    pend0, pend1 = [], []
    for j in range(3):
        h = c0(xs[j])
        x1 = h.detach().requires_grad_(True)
        loss = c1(x1, ys[j])
        if not split:
            torch.autograd.backward(loss)
            torch.autograd.backward(h, x1.grad)
            continue
        d1, w1 = backward_input(loss, None, x1, p1)
        _, w0 = backward_input(h, d1, None, p0)  # the first stage: W does it all
        if reorder:
            pend1.append(w1)
            pend0.append(w0)
        else:
            backward_weight(w1)
            backward_weight(w0)
    for w in pend1 + pend0:
        backward_weight(w)
    return {n: p.grad.clone() for n, p in full.hf_model.named_parameters() if p.grad is not None}


def test_a_tied_embedding_in_two_chunks_of_one_rank():
    full = _model("gpt2")
    assert full.hf_model.transformer.wte.weight is full.hf_model.lm_head.weight
    fused, split = _v_rank0(full, False), _v_rank0(full, True)
    assert fused.keys() == split.keys() and "transformer.wte.weight" in fused
    for n in fused:
        assert torch.equal(split[n], fused[n]), n
    # Reordered W's (all of the head's before the embedding's) sum the tied weight's six
    # contributions in another order: equal up to fp32 round-off of that sum only.
    reordered = _v_rank0(full, True, reorder=True)
    for n in fused:
        torch.testing.assert_close(reordered[n], fused[n], rtol=1e-6, atol=1e-7, msg=n)
    # ... and the order does show: the sum differs in its last bits (measured: 1.5e-8)
    assert not torch.equal(reordered["transformer.wte.weight"], fused["transformer.wte.weight"])


def test_w_frees_the_graph_and_i_computes_no_weight_gradient():
    full = _model("gpt2")
    stage = full.stage(range(1, 2), first=False, last=False)
    params = list(stage.parameters())
    xs, _, grads = _inputs(1, 1, 32, False)
    x, out = _forward(stage, xs[0], None, False)
    dx, pending = backward_input(out, grads[0], x, params)
    assert dx is not None and all(p.grad is None for p in params)  # I: the input only
    assert pending.groups and all(g.grads for g in pending.groups)
    backward_weight(pending)
    assert all(p.grad is not None for p in params) and not pending.groups


def test_the_graph_is_freed_after_w_under_the_activation_tracker():
    """Memory grows with the work, not the run: I and W keep the graph (retain_graph) until
    W ends, so nothing may hold it after that. The activation tracker's saved-tensor hook
    once did (it returned the saved output itself, a cycle through the node): every
    micro-batch's graph stayed alive. Counted as live tensors, after 5 and after 40."""
    import gc
    import warnings

    from framework.metrics.memory import ActivationTracker

    full = _model("gpt2")
    stage = full.stage(range(2, 4), first=False, last=True)
    params, tracker = list(stage.parameters()), ActivationTracker(stage)

    def live() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
            warnings.simplefilter("ignore", FutureWarning)
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    counts = {}
    for j in range(40):
        x = torch.randn(B, T, 32).requires_grad_(True)
        with tracker.forward((j, 0)):
            out = stage(x, torch.randint(0, VOCAB, (B, T))) * 0.25
        _, pending = backward_input(out, None, x, params)
        del out, x
        backward_weight(pending)
        tracker.backward_done((j, 0))
        del pending
        if j in (4, 39):
            counts[j] = live()
    assert counts[39] == counts[4], counts
