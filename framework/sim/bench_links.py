"""The local link between ranks, measured for a hardware profile (`python -m framework.sim.bench
--links N`): N processes on this node, on the backend a run here uses (gloo on a CPU, NCCL
on GPUs), time an all-reduce, a reduce-scatter and an all-gather over message sizes, through
the calls the framework makes (framework/comm/tp_comm.py's single-tensor forms), and
the cost model's alpha-beta (framework/sim/cost/collectives.py) is fitted to the all-reduce:
- alpha_us: a 1-element all-reduce's time over its ring's 2 (n-1) steps (n = 2: a p2p's);
- GBps: the largest all-reduce's bus bandwidth, 2 (n-1)/n x bytes over its time less alpha.
The reduce-scatter and the all-gather get curves of their own because a backend need not
run them as NCCL's rings do: gloo's reduce-scatter is an all-reduce of the whole buffer
(pytorch#118911), twice a ring reduce-scatter's bytes, and ZeRO 2-3 pay that on a CPU.
Each time is the slowest rank's median of repeated calls after a warm-up, so a rank that
arrives late is not counted as link time. One node only: `inter` is written equal to
`intra` (a user with a cluster measures it with NCCL's tests and edits the profile).
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
# fp32 elements: 4 B to 128 MiB (a ZeRO unit of a GPT-2 124M block is 28 MB, its token table
# 154 MB; gloo's all-gather moves half the bytes per second past 8 MB that it does below);
# --quick stops at 8 MiB
SIZES = (1, 1 << 10, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 25)
QUICK_SIZES = SIZES[:7]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, device, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, device_type: str, threads: int, sizes: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        from framework.comm.tp_comm import all_gather_single, reduce_scatter_single

        times = []
        for kind in KINDS:
            for n in sizes:  # n: the whole buffer (reduced, scattered from, or gathered into)
                whole, part = torch.ones(n, device=device), torch.ones(n // world, device=device)
                call = {"all_reduce": lambda: dist.all_reduce(whole),
                        "reduce_scatter": lambda: reduce_scatter_single(part, whole),
                        "all_gather": lambda: all_gather_single(whole, part)}[kind]
                times.append(_time(call, device, 20 if n < (1 << 18) else 7 if n < (1 << 22) else 3))
        mine = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's median
        if rank == 0:
            out.put(mine.tolist())
    finally:
        dist.destroy_process_group()


def measure_links(world: int, device_type: str, threads: int = 1, quick: bool = False) -> dict:
    """{alpha_us, GBps, samples: {kind: [[bytes of the whole buffer, seconds], ...]}} of
    `world` local ranks."""
    # a CPU's ranks are forked: nothing has run on the intra-op threads yet (the bench measures
    # the links first), and a spawned rank spent ~2 s of CPU re-importing torch; CUDA must spawn
    ctx = mp.get_context("spawn" if device_type == "cuda" else "fork")
    out = ctx.Queue()
    port = _free_port()
    sizes = tuple(max(n - n % world, world) for n in (QUICK_SIZES if quick else SIZES))  # whole shards each
    procs = [ctx.Process(target=_rank, args=(r, world, port, device_type, threads, sizes, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        flat = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
    by_kind = {k: flat[i * len(sizes):(i + 1) * len(sizes)] for i, k in enumerate(KINDS)}
    times = by_kind["all_reduce"]
    steps = 2 * (world - 1)
    alpha = times[0] / steps
    big = sizes[-1] * 4
    gbps = 2 * (world - 1) / world * big / max(times[-1] - steps * alpha, 1e-9) / 1e9
    return {"alpha_us": round(alpha * 1e6, 2), "GBps": round(gbps, 3),
            "samples": {k: [[n * 4, round(t, 7)] for n, t in zip(sizes, ts)] for k, ts in by_kind.items()}}
