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
             inside that dimension's calls (framework/comm/comm_timer.py), and for pp the
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
(tested; as that holds by construction, each part is also tested by a known cost injected
into it: the `debug.*_delay_ms` keys, docs/metrics.md). The receive waits are split on
the logging rank, which has every rank's actions:
the message's send time is the end of the producing action on its sender (one host clock;
across nodes, clock skew moves time between bubble and comm_pp, never out of the sum).

The row's `time_*` are means over ranks (they sum to the mean of `rank_step_time_s`), and
`rank_time_s` holds every rank's parts. Beside each exposed `time_comm_<dim>_s`, the
dimension's whole communication time `comm_total_<dim>_s` (mean over ranks: the exposed
spans, plus the overlapped calls' time in flight before their waits; comm_timer.py), so the
part an overlap hid is `comm_total - time_comm` and `comm_hidden_<dim>` is that share of
the total (0 without communication). `comm_hidden_unseen_calls`: the overlapped calls a step
(mean over ranks) whose completion could not be read (CUDA: comm_timer.py), so that
`comm_hidden` reads low for them (their exposed wait only). `busy_s` (and so
`bubble_fraction`) counts compute only: a tp collective or an all-to-all inside an action
is not busy.
"""

from __future__ import annotations

from bisect import bisect_right

from framework.comm.comm_timer import DIMS
from framework.schedules.messages import needs, produces, sender_of
from framework.schedules import Action

OPS = ("F", "B", "I", "W", "U")
PARTS = ("data", "compute", "optimizer", *(f"comm_{d}" for d in DIMS), "bubble", "host")
TOTAL_KEYS = (tuple(f"comm_total_{d}_s" for d in DIMS) + tuple(f"comm_hidden_{d}" for d in DIMS)
              + ("comm_hidden_unseen_calls",))
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


def serialise_pairs(actions: list, pairs: list, spans: list, side: set) -> tuple[list, list]:
    """parallelism.overlap_dualpipe: each overlapped pair's two threads (F beside B) as two
    records one after the other that tile the pair's time, and its communication spans as
    the exposed part alone, so `rank_parts` cuts it as any other action. Within the pair's
    compute window (both receives in, to both threads done), an instant where a thread
    computes is compute (half each when both do, F's or B's when one does), one where no
    thread computes and one waits in a span is that span's exposed communication, the rest
    (thread start and join) host. F's record takes its receive wait, its compute and its
    exposed communication; B's its receive wait, moved after F's share (so its bubble /
    comm_pp split reads a later start: the only approximation), its compute and its exposed
    communication. The spans' whole times stay in the totals (`comm_total_<dim>_s`).
    `pairs`: StepResult.pairs; `side`: the indices of the F thread's spans."""
    if not pairs:
        return actions, spans
    actions, keep, exposed = list(actions), [True] * len(spans), []
    for k, f0, f1, b0, b1 in pairs:
        name_f, start, f_waited, _ = actions[k]
        name_b, _, both, end = actions[k + 1]
        mine = [i for i, (_, _, s, e) in enumerate(spans) if both <= (s + e) / 2 <= end]
        for i in mine:
            keep[i] = False
        threads = [(f0, f1, [spans[i] for i in mine if i in side]), (b0, b1, [spans[i] for i in mine if i not in side])]
        compute, comm, host = _sweep(both, end, threads)
        edges = [f_waited]
        for t, at in ((0, f_waited), (1, None)):
            if at is None:  # B's record: its receive wait, after F's share
                at = edges[-1] + (both - f_waited)
                edges.append(at)
            at += compute[t]
            for dim, sec in comm[t].items():
                exposed.append((dim, "overlapped pair", at, at + sec))
                at += sec
            edges.append(at)
        actions[k] = (name_f, start, f_waited, edges[1])
        actions[k + 1] = (name_b, edges[1], edges[2], edges[3])  # then host up to `end` (thread start, join)
    return actions, sorted([sp for sp, kept in zip(spans, keep) if kept] + exposed, key=lambda sp: sp[2])


def _sweep(lo: float, hi: float, threads: list) -> tuple[list, list, float]:
    """Cut [lo, hi] at every edge; each piece to compute, exposed communication or host
    (serialise_pairs). `threads`: (compute start, end, spans) of F's and B's threads."""
    edges = sorted({lo, hi, *(min(max(x, lo), hi) for a, b, sp in threads
                               for x in (a, b, *(t for _, _, s, e in sp for t in (s, e))))})
    compute, comm, host = [0.0, 0.0], [{}, {}], 0.0
    for a, b in zip(edges, edges[1:]):
        mid, n = (a + b) / 2, b - a
        dims = [next((d for d, _, s, e in sp if s <= mid <= e), None) for _, _, sp in threads]
        busy = [t0 <= mid <= t1 and dims[t] is None for t, (t0, t1, _) in enumerate(threads)]
        if any(busy):
            for t in range(2):
                compute[t] += n * busy[t] / sum(busy)
        elif any(d is not None for d in dims):
            t = 0 if dims[0] is not None else 1
            comm[t][dims[t]] = comm[t].get(dims[t], 0.0) + n
        else:
            host += n
    return compute, comm, host


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
    mean["comm_hidden_unseen_calls"] = sum(t.get("unseen_calls", 0.0) for t in totals) / len(totals)
    ops = [op for op in OPS if any(r.get(op) for r in parts)]
    mean.update({f"time_{op}_s": sum(r.get(op, 0.0) for r in parts) / len(parts) for op in ops})
    # an op a rank did not run this step (an asynchronous schedule's segment) is 0 there
    mean["rank_time_s"] = [{p: r.get(p, 0.0) for p in (*PARTS, *ops)} for r in parts]
    return mean


def busy_s(parts: dict) -> float:
    """A pipeline rank's busy time for its bubble: its pure compute."""
    return sum(parts.get(op, 0.0) for op in OPS)
