"""DualPipe's overlap in the cost model (`Job.dualpipe_overlap`: a run's
`parallelism.overlap_dualpipe`): each steady-state pair runs one chunk's F beside the other
chunk's B, so each one's all-to-all (ep) runs under the other's compute.

Per pair on rank r (F of chunk c, B of chunk 1 - c; `schedules.base.pair_starts`): with
f, b each op's compute without its ep all-to-alls and a_F, a_B those all-to-alls,
    F in the pair = f + max(0, a_F - b),   B in the pair = b + max(0, a_B - f):
the computations share the device (their sum is the pair's compute) and each all-to-all is
exposed only past the other's compute (DeepSeek-V3's F&B). The clock (clock.py, `Costs.
paired`) charges these for the paired actions; F's and B's outside a pair (the ramps) keep
their whole times. This is the overlap a two-stream implementation reaches (DualPipe's);
the framework's CUDA path enqueues both threads on one stream (framework/parallel/
side_thread.py), so a GPU run with the key gets less than priced here (not measured).
"""

from __future__ import annotations

from framework.schedules.base import pair_starts


def paired_costs(compute: dict, ep: dict, p: int) -> dict:
    """(rank, chunk, op) -> seconds inside a pair, for F and B of both chunks. `compute`:
    whole op times (all-to-alls included); `ep`: the all-to-all seconds inside them."""
    out = {}
    for r in range(p):
        for c in (0, 1):
            f_key, b_key = (r, c, "F"), (r, 1 - c, "B")
            f, b = compute[f_key] - ep[f_key], compute[b_key] - ep[b_key]
            out[f_key] = f + max(0.0, ep[f_key] - b)
            out[b_key] = b + max(0.0, ep[b_key] - f)
    return out


def hidden_s(compute: dict, paired: dict, lists: dict) -> float:
    """The all-to-all seconds the pairs hide per step, on the rank that hides the most."""
    best = 0.0
    for r, acts in lists.items():
        keys = [(r, acts[i].chunk, acts[i].op.value) for k in pair_starts(acts) for i in (k, k + 1)]
        best = max(best, sum(compute[key] - paired[key] for key in keys))
    return best
