"""Rank layout: rank <-> (pp_rank, dp_rank, tp_rank) and the groups of each dimension.

Ranks are laid out as `arange(world).view(pp, dp, tp)`, as in Megatron-LM's model-parallel
unit: tp innermost so tensor-parallel peers are neighbouring ranks (same node, fastest
links), then dp, then pp outermost. This is the only place that layout is written.

The `dp` coordinate counts the replicas of the parameters: data parallel x context parallel
ranks (Megatron's order tp-cp-dp-pp: cp inside dp). dp rank = data_rank * cp + cp_rank, so a
`cp` group is cp consecutive dp ranks (one sequence cut over them, the same samples) and the
`dp` group, over which gradients are averaged and ZeRO shards, spans data x cp. cp = 1: the
dp coordinate is the data rank.

Expert parallelism is carved out of dp (Megatron's order tp-cp-ep-dp-pp with expert tp =
tp): dp rank = edp_rank * ep + ep_rank, so an `ep` group is ep consecutive dp ranks (the
experts of a MoE layer are split over it) and an `edp` group (expert data parallel: the
ranks holding the same experts) strides by ep through dp. ep = 1: each ep group is one rank
and edp is dp. (ep with cp > 1 is not built: framework/validate/context.py.)
`ParallelDims` is pure (no torch.distributed) so the rank math is testable without
processes; `ParallelContext.create` builds the process groups from it, once per rank, and
the context is passed explicitly to every wrapper (no module-level state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int
    ep: int = 1  # expert parallel size: divides dp
    cp: int = 1  # context parallel size: divides dp (the replicas: data x cp)

    def __post_init__(self):
        for k in ("pp", "dp", "tp", "ep", "cp"):
            if getattr(self, k) < 1:
                raise ValueError(f"ParallelDims.{k}={getattr(self, k)} must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"ParallelDims.ep={self.ep} must divide dp={self.dp}")
        if self.dp % self.cp:
            raise ValueError(f"ParallelDims.cp={self.cp} must divide dp={self.dp} (the replicas: data x cp)")

    @classmethod
    def of(cls, p) -> ParallelDims:
        """From a ParallelismConfig (the dp coordinate: its replicas, dp x cp)."""
        return cls(pp=p.pp, dp=p.replicas, tp=p.tp, ep=p.ep, cp=p.cp)

    @property
    def data(self) -> int:
        """Data-parallel size: the replicas that read different samples (parallelism.dp)."""
        return self.dp // self.cp

    def data_rank(self, c: Coords) -> int:
        return c.dp // self.cp

    def cp_rank(self, c: Coords) -> int:
        return c.dp % self.cp

    def named(self, c: Coords) -> dict:
        """The coordinates as reports name them: pp, dp (the data rank), tp; and cp when cp > 1."""
        return {"pp": c.pp, "dp": self.data_rank(c), "tp": c.tp, **({"cp": self.cp_rank(c)} if self.cp > 1 else {})}

    @property
    def edp(self) -> int:
        """Expert data parallel size: the replicas of each expert."""
        return self.dp // self.ep

    def ep_rank(self, c: Coords) -> int:
        return c.dp % self.ep

    def edp_rank(self, c: Coords) -> int:
        return c.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, c: Coords) -> int:
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim` ('tp' | 'dp' | 'pp' | 'cp' | 'ep' | 'edp'): ranks that differ only
        in that coordinate (cp, ep and edp: parts of the dp coordinate)."""
        if dim == "cp":
            return sorted(g[j * self.cp:(j + 1) * self.cp] for g in self.groups("dp") for j in range(self.data))
        if dim in ("ep", "edp"):
            inner = dim == "ep"
            return sorted(g[j * self.ep:(j + 1) * self.ep] if inner else g[j::self.ep]
                          for g in self.groups("dp") for j in range(self.edp if inner else self.ep))
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        if dim not in sizes:
            raise ValueError(f"unknown dimension {dim!r}; use pp, dp, tp, cp, ep or edp")
        others = [d for d in ("pp", "dp", "tp") if d != dim]
        out = []
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                fixed = {others[0]: a, others[1]: b}
                out.append([self.rank(Coords(**fixed, **{dim: i})) for i in range(sizes[dim])])
        return sorted(out)

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline (Megatron's embedding group): they hold the
        two copies of a tied input/output embedding. None when pp = 1."""
        return [[g[0], g[-1]] for g in self.groups("pp")] if self.pp > 1 else []

    def group_of(self, dim: str, rank: int) -> list[int]:
        return next(g for g in self.groups(dim) if rank in g)


class NullRecorder:
    """The flight recorder's stand-in (framework/train/flight.py's FlightRecorder writes what a
    rank last started) for code run outside a launched rank: unit tests, the reference model."""

    def note(self, text: str, wait: bool = False) -> None:
        pass


@dataclass
class ParallelContext:
    """One rank's view: its coordinates, its process groups and its device."""

    dims: ParallelDims
    rank: int
    coords: Coords
    device: Any  # torch.device
    groups: dict[str, Any]  # 'dp' | 'tp' | 'pp' -> torch.distributed ProcessGroup
    group_ranks: dict[str, list[int]]
    # framework.train.flight: what this rank last started, for the launcher's hang watchdog
    recorder: Any = field(default_factory=NullRecorder)
    # framework.comm.comm_timer.CommTimer: per-dimension communication spans (set by the trainer)
    timer: Any = None
    # pipeline neighbour (pp rank) -> the two ranks' own group: each pair's p2p on its own
    # communicator (NCCL: its own stream; framework/schedules/matching.py stream_of); {} at pp 1
    pp_pairs: dict = field(default_factory=dict)

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def cp_group(self):
        """Context parallel: the ranks one sequence is cut over (None when cp = 1)."""
        return self.groups.get("cp")

    @property
    def ep_group(self):
        """Expert parallel: the ranks a MoE layer's experts are split over (None when ep = 1)."""
        return self.groups.get("ep")

    @property
    def edp_group(self):
        """Expert data parallel: the ranks holding the same experts (dp's group when ep = 1)."""
        return self.groups["edp"] if self.dims.ep > 1 else self.groups["dp"]

    @property
    def log_group(self):
        """The logging rank's gathers: gloo over the world (None = the default group when
        that is gloo already). Under NCCL a gather on the default communicator would queue
        behind point-to-point ops still pending in an asynchronous pipeline (their receives
        are only posted after the peer's gather), and it would sync the host with the GPU."""
        return self.groups.get("log")

    @classmethod
    def create(cls, dims: ParallelDims, rank: int, device, recorder=None, timeout=None,
               side: bool = False) -> ParallelContext:
        """`side` (parallelism.overlap_dualpipe): a second ep group, "ep_side", the same ranks,
        for the collectives of a pair's F thread (framework/comm/side_thread.py)."""
        import torch.distributed as dist

        groups, members = {}, {}
        dims_made = ("pp", "dp", "tp", "embedding") + (("ep", "edp") if dims.ep > 1 else ()) + (
            ("cp",) if dims.cp > 1 else ()) + (("ep_side",) if side and dims.ep > 1 else ())
        for dim in dims_made:
            # new_group is collective over the whole world: every rank creates every group,
            # in the same order, and keeps the one it belongs to.
            grid = dims.embedding_groups() if dim == "embedding" else dims.groups(dim.removesuffix("_side"))
            for ranks in grid:
                g = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    groups[dim], members[dim] = g, ranks
        pairs = _pair_groups(dims, rank, groups.get("pp"), timeout)
        if dist.get_backend() != "gloo":
            groups["log"] = dist.new_group(backend="gloo", timeout=timeout)
            # NCCL makes a communicator on its first call, which must not be a
            # batch_isend_irecv some of its ranks are not in; the pairs in one global order
            for g in [groups[d] for d in ("pp", "cp") if d in groups] + list(dict.fromkeys(pairs.values())):
                dist.barrier(group=g)
        return cls(dims, rank, dims.coords(rank), device, groups, members, recorder or NullRecorder(), pp_pairs=pairs)


def _pair_groups(dims: ParallelDims, rank: int, pp_group, timeout) -> dict:
    """Each pair of pipeline neighbours (pp ranks i and i + 1 mod p) gets a group of its own;
    at p 2 the pp group is that pair. Every rank creates every pair, in one order, and the
    returned {neighbour's pp rank: group} keeps it."""
    import torch.distributed as dist

    if dims.pp == 1:
        return {}
    out = {}
    for ranks in dims.groups("pp"):
        for i in range(len(ranks)) if dims.pp > 2 else ():
            pair = sorted({ranks[i], ranks[(i + 1) % len(ranks)]})
            g = dist.new_group(pair, timeout=timeout)
            if rank in pair:
                out[ranks.index(pair[0] if pair[1] == rank else pair[1])] = g
        if dims.pp == 2 and rank in ranks:
            out[1 - ranks.index(rank)] = pp_group
    return out  # in creation order: the NCCL barriers above run in one global order
