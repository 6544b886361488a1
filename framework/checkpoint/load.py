"""Loading: each rank reads, straight into its own memory, only the stored boxes that overlap what it holds.

Whatever layout saved the checkpoint: this rank's boxes (`shards.rank_parts`, the same
geometry a save uses, without leaving out replicas) are views of its parameters (or ZeRO
slice) and of freshly allocated optimizer states shaped like them; DCP's load planner
intersects them with the stored boxes and copies only the overlaps. No full tensor is
built. Memory beyond the rank's own part: DCP reads one stored box at a time (torch.load of
that box, then the overlap copied), so the bound is the largest stored box: under a
sharded save, one rank's part of one parameter (a whole parameter when it was saved
unsharded, e.g. by a single process).

Collectives: DCP's planning on the logging group; ZeRO stages 1-2 then all-gather each
unit's slices over dp into the full parameters the modules read (as after a step). With a
master copy (framework/optim/master.py) the weights are read into it and the parameters are its
rounding, as after a step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed.checkpoint as dcp

from framework.config import RunConfig
from framework.metrics.memory import RssSampler, current_rss_bytes
from framework.optim.master import MasterOptimizer
from framework.checkpoint.save import layout_of
from framework.checkpoint.shards import LoadPlanner, rank_parts, slots
from framework.checkpoint.resume import read_meta

UPDATE_KEYS = ("update/", "scaler/", "moe/")  # framework/train/update.py's state; MoE expert biases


def load(path: str, runner, full, ctx, run: RunConfig) -> dict:
    """Fill this rank's parameters and optimizer states from the checkpoint at `path`, in
    whatever layout it was saved. Collective over the world (DCP's planning). Returns its
    step and what the load cost this rank: wall time, resident memory before and at its peak
    (sampled), and the bytes of boxes it read into."""
    t0, rss0, sampler = time.time(), current_rss_bytes(), RssSampler()
    meta = read_meta(path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    opt, slot_list = slots(runner, full.hf_model)
    # The optimizer states to read: the ones stored for this slot's first piece, allocated
    # here in this rank's shapes (nothing stored that this rank does not hold is read). A 0-d
    # state (a step count) is one tensor per slot, read under each of its pieces' names.
    states: list[dict[str, torch.Tensor]] = []
    for slot in slot_list:
        prefix = f"optim/{slot.pieces[0].name}/"
        names = sorted(k[len(prefix):] for k in md if k.startswith(prefix))
        t = slot.key  # where the optimizer keeps its states (ZeRO-Offload: the host copy)
        states.append({k: (torch.zeros((), dtype=md[prefix + k].properties.dtype) if len(md[prefix + k].size) == 0
                           else torch.zeros_like(t, memory_format=torch.contiguous_format)) for k in names})
    parts, scalars = rank_parts(runner, full, ctx, states=states)
    # The update's state as far as the checkpoint has it (another mode's has no scaler).
    scalars = {k: t for k, t in scalars.items() if k in md or not k.startswith(UPDATE_KEYS)}
    want: dict = {**parts, **scalars}
    same_layout = meta["layout"] == layout_of(run)
    rng_keys = [f"rng/rank{ctx.rank}"] + ([f"rng_cuda/rank{ctx.rank}"] if ctx.device.type == "cuda" else [])
    if same_layout:
        for k in rng_keys:
            if k in md:
                want[k] = torch.empty(md[k].size, dtype=md[k].properties.dtype)
    ctx.recorder.note(f"checkpoint: DCP load of step {meta['step']} (this rank's boxes)", wait=True)
    with torch.no_grad():
        dcp.load(want, checkpoint_id=path, planner=LoadPlanner(), process_group=ctx.log_group)

    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    sd["state"] = {index[id(slot.key)]: st for slot, st in zip(slot_list, states, strict=True) if st}
    opt.load_state_dict(sd)  # casts the states to each parameter's dtype and device, as torch does
    runner.update.load_state_dict({k: float(t) for k, t in scalars.items() if k.startswith(("update/", "scaler/"))})
    with torch.no_grad():
        if isinstance(runner.optimizer, MasterOptimizer):  # the weights were read into the masters
            runner.optimizer.copy_to_params()
        for slot in slot_list:
            u = slot.unit
            if u is not None and u.gathered:  # stages 1-2: every rank's slice into the full buffer
                u.all_gather_updated()
    if same_layout:
        torch.set_rng_state(want[rng_keys[0]])
        if ctx.device.type == "cuda" and rng_keys[1] in want:
            torch.cuda.set_rng_state(want[rng_keys[1]], ctx.device)
    return {"step": int(meta["step"]), "load_s": time.time() - t0, "rss_before_bytes": rss0,
            "peak_rss_bytes": sampler.stop(), "rank_bytes": sum(p.nbytes() for p in parts.values())}

