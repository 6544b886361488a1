"""One ZeRO unit (framework/parallel/zero.py): some parameters as views into one flat buffer,
this dp rank's slice of it, and the unit's two collectives over the dp group.

Sharded: the flat buffer (padded to a multiple of dp); dp rank r owns slice r. Collectives:
an all-gather of the slices into the buffer (stage 3 before each use, stages 1-2 after the
step) and a reduce-scatter of the flat gradient to the slices' owners (the dp mean). Each
can be issued without waiting (`start_gather`, `start_reduce`), the overlaps of
`parallelism.overlap_param_gather` and `parallelism.overlap_grad_reduce`: the buffers a
collective reads or writes are held, untouched, until its wait, and the span the step-time
breakdown counts as dp (framework/comm/comm_timer.py) is then the wait alone; its whole
time adds the part before that wait (`watch`: a watcher thread stamps the completion; gloo's
reduce-scatter Work has no future), so `comm_hidden_dp` reads the share the backward (or the
previous unit) hid.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.comm.comm_timer import timed, watch
from framework.optim.master import flat_views
from framework.comm.expert_parallel import is_expert
from framework.comm.tensor_parallel import is_tp_sharded
from framework.comm.tp_comm import all_gather_single as _all_gather_single
from framework.comm.tp_comm import reduce_scatter_single as _reduce_scatter_single


class FlatUnit:
    """Some parameters as views into one flat buffer; this dp rank's slice as `shard`."""

    timer = None  # the rank's CommTimer (set by Zero): its collectives are dp spans
    bucket: Optional[int] = None  # parallelism.bucket_mb in elements of the reduce dtype (set by Zero): CB
    swap = None  # stage 3 with parallelism.offload_params: the ParamSwap its slice lives in (set by Zero)
    training = True  # with swap: whether this gather is training's (Zero's hooks set it from the module)

    def __init__(self, params: list[nn.Parameter], group, size: int, rank: int, stage: int, tracker=None,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.params, self.group, self.size, self.rank, self.stage = params, group, size, rank, stage
        self.tracker, self.reduce_dtype = tracker, reduce_dtype
        p0 = params[0]
        numel = sum(p.numel() for p in params)
        self.slice = -(-numel // size)  # elements per rank; the last rank's slice ends in padding
        self.full = torch.zeros(self.slice * size, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in params:
            view = self.full[offset:offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view  # the module keeps its parameter objects; their memory is the buffer
            offset += p.numel()
        own = self.full[rank * self.slice:(rank + 1) * self.slice]
        # Stages 1-2 keep full parameters: the owned slice is a view (no second copy).
        self.shard = nn.Parameter(own.clone() if stage == 3 else own)
        self.shard.tp_sharded = all(is_tp_sharded(p) for p in params)
        self.shard.expert = all(is_expert(p) for p in params)
        self.shard.tp_partial = all(getattr(p, "tp_partial", False) for p in params)
        self.grad_full: Optional[torch.Tensor] = None
        self._grad_views: list[torch.Tensor] = []
        self.grads_open = False  # stages 2-3: the unit's gradient buffer holds storage now
        self.pending = 0  # parameters whose gradient of this micro-batch has not arrived yet
        self.gathered = stage < 3
        self.gathering = None  # a prefetched all-gather's Work, in flight
        if stage == 3:
            self.free_params()

    # --- parameters ---
    def start_gather(self) -> None:
        """Stage 3: the all-gather issued, not waited for (the prefetch of
        `parallelism.overlap_param_gather`); `gather_params` finishes it."""
        if self.gathered or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        if self.swap is not None:
            self.swap.fetch(self.shard, self.training)  # the slice off the drive (framework/optim/param_swap.py)
        work = _all_gather_single(self.full, self.shard.detach(), group=self.group, async_op=True)
        (self.gathering,) = watch(self.timer, "dp", [work])  # its completion stamped (comm_timer.py)

    def gather_params(self) -> None:
        if self.gathered:
            return
        if self.gathering is not None:  # prefetched: what is left is the wait (the exposed time)
            with timed(self.timer, "dp", "zero gather (prefetched)"):
                self.gathering.wait()
            self.gathering = None
        else:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            if self.swap is not None:
                self.swap.fetch(self.shard, self.training)
            with timed(self.timer, "dp", "zero gather"):
                _all_gather_single(self.full, self.shard.detach(), group=self.group)
        if self.swap is not None:  # gathered: the drive holds the slice until the update
            self.swap.release(self.shard)
        if self.tracker is not None:
            self.tracker.exclude([self.full])  # weights, not activations, when saved for backward
        self.gathered = True

    def free_params(self) -> None:
        if self.gathering is not None:  # a prefetch never used (a forward cut short): its buffer is in use
            self.gathering.wait()
            self.gathering = None
            if self.swap is not None:
                self.swap.release(self.shard)
        if self.tracker is not None and self.gathered and self.stage == 3:
            self.tracker.include_again([self.full])
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def all_gather_updated(self) -> None:
        """Stages 1-2: every rank's updated slice into the full parameters."""
        with timed(self.timer, "dp", "zero gather (updated)"):
            _all_gather_single(self.full, self.shard.detach().clone(), group=self.group)

    # --- gradients ---
    def give_grad_views(self) -> None:
        """Stage 1: parameters accumulate straight into one flat gradient buffer."""
        if self.grad_full is None:
            self.grad_full = torch.zeros_like(self.full)
            self._grad_views = flat_views(self.grad_full, self.params)
        else:
            self.grad_full.zero_()
        for p, view in zip(self.params, self._grad_views):
            p.grad = view

    def open_grads(self) -> None:
        """Stages 2-3, as the unit's backward starts (each micro-batch): its gradients land in
        one flat buffer, each parameter's `.grad` a view autograd accumulates into in place,
        so the reduce-scatter reads it as it is (no flatten copy). Its storage exists from here
        until the unit is reduced (`close_grads`): the unit's full gradient, once."""
        if self.grads_open:
            return
        if self.grad_full is None:  # the views are made once; the storage comes and goes
            self.grad_full = torch.empty_like(self.full)
            self._grad_views = flat_views(self.grad_full, self.params)
        else:
            self.grad_full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.grad_full.zero_()
        for p, view in zip(self.params, self._grad_views):
            p.grad = view
        self.grads_open = True

    def adopt(self, p: nn.Parameter) -> None:
        """Stages 2-3, after `p`'s gradient accumulated: where no hook opened the buffer first
        (a forward the unit's hooks did not see), it is opened now and `p`'s gradient copied in."""
        if not self.grads_open:
            grad = p.grad
            self.open_grads()
            p.grad.copy_(grad)

    def drop_grads(self) -> None:
        """Stages 2-3: an opened buffer no gradient reached: nothing to reduce, freed."""
        for p in self.params:
            p.grad = None
        self.close_grads()

    def close_grads(self) -> None:
        if self.grads_open:
            self.grad_full.untyped_storage().resize_(0)
            self.grads_open = False

    def reduce_scatter_grads(self, accumulate: bool) -> int:
        """Owner's slice <- dp mean of the unit's gradient. Returns transient bytes used."""
        return self.finish_reduce(self.start_reduce(accumulate, async_op=False))

    def start_reduce(self, accumulate: bool, async_op: bool) -> tuple:
        """The reduce-scatter issued (async: not waited for, the overlap of
        `parallelism.overlap_grad_reduce`; stages 2-3 then drop the parameters' gradients at
        once, their copy is in flight). For `finish_reduce`."""
        if self.stage >= 2:
            self.open_grads()  # no-op after the backward opened it (zeros if no gradient came)
        flat = held = self.grad_full
        if self.bucket is not None and not async_op:
            return self._reduce_in_buckets(held, accumulate)
        if self.reduce_dtype is not None and self.reduce_dtype != flat.dtype:
            flat = flat.to(self.reduce_dtype)  # summed wide, held in the parameters' dtype
        out = torch.empty(self.slice, dtype=flat.dtype, device=flat.device)
        work = None
        if async_op:  # its completion stamped by a watcher (gloo's reduce-scatter Work has no future)
            (work,) = watch(self.timer, "dp", [_reduce_scatter_single(out, flat, group=self.group, async_op=True)])
        else:
            with timed(self.timer, "dp", "zero reduce-scatter"):
                _reduce_scatter_single(out, flat, group=self.group)
        # Transient: a wide copy, and at stages 2-3 the unit's full gradient itself (stage 1's
        # buffer lives through the step: counted in grads_bytes).
        transient = (flat.numel() * flat.element_size() if flat is not held else 0) + \
            (held.numel() * held.element_size() if self.stage >= 2 else 0)
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
        return work, flat, out, accumulate, transient

    def _reduce_in_buckets(self, held: torch.Tensor, accumulate: bool) -> tuple:
        """ZeRO-R's constant-size buffer (CB): the reduce-scatter in pieces, each gathering
        `bucket` elements of the gradient (bucket / dp of every rank's slice, widened in the
        copy) into one buffer the pieces reuse, so the transient is that buffer whatever the
        unit's size (at least one element of each rank's slice a piece: dp elements where the
        bucket holds fewer). The same sums, element by element, as one reduce-scatter."""
        wide = self.reduce_dtype or held.dtype
        out = torch.empty(self.slice, dtype=wide, device=held.device)
        per = max(1, min(self.bucket // self.size, self.slice))  # elements of each rank's slice per piece
        buffer = torch.empty(self.size * per, dtype=wide, device=held.device)
        grid = held.view(self.size, self.slice)
        with timed(self.timer, "dp", "zero reduce-scatter"):
            for a in range(0, self.slice, per):
                n = min(per, self.slice - a)
                piece = buffer[:self.size * n]
                piece.view(self.size, n).copy_(grid[:, a:a + n])
                _reduce_scatter_single(out[a:a + n], piece, group=self.group)
        transient = buffer.numel() * buffer.element_size() + (held.numel() * held.element_size()
                                                              if self.stage >= 2 else 0)
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
        return None, held, out, accumulate, transient

    def finish_reduce(self, pending: tuple) -> int:
        work, _flat, out, accumulate, transient = pending  # the input is held until the wait
        if work is not None:
            with timed(self.timer, "dp", "zero reduce-scatter (overlapped)"):
                work.wait()
        if self.stage >= 2:  # its copy was read: the full gradient's storage goes
            self.close_grads()
        out /= self.size
        if out.dtype != self.full.dtype:
            out = out.to(self.full.dtype)
        if self.stage == 1:  # the reduced slice lives in the full buffer (no extra memory)
            own = self.grad_full[self.rank * self.slice:(self.rank + 1) * self.slice]
            own.copy_(out)
            self.shard.grad = own
        elif accumulate and self.shard.grad is not None:
            self.shard.grad += out
        else:
            self.shard.grad = out
        return transient


def open_grads_on_backward(modules: list[nn.Module], flats: list[FlatUnit]) -> None:
    """Stage 2: the unit's gradient buffers opened as its backward starts (a hook on each
    module's output gradient; the first to fire opens them), so autograd writes into them."""
    def before_backward(_grad):
        for f in flats:
            f.open_grads()

    def after_forward(_m, _args, out):
        tensor = out if isinstance(out, torch.Tensor) else out[0]
        if tensor.requires_grad:
            tensor.register_hook(before_backward)

    for m in modules:
        m.register_forward_hook(after_forward)
