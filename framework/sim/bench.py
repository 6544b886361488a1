"""Measure this machine's device and write a hardware profile for the cost model:

    python -m framework.sim.bench --out conf/hardware/NAME.yaml [--name NAME] [--device auto|cpu|cuda]
                                  [--quick] [--peak-tflops bf16=989.5,fp32=66.9] [--threads T] [--links N]

What it measures, each the median of repeated back-to-back calls (CUDA events on a GPU; on a
CPU the thread's CPU clock with one thread, else the host clock; after warm-up), a difference
of two timings from each side's fastest of alternated calls (`_fastest`), never zero:
- `gemm_tflops`: a @ b over an (m, n, k) grid per dtype (fp8 by `torch._scaled_mm` on compute
  capability 8.9+, bf16, fp16, fp32 on CUDA; fp32 and
  fp64 on CPU), as "m n k TFLOP/s" lines with 2 m n k FLOPs: the table the cost model
  interpolates (framework/sim/cost/hardware.py).
- `memory_GBps`: the best sustained copy (bytes read + written per second) over sizes that
  leave the caches; `kernel_us`: the time of a one-element add (a kernel's floor: launch on
  a GPU, dispatch on a CPU).
- `attention_tflops`: scaled-dot-product attention, causal, forward and forward + backward,
  as [s, head_dim, fwd, fwd+bwd TFLOP/s] rows, counting 4 b h s^2 d / 2 forward FLOPs (the
  causal half) and 2.5x that backward (FlashAttention-2's count).
- `memory_bound_GBps`: norms, activations and softmax of a block, bytes moved per second;
  `adamw`: the framework's own update (`framework_update`: its clip and fused AdamW).
- `host_us`: per block and pass (F, B) of each architecture, and per optimizer tensor of the
  framework's update, the time where compute is negligible (`overheads`): the launch and
  dispatch path.
With `--links N`, the link between N local ranks too (framework/sim/bench_links.py: gloo on
a CPU, NCCL on GPUs); between nodes nothing is measured, and a profile's `inter` link comes
from the datasheet or a user's NCCL tests (docs/cost_model.md).

One file past ~300 lines on purpose: every measurement of one device shares its Timer and
the profile's conventions (the bytes ops.py counts), and is read together; the link between
ranks is its own module (bench_links.py).

`peak_tflops` (the MFU denominator) is the datasheet's when `--peak-tflops` gives it, else the
best measured GEMM per dtype (then MFU reads as a share of what this device's GEMM reaches).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

from framework.device import resolve_device
from framework.commands import OutputPath, Parser, command, reject

DTYPES = {"cuda": ("fp8", "bf16", "fp16", "fp32"), "cpu": ("fp32", "fp64")}  # fp8: compute capability 8.9+ only
TORCH_DTYPE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
               "fp64": torch.float64}
# Grids: a GPU reaches its peak only past a few thousand per side; this CPU's models are
# tiny (n_embd 32-768, a few thousand tokens per micro-batch).
DIMS = {"cuda": (128, 512, 1024, 2048, 4096, 8192, 16384), "cpu": (16, 64, 256, 1024, 4096)}
MOST_MNK = {"cuda": 16384 * 8192 * 8192, "cpu": 2 ** 31}
QUICK_MNK = {"cuda": 8192 ** 3, "cpu": 2 ** 26}  # --quick: a CPU's 4096 x 4096 output alone takes 0.1 s a call
SECONDS_PER_POINT = {"cuda": 2e-2, "cpu": 5e-2}  # inner repeats aim at this much work


class Timer:
    """Median seconds per call of `fn`, on the device's own clock (CUDA events; on a CPU the
    thread's CPU clock with one thread, else the wall clock)."""

    def __init__(self, device: torch.device, cold: bool = False, quick: bool = False):
        self.device = device
        self.quick = quick  # --quick: at most 3 timed calls and 1 warm-up per point
        # CPU: each timed call starts with its operands out of the caches, as an op of a model
        # finds them after the ops between (a GEMM of (256, 512, 128) runs at 0.73x its
        # back-to-back rate here); a GPU's ops stream from HBM at these sizes anyway.
        self.junk = torch.empty(16 << 20) if cold and device.type == "cpu" else None
        # CPU, one intra-op thread (a rank's share, --threads 1): the op runs on this thread, and
        # its CPU clock leaves out the time other processes take from it on a shared machine
        # (wall-clock timings of gpt2's B read 5 us in one run, 3,481 us in another); with more threads
        # the op's work is spread over them, and only the wall clock times it.
        self.clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, reps: int = 7, inner: int = 1, warmup: int = 2) -> float:
        if self.quick:
            reps, warmup = min(reps, 3), min(warmup, 1)
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3 / inner)
            elif self.junk is not None:
                self.junk.fill_(1.0)
                t0 = self.clock()
                fn()
                times.append(self.clock() - t0)
            else:
                t0 = self.clock()
                for _ in range(inner):
                    fn()
                times.append((self.clock() - t0) / inner)
        times.sort()
        return times[len(times) // 2]


def _inner(seconds_guess: float, target: float) -> int:
    return max(1, min(200, int(target / max(seconds_guess, 1e-7))))


def _gemm(device, m: int, n: int, k: int, dtype):
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return lambda: a @ b


def _fp8_gemm(device, m: int, n: int, k: int):
    """The GEMM torchao's tensorwise FP8 linear runs: e4m3 operands (the second column-major,
    as `_scaled_mm` takes it), one fp32 scale each, bf16 out. The casts are not in it (the
    cost model prices them apart)."""
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def gemm(timer: Timer, kind: str, quick: bool) -> dict:
    dims = DIMS[kind][::2] if quick else DIMS[kind]
    out = {}
    for name in DTYPES[kind]:
        if name == "fp8" and torch.cuda.get_device_capability(timer.device) < (8, 9):
            continue  # no FP8 tensor cores
        dtype, rows = TORCH_DTYPE[name], []
        for m in dims:
            for n in dims:
                for k in dims:
                    most = (QUICK_MNK if quick else MOST_MNK)[kind]
                    if m * n * k > most or (name == "fp32" and kind == "cuda" and m * n * k > 8192 ** 3):
                        continue
                    fn = _fp8_gemm(timer.device, m, n, k) if name == "fp8" else _gemm(timer.device, m, n, k, dtype)
                    # a cold timer times one call per rep: no first call to size `inner` for
                    first = timer(fn, reps=1, warmup=1) if timer.junk is None else 1.0
                    t = timer(fn, reps=5, inner=_inner(first, SECONDS_PER_POINT[kind]))
                    rows.append(f"{m} {n} {k} {2 * m * n * k / t / 1e12:.6g}")
        out[name] = "\n".join(rows) + "\n"  # one row per line: one YAML string (hardware.py `gemm_rows`)
    return out


def bandwidth(timer: Timer, kind: str) -> tuple[float, float]:
    """(best copy GB/s over sizes past the caches, one-element add's microseconds)."""
    sizes = [2 ** p for p in ((26, 28, 30) if kind == "cuda" else (24, 26, 27))]
    best = 0.0
    for nbytes in sizes:
        x = torch.empty(nbytes // 4, device=timer.device, dtype=torch.float32)
        y = torch.empty_like(x)
        t = timer(lambda: y.copy_(x), reps=5, inner=4 if kind == "cuda" else 1)
        best = max(best, 2 * nbytes / t / 1e9)
    one = torch.zeros(1, device=timer.device)
    kernel = timer(lambda: one.add_(1), reps=7, inner=1000)
    return best, kernel * 1e6


def attention(timer: Timer, kind: str, quick: bool) -> list:
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    shapes = ([(8, 12, 1024, 64), (4, 16, 2048, 64), (2, 32, 4096, 128), (1, 64, 8192, 128)] if kind == "cuda"
              else [(4, 4, 64, 16), (4, 4, 64, 32), (4, 4, 64, 64), (4, 4, 256, 16), (4, 4, 256, 32),
                    (2, 12, 256, 64), (1, 12, 1024, 64)])
    rows = []
    for b, h, s, d in shapes[::3] if quick else shapes:
        q, k, v = (torch.randn(b, h, s, d, device=timer.device, dtype=dtype, requires_grad=True) for _ in range(3))
        fwd = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=5, inner=3)

        def both():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o))

        fb = timer(both, reps=5, inner=2)
        flops = 4 * b * h * s * s * d / 2
        rows.append([s, d, round(flops / fwd / 1e12, 6), round(3.5 * flops / fb / 1e12, 6)])
    return rows


def memory_bound(timer: Timer, kind: str) -> dict:
    """GB/s of a block's memory-bound ops, counting the bytes ops.py counts; the activations
    as the architectures compute them (GPT-2's tanh GELU from transformers, Llama's SiLU x up);
    `<op>_backward`: the gradient's rate, twice the forward's bytes over its own time."""
    from transformers.activations import ACT2FN

    tokens, hidden = (8192, 4096) if kind == "cuda" else (1024, 256)
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=timer.device, dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device=timer.device, dtype=dtype)
    nb = x.numel() * x.element_size()
    gelu = ACT2FN["gelu_new"]  # transformers' GPT2Config.activation_function default
    out = {}
    for name, fn, moved, grad in [("layer_norm", lambda: F.layer_norm(x, (hidden,), w, w), 2 * nb, True),
                                  ("rms_norm", lambda: F.rms_norm(x, (hidden,), w), 2 * nb, True),
                                  ("gelu", lambda: gelu(x), 2 * nb, True),
                                  ("silu_mul", lambda: F.silu(x) * x, 3 * nb, True),
                                  ("softmax", lambda: torch.softmax(x, -1), 2 * nb, False),
                                  ("add", lambda: x + x, 3 * nb, False)]:
        def bare(fn=fn):
            with torch.no_grad():
                fn()

        out[name] = round(moved / timer(bare, reps=7, inner=5) / 1e9, 3)
        if grad:  # the gradient's time is a difference: both timed alternately (`_fastest`)
            g = torch.ones(tokens, hidden, device=timer.device, dtype=dtype)

            def rate(bare=bare, both=lambda fn=fn, g=g: fn().backward(g), moved=moved):
                fwd, fb = _fastest(timer, (bare, both), 3 if timer.quick else 7)
                return round(2 * moved / (fb - fwd) / 1e9, 3) if fb > fwd else 0.0

            out[f"{name}_backward"] = _positive(rate, f"memory_bound_GBps {name}_backward")
    # the update as ops.py counts it (optimizer_ops: 32 bytes per fp32 parameter, no master),
    # run as the framework runs it (framework_update)
    # (on a CPU 4 x 2^20 parameters: at 4 x 65,536 the update's fixed cost was most of its
    # time, 5.8 GB/s against 17.8 at 2^20 and 22 at 2^22, one thread; a model's update is
    # bandwidth)
    size = (tokens * hidden // 4) if kind == "cuda" else 1 << 20
    params = [torch.zeros(size, device=timer.device, requires_grad=True) for _ in range(4)]
    for q in params:
        q.grad = torch.ones_like(q)
    update = framework_update(params)

    out["adamw"] = round(32 * 4 * size / timer(update, reps=5, inner=2) / 1e9, 3)
    return out


ROUNDS = 25  # host_us: turns of the alternated calls, each variant keeping its fastest


def framework_update(params: list) -> Callable[[], None]:
    """One update as a run of the framework makes it at fp32: the global norm and its clip
    (framework/parallel/grads.py: one multi-tensor norm, one multiply) and the default
    optimizer group's class with weight decay, built by framework/optim/build.py under
    `optimizer.implementation=auto` (fused where torch has it; betas and eps change no cost).
    The bench timed torch's default AdamW and clip before: a kernel per tensor on a CPU,
    3-5x the framework's update there."""
    from framework.optim.build import build_optimizer
    from framework.parallel.grads import clip_grad_norm

    opt = build_optimizer({"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.1,
                           "implementation": "auto"}, params)

    def step() -> None:
        clip_grad_norm(params, 1e9)  # the multiply runs, by 1: the gradients stay as they are
        opt.step()

    return step


def _fastest(timer: Timer, fns, rounds: int = ROUNDS) -> list:
    """Each of `fns`' fastest call in seconds, the fns called in turn `rounds` times. host_us
    is a difference of two such times, a few hundred microseconds out of milliseconds: the
    medians of each, taken seconds apart on a shared machine, differed by more than that
    (gpt2 B 5 us beside F 917 us; llama B and optimizer_tensor clamped to 0). Contention only
    adds time, and alternation exposes both variants to the same load, so the fastest call
    of each is its own cost."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timer(fn, reps=1, warmup=0))
    return best


def _positive(measure, what: str, tries: int = 3):
    """`measure()` ({key: us} or us) retried until every value is above zero: a difference
    that timed non-positive is noise, never a cost, and is not written."""
    for _ in range(tries):
        got = measure()
        if all(v > 0 for v in (got.values() if isinstance(got, dict) else [got])):
            return got
    raise RuntimeError(f"{what}: {got} after {tries} tries: the larger variant timed no slower than "
                       "the smaller (the machine too busy to time); rerun the bench on a quieter machine")


def _blocks(device: torch.device, dtype, arch: str, layers: int) -> tuple:
    """(forward, forward + backward) of `layers` of the framework's blocks at hidden 64."""
    from framework.config import ModelConfig
    from framework.models import ARCHS

    m = ModelConfig(arch=arch, n_layer=layers, n_embd=64, n_head=4, n_kv_head=2 if arch == "llama" else None,
                    max_positions=64, tie_embeddings=arch == "gpt2")
    with torch.device(device):
        model = ARCHS[arch].MODEL_CLASS(ARCHS[arch].hf_config(m, 256)).to(dtype)
    x = torch.randint(0, 256, (1, 16), device=device)

    def fwd():
        with torch.no_grad():
            model(x)

    def both():
        model(x).logits.float().sum().backward()

    return fwd, both


def overheads(timer: Timer, kind: str) -> dict:
    """Host time per block and pass, and per optimizer tensor, where compute is negligible:
    the framework's own blocks (transformers' code, as a run builds it) at hidden 64 over 16
    tokens, 5 blocks minus 1 over 4, forward and forward + backward; AdamW (foreach, as torch
    picks it) over 64 tensors of 64 elements minus 32, over 32; each the fastest of
    alternated calls (`_fastest`). On a GPU this is the launch path a block's kernels cannot
    beat when they are small (the cost model takes the larger of it and the kernels' time);
    on a CPU it adds to them."""
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    out = {}
    for arch in ("gpt2", "llama"):
        (f1, b1), (f5, b5) = (_blocks(timer.device, dtype, arch, n) for n in (1, 5))

        def per_block(fns=(f1, b1, f5, b5)):
            t = _fastest(timer, fns)
            f = (t[2] - t[0]) / 4
            return {"F": round(f * 1e6, 2), "B": round(((t[3] - t[1]) / 4 - f) * 1e6, 2)}

        out[arch] = _positive(per_block, f"host_us {arch}")
    steps = []
    for n in (32, 64):
        params = [torch.zeros(64, device=timer.device, requires_grad=True) for _ in range(n)]
        for q in params:
            q.grad = torch.ones_like(q)
        steps.append(framework_update(params))

    def per_tensor():
        t = _fastest(timer, steps)
        return round((t[1] - t[0]) / 32 * 1e6, 3)

    out["optimizer_tensor"] = _positive(per_tensor, "host_us optimizer_tensor")
    return out


def measure(device_type: str, quick: bool = False) -> dict:
    device = torch.device(device_type)
    # --quick: fewer timed calls per point (gemm, attention, memory-bound); the host path's
    # differences keep their full count (overheads: cheap, and the noisiest)
    timer, cold = Timer(device), Timer(device, cold=True, quick=quick)
    name = torch.cuda.get_device_name(device) if device_type == "cuda" else (_cpu_name() or "cpu")
    memory = (torch.cuda.get_device_properties(device).total_memory if device_type == "cuda"
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    copy_gbps, kernel_us = bandwidth(timer, device_type)
    prof = {"device_name": name, "memory_gib": round(memory / 2 ** 30, 2), "memory_GBps": round(copy_gbps, 3),
            "kernel_us": round(kernel_us, 3), "memory_bound_GBps": memory_bound(cold, device_type),
            "host_us": overheads(timer, device_type), "attention_tflops": attention(cold, device_type, quick),
            "gemm_tflops": gemm(cold, device_type, quick)}
    prof["source"] = (f"measured by python -m framework.sim.bench on {name} ({device_type}, torch {torch.__version__}"
                      f"{', cuda ' + torch.version.cuda if device_type == 'cuda' else ''}, "
                      f"{torch.get_num_threads()} threads), {datetime.date.today().isoformat()}")
    return prof


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def parse_peaks(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            reject("--peak-tflops", text, f"{item!r} is not dtype=number", "write e.g. --peak-tflops bf16=989.5,fp32=66.9")
        if key.strip() not in TORCH_DTYPE or not 0 < out[key.strip()] < 1e6:
            reject("--peak-tflops", text, f"{item!r}: a dtype of {', '.join(TORCH_DTYPE)} and a TFLOP/s in (0, 1e6)",
                   "write e.g. --peak-tflops bf16=989.5,fp32=66.9")
    return out


def _dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        """A multi-line string (a GEMM table) as a literal block: one row per line in the file."""

    Dumper.add_representer(str, lambda d, x: d.represent_scalar("tag:yaml.org,2002:str", x, style="|" if "\n" in x
                                                                  else None))
    return Dumper


def parser() -> Parser:
    p = Parser(prog="python -m framework.sim.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=OutputPath(suffixes=("yaml",)), help="the profile to write")
    p.add_argument("--name", help="the profile's name (default: the file's stem)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="a coarser grid (seconds, for a test)")
    p.add_argument("--peak-tflops", default="", help="datasheet peaks, dtype=TFLOP/s,... (default: the best measured)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="written as the profile's gpus_per_node (default: --links, else 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads while measuring: a rank's share of the cores (default: torch's)")
    p.add_argument("--links", type=int, default=0,
                   help="also measure the link between this many local ranks (framework/sim/bench_links.py)")
    return p


@command
def main(argv: list[str]) -> int:
    import yaml

    args = parser().parse_args(argv)
    peaks = parse_peaks(args.peak_tflops)
    device_type = resolve_device(args.device)
    if device_type == "cuda" and not torch.cuda.is_available():
        reject("--device", "cuda", "no CUDA device here", "leave --device out (auto) or give cpu")
    for flag, value, low in (("--threads", args.threads, 1), ("--links", args.links, 0),
                             ("--gpus-per-node", args.gpus_per_node, 1)):
        if value is not None and not low <= value <= 1024:
            reject(flag, str(value), f"is not a count from {low} to 1024", f"give {flag} a count from {low} to 1024")
    if args.links == 1:
        reject("--links", "1", "a link needs two ranks", "give --links 2 or more, or leave it out")
    if args.threads:
        torch.set_num_threads(args.threads)
    per_node = args.gpus_per_node or args.links or 1
    links = None
    if args.links:
        from framework.sim.bench_links import measure_links

        links = measure_links(args.links, device_type, torch.get_num_threads(), args.quick)
    prof = measure(device_type, args.quick)
    best = {d: max(float(r.split()[3]) for r in rows.splitlines()) for d, rows in prof["gemm_tflops"].items() if rows}
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    out = {"name": name, "source": prof.pop("source"), "gpus_per_node": per_node, "gpus": per_node,
           "host_overlaps": device_type == "cuda",
           "peak_tflops": {**best, **peaks}, "peak_source": "datasheet" if peaks else "best measured GEMM", **prof}
    if links is not None:
        link = {"alpha_us": links["alpha_us"], "GBps": links["GBps"],
                **{f"{kind}_s": {"ranks": args.links, "rows": rows} for kind, rows in links["samples"].items()}}
        out["links"] = {"intra": link, "inter": copy.deepcopy(link)}  # one node: nothing between nodes measured
    with open(args.out, "w") as f:
        f.write(f"# {out['source']}\n")
        if links is not None:
            f.write(f"# links: {args.links} local ranks' all-reduce, reduce-scatter and all-gather measured (*_s); inter = intra\n")
        yaml.dump(out, f, Dumper=_dumper(), sort_keys=False, default_flow_style=None, width=120)
    # the numbers as the file holds them (a CPU's GEMM best is a few hundredths of a TFLOP/s)
    print(f"wrote {args.out}: GEMM best {', '.join(f'{d} {t}' for d, t in best.items())} TFLOP/s, "
          f"copy {prof['memory_GBps']} GB/s, kernel {prof['kernel_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
