"""The schedule model's clock: run every rank's action list together with given op durations.

Each rank computes its actions in order, one at a time; an action that needs a message
starts once the message has arrived (sent when the producing action ended, no transfer
cost); sends never block (gloo's behaviour; NCCL's rules are proved in check.py without a
clock). Durations are per op (`OpTimes` or a dict with U); unit times give the grid the dry
run prints, measured times give the analytic bubble of schedules without a closed form.
"""

from __future__ import annotations

from collections import defaultdict

from .messages import needs, produces, receiver_of, sender_of
from .schedules.base import Action, Op, OpTimes, StageMap


class ScheduleError(ValueError):
    """A rule a schedule breaks; `where`: the (rank, action) pairs it concerns (action None:
    the rank as a whole), so a schedule file's error can name its row and cell."""

    def __init__(self, message: str, where: tuple = ()):
        super().__init__(message)
        self.where = tuple(where)


def _duration(durations, op: Op) -> float:
    if isinstance(durations, OpTimes):
        return 0.0 if op is Op.U else getattr(durations, op.value)
    return durations.get(op.value, durations.get(op, 0.0))


def simulate(lists: dict[int, list[Action]], smap: StageMap, durations=None) -> dict[int, list[tuple]]:
    """{rank: [(start, end, action)]}; ScheduleError on a deadlock, or when a channel's
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
                    arrived[out] = clock[r]
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
