"""Saving: each rank writes only its own boxes, in the background, and the job is told when it fails.

`Saver.save(k)` (collective over the world, at a step boundary):
1. staging, which the step waits for: every box this rank writes (of its parameters or
   ZeRO slice and their optimizer states) is copied once into host memory, one compact
   tensor per box, so training may change the originals while the write goes on. That copy
   is the rank's own part (what it writes of what it holds), not its stage's: no gather over
   tp or dp happens.
2. writing, in a background thread (`trainer.checkpoint_async=true`, the default): DCP's
   save of those boxes on a gloo group of its own (its collectives never queue behind the
   training's), then on rank 0 `meta.json`, the metrics rows and, last, `COMPLETE`; then a
   barrier on that group, so no rank's write ends before the marker exists. At most one
   save is in flight: the next `save` and the end of training wait for it (`wait`), and so
   does a rank leaving with an exception, so a fault after step k does not take down
   checkpoint k. With `checkpoint_async=false` the step waits for both phases, and no copy
   is made (DCP reads the views directly, cloning one box at a time).
A write that fails (a full disk, a lost mount, rank 0's meta or marker) is re-raised in the
training thread as `CheckpointWriteError`, naming the checkpoint and the cause: DCP and the
closing all-reduce end the write alike on every rank, so each raises it at its next step
boundary whose write has ended, or when it next waits for it (the next save, the end) (`No space left on device` and the bytes free where that is it); rank 0 removes the
incomplete directory so the earlier complete checkpoint survives and there is room to
report. `debug.checkpoint_disk_bytes` emulates a full file system for that test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from framework.config import RunConfig
from framework.files import write_atomic
from framework.metrics.memory import RssSampler, current_rss_bytes
from framework.checkpoint.shards import SavePlanner, rank_parts
from framework.checkpoint.store import CHECKPOINTS_DIR, MARKER, META, METRICS, is_complete, prune, step_dir


class CheckpointWriteError(RuntimeError):
    """Writing checkpoint step_<k> failed; the earlier complete checkpoints are intact."""


def layout_of(run: RunConfig) -> dict:
    p, s = run.parallelism, run.schedule
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "zero": p.zero, "schedule": s.name,
            "microbatches": s.microbatches, "virtual_stages": s.virtual_stages, "sequence_parallel": p.sequence_parallel and p.tp > 1}


def _meta(run: RunConfig, step: int, vocab_size: int, parent: Optional[str]) -> dict:
    return {"step": step, "time": time.time(), "layout": layout_of(run), "world_size": run.world_size,
            "model": {**asdict(run.model), "vocab_size": vocab_size}, "precision": run.trainer.precision,
            "optimizer": run.optimizer, "seed": run.trainer.seed, "global_batch": run.global_batch,
            "data": {k: getattr(run.data, k) for k in ("name", "seq_len", "tokenizer")},
            "steps": run.trainer.steps, "resumed_from": parent, "format": "sharded-boxes-v1"}


class _LimitedWriter(FileSystemWriter):
    """debug.checkpoint_disk_bytes: the checkpoints directory behaves as a file system of that
    many bytes; a write past it raises ENOSPC, as the kernel would."""

    def __init__(self, path: str, limit: int):
        super().__init__(path, thread_count=1, per_thread_copy_ahead=0)
        self.limit, self.root = limit, os.path.dirname(path)

    def _used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.root) for f in fs)

    def write_data(self, plan, planner):
        used = self._used()
        need = sum(planner.resolve_data(i).numel() * planner.resolve_data(i).element_size()
                   for i in plan.items if i.tensor_data is not None)
        if used + need > self.limit:
            raise OSError(errno.ENOSPC, f"No space left on device (debug.checkpoint_disk_bytes={self.limit}: "
                                        f"{used} used, {need} more needed)", self.path)
        return super().write_data(plan, planner)


FULL = "No space left on device"


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _cause(e: BaseException, root: str, need: int) -> str:
    """The first OSError under DCP's wrapping (CheckpointException keeps each rank's), or the
    exception itself, in one line. A full disk says so with the bytes free, also when the
    error hides it: torch's zip writer reports ENOSPC as `unexpected pos ...`, so a file
    system with less room than this rank's part (`need` bytes) is named as the cause."""
    seen, todo = [], [e]
    while todo:
        x = todo.pop(0)
        seen.append(x)
        for v in getattr(x, "failures", {}).values():  # rank -> (exception, its traceback)
            todo += [w for w in (v if isinstance(v, tuple) else (v,)) if isinstance(w, BaseException)]
        todo += [c for c in (x.__cause__, x.__context__) if c is not None and c not in seen]
    free = _free_bytes(root)
    there = "" if free is None else f"; {free} bytes free there"
    for x in seen:
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return f"{FULL} ({x}){there}"
    x = next((x for x in seen if isinstance(x, OSError)), seen[-1])
    said = f"{type(x).__name__}: {(str(x).strip().splitlines() or [''])[0]}"
    if free is not None and free < need:
        return f"{FULL}: {free} bytes free there, {need} needed for this rank's part ({said})"
    return said


class Saver:
    """One rank's checkpoint writer (created on every rank by the trainer when
    trainer.checkpoint_interval > 0: its gloo group is created collectively)."""

    def __init__(self, run: RunConfig, ctx, job_dir: str, parent: Optional[str]):
        self.run, self.ctx, self.job_dir, self.parent = run, ctx, job_dir, parent
        self.asynchronous = run.trainer.checkpoint_async
        timeout = timedelta(seconds=run.trainer.hang_timeout_s + 30)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.asynchronous else ctx.log_group
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[CheckpointWriteError] = None
        self.last: dict = {}  # the last save's numbers (summary.json's checkpoint_save)
        self.completed: list[dict] = []  # saves written and not yet told on the console (finished_lines)

    def save(self, runner, full, step: int, vocab_size: int, metrics_path: Optional[str]) -> str:
        self.wait()  # the previous save first: one in flight
        ctx, path = self.ctx, step_dir(self.job_dir, step)
        t0, rss0 = time.time(), current_rss_bytes()
        sampler = RssSampler()
        problem = None
        if ctx.rank == 0:
            try:
                if os.path.exists(path):
                    shutil.rmtree(path)  # an incomplete one (a save cut off)
                os.makedirs(path)
                if metrics_path and os.path.exists(metrics_path):  # the rows up to step k, as of now
                    shutil.copyfile(metrics_path, os.path.join(path, METRICS))
            except OSError as e:
                problem = e
        if self._agree(problem is not None)[0]:  # instead of a barrier: every rank learns rank 0's outcome
            sampler.stop()
            self._fail(path, problem or RuntimeError("rank 0 could not create the checkpoint directory"))
            self.raise_error()
        ctx.recorder.note(f"checkpoint step {step}: stage this rank's boxes", wait=True)
        parts, scalars = rank_parts(runner, full, ctx, writers_only=True)
        if self.asynchronous:  # training may change the originals while the write goes on
            parts = {k: p.staged() for k, p in parts.items()}
            scalars = {k: t.detach().to("cpu", copy=True) for k, t in scalars.items()}
        state: dict = {**parts, **scalars, f"rng/rank{ctx.rank}": torch.get_rng_state()}
        if ctx.device.type == "cuda":
            state[f"rng_cuda/rank{ctx.rank}"] = torch.cuda.get_rng_state(ctx.device)
        own = sum(p.nbytes() for p in parts.values())
        self.last = {"step": step, "rank_bytes": own, "staged_bytes": own if self.asynchronous else 0,
                     "step_wait_s": None, "write_s": None, "rss_before_bytes": rss0, "peak_rss_bytes": None}
        meta = _meta(self.run, step, vocab_size, self.parent)
        if self.asynchronous:
            self.last["step_wait_s"] = time.time() - t0
            self.thread = threading.Thread(target=self._write, args=(state, path, meta, t0, sampler), daemon=True,
                                           name=f"checkpoint-step_{step}")
            self.thread.start()
        else:
            self._write(state, path, meta, t0, sampler)
            self.last["step_wait_s"] = time.time() - t0
            self.raise_error()
        return path

    def _agree(self, failed: bool, full: bool = False) -> tuple[bool, bool]:
        """Whether any rank failed, and whether any found its disk full (one all-reduce of
        two int64 on the checkpoint group)."""
        flags = torch.tensor([int(failed), int(full)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def _fail(self, path: str, e: BaseException, cause: Optional[str] = None) -> None:
        cause = cause or self._cause(path, e)
        self.error = CheckpointWriteError(f"checkpoint {path}: writing failed: {cause}; the earlier "
                                          f"complete checkpoints are intact")
        self.error.__cause__ = e
        if self.ctx.rank == 0 and not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)  # room to report; resume=auto takes the previous one

    def _cause(self, path: str, e: BaseException) -> str:
        return _cause(e, os.path.dirname(path), self.last.get("rank_bytes") or 0)

    def _write(self, state: dict, path: str, meta: dict, t0: float, sampler: RssSampler) -> None:
        ctx = self.ctx
        if ctx.device.type == "cuda":  # a new thread starts on device 0; DCP syncs the current one
            torch.cuda.set_device(ctx.device)
        problem: Optional[BaseException] = None
        try:
            limit = self.run.debug.checkpoint_disk_bytes
            # per_thread_copy_ahead=0: the staged boxes are on the host already (no CUDA loader)
            writer = (_LimitedWriter(path, limit) if limit is not None
                      else FileSystemWriter(path, thread_count=1, per_thread_copy_ahead=0))
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=self.group)
            if ctx.rank == 0:
                write_atomic(os.path.join(path, META), json.dumps(meta, indent=2))
                write_atomic(os.path.join(path, MARKER), f"step {meta['step']}\n")
        except BaseException as e:  # noqa: BLE001 - told in the training thread, with the checkpoint's name
            problem = e
        # The cause now, while the partial files still fill the disk (rank 0 removes them).
        cause = self._cause(path, problem) if problem is not None else None
        try:
            # No rank's write ends before the marker exists (a failure right after this
            # checkpoint must not take it down), and every rank learns rank 0's outcome.
            failed, full = self._agree(problem is not None, cause is not None and cause.startswith(FULL))
        except BaseException as e:  # noqa: BLE001 - a peer gone: the training thread fails on it too
            failed, full, problem = True, False, problem or e
        if failed and full and not (cause or "").startswith(FULL):  # told alike on every rank
            cause = f"{FULL} (another rank's file system had less room than its part); here: {cause or 'no error'}"
        if failed:
            self._fail(path, problem or RuntimeError("another rank failed to write its part or the marker"), cause)
            sampler.stop()
            return
        if ctx.rank == 0:
            prune(self.job_dir, self.run.trainer.keep_checkpoints)  # never raises
        self.last.update(write_s=time.time() - t0, peak_rss_bytes=sampler.stop())
        self.completed.append(self.last)  # (the same dict: step_wait_s is filled in by then or soon after)

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its failure."""
        if self.thread is not None:
            self.ctx.recorder.note("wait for the checkpoint write in flight", wait=True)
            self.thread.join()
            self.thread = None
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def finished_lines(self) -> list[str]:
        """Once per completed save: the console's line (step, where, bytes on disk, time)."""
        out = []
        while self.completed:
            done = self.completed.pop(0)
            path = step_dir(self.job_dir, done["step"])
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
            out.append(f"checkpoint saved: step {done['step']} -> {path} ({size / 2 ** 20:.1f} MiB; the step waited "
                       f"{done['step_wait_s'] or 0.0:.2f} s, the write took {done['write_s']:.2f} s)")
        return out

    def poll(self) -> None:
        """At a step boundary: a finished write's failure surfaces here."""
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def drain(self, timeout_s: float) -> None:
        """A rank leaving with an exception: let the write in flight finish (bounded), so the
        checkpoint it was writing is complete; its own failure is not raised over the first."""
        if self.thread is not None:
            self.thread.join(timeout_s)
            self.thread = None


__all__ = ["CHECKPOINTS_DIR", "CheckpointWriteError", "Saver", "layout_of"]
