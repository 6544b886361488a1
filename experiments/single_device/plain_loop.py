"""The plain loop the framework is measured against (issue 46): transformers' GPT2LMHeadModel,
torch's fused AdamW (lr 3e-4, betas 0.9 / 0.95, weight decay 0.1), global-norm clipping at
1.0, `accum` micro-batches per step, random tokens on the device. `--precision`:
`autocast` (fp32 weights under bf16 autocast, nanoGPT's recipe; the "before" numbers),
`fp32`, or `bf16-mixed` (the framework's arithmetic: bf16 weights and gradients, fp32
masters in one flat buffer, the fp32 gradients copied in, clipped, stepped by fused AdamW
and copied back: the same ops as framework/optim/master.py, written out by hand). Prints one JSON line: tokens/s (median
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
    ap.add_argument("--precision", default="autocast", choices=("autocast", "fp32", "bf16-mixed"))
    ap.add_argument("--layers", type=int)  # override the size's blocks / width / heads
    ap.add_argument("--width", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))  # llama: the sizes from the flags
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--inner", type=int)
    a = ap.parse_args()
    dev = torch.device(a.device)
    layers, width, heads = SIZES[a.model]
    layers, width, heads = a.layers or layers, a.width or width, a.heads or heads
    torch.manual_seed(0)
    if a.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, hidden_size=width, intermediate_size=a.inner,
                                             num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=a.kv_heads or heads, max_position_embeddings=a.seq,
                                             tie_word_embeddings=False)).to(dev)
    else:
        cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_layer=layers, n_embd=width, n_head=heads,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(dev)
    params = list(model.parameters())
    if a.precision == "bf16-mixed":
        model.to(torch.bfloat16)
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        masters, grads, at = [], [], 0
        grad_flat = torch.empty_like(flat)
        for p in params:
            masters.append(torch.nn.Parameter(flat[at:at + p.numel()].view(p.shape)))
            grads.append(grad_flat[at:at + p.numel()].view(p.shape))
            at += p.numel()
        for m, g in zip(masters, grads):
            m.grad = g
    opt = torch.optim.AdamW(masters if a.precision == "bf16-mixed" else params, lr=3e-4, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=True)
    x = torch.randint(0, a.vocab, (a.accum, a.mb, a.seq), device=dev)
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
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "autocast"):
                    loss = model(x[j], labels=x[j]).loss / a.accum
                loss.backward()
            if cuda:
                ev[1].record()
            t1 = time.perf_counter()
            if a.precision == "bf16-mixed":  # the framework's update, by hand
                with torch.no_grad():
                    held = [p.grad for p in params]
                    norm = torch.stack(torch._foreach_norm(held, 2, dtype=torch.float32)).pow(2).sum().sqrt()
                    torch._foreach_copy_(grads, held)
                    torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
                    opt.step()
                    torch._foreach_copy_(params, masters)
                model.zero_grad(set_to_none=True)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
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
    print(json.dumps({"impl": "plain", "model": a.model if a.arch == "gpt2" else a.arch, "precision": a.precision, "blocks": layers, "mb": a.mb, "accum": a.accum, "seq": a.seq,
                      "tokens_per_s": a.mb * a.accum * a.seq / step_s, "step_s": step_s,
                      "optimizer_ms": statistics.median(opt_ms) if opt_ms else None,
                      "syncs_last_step": syncs, "steps_measured": len(times)}))


if __name__ == "__main__":
    main()
