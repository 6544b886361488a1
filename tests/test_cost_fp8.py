"""The cost model prices precision.fp8 and trainer.compile=blocks (framework/sim/cost/ops.py,
hardware.py), on hand-computed cases: an FP8 linear's GEMMs at the fp8 rate (the profile's
fp8 table, else the bf16 table's efficiency at the fp8 peak), the casts of its six operands
as memory-bound kernels (eager's abs / amax / upcast / scale / clamp / cast against compiled's
reduction and fused cast), and a compiled block's elementwise ops fused."""

import pytest

from framework.sim.cost.hardware import Profile
from framework.sim.cost.ops import CostOp, _fp8, _linear, block_ops
from framework.sim.cost.shapes import Layout, ModelShape


def _profile(**extra) -> Profile:
    return Profile(name="t", peak_tflops={"fp8": 200.0, "bf16": 100.0}, memory_GBps=1000.0, kernel_us=0.0,
                   memory_bound_GBps={"rms_norm": 250.0, "add": 500.0, "silu_mul": 400.0}, **extra)


def test_an_fp8_gemm_runs_at_the_fp8_rate():
    """No table: the efficiency curve at the fp8 peak (twice bf16's time / 2). A bf16 table and
    no fp8 one: the bf16 table's rate at that shape x 200 / 100."""
    op = CostOp("q", "gemm", "F", flops=2.0 * 1024 ** 3, shape=(1024, 1024, 1024), dtype="fp8")
    bf16 = CostOp("q", "gemm", "F", flops=2.0 * 1024 ** 3, shape=(1024, 1024, 1024))
    prof = _profile(gemm_efficiency={"max": 0.5, "half_dim": 1024})
    eff = 0.5 * (1024 / 2048) ** 3
    assert prof.op_seconds(bf16, "bf16") == pytest.approx(2.0 * 1024 ** 3 / (100e12 * eff))
    assert prof.op_seconds(op, "bf16") == pytest.approx(2.0 * 1024 ** 3 / (200e12 * eff))
    table = _profile(gemm_tflops={"bf16": [[m, n, k, 40.0] for m in (512, 2048) for n in (512, 2048)
                                           for k in (512, 2048)]})
    assert table.op_seconds(op, "bf16") == pytest.approx(2.0 * 1024 ** 3 / 80e12)
    # a measured fp8 table (the bench's, on a GPU with FP8 units) is read as it is
    both = _profile(gemm_tflops={**table.gemm_tflops, "fp8": [[m, n, k, 70.0] for m in (512, 2048)
                                                              for n in (512, 2048) for k in (512, 2048)]})
    assert both.op_seconds(op, "bf16") == pytest.approx(2.0 * 1024 ** 3 / 70e12)


def test_the_bench_times_the_fp8_gemm_torchao_runs():
    """framework/sim/bench.py's fp8 point: e4m3 operands, unit scales, bf16 out: the product
    of the e4m3 values (torch._scaled_mm runs on this CPU too)."""
    import torch

    from framework.sim.bench import _fp8_gemm

    torch.manual_seed(0)
    fn = _fp8_gemm(torch.device("cpu"), 32, 48, 64)
    a, b = fn.__closure__[0].cell_contents, fn.__closure__[1].cell_contents
    y = fn()
    assert a.dtype == b.dtype == torch.float8_e4m3fn and y.dtype == torch.bfloat16 and y.shape == (32, 48)
    assert torch.equal(y, (a.float() @ b.float()).to(torch.bfloat16))


@pytest.mark.parametrize("recipe,compiled,scale_kernels", [("tensorwise", False, 4), ("rowwise", False, 7),
                                                            ("tensorwise", True, 0)])
def test_an_fp8_linear_casts_its_six_operands(recipe, compiled, scale_kernels):
    """t 8 tokens, 16 -> 32 features, bf16 activations (2 bytes): F casts x (128) and W (512),
    I dY (256) and W, W dY and x. Eager, per element of a bf16 operand: abs 4, amax 2, upcast
    2 + 4, multiply 8, clamp 8, cast 4 + 1 = 33 bytes in 6 kernels; compiled: amax 2 + fused
    cast 2 + 1 = 5 bytes in 2 kernels; the scale's scalar kernels (4, rowwise 7) eager only."""
    lay = Layout(1, 8, fp8=recipe, compiled=compiled)
    ops = _fp8(_linear("q", 8, 16, 32, 16 * 32, 1), lay)
    assert [o.dtype for o in ops if o.kind == "gemm"] == ["fp8"] * 3
    per_element = 5 if compiled else 33
    for phase, elements in (("F", 128 + 512), ("I", 256 + 512), ("W", 256 + 128)):
        casts = [o for o in ops if o.phase == phase and o.name == "fp8_cast"]
        assert sum(o.bytes * o.count for o in casts) == per_element * elements
        assert sum(o.count for o in casts) == (2 if compiled else 6) * 2
        assert sum(o.count for o in ops if o.phase == phase and o.name == "fp8_scale") == 2 * scale_kernels
    # at the copy rate (1000 GB/s), no kernel floor: F's casts last their bytes / rate
    prof = _profile()
    f_casts = [o for o in ops if o.phase == "F" and o.kind == "memory"]
    assert prof.seconds(f_casts, "bf16") == pytest.approx(per_element * 640 / 1e12)
    assert _fp8(_linear("q", 8, 16, 32, 16 * 32, 1), Layout(1, 8)) == _linear("q", 8, 16, 32, 16 * 32, 1)
    # Llama's k and v (gate and up) are one op here and two linears at run time: eager, each
    # casts x itself (F and W: one more x each); compiled, the graph casts it once
    two = _fp8(_linear("kv", 8, 16, 32, 16 * 32, 1), lay, readers=2)
    extra = 0 if compiled else per_element * 128
    for phase in "FW":
        assert (sum(o.bytes * o.count for o in two if o.phase == phase and o.name == "fp8_cast")
                - sum(o.bytes * o.count for o in ops if o.phase == phase and o.name == "fp8_cast")) == extra


def test_a_compiled_block_fuses_its_elementwise_ops():
    """A Llama block (h 64, ffn 128, t 32 tokens, bf16): compiled, the residual add and the
    next norm are one kernel (the sum written once, never read back: 3 + 2 -> 4 t h a bytes),
    and every elementwise kernel streams at the copy rate (1000 GB/s) instead of eager's
    measured per-op rates (rms_norm 250, add 500, silu_mul 400 GB/s)."""
    s = ModelShape("llama", 1, 64, 4, 4, 128, 256, False)
    eager, comp = block_ops(s, Layout(1, 32)), block_ops(s, Layout(1, 32, compiled=True))
    t, h, a = 32, 64, 2
    mem = lambda ops, ph: [o for o in ops if o.kind == "memory" and o.phase == ph]  # noqa: E731
    assert sum(o.bytes for o in mem(eager, "F")) - sum(o.bytes for o in mem(comp, "F")) == t * h * a
    assert len(mem(eager, "F")) - len(mem(comp, "F")) == 1
    assert sum(o.bytes for o in mem(eager, "I")) == sum(o.bytes for o in mem(comp, "I"))
    assert all(o.fused for o in mem(comp, "F") + mem(comp, "I"))
    prof = _profile()
    rates = {"rms_norm": 250.0, "add": 500.0, "silu_mul": 400.0, "rotary": 1000.0}
    want_eager = sum(o.bytes / (rates[o.name] * 1e9) for o in mem(eager, "F"))
    assert prof.seconds(mem(eager, "F"), "bf16") == pytest.approx(want_eager)
    assert prof.seconds(mem(comp, "F"), "bf16") == pytest.approx(sum(o.bytes for o in mem(comp, "F")) / 1e12)
    # the model FLOPs do not change: fusion moves bytes, not work
    assert sum(o.model_flops for o in comp) == sum(o.model_flops for o in eager)
