"""What a collective costs: NCCL's algorithms as alpha-beta over the slowest link a group
crosses, the group placed by the framework's own rank order (framework/topology.py).

Placement: ranks fill nodes in order (`gpus_per_node` per node, as torchrun numbers them);
a group is inside one node when all its ranks are (tp, innermost, is when tp divides
gpus_per_node; dp and pp usually cross nodes). A group inside a node runs at the profile's
`links.intra` (NVLink / NVSwitch: per GPU, one direction), one that crosses nodes at
`links.inter` (each GPU's own NIC in a DGX node: 200 Gb/s HDR = 25 GB/s, 400 Gb/s NDR = 50 GB/s).

Algorithms (bus-bandwidth factors as nccl-tests reports them; Thakur et al. 2005):
- all-reduce, ring: 2 (n-1) / n x bytes over the link, 2 (n-1) latency steps
- all-gather / reduce-scatter, ring: (n-1) / n x bytes (the whole, gathered size), n-1 steps
- all-to-all, pairwise: (n-1) / n x bytes sent, n-1 steps
- p2p: bytes, one step
A link measured on this machine (`all_reduce_s`, python -m framework.sim.bench --links N) is
read as its curve for groups of that size: a reduce-scatter or an all-gather costs its own
measured curve at the whole buffer's bytes where the bench measured one (gloo's
reduce-scatter is an all-reduce of the whole buffer: twice the ring's bytes), anything else
the measured all-reduce that moves the same bus bytes (all-gather of B as an all-reduce of
B / 2; a p2p of B, n = 2, as one of B / 2), log-log between the measured sizes. Not
modelled (docs/cost_model.md): NCCL's tree all-reduce and its choice between the two,
hierarchical (intra- then inter-node) rings, contention between collectives of different
groups on one link, SHARP, and any overlap of a collective with compute unless the caller
says so.
"""

from __future__ import annotations

import bisect
import math

from framework.sim.cost.hardware import Link, Profile
from framework.topology import Coords, ParallelDims

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "p2p": lambda n: 1}


def crosses_nodes(group: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in group}) > 1


def first_group(dims: ParallelDims, dim: str) -> list[int]:
    """Rank 0's group of `dim`: the ranks whose other coordinates are 0 (ep, cp: the first ep
    (cp) dp ranks), without listing every group of a 16k-rank world (topology.groups does)."""
    size = {"tp": dims.tp, "dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "cp": dims.cp}[dim]
    axis = "dp" if dim in ("ep", "cp") else dim
    return [dims.rank(Coords(**{"pp": 0, "dp": 0, "tp": 0, axis: i})) for i in range(size)]


def group_link(prof: Profile, dims: ParallelDims, dim: str) -> Link:
    """The link rank 0's `dim` group runs at (every group of a dimension has the same shape)."""
    return prof.links["inter" if crosses_nodes(first_group(dims, dim), prof.gpus_per_node) else "intra"]


def collective_s(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of one collective over n ranks; `nbytes`: the whole buffer (all-reduce: the
    reduced tensor; all-gather: the gathered one; all-to-all: what one rank sends in all)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    own = getattr(link, f"{kind}_s", None)
    if own and own["ranks"] == n:  # the collective's own measured curve (an all-reduce's is its own)
        return _read(own, nbytes)
    curve = link.all_reduce_s
    if curve and curve["ranks"] == n:  # the measured all-reduce moving the same bus bytes
        return _read(curve, nbytes * FACTORS[kind](n) / FACTORS["all_reduce"](n))
    return STEPS[kind](n) * link.alpha_us * 1e-6 + FACTORS[kind](n) * nbytes / (link.GBps * 1e9)


def _read(curve: dict, nbytes: float) -> float:
    """A measured curve's seconds at `nbytes` ({ranks, rows: [[bytes, seconds], ...]})."""
    rows = sorted(curve["rows"])
    return _loglog([r[0] for r in rows], [r[1] for r in rows], nbytes)


def _loglog(xs: list, ys: list, x: float) -> float:
    """Piecewise linear in log-log; below the first row its time, above the last, linear in bytes."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x) - 1
    f = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
    return math.exp(math.log(ys[i]) + f * (math.log(ys[i + 1]) - math.log(ys[i])))
