"""Where ours' GPT-2 124M step goes against the plain loop's, in one process (issue 46, item 5):
the framework's split model (framework/models/gpt2.py: embedding | 12 HFBlocks | head, its
lm_loss) and transformers' GPT2LMHeadModel are the same modules; each forward + backward of
one micro-batch (1 x 64 tokens, the 50,304-token vocabulary, fp32) runs alternately, the
order flipped every round, on this machine's threads. Prints the median seconds of each
after two warm-up rounds, and every round's.

    .venv/bin/python experiments/single_device/profile_124m.py --rounds 12
    .venv/bin/python experiments/single_device/profile_124m.py --ops   # torch.profiler, op by op

Two processes (cpu_compare.py) differ by the machine's drift between them; one process
alternating shows whether the model's own forward / backward differs.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from framework.models import gpt2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ops", action="store_true", help="torch.profiler's self CPU time per op, 4 micro-batches each")
    a = ap.parse_args()
    torch.manual_seed(0)
    vocab, seq = 50304, 64
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=1024, n_layer=12, n_embd=768, n_head=12,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    split = gpt2.split(hf)
    x = torch.randint(0, vocab, (1, seq + 1))

    def ours():  # the framework's inputs: labels already shifted
        split(x[:, :-1], x[:, 1:]).backward()

    def plain():  # transformers shifts the labels itself
        hf(x[:, :-1], labels=x[:, :-1]).loss.backward()

    if a.ops:
        return ops(ours, plain, hf)
    took = {"ours": [], "plain": []}
    for k in range(a.rounds):
        for name, fn in ((("ours", ours), ("plain", plain)) if k % 2 == 0 else (("plain", plain), ("ours", ours))):
            t = time.perf_counter()
            fn()
            took[name].append(time.perf_counter() - t)
            hf.zero_grad(set_to_none=True)
    for name, v in took.items():
        print(f"{name}: forward + backward of one micro-batch, median {statistics.median(v[2:]):.3f} s "
              f"(rounds: {', '.join(f'{t:.3f}' for t in v)})")



def ops(ours, plain, hf) -> None:
    """Each side's ops over 4 micro-batches (after 2 warm-up rounds), self CPU time per
    micro-batch: the total and the 12 ops whose time differs most."""
    from torch.profiler import ProfilerActivity, profile

    for fn in (ours, plain, ours, plain):
        fn()
        hf.zero_grad(set_to_none=True)
    tabs = {}
    for name, fn in (("ours", ours), ("plain", plain)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                fn()
                hf.zero_grad(set_to_none=True)
        tabs[name] = {e.key: (e.self_cpu_time_total / 4e3, e.count // 4) for e in prof.key_averages()}
    print("self CPU ms per micro-batch, all ops:", {n: round(sum(v[0] for v in t.values()), 1) for n, t in tabs.items()})
    zero = (0.0, 0)
    for k in sorted(set(tabs["ours"]) | set(tabs["plain"]),
                    key=lambda k: -abs(tabs["ours"].get(k, zero)[0] - tabs["plain"].get(k, zero)[0]))[:12]:
        o, p = tabs["ours"].get(k, zero), tabs["plain"].get(k, zero)
        print(f"{k[:50]:50s} ours {o[0]:8.2f} ms x{o[1]:4d}   plain {p[0]:8.2f} ms x{p[1]:4d}")


if __name__ == "__main__":
    main()
