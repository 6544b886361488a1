"""ZeRO stages 1, 2 and 3 over the dp group (Rajbhandari et al., 2020), written over flat buffers.

Sharded over dp: each *unit*'s parameters (per transformer block, and the embedding with
the head) are flattened into one buffer padded to a multiple of dp; dp rank r owns its
r-th contiguous slice. Stage 1 keeps the optimizer states of that slice only; stage 2 also
only its gradient; stage 3 also only its parameters between uses. Tensor-parallel shards
and replicated parameters go to separate buffers, so the global norm can count each once.
Expert-parallel experts (framework/comm/expert_parallel.py) go to a buffer of their own
sharded over the expert data parallel group (edp: the replicas of those experts), not dp.

Collectives over the dp group, per stage:
- 1: after the step's last backward, a reduce-scatter of each unit's full gradient buffer
  (the owner gets the dp mean of its slice); the sharded optimizer step; an all-gather of
  the updated slices into the parameters.
- 2: the reduce-scatter runs per unit as soon as that unit's gradients of a micro-batch are
  complete (post-accumulate-grad hooks fire once per parameter per backward), adding into
  the owned slice, and the unit's full gradients are freed there; all-gather after the step.
  The full gradients are views of one flat buffer per unit, given its storage as the unit's
  backward starts (a hook on its output's gradient), so the reduce-scatter reads what
  autograd wrote: no flatten copy (zero_unit.py, `open_grads`).
- 3: also an all-gather of a unit's parameters before its forward and again before its
  backward (a hook on the unit's output gradient), freed after each. The embedding + head
  unit stays gathered from the embedding's forward until its backward is done (the tied
  head is used last in forward and first in backward).

Overlaps (each off by default; the values are the same either way, only when a collective
is waited for moves; the unit's collectives themselves are zero_unit.py's, and what each
overlap hid reads as `comm_hidden_dp`, framework/comm/comm_timer.py):
- `parallelism.overlap_grad_reduce`: each unit's reduce-scatter is issued without waiting
  as soon as its gradients are complete (stage 1: in the step's last micro-batch, from the
  same post-accumulate-grad hooks), and all are waited for when the micro-batch's backward
  ends, so they run under the backward of the units before them (Megatron's bucketed
  overlap, a unit per bucket). Every copy in flight is held at once (the transient peak).
- `parallelism.overlap_param_gather` (stage 3): the order the hooked modules run in is
  learned in the first forward; from then on each module's pre-forward hook issues the next
  module's all-gather, and each backward hook the previous module's (FSDP's forward and
  backward prefetch), so two units are gathered at once.

Why not PyTorch's own: `ZeroRedundancyOptimizer` partitions whole parameters greedily, so
per-rank optimizer bytes only approximate 1/N and it shards neither gradients nor
parameters; FSDP2's `fully_shard` steps the optimizer on sharded parameters, so between
steps it holds stage 3's layout, never stage 2's "full parameters, sharded gradients"
(`set_reshard_after_backward(False)` only defers the reshard within accumulation). Flat
per-unit buffers give the paper's partition exactly, for all three stages, and fit the
pipeline runner's own gradient flow (ZeRO-1 with pp).

Mixed precision (framework/precision.py): the flat buffers (parameters, gradients) are in
the 16-bit parameter dtype; the reduce-scatter runs in the policy's reduce dtype (fp32 by
default: a transient wide copy of the unit's gradient) and the reduced slice is held in 16
bits; the optimizer's fp32 master copy and states exist for this rank's slice only
(framework/optim/master.py), and stage 3 gathers 16-bit parameters.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from framework.optim.master import build as build_master
from framework.metrics.memory import held_states, tensor_bytes
from framework.comm.expert_parallel import is_expert
from framework.comm.tensor_parallel import is_tp_sharded
from framework.parallel.zero_unit import FlatUnit, open_grads_on_backward


class Zero:
    """The ZeRO state of one rank: its units, the shards the optimizer steps, the hooks."""

    def __init__(self, stage: int, units: list[list[nn.Module]], ctx, tracker=None,
                 separate: Optional[nn.Parameter] = None, fill: Optional[Callable] = None,
                 reduce_dtype: Optional[torch.dtype] = None, overlap_reduce: bool = False, prefetch: bool = False,
                 bucket_mb: Optional[float] = None):
        """`units`: groups of modules whose parameters share a buffer (and, at stage 3, are
        gathered together). `separate`: a parameter kept in a buffer of its own (a tied
        embedding's second copy on the last pipeline stage, left out of the grad norm).
        `fill(params)`: materialises meta parameters (framework/models/materialise.py), called
        unit by unit, so a stage-3 rank never holds more than one whole unit at start-up.
        `reduce_dtype`: the gradient reduce-scatter's dtype (the precision policy's); None:
        the parameters'. The reduced slice is held in the parameters' dtype either way.
        `overlap_reduce` (`parallelism.overlap_grad_reduce`): each unit's reduce-scatter is
        issued as its gradients complete and waited for at the end of the micro-batch's
        backward (stage 1: in the step's last micro-batch; stages 2-3: in every one).
        `prefetch` (`parallelism.overlap_param_gather`, stage 3): the next unit's all-gather
        issued as a unit starts, in forward and in backward (module docstring). `bucket_mb`
        (`parallelism.bucket_mb`, MiB): each reduce-scatter in pieces through one buffer of
        that size (CB, zero_unit.py)."""
        self.stage, self.overlap_reduce, self.prefetch = stage, overlap_reduce, prefetch and stage == 3
        self.reducing: list[tuple[FlatUnit, tuple]] = []  # reduce-scatters in flight
        self.order: list[int] = []  # stage 3: hooked modules' positions in forward order (learned once)
        self.order_known, self.last_microbatch = False, False
        self._place: dict[int, int] = {}  # module position -> its index in `order`
        size, rank, group = ctx.dims.dp, ctx.coords.dp, ctx.dp_group
        self.flat: list[FlatUnit] = []
        seen: set[int] = set()
        self.separate = None
        if separate is not None:
            self.separate = FlatUnit([separate], group, size, rank, stage, tracker, reduce_dtype)
            self.flat.append(self.separate)
            seen.add(id(separate))
        self.transient_peak_bytes = 0
        self.unit_flats: list[list[FlatUnit]] = []  # each unit's flats, in `units`' order
        self._modules: list[list[FlatUnit]] = []  # stage 3: each hooked module's flats, by position
        self._position: dict[nn.Module, int] = {}
        for modules in units:
            params = []
            for p in (p for m in modules for p in m.parameters()):
                if id(p) not in seen and p.requires_grad:  # a tied weight: one place in one buffer
                    seen.add(id(p))
                    params.append(p)
            if fill is not None:
                fill(params)
            experts = [p for p in params if is_expert(p)]
            params = [p for p in params if not is_expert(p)]
            partial = [p for p in params if getattr(p, "tp_partial", False)]  # summed over tp: a buffer of their own
            params = [p for p in params if not getattr(p, "tp_partial", False)]
            groups = [[p for p in params if is_tp_sharded(p)], [p for p in params if not is_tp_sharded(p)], partial]
            flats = [FlatUnit(g, group, size, rank, stage, tracker, reduce_dtype) for g in groups if g]
            if experts:  # sharded over their replicas (edp), not dp
                flats.append(FlatUnit(experts, ctx.edp_group, ctx.dims.edp, ctx.dims.edp_rank(ctx.coords), stage,
                                      tracker, reduce_dtype))
            self.flat.extend(flats)
            self.unit_flats.append(flats)
            if stage >= 2 or overlap_reduce:
                for f in flats:
                    self._hook_grads(f)
            if stage == 3:
                self._hook_params(modules, flats)
            elif stage == 2:
                open_grads_on_backward(modules, flats)
        for f in self.flat:  # the separate unit is in self.flat too
            f.timer = getattr(ctx, "timer", None)
            if bucket_mb is not None:
                f.bucket = max(1, int(bucket_mb * 2 ** 20) // (reduce_dtype or f.full.dtype).itemsize)
        self.shards = [f.shard for f in self.flat]
        self._live = 0  # bytes of parameters gathered right now (stage 3)
        if tracker is not None and stage < 3:  # the flattened weights are new storages
            tracker.exclude([f.full for f in self.flat])

    # --- hooks (stages 2, 3) ---
    def _hook_grads(self, f: FlatUnit) -> None:
        def on_grad(p):
            if self.stage == 1 and not self.last_microbatch:  # stage 1 reduces in the last one only
                return
            if self.stage >= 2:
                f.adopt(p)
            f.pending -= 1
            if f.pending == 0:
                self._unit_backward_done(f)

        for p in f.params:
            p.register_post_accumulate_grad_hook(on_grad)

    def _unit_backward_done(self, f: FlatUnit) -> None:
        if self.overlap_reduce:
            self.reducing.append((f, f.start_reduce(accumulate=True, async_op=True)))
            self._note_peak(sum(pending[4] for _, pending in self.reducing))  # every copy in flight
        else:
            self._note_peak(f.reduce_scatter_grads(accumulate=True))
        if self.stage == 3:
            self._free(f)

    def start_unit_reduce(self, k: int) -> None:
        """Stage 1 in a pipeline (`parallelism.overlap_grad_reduce`): unit k's gradients are
        final (its chunk's last backward ran), so its reduce-scatters are issued now;
        `reduce_gradients` waits for them and reduces the rest (the separate unit)."""
        for f in self.unit_flats[k]:
            self.reducing.append((f, f.start_reduce(accumulate=False, async_op=True)))
        self._note_peak(sum(pending[4] for _, pending in self.reducing))

    def _finish_reduces(self) -> None:
        for f, pending in self.reducing:
            f.finish_reduce(pending)
        self.reducing = []

    def _hook_params(self, modules: list[nn.Module], flats: list[FlatUnit]) -> None:
        io_unit = len(modules) > 1  # embedding + head: gathered from first use to backward's end

        def before_forward(m, _args):  # (activation checkpointing, a forward in backward: rejected at zero 3)
            for f in flats:  # offload_params: an evaluation's gathers do not train the read-ahead
                f.training = m.training
            if not self.order_known:
                self.order.append(self._position[m])
            for f in flats:
                self._gather(f)
            if self.order_known:
                self._prefetch_after(m, +1)

        def before_backward(m):
            for f in flats:
                f.training = True
                self._gather(f)
                f.open_grads()
            if self.order_known:
                self._prefetch_after(m, -1)

        def after_forward(m, _args, out):
            tensor = out if isinstance(out, torch.Tensor) else out[0]
            if tensor.requires_grad:
                tensor.register_hook(lambda g: before_backward(m))
            if not io_unit:
                for f in flats:
                    self._free(f)

        for m in modules:
            m.register_forward_pre_hook(before_forward)
            m.register_forward_hook(after_forward)
            self._position[m] = len(self._modules)
            self._modules.append(flats)

    def _prefetch_after(self, m: nn.Module, direction: int) -> None:
        """The next module's flats in forward (+1) or backward (-1) order: their all-gather
        issued now, waited for by their own hook."""
        if not self.prefetch:
            return
        k = self._place[self._position[m]] + direction
        if 0 <= k < len(self.order):
            for f in self._modules[self.order[k]]:
                if not f.gathered and f.gathering is None:
                    f.training = m.training
                    f.start_gather()
                    self._live += f.full.numel() * f.full.element_size()
                    self._note_peak(0)

    def _gather(self, f: FlatUnit) -> None:
        if not f.gathered:
            if f.gathering is None:  # prefetched ones were counted at their start
                self._live += f.full.numel() * f.full.element_size()
            f.gather_params()
            self._note_peak(0)

    def _free(self, f: FlatUnit) -> None:
        if f.gathered or f.gathering is not None:
            f.free_params()
            self._live -= f.full.numel() * f.full.element_size()

    def _note_peak(self, extra: int) -> None:
        """Transient peak: gathered parameters plus the flat gradient copy being reduced.
        (Autograd's own per-parameter gradients before their unit is reduced are not counted.)"""
        self.transient_peak_bytes = max(self.transient_peak_bytes, self._live + extra)

    # --- the step ---
    def start_microbatch(self, last: bool = True) -> None:
        """`last`: the step's last micro-batch (stage 1 with overlap_reduce reduces in it)."""
        self.last_microbatch = last
        for f in self.flat:
            f.pending = len(f.params)

    def start_step(self) -> None:
        if self.stage == 1:
            for f in self.flat:
                f.give_grad_views()
        for f in self.flat:
            f.shard.grad = None

    def finish_backward(self) -> None:
        """After each micro-batch's backward: units whose hooks did not all fire (a parameter
        unused) are reduced now; one opened that no gradient reached (no token) is freed."""
        if self.stage >= 2:
            for f in self.flat:
                if 0 < f.pending < len(f.params):
                    f.pending = 0
                    self._unit_backward_done(f)
                elif f.grads_open and f.pending == len(f.params):  # opened; no gradient came
                    f.drop_grads()
            self._finish_reduces()
        if not self.order_known and self.order:  # the first forward has run: each module's place in it
            self.order_known, self._place = True, {pos: k for k, pos in enumerate(self.order)}

    def reduce_gradients(self) -> None:
        """After the step's last backward (stage 1: the one reduce-scatter per unit)."""
        if self.stage == 1:
            started = {id(f) for f, _ in self.reducing}
            self._finish_reduces()  # overlap_reduce: those whose gradients completed in backward
            for f in self.flat:
                if id(f) not in started:
                    self._note_peak(f.reduce_scatter_grads(accumulate=False))

    def after_step(self) -> None:
        if self.stage < 3:
            for f in self.flat:
                f.all_gather_updated()

    def gather_all(self) -> None:
        """Stage 3: full parameters everywhere (for the checkpoint at the end)."""
        for f in self.flat:
            self._gather(f)

    def free_gathered(self) -> None:
        """Stage 3: free every gathered unit, the state between steps. A forward with no
        backward (evaluation) leaves the embedding + head unit gathered, since its backward
        is what frees it."""
        if self.stage == 3:
            for f in self.flat:
                self._free(f)

    def build_optimizer(self, spec: dict, offload, policy):
        """Over this rank's slices: plain, or with master copies of the slices (fp32 in the
        mixed modes; in host memory with ZeRO-Offload, `offload` an OffloadTarget, its states
        on NVMe with its nvme tier), framework/optim/master.py."""
        opt = build_master(spec, self.shards, policy, offload)
        for f in self.flat:  # stage 3 with offload_params: the slices live on the drive
            f.swap = getattr(opt, "param_swap", None)
        return opt

    def state_bytes(self, optimizer) -> dict[str, int]:
        """Model states this rank holds between steps (storage-deduplicated exact bytes); the
        master copies are counted by the runner (framework/optim/master.py)."""
        params = [f.full for f in self.flat if f.gathered] + [f.shard for f in self.flat]
        grads = [f.grad_full for f in self.flat] if self.stage == 1 else [f.shard.grad for f in self.flat]
        opt = held_states(optimizer)
        return {"params_bytes": tensor_bytes(params), "grads_bytes": tensor_bytes(grads),
                "optimizer_bytes": tensor_bytes(opt), "zero_transient_peak_bytes": self.transient_peak_bytes}

