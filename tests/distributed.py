"""Run a function on N gloo ranks in fresh processes and collect what each returns.

The ranks fork from the launcher's own rank server (framework/launch/forkserver.py: torch,
transformers and the framework imported once per test session) instead of being spawned:
a spawned rank imported them again, 6-8 s of a 2-core machine per rank. A fork of the
server is as clean as a spawned process (the server never ran a torch op)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # Pickled here: the queue's own pickler would pass tensors as shared-memory handles,
        # which die with this process.
        queue.put((rank, pickle.dumps(fn(rank, world, *args)), None))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank's traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """fn(rank, world, *args) on every rank (fn must be importable: module level)."""
    from framework.launch import forkserver

    forkserver.prepare()  # the server of this process's environment, the framework preloaded
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, out, err = queue.get(timeout=timeout)
            if err is not None:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
