"""Our tensor-parallel layers against torch.distributed.tensor.parallel on the same model.

Both sides train the same seeded Llama (nn.Linear projections: torch's ColwiseParallel /
RowwiseParallel do not take GPT-2's Conv1D) at tp = 2 on this machine, on the same
synthetic batches, AdamW with the same lr schedule, no clipping:
- ours: `python run.py parallelism=tp2 ...` (our plan: vocab-parallel embedding and head
  with vocab-parallel cross-entropy, column / row-parallel q, k, v, o, gate, up, down);
- theirs: the same split model in two processes started here, with `parallelize_module`:
  RowwiseParallel embedding, ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, and the
  head ColwiseParallel with sharded logits under `loss_parallel()` (torchtitan's recipe).
Both time whole optimizer steps (data, forward, backward, optimizer) and report the median
of the slowest rank's step after 3 warm-up steps; passes alternate (ours, theirs, ours,
theirs) so drift on this shared VM hits both. Final losses are printed: the same math must
give the same loss.

    python experiments/peer_tensor_parallel/compare.py [out_dir] [passes]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TP = 2
COMMON = ["parallelism=tp2", "model=llama-tiny", "data=synthetic", "data.seq_len=128", "logger=none",
          "trainer.steps=20", "trainer.micro_batch_size=8", "schedule.microbatches=1", "trainer.grad_clip=0",
          "metrics.skip_first=3", "trainer.log_interval=20"]


def ours(out: Path, tag: str) -> dict:
    job = out / f"ours_{tag}"
    subprocess.run([sys.executable, str(ROOT / "run.py"), *COMMON, f"hydra.run.dir={job}"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    s = json.loads((job / "summary.json").read_text())
    return {"step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "loss": s["loss"]}


def _torch_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*."
    return {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            **{f"{layer}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            f"{layer}self_attn.o_proj": RowwiseParallel(),
            f"{layer}mlp.gate_proj": ColwiseParallel(), f"{layer}mlp.up_proj": ColwiseParallel(),
            f"{layer}mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def _peer_worker(rank: int, port: int, result_path: str) -> None:
    import numpy as np
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from framework.data import ShardedSampler, TokenData
    from framework.models import ARCHS, build_hf_model
    from framework.optim.build import build_optimizer, lr_at, set_lr
    from tests.conftest import compose

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # what our launcher gives each of 2 ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    run = compose(*COMMON)
    hf = build_hf_model(run.model, run.data.vocab_size, run.trainer.seed)
    parallelize_module(hf, init_device_mesh("cpu", (TP,)), _torch_plan())
    model = ARCHS["llama"].split(hf)
    opt = build_optimizer(run.optimizer, model.parameters())
    data = TokenData.load(run, None)
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, 1, 0, 1, run.trainer.seed)
    times, losses = [], []
    for step in range(run.trainer.steps):
        t0 = time.time()
        x, y = data.batch(np.concatenate(sampler.step_indices(step)))
        set_lr(opt, lr_at(step, run))
        logits = model.head(model.run_blocks(model.embedding(x)))  # DTensor, vocab-sharded
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t0)
        loss = loss.detach()
        losses.append(float(loss.full_tensor()) if hasattr(loss, "full_tensor") else float(loss))
    Path(f"{result_path}.{rank}").write_text(json.dumps({"times": times, "losses": losses}))
    dist.destroy_process_group()


def theirs(out: Path, tag: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(out / f"theirs_{tag}.json")
    mp.start_processes(_peer_worker, args=(port, path), nprocs=TP, start_method="spawn")
    ranks = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(TP)]
    slowest = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)][3:]
    step = statistics.median(slowest)
    run_tokens = 8 * 128
    return {"step_time_s": step, "tokens_per_s": run_tokens / step, "loss": ranks[0]["losses"][-1]}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/peer_tensor_parallel/out")
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(passes):
        a, b = ours(out, str(i)), theirs(out, str(i))
        rows.append({"pass": i, "ours": a, "theirs": b, "ratio": a["tokens_per_s"] / b["tokens_per_s"]})
        print(f"pass {i}: ours {a['tokens_per_s']:,.0f} tok/s (loss {a['loss']:.4f}) | torch TP "
              f"{b['tokens_per_s']:,.0f} tok/s (loss {b['loss']:.4f}) | ratio {rows[-1]['ratio']:.2f}", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
