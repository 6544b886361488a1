"""Raw micro-benchmarks of one CUDA device, for the cluster cost model (issue "Predict the cluster").

Measured with CUDA events around many back-to-back launches (median of repeats), written as
JSON: GEMM time over an (m, n, k) grid per dtype, memory bandwidth of copy / add at sizes
from 64 KiB to 2 GiB (the small end shows the per-kernel overhead), the launch overhead of
an empty-sized kernel, flash attention (torch SDPA, causal) forward and forward+backward,
and the common memory-bound ops of a block (layer_norm, gelu, softmax, cross_entropy).

It needs only torch: it ran before the cost model that reads it existed. Superseded by the
framework's own `python -m framework.sim.bench` (same timing loop, written as a hardware
profile); kept because it produced h200_2026-11-26/microbench.json, which the README cites.
Usage: python experiments/cluster_model/gpu_microbench.py OUT.json
"""
import json
import sys
import time

import torch
import torch.nn.functional as F


def timed(fn, reps=20, warmup=3, inner=1):
    """Median seconds per call of fn over reps repeats of `inner` calls, on the device's clock."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1]}


def gemms(out):
    dims = [128, 512, 1024, 2048, 4096, 8192, 16384]
    rows = []
    for dtype, tf32 in [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.float32, True)]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for m in dims:
            for n in dims:
                for k in dims:
                    if m * n * k > 16384 * 8192 * 8192 or (dtype == torch.float32 and m * n * k > 8192 ** 3):
                        continue
                    a = torch.randn(m, k, device="cuda", dtype=dtype)
                    b = torch.randn(k, n, device="cuda", dtype=dtype)
                    flops = 2 * m * n * k
                    inner = max(1, min(50, int(2e11 // flops)))
                    t = timed(lambda: a @ b, reps=7, inner=inner)
                    rows.append({"dtype": str(dtype).split(".")[1] + ("-tf32" if tf32 else ""), "m": m, "n": n,
                                 "k": k, **t, "tflops": flops / t["median_s"] / 1e12})
    torch.backends.cuda.matmul.allow_tf32 = False
    out["gemm"] = rows


def bandwidth(out):
    rows = []
    for nbytes in [2 ** p for p in range(16, 32, 1)]:
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        inner = max(1, min(200, int(2 ** 30 // nbytes)))
        t = timed(lambda: y.copy_(x), reps=9, inner=inner)
        rows.append({"op": "copy", "bytes_moved": 2 * nbytes, **t, "gb_per_s": 2 * nbytes / t["median_s"] / 1e9})
        z = torch.empty_like(x)
        t = timed(lambda: torch.add(x, y, out=z), reps=9, inner=inner)
        rows.append({"op": "add", "bytes_moved": 3 * nbytes, **t, "gb_per_s": 3 * nbytes / t["median_s"] / 1e9})
    out["bandwidth"] = rows
    one = torch.zeros(1, device="cuda")
    out["kernel_overhead"] = {"device_s": timed(lambda: one.add_(1), reps=9, inner=1000)["median_s"]}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10000):
        one.add_(1)
    out["kernel_overhead"]["host_enqueue_s"] = (time.perf_counter() - t0) / 10000
    torch.cuda.synchronize()


def attention(out):
    rows = []
    for b, h, s, d in [(8, 12, 1024, 64), (4, 16, 2048, 64), (2, 32, 4096, 128), (1, 64, 8192, 128),
                       (8, 32, 2048, 128), (1, 8, 16384, 128), (16, 16, 512, 64)]:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=9, inner=5)

        def fb():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o))
        both = timed(fb, reps=9, inner=3)
        causal_flops = 4 * b * h * s * s * d / 2  # QK^T and PV, causal half
        rows.append({"b": b, "h": h, "s": s, "d": d, "fwd_s": fwd["median_s"], "fwd_bwd_s": both["median_s"],
                     "fwd_tflops": causal_flops / fwd["median_s"] / 1e12,
                     "fwd_bwd_tflops": 3.5 * causal_flops / both["median_s"] / 1e12})
    out["attention_sdpa_causal_bf16"] = rows


def memory_bound(out):
    rows = []
    for tokens, hidden in [(8192, 768), (8192, 4096), (16384, 8192)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        nb = x.numel() * 2
        for name, fn, moved in [("layer_norm", lambda: F.layer_norm(x, (hidden,), w, w), 2 * nb),
                                ("rms_norm", lambda: F.rms_norm(x, (hidden,), w), 2 * nb),
                                ("gelu", lambda: F.gelu(x, approximate="tanh"), 2 * nb),
                                ("silu_mul", lambda: F.silu(x) * x, 3 * nb),
                                ("softmax", lambda: torch.softmax(x, -1), 2 * nb)]:
            t = timed(fn, reps=9, inner=10)
            rows.append({"op": name, "tokens": tokens, "hidden": hidden, **t, "gb_per_s": moved / t["median_s"] / 1e9})
    for tokens, vocab in [(8192, 50304), (4096, 128256)]:
        logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, vocab, (tokens,), device="cuda")
        t = timed(lambda: F.cross_entropy(logits.float(), tgt), reps=9, inner=3)
        rows.append({"op": "cross_entropy_fp32", "tokens": tokens, "vocab": vocab, **t,
                     "gb_per_s": logits.numel() * 2 / t["median_s"] / 1e9})
    out["memory_bound"] = rows


def main():
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "memory_bytes": torch.cuda.get_device_properties(0).total_memory}
    for part in (bandwidth, attention, memory_bound, gemms):
        t0 = time.time()
        part(out)
        print(part.__name__, f"{time.time() - t0:.1f} s", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
