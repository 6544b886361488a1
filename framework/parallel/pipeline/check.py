"""Prove a schedule valid, and draw it as a rank x time grid.

`check` runs all ranks' lists together in a simulation where a send never blocks and a
receive waits for its message (what the executor does). It raises ScheduleError when:
an action repeats or is missing; a backward precedes its forward on a rank; the ranks
deadlock (no rank can take its next action); a channel's messages are received in a
different order than sent (NCCL matches point-to-point messages by order, not tag); or an
asynchronous schedule runs a forward before the weight version it needs exists.
"""

from __future__ import annotations

from collections import defaultdict

from .schedules import ASYNC_SCHEDULES, Action, build_schedule, stage_of, version_of


class ScheduleError(ValueError):
    pass


def _needs(a: Action, rank: int, pp: int, stages: int):
    """The message this action must receive first: (kind, microbatch, receiving stage), or None."""
    g = stage_of(rank, a.chunk, pp)
    if a.op == "F" and g > 0:
        return ("act", a.microbatch, g)
    if a.op == "B" and g < stages - 1:
        return ("grad", a.microbatch, g)
    return None


def _sends(a: Action, rank: int, pp: int, stages: int):
    g = stage_of(rank, a.chunk, pp)
    if a.op == "F" and g < stages - 1:
        return ("act", a.microbatch, g + 1)
    if a.op == "B" and g > 0:
        return ("grad", a.microbatch, g - 1)
    return None


def _rank_of_stage(g: int, pp: int) -> int:
    return g % pp


def _check_lists(lists: dict[int, list[Action]], pp: int, v: int, n: int, async_: bool) -> None:
    for r, acts in lists.items():
        seen = set()
        for a in acts:
            if a in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            if a.op == "B" and Action("F", a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {r}: {a} before its forward")
            seen.add(a)
        want = {Action(op, j, c) for op in "FB" for j in range(n) for c in range(v)}
        missing = want - {a for a in seen if a.op in "FB"}
        if missing:
            raise ScheduleError(f"rank {r}: missing {sorted(map(str, missing))[:5]}")
        if not async_ and any(a.op == "U" for a in acts):
            raise ScheduleError(f"rank {r}: update action in a synchronous schedule")


def simulate(lists: dict[int, list[Action]], pp: int, v: int, durations=None):
    """Run the ranks together; returns {rank: [(start, end, action)]} with unit-ish times."""
    stages = pp * v
    durations = durations or {"F": 1, "B": 1, "U": 0}
    pos = {r: 0 for r in lists}
    clock = {r: 0 for r in lists}
    arrived: dict[tuple, int] = {}  # message -> time it was sent
    sent_order, recv_order = defaultdict(list), defaultdict(list)
    timeline = {r: [] for r in lists}
    remaining = sum(len(x) for x in lists.values())
    while remaining:
        progressed = False
        for r, acts in lists.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = _needs(a, r, pp, stages)
                if need is not None and need not in arrived:
                    break
                start = max(clock[r], arrived.get(need, 0))
                if need is not None:
                    recv_order[(_rank_of_stage(need[2] + (-1 if need[0] == "act" else 1), pp), r)].append(need)
                clock[r] = start + durations[a.op]
                timeline[r].append((start, clock[r], a))
                out = _sends(a, r, pp, stages)
                if out is not None:
                    arrived[out] = clock[r]
                    sent_order[(r, _rank_of_stage(out[2], pp))].append(out)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(lists[r][pos[r]]) for r in lists if pos[r] < len(lists[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}")
    for channel, order in sent_order.items():
        if recv_order[channel] != order:
            raise ScheduleError(f"channel {channel[0]}->{channel[1]} receives out of send order")
    return timeline


def _check_versions(name: str, lists: dict[int, list[Action]], pp: int, m: int) -> None:
    for r, acts in lists.items():
        updates = 0
        for a in acts:
            if a.op == "U":
                updates += 1
            elif a.op == "F" and version_of(name, a.microbatch, r, pp, m) > updates:
                raise ScheduleError(f"rank {r}: {a} needs weight version "
                                    f"{version_of(name, a.microbatch, r, pp, m)} before it exists")


def check(name: str, pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """Build and prove a schedule; returns the lists."""
    lists = build_schedule(name, pp, m, v, steps)
    async_ = name in ASYNC_SCHEDULES
    n = m * steps if async_ else m
    if sorted(lists) != list(range(pp)):
        raise ScheduleError(f"lists for ranks {sorted(lists)}, expected 0..{pp - 1}")
    _check_lists(lists, pp, v, n, async_)
    simulate(lists, pp, v)
    if async_:
        _check_versions(name, lists, pp, m)
    return lists


def grid(lists: dict[int, list[Action]], pp: int, v: int = 1, backward_cost: int = 1) -> str:
    """Rank x time: one column per time unit, `.` where the rank idles."""
    timeline = simulate(lists, pp, v, {"F": 1, "B": backward_cost, "U": 0})
    end = max((t for r in timeline for _, t, _ in timeline[r]), default=0)
    width = max((len(str(a)) for r in lists for a in lists[r]), default=2)
    rows = []
    for r in sorted(timeline):
        cells = ["." * width] * end
        for s, e, a in timeline[r]:
            for t in range(s, e):
                cells[t] = f"{str(a):<{width}}"
        rows.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(rows)


def simulated_bubble(lists: dict[int, list[Action]], pp: int, v: int = 1, backward_cost: int = 2) -> float:
    """Idle share averaged over ranks in the unit-time simulation (for cross-checking formulas)."""
    timeline = simulate(lists, pp, v, {"F": 1, "B": backward_cost, "U": 0})
    end = max(t for r in timeline for _, t, _ in timeline[r])
    busy = [sum(e - s for s, e, _ in timeline[r]) for r in timeline]
    return sum(1 - b / end for b in busy) / len(busy)
