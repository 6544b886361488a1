"""Where the step goes: each rank's step time cut into parts that sum to it.

Parts (seconds per rank and step; metrics.jsonl, summary.json and W&B key `time_<part>_s`):
  data       loading the step's micro-batches
  compute    forward and backward (and an asynchronous schedule's updates) with every
             communication span inside them taken out; pipelines also per op (`time_F_s`,
             `time_B_s`, `time_I_s`, `time_W_s`, `time_U_s`: the parts of compute)
  optimizer  after the last backward (pipelines: after the flush): clipping with the global
             norm's scalar all-reduces, the update, ZeRO's slice bookkeeping; the gradient
             reductions' spans taken out
  comm_dp, comm_tp, comm_pp, comm_ep, comm_cp   exposed communication: the rank's spans
             inside that dimension's calls (framework/metrics/comm_timer.py), and for pp the
             part of each receive wait after its message was sent
  bubble     pipelines: idle waiting for a pipeline neighbour: the part of each receive wait
             before its message was sent (the sender still computing), the step's send waits
             and the flush
  host       the rest: between actions (issuing p2p batches, bookkeeping), before the first
             action (learning rate, ZeRO's buffers) and after the update (MoE statistics)

How exactly they sum: every part is made of intervals between the step's own marks (its
start and end, the data mark, each action's three marks, the flush, the update's end), and
those intervals tile the step; a communication span is taken out of the interval holding it
and given to its dimension. So a rank's parts sum to its `step_time_s` up to float rounding
(tested). The receive waits are split on the logging rank, which has every rank's actions:
the message's send time is the end of the producing action on its sender (one host clock;
across nodes, clock skew moves time between bubble and comm_pp, never out of the sum).

The row's `time_*` are means over ranks (they sum to the mean of `rank_step_time_s`), and
`rank_time_s` holds every rank's parts. Beside each exposed `time_comm_<dim>_s`, the
dimension's whole communication time `comm_total_<dim>_s` (mean over ranks: synchronous
calls, plus each overlapped call from its issue to its completion; comm_timer.py), so the
part an overlap hid is `comm_total - time_comm` and `comm_hidden_<dim>` is that share of
the total (0 without communication). `busy_s` (and so `bubble_fraction`) counts compute
only: a tp collective or an all-to-all inside an action is not busy.
"""

from __future__ import annotations

from bisect import bisect_right

from framework.metrics.comm_timer import DIMS
from framework.parallel.pipeline.messages import needs, produces, sender_of
from framework.parallel.pipeline.schedules import Action

OPS = ("F", "B", "I", "W", "U")
PARTS = ("data", "compute", "optimizer", *(f"comm_{d}" for d in DIMS), "bubble", "host")
TOTAL_KEYS = tuple(f"comm_total_{d}_s" for d in DIMS) + tuple(f"comm_hidden_{d}" for d in DIMS)
KEYS = tuple(f"time_{p}_s" for p in PARTS) + TOTAL_KEYS


def rank_parts(t0: float, t1: float, t2: float, start: float, pipeline_s: float, optimizer_s: float,
               actions: list, spans: list) -> tuple[dict, list[float]]:
    """One rank's parts (PARTS, the op letters of pipelines, and `wait`: receive waits the
    logging rank splits into bubble and comm_pp), and per action the communication seconds
    inside its compute (what the simulator's calibration takes out of busy). t0 / t1 / t2:
    the step's start, data loaded, end; `start`: the pipeline's (pp = 1: forward's) start;
    `actions`: (action, start, compute start, end) records; `spans`: CommTimer.take()."""
    pipe_end = start + pipeline_s
    cuts = [("data", t0, t1), ("host", t1, start)]
    action_of: dict[int, int] = {}  # cut index -> action index (its compute)
    if actions:
        for k, (name, s, c, e) in enumerate(actions):
            if k:
                cuts.append(("host", actions[k - 1][3], s))
            cuts.append(("wait", s, c))
            action_of[len(cuts)] = k
            cuts.append((Action.parse(name).op.value, c, e))
        cuts.append(("bubble", actions[-1][3], pipe_end))  # the step's send waits and the flush
    else:
        cuts.append(("compute", start, pipe_end))
    cuts += [("optimizer", pipe_end, pipe_end + optimizer_s), ("host", pipe_end + optimizer_s, t2)]
    parts = dict.fromkeys((*PARTS, "wait"), 0.0)
    for label, s, e in cuts:
        parts[label] = parts.get(label, 0.0) + (e - s)
    starts = [s for _, s, _ in cuts]
    inside = [0.0] * len(actions)
    for dim, _, s, e in spans:
        i = max(0, bisect_right(starts, (s + e) / 2) - 1)
        parts[cuts[i][0]] -= e - s
        parts[f"comm_{dim}"] += e - s
        if i in action_of:
            inside[action_of[i]] += e - s
    parts["compute"] += sum(parts.get(op, 0.0) for op in OPS)
    return parts, inside


def split_waits(per_rank: list, smap, pipelines: list[list[int]]) -> list[dict]:
    """Every rank's parts with its receive waits split (module docstring): before the
    message was sent, bubble; after, comm_pp. A message sent in an earlier step (the
    asynchronous schedules' warm-up) counts whole as comm_pp."""
    out = [dict(r.parts) for r in per_rank]
    for ranks in pipelines:
        sent = {}
        for pp, g in enumerate(ranks):
            for name, _, _, e in per_rank[g].actions:
                msg = produces(Action.parse(name), pp, smap)
                if msg is not None:
                    sent[msg] = e
        for pp, g in enumerate(ranks):
            parts = out[g]
            for name, s, c, _ in per_rank[g].actions:
                msg = needs(Action.parse(name), pp, smap)
                parts["wait"] -= c - s
                if msg is None or sender_of(msg, smap) == pp:  # nothing to receive: the marks' own cost
                    parts["host"] += c - s
                    continue
                idle = min(max(sent.get(msg, s) - s, 0.0), c - s)
                parts["bubble"] += idle
                parts["comm_pp"] += c - s - idle
            parts["bubble"] += parts["wait"]  # rounding, or a span inside a wait (none is): the sum stays exact
            parts["wait"] = 0.0
    return out


def row(parts: list[dict], totals: list[dict]) -> dict:
    """metrics.jsonl keys: each part's mean over ranks, the op parts of pipelines, every rank's,
    and per dimension the total communication beside the exposed (`totals`: each rank's)."""
    mean = {f"time_{p}_s": sum(r[p] for r in parts) / len(parts) for p in PARTS}
    for d in DIMS:
        total = sum(t.get(d, 0.0) for t in totals) / len(totals)
        # a total below the exposed time is a clock's rounding, never a negative hidden part
        mean[f"comm_total_{d}_s"] = total = max(total, mean[f"time_comm_{d}_s"])
        mean[f"comm_hidden_{d}"] = 1.0 - mean[f"time_comm_{d}_s"] / total if total > 0 else 0.0
    ops = [op for op in OPS if any(r.get(op) for r in parts)]
    mean.update({f"time_{op}_s": sum(r.get(op, 0.0) for r in parts) / len(parts) for op in ops})
    # an op a rank did not run this step (an asynchronous schedule's segment) is 0 there
    mean["rank_time_s"] = [{p: r.get(p, 0.0) for p in (*PARTS, *ops)} for r in parts]
    return mean


def busy_s(parts: dict) -> float:
    """A pipeline rank's busy time for its bubble: its pure compute."""
    return sum(parts.get(op, 0.0) for op in OPS)
