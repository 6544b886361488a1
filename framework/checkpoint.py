"""Distributed checkpoints in one layout-free form: resume bit-exactly, or under another layout.

Written with `torch.distributed.checkpoint` (DCP) to `<job>/checkpoints/step_<k>/` after k
optimizer steps. Every tensor is stored under its single-process name and shape, whatever
the layout that saved it:
- `model/<transformers name>`: the parameter; tp shards are gathered over tp (vocab padding
  dropped), ZeRO slices over dp, pipeline stages each write their own names.
- `optim/<transformers name>/<state>`: the optimizer state of that parameter (AdamW's
  `exp_avg`, `exp_avg_sq`, `step`), put together the same way. ZeRO keeps one state per flat
  slice: its elements go back to the parameters they belong to.
- `rng/rank<r>` (and `rng_cuda/rank<r>`): each rank's generator state, restored only when
  the resuming layout is the same (dropout draws are per rank; with dropout 0 nothing reads them).
Beside DCP's files: `meta.json` (step, layout, model sizes, precision, optimizer, data, global
batch), `metrics.jsonl` (the run's rows up to step k, so a resumed run's file is whole) and,
written last and atomically, `COMPLETE`: a checkpoint without it is ignored and replaced.

Loading reads, on each rank, the full tensors of the parameters it holds and keeps its part
(its tp rows / columns, its ZeRO slice), so any layout reads any checkpoint. The data position
is the step alone (framework.data.ShardedSampler is a function of seed, step and global
batch) and the lr schedule a function of the step (framework.optim.lr_at), so neither is stored.

Collectives, per save: for each parameter and state, an all-gather over tp (tp shards) and
over dp (ZeRO slices); DCP's planning on the logging group (gloo, CPU); barriers there
around the write. Per load: DCP's planning only. The gathered tensors of one stage sit on
its dp-0 / tp-0 rank during a save: one stage's full weights and states, on the host.

Over ~300 lines: issue 20 (checkpoints and data past one node) rewrites this module and
splits it into a package by concern; split then, not twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .config import ConfigError, RunConfig
from .files import write_atomic
from .parallel.tensor_parallel import full_tensor, shard_tensor
from .parallel.tp_comm import all_gather_single
from .parallel.zero import FlatUnit, HostOptimizer

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
META = "meta.json"
METRICS = "metrics.jsonl"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---- what the optimizer steps, and which named parameters each of its tensors covers ----

@dataclass
class Piece:
    name: str  # the single-process (transformers) name
    param: torch.Tensor  # this rank's parameter: the whole tensor, or a tp shard (`tp_shard`)
    offset: int = 0  # where it starts in its ZeRO unit's flat buffer


@dataclass
class Slot:
    """One tensor the optimizer steps: a parameter, or a ZeRO unit's flat slice."""

    key: torch.Tensor  # the optimizer's key (ZeRO-Offload: the host copy)
    pieces: list[Piece]
    unit: Optional[FlatUnit] = None


def _slots(runner, hf_model) -> tuple[torch.optim.Optimizer, list[Slot]]:
    names = {id(p): n for n, p in hf_model.named_parameters()}  # a tied weight: its first name
    opt = runner.optimizer
    host = {}
    if isinstance(opt, HostOptimizer):
        host = {id(s): h for s, h in zip(opt.shards, opt.host, strict=True)}
        opt = opt.inner
    zero = getattr(runner, "zero", None)
    if zero is None:
        return opt, [Slot(p, [Piece(names[id(p)], p)]) for p in runner.params]
    slots = []
    for f in zero.flat:
        offsets = [0]
        for p in f.params:
            offsets.append(offsets[-1] + p.numel())
        pieces = [Piece(names[id(p)], p, o) for p, o in zip(f.params, offsets, strict=False)]
        slots.append(Slot(host.get(id(f.shard), f.shard), pieces, f))
    return opt, slots


def _layout(run: RunConfig) -> dict:
    p, s = run.parallelism, run.schedule
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "schedule": s.name, "microbatches": s.microbatches,
            "virtual_stages": s.virtual_stages, "sequence_parallel": p.sequence_parallel and p.tp > 1}


# ---- save ----

def _per_piece(slot: Slot, local: torch.Tensor, ctx) -> list[torch.Tensor]:
    """A slot's tensor (a parameter, a ZeRO slice, or a state of either) as one tensor per
    piece, in the piece's local (tp-shard) shape. ZeRO slices are all-gathered over dp."""
    if slot.unit is None:
        return [local.detach()]
    u = slot.unit
    flat = torch.empty(u.slice * u.size, dtype=local.dtype, device=local.device)
    all_gather_single(flat, local.detach().reshape(-1).contiguous(), group=ctx.dp_group)
    return [flat[pc.offset:pc.offset + pc.param.numel()].view_as(pc.param) for pc in slot.pieces]


def _whole(t: torch.Tensor, piece: Piece, tp_comm) -> torch.Tensor:
    spec = getattr(piece.param, "tp_shard", None)
    return (full_tensor(t, spec, tp_comm) if spec is not None else t).cpu().clone()


def layout_free_state(runner, full, ctx) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint under single-process names and shapes. Every rank
    takes part in the gathers; the dp-0 / tp-0 rank of each stage keeps the result."""
    opt, slots = _slots(runner, full.hf_model)
    keep = ctx.coords.dp == 0 and ctx.coords.tp == 0
    out: dict[str, torch.Tensor] = {}

    def put(key, t):
        if keep:
            out[key] = t

    for slot in slots:
        source = slot.unit.shard if slot.unit is not None else slot.pieces[0].param
        for pc, t in zip(slot.pieces, _per_piece(slot, source, ctx), strict=True):
            put(f"model/{pc.name}", _whole(t, pc, runner.tp_comm))
        state = opt.state.get(slot.key, {})
        for k in sorted(state):  # the same order on every rank of the gathers
            v = state[k]
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0:  # a step count: the same for every piece of the slot
                for pc in slot.pieces:
                    put(f"optim/{pc.name}/{k}", v.detach().cpu().clone())
                continue
            for pc, t in zip(slot.pieces, _per_piece(slot, v, ctx), strict=True):
                put(f"optim/{pc.name}/{k}", _whole(t, pc, runner.tp_comm))
    out[f"rng/rank{ctx.rank}"] = torch.get_rng_state()
    if ctx.device.type == "cuda":
        out[f"rng_cuda/rank{ctx.rank}"] = torch.cuda.get_rng_state(ctx.device)
    return out


def step_dir(job_dir: str, step: int) -> str:
    return os.path.join(job_dir, CHECKPOINTS_DIR, f"step_{step}")


def save(runner, full, ctx, run: RunConfig, job_dir: str, step: int, vocab_size: int,
         metrics_path: Optional[str]) -> str:
    """Checkpoint after `step` optimizer steps. Collective over the world. Returns its path."""
    path = step_dir(job_dir, step)
    if ctx.rank == 0 and os.path.exists(path):
        shutil.rmtree(path)  # an incomplete one (a save cut off), or an earlier lineage's
    dist.barrier(group=ctx.log_group)
    ctx.recorder.note(f"checkpoint step {step}: gather over tp / dp", wait=True)
    state = layout_free_state(runner, full, ctx)
    ctx.recorder.note(f"checkpoint step {step}: DCP save", wait=True)
    dcp.save(state, checkpoint_id=path, process_group=ctx.log_group)
    if ctx.rank == 0:
        meta = {"step": step, "time": time.time(), "layout": _layout(run), "world_size": run.world_size,
                "model": {**asdict(run.model), "vocab_size": vocab_size}, "precision": run.trainer.precision,
                "optimizer": run.optimizer, "seed": run.trainer.seed, "global_batch": run.global_batch,
                "data": {k: getattr(run.data, k) for k in ("name", "seq_len", "tokenizer")},
                "steps": run.trainer.steps}
        write_atomic(os.path.join(path, META), json.dumps(meta, indent=2))
        if metrics_path and os.path.exists(metrics_path):
            shutil.copyfile(metrics_path, os.path.join(path, METRICS))
        write_atomic(os.path.join(path, MARKER), f"step {step}\n")
        prune(job_dir, run.trainer.keep_checkpoints)
    # No rank leaves before the marker exists: a failure right after this step must not
    # take down the checkpoint that is meant to survive it.
    dist.barrier(group=ctx.log_group)
    return path


# ---- finding checkpoints ----

def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def checkpoints(job_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint directory in the job, complete or not, by step."""
    root = os.path.join(job_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP_DIR.match(n))]
    return sorted(found)


def latest(job_dir: str) -> Optional[str]:
    done = [p for _, p in checkpoints(job_dir) if is_complete(p)]
    return done[-1] if done else None


def prune(job_dir: str, keep: Optional[int]) -> None:
    """Keep the newest `keep` complete checkpoints; incomplete ones older than the newest
    complete one are leftovers of cut-off saves."""
    found = checkpoints(job_dir)
    complete = [(s, p) for s, p in found if is_complete(p)]
    if not complete:
        return
    newest = complete[-1][0]
    stale = [p for s, p in found if not is_complete(p) and s < newest]
    if keep is not None:
        stale += [p for _, p in complete[:-keep]]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


# ---- resume: resolved and checked in the launching process, before any rank starts ----

_SIZE_KEYS = ("arch", "n_layer", "n_embd", "n_head", "n_kv_head", "n_inner", "max_positions", "vocab_size",
              "tie_embeddings")


def resolve_resume(run: RunConfig, job_dir: str) -> Optional[str]:
    """trainer.resume -> the checkpoint to load, or None to start at step 0. `auto` takes
    the newest complete checkpoint in this job directory and starts afresh without one (so
    a pre-emptible job can always be launched with it)."""
    r = run.trainer.resume
    if r is None:
        return None
    if r == "auto":
        return latest(job_dir)
    path = os.path.abspath(os.path.expanduser(r))
    if os.path.isdir(path) and not _STEP_DIR.match(os.path.basename(path)) and latest(path):
        path = latest(path)  # a job directory: its newest complete checkpoint
    if not os.path.isdir(path):
        raise ConfigError("trainer.resume", r, "no such checkpoint directory",
                          "give checkpoints/step_<k> of a job (or the job directory), or auto")
    if not is_complete(path):
        raise ConfigError("trainer.resume", r, f"incomplete checkpoint (no {MARKER} marker: its save was cut off)",
                          "resume from an earlier complete checkpoint of the same job")
    return path


def check_compatible(run: RunConfig, path: str, vocab_size: int) -> dict:
    """The checkpoint's meta against this run: the model must be the same, the step inside
    the run. A different global batch or seed is allowed but warned about (the data stream
    then differs from the saving run's). Returns the meta."""
    meta = read_meta(path)
    saved = meta["model"]
    here = {**asdict(run.model), "vocab_size": vocab_size}
    for k in _SIZE_KEYS:
        if saved.get(k) != here.get(k):
            raise ConfigError(f"model.{k}", here.get(k), f"the checkpoint {path} was saved with model.{k}="
                              f"{saved.get(k)!r}", f"resume with model.{k}={saved.get(k)!r} (the model must match)")
    if meta["step"] >= run.trainer.steps:
        raise ConfigError("trainer.steps", run.trainer.steps, f"the checkpoint {path} is already at step "
                          f"{meta['step']}: nothing left to run", f"raise trainer.steps above {meta['step']}")
    target = run.optimizer.get("_target_")
    if meta["optimizer"].get("_target_") != target:
        raise ConfigError("optimizer._target_", target, f"the checkpoint holds {meta['optimizer'].get('_target_')} "
                          "states", "resume with the same optimizer")
    from .models import param_dtype

    if param_dtype(meta["precision"]) != param_dtype(run.trainer.precision):
        raise ConfigError("trainer.precision", run.trainer.precision, f"the checkpoint's parameters are "
                          f"{meta['precision']}", f"resume with trainer.precision={meta['precision']}")
    data = {k: getattr(run.data, k) for k in ("name", "seq_len", "tokenizer")}
    for key, now in (("global_batch", run.global_batch), ("seed", run.trainer.seed), ("data", data)):
        if meta[key] != now:
            print(f"WARNING: resuming {path}: {key} {meta[key]} -> {now}; the data stream is this run's from "
                  f"step {meta['step'] + 1} on, not the saving run's", flush=True)
    return meta


# ---- load (in every rank) ----

def _local(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    spec = getattr(piece.param, "tp_shard", None)
    t = shard_tensor(full, spec) if spec is not None else full
    return t.to(dtype=piece.param.dtype, device=piece.param.device)


def _slot_tensor(slot: Slot, parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-piece local tensors -> what the slot holds: the parameter itself, or this dp
    rank's slice of the unit's flat buffer (the tail padding is zero, as in training)."""
    if slot.unit is None:
        return parts[0]
    u = slot.unit
    flat = torch.zeros(u.slice * u.size, dtype=parts[0].dtype, device=parts[0].device)
    for pc, t in zip(slot.pieces, parts, strict=True):
        flat[pc.offset:pc.offset + t.numel()] = t.reshape(-1)
    return flat


def load(path: str, runner, full, ctx, run: RunConfig) -> int:
    """Fill this rank's parameters and optimizer states from the checkpoint at `path`, in
    whatever layout it was saved. Collective over the world (DCP's planning). Returns its step."""
    meta = read_meta(path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    opt, slots = _slots(runner, full.hf_model)

    def empty(key):
        m = md[key]
        return torch.empty(m.size, dtype=m.properties.dtype)

    want: dict[str, torch.Tensor] = {}
    states: dict[str, list[str]] = {}  # piece name -> its optimizer state keys
    for slot in slots:
        for pc in slot.pieces:
            want[f"model/{pc.name}"] = empty(f"model/{pc.name}")
            prefix = f"optim/{pc.name}/"
            states[pc.name] = sorted(k[len(prefix):] for k in md if k.startswith(prefix))
            for k in states[pc.name]:
                want[prefix + k] = empty(prefix + k)
    same_layout = meta["layout"] == _layout(run)
    rng_keys = [f"rng/rank{ctx.rank}"] + ([f"rng_cuda/rank{ctx.rank}"] if ctx.device.type == "cuda" else [])
    if same_layout:
        for k in rng_keys:
            if k in md:
                want[k] = empty(k)
    ctx.recorder.note(f"checkpoint: DCP load of step {meta['step']}", wait=True)
    dcp.load(want, checkpoint_id=path, process_group=ctx.log_group)

    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    sd["state"] = {}
    with torch.no_grad():
        for slot in slots:
            value = _slot_tensor(slot, [_local(want[f"model/{pc.name}"], pc) for pc in slot.pieces])
            _set_params(slot, value)
            entry = {}
            for k in states[slot.pieces[0].name]:
                keys = [f"optim/{pc.name}/{k}" for pc in slot.pieces]
                if want[keys[0]].dim() == 0:
                    entry[k] = want[keys[0]]
                else:
                    entry[k] = _own(slot, _slot_tensor(slot, [_local(want[q], pc) for q, pc in zip(keys, slot.pieces,
                                                                                                 strict=True)]))
            if entry:
                sd["state"][index[id(slot.key)]] = entry
    opt.load_state_dict(sd)  # casts the states to each parameter's dtype and device, as torch does
    if isinstance(runner.optimizer, HostOptimizer):
        for s, h in zip(runner.optimizer.shards, runner.optimizer.host, strict=True):
            h.data.copy_(s.data)
    if same_layout:
        torch.set_rng_state(want[rng_keys[0]])
        if ctx.device.type == "cuda" and rng_keys[1] in want:
            torch.cuda.set_rng_state(want[rng_keys[1]], ctx.device)
    return int(meta["step"])


def _own(slot: Slot, flat: torch.Tensor) -> torch.Tensor:
    if slot.unit is None:
        return flat
    u = slot.unit
    return flat[u.rank * u.slice:(u.rank + 1) * u.slice].clone()


def _set_params(slot: Slot, value: torch.Tensor) -> None:
    if slot.unit is None:
        slot.pieces[0].param.data.copy_(value)
        return
    u = slot.unit
    u.shard.data.copy_(value[u.rank * u.slice:(u.rank + 1) * u.slice])
    if u.gathered:  # stages 1-2 (and a gathered stage-3 unit): the full buffer the modules read
        u.full.copy_(value)


def history(path: str, step: int) -> list[str]:
    """The saving run's metrics.jsonl rows of steps 1..`step` (steps are 1-based: checkpoint
    step_<k> is saved after step k); a resumed run's file starts with them."""
    f = os.path.join(path, METRICS)
    if not os.path.exists(f):
        return []
    with open(f) as fh:
        return [line for line in fh if line.strip() and json.loads(line)["step"] <= step]
