"""What this rank holds, as boxes of the single-process tensors: the geometry of a sharded checkpoint.

Every tensor the optimizer steps (a `Slot`: a parameter, or a ZeRO unit's flat slice) is
cut into boxes (offsets and sizes in the transformers tensor of each parameter it covers):
- a ZeRO slice holds a contiguous flat range of each parameter it touches; a flat range of a
  row-major tensor is at most a partial row, whole rows, a partial row (recursively per
  dimension), each box contiguous in the slice (`flat_boxes`);
- an FSDP2 shard (framework/parallel/fsdp2.py) is a DTensor whose local tensor is a dim-0
  chunk of its parameter: the flat range [first, first + numel) of it, cut as a ZeRO slice's;
- a tp shard holds some positions along one dimension (`TPShard.index`: runs, e.g. GPT-2's
  fused q | k | v columns are three runs; positions >= the vocabulary are padding, never
  stored); each run is one box along that dimension (`_tp_runs`).
A `Part` is one name's boxes on this rank, each a VIEW of the slot's memory (or of a staged
copy), and speaks DCP's protocol for it (write items with global offsets; the chunk list a
load overlaps with what was stored), so DCP writes and reads only those boxes.

Who writes a box (`rank_parts(writers_only=True)`): exactly one rank per element, so no DCP
dedup or overlap is relied on: dp replicas (no ZeRO, ours or FSDP2's) only from dp rank 0, tp-replicated
parameters only from tp rank 0, the tied embedding only from the stage that embeds (pp rank
0; the head's copy on the last stage is identical). A 0-d state (AdamW's `step`) is one
whole tensor, written by every rank holding part of its parameter and deduplicated by DCP;
so is the update's state (`update/skipped_steps`, and fp16-mixed's `scaler/*`), the same on
every rank.

The weights stored are the optimizer's own copy where it has one (framework/optim/master.py):
fp32 master weights in bf16-mixed / fp16-mixed, so a checkpoint holds fp32 weights and
states in every mode but fp64, and those modes resume each other's checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from framework.optim.master import MasterOptimizer, master_of
from framework.comm.expert_parallel import is_expert, shard_spec
from framework.parallel.fsdp2 import chunk_start, local
from framework.parallel.zero_unit import FlatUnit


@dataclass
class Piece:
    name: str  # the single-process (transformers) name
    param: torch.Tensor  # this rank's parameter: the whole tensor, or a tp shard (`tp_shard`)
    offset: int = 0  # where it starts in its ZeRO unit's flat buffer


@dataclass
class Slot:
    """One tensor the optimizer steps: a parameter, or a ZeRO unit's flat slice."""

    key: torch.Tensor  # the optimizer's key: the parameter or slice, or its master copy (framework/optim/master.py)
    pieces: list[Piece]
    unit: Optional[FlatUnit] = None
    first: Optional[int] = None  # FSDP2: where this rank's dim-0 chunk starts in the parameter (elements)

    def tensor(self) -> torch.Tensor:
        """The memory the slot's values live in: the parameter (FSDP2: its local chunk), or
        this dp rank's slice."""
        return self.unit.shard if self.unit is not None else local(self.pieces[0].param)


def slots(runner, hf_model) -> tuple[torch.optim.Optimizer, list[Slot]]:
    names = {id(p): n for n, p in hf_model.named_parameters()}  # a tied weight: its first name
    opt = runner.optimizer
    host = master_of(opt)  # the optimizer's own copies (fp32 masters; ZeRO-Offload's host copies)
    if isinstance(opt, MasterOptimizer):
        opt = opt.inner
    zero = getattr(runner, "zero", None)
    if zero is None:
        return opt, [Slot(host.get(id(p), p), [Piece(names[id(p)], p)]) for p in runner.params]
    if not hasattr(zero, "flat"):  # FSDP2: one slot per DTensor parameter
        return opt, [Slot(p, [Piece(names[id(p)], p)], first=chunk_start(p)) for p in zero.shards]
    out = []
    for f in zero.flat:
        offsets = [0]
        for p in f.params:
            offsets.append(offsets[-1] + p.numel())
        pieces = [Piece(names[id(p)], p, o) for p, o in zip(f.params, offsets, strict=False)]
        out.append(Slot(host.get(id(f.shard), f.shard), pieces, f))
    return opt, out


def global_shape(piece: Piece) -> torch.Size:
    spec = shard_spec(piece.param)
    shape = list(piece.param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return torch.Size(shape)


# ---- boxes ----

def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes covering the row-major elements [a, b) of `shape`, in order;
    each box is contiguous in memory (leading sizes 1, one partial dimension, then whole ones)."""
    if a >= b:
        return []
    if len(shape) == 0:
        return [((), ())]
    inner = math.prod(shape[1:])
    out = []
    row = a // inner
    if a % inner:  # a partial first row
        end = min(b, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a - row * inner, end - row * inner)]
        a, row = end, row + 1
    whole = b // inner
    if a < b and whole > row:
        out.append(((row, *[0] * (len(shape) - 1)), (whole - row, *shape[1:])))
        a = whole * inner
    if a < b:  # a partial last row
        out += [((whole, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, b - whole * inner)]
    return out


def _tp_runs(index: torch.Tensor, start: int, length: int, full_size: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the runs of consecutive positions in
    index[start:start+length], vocab padding (>= full_size) left out."""
    pos = index[start:start + length].tolist()
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(pos):
        if g >= full_size:
            continue
        if runs and runs[-1][1] + runs[-1][2] == g and runs[-1][0] + runs[-1][2] == start + i:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((start + i, g, 1))
    return runs


def piece_boxes(piece: Piece, flat: torch.Tensor, lo: int, hi: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The piece's elements [lo, hi) (row-major, in its local shape), whose values are
    `flat` (hi - lo elements), as (global offsets, view) boxes."""
    shape = tuple(piece.param.shape)
    spec = shard_spec(piece.param)
    out = []
    at = 0
    for offs, sizes in flat_boxes(shape, lo, hi):
        n = math.prod(sizes)
        view = flat[at:at + n].view(sizes)
        at += n
        if spec is None:
            out.append((offs, view))
            continue
        d = spec.dim
        for at_local, g, length in _tp_runs(spec.index, offs[d], sizes[d], spec.full_size):
            o = list(offs)
            o[d] = g
            out.append((tuple(o), view.narrow(d, at_local - offs[d], length)))
    return out


def slot_boxes(slot: Slot, values: torch.Tensor) -> list[tuple[Piece, list]]:
    """Each piece's boxes, as views of `values` (the slot's tensor, or a tensor shaped like it:
    a state, a staged copy)."""
    flat = local(values).view(-1)
    if slot.unit is None:
        p, first = slot.pieces[0], slot.first or 0
        return [(p, piece_boxes(p, flat, first, first + flat.numel()))]
    u = slot.unit
    start, end = u.rank * u.slice, (u.rank + 1) * u.slice
    out = []
    for p in slot.pieces:
        lo, hi = max(start, p.offset), min(end, p.offset + p.param.numel())
        if lo < hi:
            out.append((p, piece_boxes(p, flat[lo - start:hi - start], lo - p.offset, hi - p.offset)))
    return out


class Part:
    """One name's boxes on this rank, for DCP: written with their global offsets; on load,
    DCP reads into them only what overlaps them."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.boxes: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def size(self) -> torch.Size:
        return self.shape

    def staged(self) -> Part:
        """A copy in host memory, one compact tensor per box (so DCP serialises each as is,
        without the clone it makes of a view into a larger buffer)."""
        out = Part(self.shape, self.dtype)
        out.boxes = [(o, v.detach().to("cpu", copy=True)) for o, v in self.boxes]
        return out

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for _, v in self.boxes)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), v.shape),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=self.shape))
                for o, v in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in self.boxes]

    def box(self, offsets) -> torch.Tensor:
        for o, v in self.boxes:
            if torch.Size(o) == offsets:
                return v
        raise KeyError(f"no box at {tuple(offsets)}")


def _lookup(state_dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.box(index.offset) if isinstance(obj, Part) else obj


class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index)


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's own set-up walks the state dict and replaces every value it does not know
        # (a Part) with None; this one's values are already flat tensors and Parts.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


def rank_parts(runner, full, ctx, states: Optional[dict] = None,
               writers_only: bool = False) -> tuple[dict[str, Part], dict[str, torch.Tensor]]:
    """This rank's boxes of every parameter (`model/<name>`) and optimizer state
    (`optim/<name>/<state>`), as `Part`s, plus the 0-d states as whole tensors.
    `states`: slot index -> {state name: tensor shaped like the slot} (default: the optimizer's).
    `writers_only`: leave out boxes another rank writes."""
    opt, slot_list = slots(runner, full.hf_model)
    c = ctx.coords
    tied = getattr(runner, "tied", None)
    parts: dict[str, Part] = {}
    scalars: dict[str, torch.Tensor] = {}

    def skip(piece: Piece, slot: Slot) -> bool:
        if not writers_only:
            return False
        if slot.unit is None and slot.first is None and (ctx.dims.edp_rank(c) if is_expert(piece.param) else c.dp):
            return True  # a dp replica (an expert's: an edp replica)
        if getattr(piece.param, "tp_shard", None) is None and c.tp != 0:
            return True  # replicated over tp
        return tied is not None and piece.param is tied and c.pp != 0  # the head's copy of the embedding

    for i, slot in enumerate(slot_list):
        # The weights stored are the optimizer's copy: the fp32 master where there is one (the
        # 16-bit parameters are its rounding), so any precision mode can resume them.
        values = {"": slot.key.detach()}
        own = states[i] if states is not None else opt.state.get(slot.key, {})
        values.update({k: v for k, v in sorted(own.items()) if isinstance(v, torch.Tensor)})
        for k, t in values.items():
            if t.dim() == 0:  # a step count: the same for every piece of the slot
                for p in slot.pieces:
                    if not skip(p, slot):
                        scalars[f"optim/{p.name}/{k}"] = t
                continue
            for p, boxes in slot_boxes(slot, t):
                if skip(p, slot):
                    continue
                key = f"model/{p.name}" if k == "" else f"optim/{p.name}/{k}"
                part = parts.setdefault(key, Part(global_shape(p), t.dtype))
                part.boxes += boxes
    scalars.update({k: torch.tensor(v) for k, v in runner.update.state_dict().items()})  # powers of 2, counts: exact
    scalars.update(moe_biases(runner, full))
    return parts, scalars


def moe_biases(runner, full) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's expert biases of the MoE layers this rank holds (buffers the bias update
    steps, the same on every rank of a stage): whole tensors, loaded in place."""
    moe = getattr(full, "moe", None)
    if moe is None:
        return {}
    mine = {id(p) for p in runner.module.parameters()}
    return {f"moe/layer{i}/expert_bias": g.expert_bias for i, g in moe.gates.items()
            if hasattr(g, "expert_bias") and id(g.weight) in mine}
