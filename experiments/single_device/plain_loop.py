"""The plain loop the framework is measured against (issue 46's "before" numbers): transformers'
GPT2LMHeadModel, fp32 weights under bf16 autocast, torch's fused AdamW (lr 3e-4, betas 0.9 /
0.95, weight decay 0.1), global-norm clipping at 1.0 (torch's clip_grad_norm_), `accum`
micro-batches per step, random tokens on the device. Prints one JSON line: tokens/s (median
step after the warm-up, CUDA events), optimizer ms (events around clip + step), and the host
syncs of one measured step (torch.cuda.set_sync_debug_mode, counted).

    python experiments/single_device/plain_loop.py --model gpt2 --mb 8 --accum 4 --steps 20
"""
import argparse
import json
import statistics
import time
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SIZES = {"gpt2-tiny": (4, 128, 4), "gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=sorted(SIZES))
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    layers, width, heads = SIZES[a.model]
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50304, n_positions=a.seq, n_layer=layers, n_embd=width, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(dev)
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    x = torch.randint(0, 50304, (a.accum, a.mb, a.seq), device=dev)
    cuda = dev.type == "cuda"
    times, opt_ms, syncs = [], [], None
    for step in range(a.steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
        count = step == a.steps - 1 and cuda
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if count:
                torch.cuda.set_sync_debug_mode("warn")
            if cuda:
                ev[0].record()
            t0 = time.perf_counter()  # the CPU's clock (CUDA: the events)
            for j in range(a.accum):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = model(x[j], labels=x[j]).loss / a.accum
                loss.backward()
            if cuda:
                ev[1].record()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                ev[2].record()
            if count:
                torch.cuda.set_sync_debug_mode(0)
                syncs = sum("synchroniz" in str(w.message) for w in caught)
        t2 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(ev[0].elapsed_time(ev[2]) / 1e3 if cuda else t2 - t0)
            opt_ms.append(ev[1].elapsed_time(ev[2]) if cuda else (t2 - t1) * 1e3)
    step_s = statistics.median(times) if times else float("nan")
    print(json.dumps({"impl": "plain", "model": a.model, "mb": a.mb, "accum": a.accum, "seq": a.seq,
                      "tokens_per_s": a.mb * a.accum * a.seq / step_s, "step_s": step_s,
                      "optimizer_ms": statistics.median(opt_ms) if opt_ms else None,
                      "syncs_last_step": syncs, "steps_measured": len(times)}))


if __name__ == "__main__":
    main()
