"""The schedule model's clock: run every rank's action list (or plan) together with durations.

`simulate` (unit time or per-op durations, no link cost): each rank computes its actions in
order; an action that needs a message starts once it has arrived (when the producing
action ended); sends never block. The dry run's grid, the bubble of schedules without a
closed form (reported as "schedule model", not analytic), and the lockstep that places p2p
ops (p2p.py) run on it; NCCL's rules are proved in check.py without a clock.
`clock` / `predict` (the simulator, docs/simulator.md): the executor's real batches with
per-stage durations, host gaps and a link cost, under gloo's or NCCL's rules.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from framework.schedules.messages import needs, produces, receiver_of, sender_of
from framework.schedules.base import Action, Op, OpTimes, StageMap, pair_starts
from framework.schedules.matching import ScheduleError, match_pairs, recv_units, stream_prev, units


def _duration(durations, op: Op) -> float:
    if isinstance(durations, OpTimes):
        return 0.0 if op is Op.U else getattr(durations, op.value)
    return durations.get(op.value, durations.get(op, 0.0))


def simulate(lists: dict[int, list[Action]], smap: StageMap, durations=None, comm: float = 0.0) -> dict[int, list[tuple]]:
    """{rank: [(start, end, action)]}; `comm`: a message between two ranks arrives this long
    after its producer ends (each receive gating only its own op; the zero-bubble paper's
    T_comm). ScheduleError on a deadlock, or when a channel's
    activations (or its gradients) are consumed in another order than sent. The two kinds
    may interleave differently (a V sends both over one pair of ranks): which buffer each
    message lands in under NCCL's in-order matching is proved on the real batches in
    check.nccl_simulate."""
    if durations is None or durations == "unit":  # every compute op one unit: the lockstep of p2p.py
        durations = {"F": 1, "B": 1, "I": 1, "W": 1, "U": 0}
    pos = {r: 0 for r in lists}
    clock = {r: 0 for r in lists}
    arrived: dict = {}  # message -> time it was sent
    sent_order, recv_order = defaultdict(list), defaultdict(list)
    timeline = {r: [] for r in lists}
    remaining = sum(len(x) for x in lists.values())
    while remaining:
        progressed = False
        for r, acts in lists.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = needs(a, r, smap)
                if need is not None and need not in arrived:
                    break
                start = max(clock[r], arrived.get(need, 0))
                if need is not None:
                    recv_order[(sender_of(need, smap), r, need.kind)].append(need)
                clock[r] = start + _duration(durations, a.op)
                timeline[r].append((start, clock[r], a))
                out = produces(a, r, smap)
                if out is not None:
                    arrived[out] = clock[r] + (comm if receiver_of(out, smap) != r else 0)
                    sent_order[(r, receiver_of(out, smap), out.kind)].append(out)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(lists[r][pos[r]]) for r in lists if pos[r] < len(lists[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}",
                                [(r, lists[r][pos[r]]) for r in lists if pos[r] < len(lists[r])])
    for channel, order in sent_order.items():
        if recv_order[channel] != order:
            raise ScheduleError(f"channel {channel[0]}->{channel[1]} receives its {channel[2]} messages out of "
                                "send order")
    return timeline


def idle_share(timeline: dict[int, list[tuple]]) -> float:
    """Idle share averaged over ranks, each rank's window from 0 to the last rank's end (the
    flush): the measured bubble's definition."""
    end = max((t for r in timeline for _, t, _ in timeline[r]), default=0)
    if end == 0:
        return 0.0
    busy = [sum(e - s for s, e, _ in timeline[r]) for r in timeline]
    return sum(1 - b / end for b in busy) / len(busy)


def simulated_bubble(lists: dict[int, list[Action]], smap: StageMap, durations=None) -> float:
    return idle_share(simulate(lists, smap, durations))


def grid(lists: dict[int, list[Action]], smap: StageMap, durations=None) -> str:
    """Rank x time: one column per time unit, `.` where the rank idles (integer durations)."""
    timeline = simulate(lists, smap, durations)
    end = int(max((t for r in timeline for _, t, _ in timeline[r]), default=0))
    width = max((len(str(a)) for r in lists for a in lists[r]), default=2)
    rows = []
    for r in sorted(timeline):
        cells = ["." * width] * end
        for s, e, a in timeline[r]:
            for t in range(int(s), int(e)):
                cells[t] = f"{str(a):<{width}}"
        rows.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(rows)


# --- The calibrated clock: a plan's real batches, measured durations, a link cost ---------


@dataclass
class Costs:
    """What the clock charges. `compute[(rank, chunk, op)]`: seconds of one action's compute
    (per stage, never pooled across stages; op a letter); `gap_s[rank]`: host time between
    one action's end and the next one's start (issuing its p2p batch, bookkeeping), idle in
    the measured bubble; a transfer costs `alpha_s + bytes / beta_Bps`, counted from the
    end of the producing action (so the sender's issue time is inside alpha); `flush_s`:
    from the last compute of a flushing step to the end of its flush (the step's sends
    waited for, the pp all-reduce)."""

    compute: dict = field(default_factory=dict)
    gap_s: dict = field(default_factory=dict)
    alpha_s: float = 0.0
    beta_Bps: float = float("inf")
    message_bytes: int = 0
    flush_s: float = 0.0
    # a receive posted after its send was issued: the latency from the posting (gloo's
    # rendezvous costs more then); None: alpha_s
    alpha_late_s: Optional[float] = None
    # (rank, chunk, op) -> seconds of an action inside an overlapped F / B pair
    # (parallelism.overlap_dualpipe: sim/cost/pairs.py); the pairs are `pair_starts`'
    paired: dict = field(default_factory=dict)

    def duration(self, rank: int, a: Action, paired: bool = False) -> float:
        key = (rank, a.chunk, a.op.value)
        if paired and key in self.paired:
            return self.paired[key]
        if key not in self.compute:
            raise KeyError(f"no duration for {a} on rank {rank} (chunk {a.chunk}, op {a.op.value})")
        return self.compute[key]

    def transfer_s(self, late: bool = False) -> float:
        alpha = self.alpha_late_s if late and self.alpha_late_s is not None else self.alpha_s
        return alpha + (self.message_bytes / self.beta_Bps if self.beta_Bps else 0.0)


@dataclass
class Timed:
    """One simulated action: as the executor's records (start before the receive wait)."""

    action: Action
    start: float
    compute_start: float
    end: float


def clock(plans: dict, smap: StageMap, costs: Costs, rules: str = "gloo") -> dict[int, list[Timed]]:
    """Run every rank's plan (`p2p.RankPlan`: actions, and batch k issued after action k-1,
    one unit per group: matching.py) with `costs`. Each rank computes serially.
    Both rules: a transfer starts once both sides' units have started (the send issued and
    its receive posted) and completes the send and the receive together. rules="gloo": a
    unit starts when issued, each op is its own Work, and a compute waits for its receive
    alone; measured on this machine's gloo, a message sent before its receive was posted
    arrives only after the posting (median 1.4 ms after it, against 0.4 ms after the send
    when the receive was posted first: experiments/simulator). rules="nccl": a rank's units
    on one communicator run in issue order on its stream (a unit starts when issued and
    the one before it on that stream is done; a communicator per pair of neighbours,
    matching.stream_of; rules="nccl-shared": the pp group's one, the design before), a unit completes with its last op, and a compute waits for its receive's whole
    unit (one coalesced Work)."""
    nccl = rules.startswith("nccl")
    ul = {r: units(p, shared=rules == "nccl-shared") for r, p in plans.items()}
    prev = {r: stream_prev(ul[r]) for r in plans}
    pairs = match_pairs(plans, ul)
    n = {r: len(p.actions) for r, p in plans.items()}
    end = {r: [None] * n[r] for r in plans}
    cstart = {r: [None] * n[r] for r in plans}
    ustart = {r: [None] * len(ul[r]) for r in plans}
    udone = {r: [None] * len(ul[r]) for r in plans}
    opdone: dict = {}
    waits = {r: recv_units(plans[r], ul[r], r, smap) for r in plans}
    ni = {r: 0 for r in plans}  # units issued (a prefix)
    na = {r: 0 for r in plans}  # actions computed (a prefix)
    low = {r: 0 for r in plans}  # every unit before it is done
    local_ready: dict = {}  # a V's turn: handed over in memory when produced
    cost = (costs.transfer_s(), costs.transfer_s(late=True))
    in_pair = {r: {i for k in pair_starts(p.actions) for i in (k, k + 1)} if costs.paired else set()
               for r, p in plans.items()}
    progressed = True
    while progressed:
        progressed = False
        for r, plan in plans.items():
            while True:
                moved = False
                while ni[r] < len(ul[r]) and ul[r][ni[r]][0] <= na[r]:  # unit goes out after action k-1
                    ni[r] += 1
                    moved = True
                for u in range(low[r], ni[r]):
                    if udone[r][u] is not None:
                        continue
                    if ustart[r][u] is None:  # nccl: behind the one before it on its stream
                        k, p = ul[r][u][0], prev[r][u]
                        issued = 0.0 if k == 0 else end[r][k - 1]
                        if nccl and p is not None:
                            if udone[r][p] is None:
                                continue
                            issued = max(issued, udone[r][p])
                        ustart[r][u] = issued
                        moved = True
                    udone[r][u] = _unit_done(ul[r][u][1], r, u, pairs, ustart, cost, opdone)
                    moved = moved or udone[r][u] is not None
                while low[r] < ni[r] and udone[r][low[r]] is not None:
                    low[r] += 1
                k = na[r]
                if k < n[r]:
                    a = plan.actions[k]
                    ready = (end[r][k - 1] if k else 0.0) + costs.gap_s.get(r, 0.0)
                    kind, where = waits[r][k]
                    if kind == "unit":
                        got = udone[r][where[0]] if nccl else opdone.get((r, *where))
                        ready = None if got is None else max(ready, got)
                    elif kind == "local":
                        ready = None if where not in local_ready else max(ready, local_ready[where])
                    if ready is not None:
                        cstart[r][k] = ready
                        end[r][k] = ready + costs.duration(r, a, k in in_pair[r])
                        out = produces(a, r, smap)
                        if out is not None and receiver_of(out, smap) == r:
                            local_ready[out] = end[r][k]
                        na[r] += 1
                        moved = True
                if not moved:
                    break
                progressed = True
    missing = [r for r in plans if None in end[r]]
    if missing:
        raise ScheduleError(f"the clock stalls on ranks {missing} (a plan the checker rejects)")
    return {r: [Timed(a, end[r][k - 1] + costs.gap_s.get(r, 0.0) if k else costs.gap_s.get(r, 0.0),
                      cstart[r][k], end[r][k]) for k, a in enumerate(plans[r].actions)] for r in plans}


def _unit_done(ops: list, r: int, u: int, pairs: dict, ustart: dict, cost: tuple, opdone: dict):
    """When unit u of rank r completes (None: a peer's unit has not started); fills `opdone`
    for each op whose transfer is known (gloo's compute waits for its own op)."""
    done = ustart[r][u]
    for i, op in enumerate(ops):
        peer, up = pairs[(r, u, i)]
        if ustart[peer][up] is None:
            done = None
            continue
        send_at, recv_at = (ustart[r][u], ustart[peer][up]) if op.op == "send" else (ustart[peer][up], ustart[r][u])
        opdone[(r, u, i)] = max(send_at, recv_at) + cost[recv_at > send_at]
        done = None if done is None else max(done, opdone[(r, u, i)])
    return done


@dataclass
class Prediction:
    """The clock's step: per rank busy (compute), window (first action's start to the end
    of the step) and their bubble (1 - busy / window: the measured bubble's definition)."""

    timeline: dict[int, list[Timed]]
    busy_s: dict[int, float]
    window_s: dict[int, float]
    pipeline_s: float  # from the step's start to its end (flush, or the last action)

    @property
    def rank_bubble(self) -> dict[int, float]:
        return {r: 1 - self.busy_s[r] / self.window_s[r] if self.window_s[r] > 0 else 0.0 for r in self.busy_s}

    @property
    def bubble(self) -> float:
        b = self.rank_bubble
        return sum(b.values()) / len(b)


def predict(plans: dict, smap: StageMap, costs: Costs, flushes: bool = True, rules: str = "gloo") -> Prediction:
    """One step (flushing schedules; the window of each rank ends at the flush, after the
    last rank's compute) or a never-flushed run (each rank's window ends at its last action)."""
    tl = clock(plans, smap, costs, rules)
    last = max(t.end for r in tl for t in tl[r])
    finish = last + costs.flush_s if flushes else None
    busy = {r: sum(t.end - t.compute_start for t in tl[r]) for r in tl}
    window = {r: ((finish if flushes else tl[r][-1].end) - tl[r][0].start) if tl[r] else 0.0 for r in tl}
    return Prediction(tl, busy, window, finish if flushes else last)
