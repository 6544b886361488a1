"""trainer.compile=blocks against eager on this CPU (issue 48, item 4): the same run, one
process each, in alternating passes; prints a JSON line per run and a markdown table
(median tokens/s of the passes with min-max, compiled / eager as the median of the
per-pass ratios with its min-max, and the compile seconds the warm-up took).

    .venv/bin/python experiments/compile_fp8/cpu_compare.py --passes 3 --out DIR [--sizes gpt2-tiny gpt2-124M]

tokens/s: summary.json's median over the steps after metrics.skip_first=2 (compilation is
in the first step, which that leaves out: the row's `compiles_measured` must be 0); fp32;
inductor (gcc-built C++ kernels) on torch's default intra-op threads. Each compiled run
starts from an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so `compile_s` is a cold
compile's wall time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# name -> (blocks, width, heads, vocab, seq, micro-batch, accumulation, steps)
SIZES = {"gpt2-tiny": (4, 128, 4, 256, 128, 4, 4, 10),
         "gpt2-124M": (12, 768, 12, 50304, 128, 1, 2, 8)}


def one(name: str, compiled: bool, out: Path, k: int) -> dict:
    blocks, width, heads, vocab, seq, mb, accum, steps = SIZES[name]
    job = out / f"{name}_{'compiled' if compiled else 'eager'}_{k}"
    args = [sys.executable, str(ROOT / "run.py"), "model=gpt2-tiny", f"model.n_layer={blocks}", f"model.n_embd={width}",
            f"model.n_head={heads}", "model.max_positions=1024", "data=synthetic", f"data.vocab_size={vocab}",
            f"data.seq_len={seq}", f"trainer.micro_batch_size={mb}", f"schedule.microbatches={accum}",
            f"trainer.steps={steps}", "metrics.skip_first=2", "trainer.warmup_steps=1", "parallelism=single",
            "logger=none", f"trainer.log_interval={steps}", f"hydra.run.dir={job}"]
    args += ["trainer.compile=blocks"] if compiled else []
    # a fresh inductor cache per compiled run: compile_s is a cold compile's, as a first run sees it
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / f"inductor_{name}_{k}")}
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True, timeout=1800, env=env)
    s = json.loads((job / "summary.json").read_text())
    return {"size": name, "compiled": compiled, "pass": k, "tokens_per_s": s["tokens_per_s"],
            "compile_s": s.get("compile_s"), "compiles_measured": s.get("compiles_measured"),
            "activation_peak_bytes": s["activation_peak_bytes_max"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default="/tmp/compile_cpu")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    for k in range(args.passes):
        for name in args.sizes:
            for compiled in ((False, True) if k % 2 == 0 else (True, False)):  # alternate which goes first
                rows.append(one(name, compiled, out, k))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| model | eager tokens/s (min-max) | compiled tokens/s (min-max) | compiled / eager (min-max) | "
          "compile s | recompiles measured | saved activations eager / compiled |")
    print("|---|---|---|---|---|---|---|")
    for name in args.sizes:
        e = [r for r in rows if r["size"] == name and not r["compiled"]]
        c = [r for r in rows if r["size"] == name and r["compiled"]]
        ratio = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(e, c)]
        te, tc = [r["tokens_per_s"] for r in e], [r["tokens_per_s"] for r in c]
        print(f"| {name} | {statistics.median(te):,.0f} ({min(te):,.0f}-{max(te):,.0f}) | "
              f"{statistics.median(tc):,.0f} ({min(tc):,.0f}-{max(tc):,.0f}) | {statistics.median(ratio):.3f} "
              f"({min(ratio):.3f}-{max(ratio):.3f}) | {statistics.median(r['compile_s'] for r in c):.0f} | "
              f"{max(r['compiles_measured'] for r in c)} | {e[0]['activation_peak_bytes'] / 2**20:.1f} / "
              f"{c[0]['activation_peak_bytes'] / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
