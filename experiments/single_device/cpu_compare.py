"""Ours against the plain loop on this CPU (issue 46, item 5): the same model, shapes,
precision, AdamW (fused), global-norm clipping and accumulation, one process each, in
alternating passes; prints a JSON line per run and a markdown table (median tokens/s of the
passes, min-max, ours / plain as the median of the per-pass ratios with its min-max).

    .venv/bin/python experiments/single_device/cpu_compare.py --passes 5 --out DIR

Ours: `run.py parallelism=single data=synthetic ...`, tokens/s = summary.json's median over
the steps after metrics.skip_first (its step time: data + forward / backward + update).
Plain: plain_loop.py's median step (forward / backward + update; its tokens are already in
memory). Both on torch's default intra-op threads of this machine.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# name -> (plain --model, blocks, width, heads, vocab, seq, micro-batch, accumulation, steps)
SIZES = {"gpt2-tiny": ("gpt2-tiny", 4, 128, 4, 256, 128, 4, 4, 12),
         "narrow-24": ("gpt2-tiny", 24, 32, 2, 256, 128, 4, 4, 12),
         "gpt2-124M": ("gpt2", 12, 768, 12, 50304, 64, 1, 2, 12)}


def ours(name: str, precision: str, out: Path) -> dict:
    _, blocks, width, heads, vocab, seq, mb, accum, steps = SIZES[name]
    job = out / f"ours_{name}_{precision}"
    args = [sys.executable, str(ROOT / "run.py"), "model=gpt2-tiny", f"model.n_layer={blocks}", f"model.n_embd={width}",
            f"model.n_head={heads}", "model.max_positions=1024", "data=synthetic", f"data.vocab_size={vocab}",
            f"data.seq_len={seq}", f"trainer.micro_batch_size={mb}", f"schedule.microbatches={accum}",
            f"trainer.steps={steps}", "metrics.skip_first=2", "trainer.warmup_steps=1", "optimizer.lr=3e-4",
            "trainer.grad_clip=1.0", f"trainer.precision={precision}", "parallelism=single", "logger=none",
            f"trainer.log_interval={steps}", f"hydra.run.dir={job}"]
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True, timeout=900)
    s = json.loads((job / "summary.json").read_text())
    return {"impl": "ours", "size": name, "precision": precision, "tokens_per_s": s["tokens_per_s"],
            "optimizer_s": s.get("optimizer_s")}


def plain(name: str, precision: str) -> dict:
    model, blocks, width, heads, vocab, seq, mb, accum, steps = SIZES[name]
    out = subprocess.run([sys.executable, str(ROOT / "experiments/single_device/plain_loop.py"), "--model", model,
                          "--layers", str(blocks), "--width", str(width), "--heads", str(heads), "--vocab", str(vocab),
                          "--seq", str(seq), "--mb", str(mb), "--accum", str(accum), "--steps", str(steps),
                          "--warmup", "2", "--device", "cpu", "--precision", precision],
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=900).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"impl": "plain", "size": name, "precision": precision, "tokens_per_s": r["tokens_per_s"],
            "optimizer_s": r["optimizer_ms"] / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", default="/tmp/cpu_compare")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.sizes.split(","):
        for k in range(a.passes):  # alternating, the order flipped every pass
            for fn in ((ours, plain) if k % 2 == 0 else (plain, ours)):
                r = fn(name, a.precision, out) if fn is ours else fn(name, a.precision)
                r["pass"] = k
                rows.append(r)
                print(json.dumps(r), flush=True)
    print("\n| size | precision | ours tokens/s, median (min-max) | plain tokens/s | ours / plain, median of passes (min-max) | ours / plain optimizer s |")
    print("|---|---|---|---|---|---|")
    for name in a.sizes.split(","):
        o = [r for r in rows if r["size"] == name and r["impl"] == "ours"]
        p = [r for r in rows if r["size"] == name and r["impl"] == "plain"]
        ratio = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(o, p)]
        med = lambda rs, k="tokens_per_s": statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"| {name} | {a.precision} | {med(o):,.0f} ({min(r['tokens_per_s'] for r in o):,.0f}-"
              f"{max(r['tokens_per_s'] for r in o):,.0f}) | {med(p):,.0f} ({min(r['tokens_per_s'] for r in p):,.0f}-"
              f"{max(r['tokens_per_s'] for r in p):,.0f}) | {statistics.median(ratio):.3f} ({min(ratio):.3f}-"
              f"{max(ratio):.3f}) | {med(o, 'optimizer_s') * 1e3:.1f} / {med(p, 'optimizer_s') * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
