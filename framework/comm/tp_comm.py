"""Communication into and out of the tensor-parallel region (Megatron-LM, Shoeybi et al., 2019;
sequence parallelism: Korthikanti et al., 2022).

Each function is an autograd Function over one rank's tp group, named as in Megatron:
the forward collective and the backward collective are conjugate, so gradients of a
tensor-parallel layer equal those of the unsplit layer. Shapes are (B, T, H): the
"last dim" functions split hidden features, the sequence functions split T (dim 1).

`TPComm` wraps the group (passed explicitly; no module state) and tallies the bytes every
collective moves, forward and backward, so runs can log `tp_comm_bytes` per step. The tally
is algorithmic: the bytes each rank sends under ring algorithms (all-reduce 2(n-1)/n of the
tensor, all-gather and reduce-scatter (n-1)/n of the full tensor, all-to-all (n-1)/n of what a
rank sends: cp's Ulysses uses the same comm), the same convention as
NCCL's bus bandwidth. It is not a measurement on the wire (gloo on one host uses shared
memory; NCCL may pick trees).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from framework.comm.comm_timer import timed


# torch 2.13 renamed the tensor-in / tensor-out collectives; 2.6-2.12 have the older names.
# (zero.py uses them over the dp group too.)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TPComm:
    """One rank's tp group: size, rank, and the collectives with their byte tally."""

    def __init__(self, group, size: int, rank: int, timer=None, dim: str = "tp"):
        self.group, self.size, self.rank = group, size, rank
        self.bytes_sent = 0
        # the step-time breakdown's per-dimension spans (framework/comm/comm_timer.py)
        self.timer, self.dim = timer, dim
        self.delay_s = 0.0  # debug.tp_delay_ms: rank 0 sleeps before each collective

    @contextlib.contextmanager
    def timed(self):
        """A collective's span (an overlapped call's is its watched wait: comm_timer.watch)."""
        if self.delay_s and self.rank == 0:
            time.sleep(self.delay_s)  # before the span: a slow rank's compute; its peers wait inside theirs
        with timed(self.timer, self.dim):  # the one clock: the step's CommTimer (none: untimed)
            yield

    def _tally(self, full: torch.Tensor, factor: float) -> None:
        self.bytes_sent += int(full.numel() * full.element_size() * factor * (self.size - 1) / self.size)

    def take_bytes(self) -> int:
        """Bytes sent since the last call (a step's worth when called once per step)."""
        out, self.bytes_sent = self.bytes_sent, 0
        return out

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        out = x.contiguous().clone()  # never reduce in place: autograd may share the input
        self._tally(out, 2)
        with self.timed():
            dist.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in tp-rank order."""
        x = x.contiguous()
        out = torch.empty((self.size * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._tally(out, 1)
        with self.timed():
            all_gather_single(out, x, group=self.group)
        return out if dim == 0 else torch.cat(out.chunk(self.size, 0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, keep this rank's slice of `dim`."""
        chunks = x.chunk(self.size, dim)
        stacked = torch.cat(chunks, 0).contiguous() if dim != 0 else x.contiguous()
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        self._tally(stacked, 1)
        with self.timed():
            reduce_scatter_single(out, stacked, group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Block j of `x`'s dim 0 to rank j; block j of the result from rank j."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._tally(x, 1)
        with self.timed():
            dist.all_to_all_single(out, x, group=self.group)
        return out

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of `dim` (no communication)."""
        return x.chunk(self.size, dim)[self.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity in forward, all-reduce in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dim in forward, all-gather it in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.split(x, -1)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g, -1), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim in forward, split it in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x, -1)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.split(g, -1), None


class _GatherFromSP(torch.autograd.Function):
    """All-gather the sequence dim (1 of (B, T, H); context parallelism's K / V: 2) in forward,
    reduce-scatter it in backward."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.all_gather(x, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.reduce_scatter(g, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter the sequence dim in forward, all-gather it in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x, 1)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g, 1), None


def copy_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm)


def scatter_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ScatterToTP.apply(x, comm)


def gather_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _GatherFromTP.apply(x, comm)


def gather_from_sequence_parallel_region(x: torch.Tensor, comm: TPComm, dim: int = 1) -> torch.Tensor:
    return _GatherFromSP.apply(x, comm, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, comm)


def enter_tp_region(x: torch.Tensor, comm: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """Into a column-parallel layer: replicated input (copy) or sequence shards (all-gather)."""
    return gather_from_sequence_parallel_region(x, comm) if sequence_parallel else copy_to_tp_region(x, comm)


def exit_tp_region(x: torch.Tensor, comm: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """Out of a row-parallel layer: partial sums to the full sum (all-reduce) or to this
    rank's sequence shard of it (reduce-scatter)."""
    return reduce_scatter_to_sequence_parallel_region(x, comm) if sequence_parallel else reduce_from_tp_region(x, comm)
