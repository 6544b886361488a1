"""Our pipeline schedules against torch.distributed.pipelining on the same model and layout.

For each pair (ours gpipe / ScheduleGPipe, ours flush / Schedule1F1B, ours interleaved /
ScheduleInterleaved1F1B, ours interleaved-zb / ScheduleInterleavedZeroBubble, ours zbv /
ScheduleZBVZeroBubble; the last three with 2 chunks per rank, zbv's in a V) both run pp = 2 ranks on this machine with the same gpt2-tiny,
the same seeded weights, the same uniform partition (interleaved: 2 chunks per rank), the
same synthetic batches, AdamW with the same lr schedule and no clipping. Ours runs through
`python run.py`; theirs in two processes started here (gloo). Both time whole optimizer
steps (data, pipeline, optimizer) and report the median step after 3 warm-up steps, the
slowest rank's. The final losses are printed too: the same math must give the same loss.

    python experiments/peer_pipelining/compare.py [out_dir] [--passes=3] [--only=flush,zbv]
"""

from __future__ import annotations

import json
import os
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

PAIRS = {"gpipe": "ScheduleGPipe", "flush": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
CHUNKS = {"interleaved": 2, "interleaved-zb": 2, "zbv": 2}  # per rank; the others 1
SPLIT = ("interleaved-zb", "zbv")  # backward split into I and W
COMMON = ["parallelism=pp2", "data=synthetic", "logger=none", "trainer.steps=20", "trainer.micro_batch_size=4",
          "schedule.microbatches=8", "trainer.grad_clip=0", "metrics.skip_first=3", "model.n_layer=8"]


def ours(schedule: str, out: Path) -> dict:
    job = out / f"ours_{schedule}"
    subprocess.run([sys.executable, str(ROOT / "run.py"), *COMMON, f"schedule={schedule}",
                    f"schedule.virtual_stages={CHUNKS.get(schedule, 1)}", f"hydra.run.dir={job}"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((job / "summary.json").read_text())


def _peer_worker(rank: int, schedule: str, port: int, result_path: str) -> None:
    from torch.distributed import pipelining

    from framework.data import ShardedSampler, TokenData
    from framework.models import build_model, lm_loss
    from framework.optim.build import build_optimizer, lr_at, set_lr
    from framework.schedules import get
    from framework.parallel.pipeline.stage import build_chunks, stage_ranges
    from tests.conftest import compose

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # what our launcher gives each of 2 ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    v = CHUNKS.get(schedule, 1)
    run = compose(*COMMON, f"schedule={schedule}", f"schedule.virtual_stages={v}")
    full = build_model(run.model, run.data.vocab_size, run.trainer.seed)
    smap = get(schedule).stage_map(2, v)  # loop, or zbv's V: the same placement on both sides
    chunks = build_chunks(full, stage_ranges("uniform", full, 2 * v), smap, rank)
    ids = [smap.stage(rank, k) for k in range(v)]
    stages = [pipelining.PipelineStage(c, ids[k], 2 * v, torch.device("cpu")) for k, c in enumerate(chunks)]
    m = run.schedule.microbatches
    cls = getattr(pipelining, PAIRS[schedule])
    sched = cls(stages if v > 1 else stages[0], m, loss_fn=lm_loss)
    opt = build_optimizer(run.optimizer, [p for c in chunks for p in c.parameters()])
    data = TokenData.load(run, None)
    sampler = ShardedSampler(data.num_samples, run.trainer.micro_batch_size, m, 0, 1, run.trainer.seed)
    times, losses = [], []
    for step in range(run.trainer.steps):
        t0 = time.time()
        x, y = data.batch(__import__("numpy").concatenate(sampler.step_indices(step)))
        set_lr(opt, lr_at(step, run))
        step_losses = []
        first, last = 0 in ids, 2 * v - 1 in ids  # a V's rank 0 holds both ends
        if first and last:
            sched.step(x, target=y, losses=step_losses)
        elif first:
            sched.step(x)
        else:
            sched.step(target=y, losses=step_losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t0)
        if step_losses:
            losses.append(float(torch.stack(step_losses).detach().mean()))
    gathered = [None, None]
    dist.all_gather_object(gathered, {"times": times, "losses": losses})
    if rank == 0:
        per_step = [max(a, b) for a, b in zip(gathered[0]["times"], gathered[1]["times"], strict=True)]
        med = statistics.median(per_step[3:])
        loss = (gathered[0]["losses"] or gathered[1]["losses"])[-1]
        tokens = run.tokens_per_step
        Path(result_path).write_text(json.dumps({"step_time_s": med, "tokens_per_s": tokens / med, "loss": loss}))
    dist.destroy_process_group()


def theirs(schedule: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"theirs_{schedule}.json"
    mp.spawn(_peer_worker, args=(schedule, 29500 + hash(schedule) % 1000, str(path)), nprocs=2, join=True)
    return json.loads(path.read_text())


REPEATS = 3  # ours, theirs, ours, theirs, ...: drift of this shared machine hits both alike


def breakdown(job_summary: dict, job_dir: Path) -> str:
    """Where ours spends a step, from its calibration.json (the simulator's inputs): per
    step, the slowest rank's compute, its host gaps between actions (issuing p2p batches,
    timing marks), the time outside the pipeline (optimizer, gradient-norm all-reduce), and
    what is left (waits on the peer, the flush); beside the replay's error."""
    cal = json.loads((job_dir / "calibration.json").read_text())
    cfg = (job_dir / "config.yaml").read_text()
    m = int(cfg.split("microbatches:")[1].split()[0])
    per_rank = {}
    for key, sec in cal["compute"].items():
        r = key.split(",")[0]
        per_rank[r] = per_rank.get(r, 0.0) + sec * m
    worst = max(per_rank, key=per_rank.get)
    name = job_summary["schedule"]
    n_actions = (3 if name in SPLIT else 2) * m * CHUNKS.get(name, 1)
    compute, gaps = per_rank[worst], cal["gap_s"][worst] * (n_actions - 1)
    outside = cal["outside_s"][worst]
    step = job_summary["step_time_s"]
    return (f"{step * 1e3:.0f} = compute {compute * 1e3:.0f} + gaps {gaps * 1e3:.1f} + outside {outside * 1e3:.1f} "
            f"+ waits/flush {(step - compute - gaps - outside) * 1e3:.0f} (replay {job_summary['predicted_step_time_error']:+.1%})")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    passes = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--passes=")), REPEATS)
    only = next((a.split("=")[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")), list(PAIRS))
    out = Path(args[0] if args else ROOT / "outputs" / "peer_pipelining")
    out.mkdir(parents=True, exist_ok=True)
    runs = " / ".join(str(i + 1) for i in range(passes))
    rows = [f"| schedule (ours / torch.distributed.pipelining) | ours tokens/s (pass {runs}) | theirs tokens/s "
            f"(pass {runs}) | ours / theirs (pass {runs}) | median ratio | final loss ours / theirs |", "|" + "---|" * 6]
    where = ["| schedule | ours, ms per step (pass 1), from calibration.json |", "|---|---|"]
    for schedule, peer in PAIRS.items():
        if schedule not in only:
            continue
        a, b = [], []
        for i in range(passes):
            a.append(ours(schedule, out / f"run{i}"))
            b.append(theirs(schedule, (out / f"run{i}")))
        tps = lambda runs: " / ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)  # noqa: E731
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b, strict=True)]
        rows.append(f"| {schedule} / {peer} | {tps(a)} | {tps(b)} | {' / '.join(f'{r:.2f}' for r in ratios)} "
                    f"| {statistics.median(ratios):.2f} | {a[0]['loss']:.4f} / {b[0]['loss']:.4f} |")
        where.append(f"| {schedule} | {breakdown(a[0], out / 'run0' / f'ours_{schedule}')} |")
    text = f"torch {torch.__version__}, {os.cpu_count()} CPUs\n\n" + "\n".join(rows) + "\n\n" + "\n".join(where) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
