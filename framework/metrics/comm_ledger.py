"""What every collective of a training step hands to torch.distributed, per dimension: the
measurement the cost model's collective bytes are tested against (`debug.comm_ledger=true`).

The ledger is a TorchDispatchMode around `train_step`: every c10d operator a rank issues
(torch DDP's C++ reducer, ZeRO's gathers, the pipeline's sends, the all-to-alls, the tp
region's autograd Functions, hooks run by the backward) passes through it, with its
process group. So it measures what the code under test does, not what it says it does.

Recorded per (dimension, operator, dtype): calls and payload bytes, where the payload is
  all_reduce: the reduced tensor | all_gather: the gathered output | reduce_scatter: the
  whole input | all_to_all: the input (every peer's part, this rank's own included) |
  send / recv: the tensor | broadcast: the tensor.
These are the sizes the cost model's `collective_s` takes (sim/cost/collectives.py), not
bytes on the wire (a ring all-reduce sends 2 (n-1)/n of them). The dimension is the
ParallelContext group the operator ran on (tp, dp, pp, ep, edp, embedding), `world` for the
default group (flags, logging).

Counted: the training steps only (not evaluation, checkpoint saves or the log gathers
between steps). Costs: every tensor operator goes through Python while it is on, so it is
a debug key, off by default.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator -> (what the ledger calls it, which tensor argument is its payload)
_OPS = {"allreduce_": ("all_reduce", 0), "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
        "allgather_into_tensor_coalesced_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
        "reduce_scatter_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
        "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "send": ("send", 0),
        "recv_": ("recv", 0), "recv_any_source_": ("recv", 0), "broadcast_": ("broadcast", 0)}


def _nbytes(arg) -> tuple[int, str]:
    """(bytes, dtype) of a tensor or a list of tensors (the c10d list-form operators)."""
    tensors = arg if isinstance(arg, (list, tuple)) else [arg]
    while tensors and isinstance(tensors[0], (list, tuple)):  # allgather_'s list of lists
        tensors = [t for inner in tensors for t in inner]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else "none"
    return sum(t.numel() * t.element_size() for t in tensors), dtype


def _group_name(args) -> str | None:
    for a in args:
        if isinstance(a, torch.ScriptObject) or isinstance(a, dist.ProcessGroup):
            try:
                pg = a if isinstance(a, dist.ProcessGroup) else dist.ProcessGroup.unbox(a)
                return pg.group_name
            except (RuntimeError, TypeError, AttributeError):  # a ReduceOp or options object
                continue
    return None


class CommLedger(TorchDispatchMode):
    """One rank's ledger over a ParallelContext's groups (dimension -> ProcessGroup) and
    members (dimension -> global ranks)."""

    def __init__(self, rank: int, groups: dict, members: dict):
        super().__init__()
        self.rank, self.members = rank, members
        self.names: dict[str, str] = {}
        for dim, g in groups.items():
            if g is not None:  # one group can serve two dimensions (dp is edp when ep = 1)
                self.names[g.group_name] = "+".join(filter(None, (self.names.get(g.group_name), dim)))
        self.totals: dict = defaultdict(lambda: [0, 0])
        self.steps = 0

    def _dim(self, op: str, args) -> str:
        name = _group_name(args)
        if name in self.names:
            return self.names[name]
        if op in ("send", "recv"):  # the pipeline's p2p names global peers on the default group
            peer = args[2]
            shared = [d for d, ranks in self.members.items() if self.rank in ranks and peer in ranks]
            return "pp" if "pp" in shared else "+".join(shared) or "world"
        return "world"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            op = _OPS.get(func.__name__.split(".")[0])
            if op is not None:
                nbytes, dtype = _nbytes(args[op[1]])
                # one element (a flag, a norm's partial sum) is told apart from payloads
                entry = self.totals[(self._dim(op[0], args), op[0], dtype, nbytes <= 8)]
                entry[0] += 1
                entry[1] += nbytes
        return func(*args, **(kwargs or {}))

    def write(self, path: str) -> None:
        """{steps, entries: [{dim, op, dtype, scalar, calls, bytes}]}: totals over the counted
        steps; `scalar`: calls of at most 8 bytes (flags, norms' partial sums)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entries = [{"dim": d, "op": o, "dtype": t, "scalar": sc, "calls": c, "bytes": b}
                   for (d, o, t, sc), (c, b) in sorted(self.totals.items())]
        with open(path, "w") as f:
            json.dump({"steps": self.steps, "entries": entries}, f, indent=1)


def ledger_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, "comm_ledger", f"rank_{rank}.json")
