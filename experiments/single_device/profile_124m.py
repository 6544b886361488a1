"""Where ours' GPT-2 124M step goes against the plain loop's, in one process (issue 46, item 5):
the framework's split model (framework/models/gpt2.py: embedding | 12 HFBlocks | head, its
lm_loss) and transformers' GPT2LMHeadModel are the same modules; each forward + backward of
one micro-batch (1 x 64 tokens, the 50,304-token vocabulary, fp32) runs alternately, the
order flipped every round, on this machine's threads. Prints the median seconds of each
after two warm-up rounds, and every round's.

    .venv/bin/python experiments/single_device/profile_124m.py --rounds 12

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


if __name__ == "__main__":
    main()
