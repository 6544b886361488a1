"""Prove a schedule valid, and draw it as a rank x time grid.

`check` proves a schedule twice:
1. Its action lists, in a simulation where a send never blocks and a receive waits for
   its message (gloo's behaviour). ScheduleError when an action repeats or is missing, a
   backward precedes its forward, the ranks deadlock, a channel's messages are consumed
   in another order than sent, or an asynchronous schedule runs a forward before the
   weight version it needs exists.
2. The batches the executor really issues (`p2p.comm_plan`, the one shared description)
   under NCCL's rules (`nccl_simulate`): each rank's p2p ops run in issue order on one
   stream (a batch starts when the previous one completed and the compute issued before
   it is done); a send completes only together with its matching receive, i.e. once both
   sides' batches have started; a pair's messages match in issue order, tags ignored, so
   the n-th send r -> q must carry the message q's n-th receive from r expects; a batch
   completes as a unit, and a compute that needs a received tensor waits for its whole
   batch. ScheduleError on a deadlock (for any timing: the model has no clock) or on a
   message that would land in another message's buffer.
"""

from __future__ import annotations

from collections import defaultdict

from .p2p import RankPlan, comm_plan, needs, produces, rank_of_stage, sender_of
from .schedules import ASYNC_SCHEDULES, Action, build_schedule, version_of


class ScheduleError(ValueError):
    pass


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
                need = needs(a, r, pp, stages)
                if need is not None and need not in arrived:
                    break
                start = max(clock[r], arrived.get(need, 0))
                if need is not None:
                    recv_order[(sender_of(need, pp), r)].append(need)
                clock[r] = start + durations[a.op]
                timeline[r].append((start, clock[r], a))
                out = produces(a, r, pp, stages)
                if out is not None:
                    arrived[out] = clock[r]
                    sent_order[(r, rank_of_stage(out.stage, pp))].append(out)
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


def _match_pairs(plans: dict[int, RankPlan]) -> dict[tuple, tuple]:
    """NCCL's matching: the n-th send r -> q meets q's n-th receive from r. Returns
    {(rank, batch, op index): (peer, peer's batch)} for every op."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, plan in plans.items():
        for k, batch in enumerate(plan.batches):
            for i, op in enumerate(batch):
                (sends[(r, op.peer)] if op.op == "send" else recvs[(op.peer, r)]).append((r, k, i, op.msg))
    match = {}
    for pair in set(sends) | set(recvs):
        s, rv = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(rv):
            raise ScheduleError(f"channel {pair[0]}->{pair[1]}: {len(s)} sends but {len(rv)} receives")
        for (r, k, i, msg), (q, kq, iq, want) in zip(s, rv):
            if msg != want:
                raise ScheduleError(f"channel {pair[0]}->{pair[1]}: NCCL matches in issue order, so {msg} "
                                    f"would land in the buffer of {want}")
            match[(r, k, i)], match[(q, kq, iq)] = (q, kq), (r, k)
    return match


def _recv_batch(plan: RankPlan, rank: int, pp: int, stages: int) -> list:
    """For each action, the index of the batch holding the receive it waits for, or None."""
    where = {op.msg: k for k, batch in enumerate(plan.batches) for op in batch if op.op == "recv"}
    out = []
    for k, a in enumerate(plan.actions):
        msg = needs(a, rank, pp, stages)
        if msg is not None and (msg not in where or where[msg] > k):
            raise ScheduleError(f"rank {rank}: {a} needs {msg}, which no earlier batch receives")
        out.append(None if msg is None else where[msg])
    return out


def nccl_simulate(plans: dict[int, RankPlan], pp: int, v: int) -> None:
    """Run every rank's batches and computes under NCCL's rules (module docstring) until
    nothing can move; anything left is a deadlock."""
    stages = pp * v
    match = _match_pairs(plans)
    wait_on = {r: _recv_batch(plan, r, pp, stages) for r, plan in plans.items()}
    started = {r: 0 for r in plans}  # batches started (a prefix: the stream is ordered)
    done = {r: 0 for r in plans}  # batches completed (a prefix)
    computed = {r: 0 for r in plans}  # actions whose compute is done (a prefix)

    def batch_complete(r: int, k: int) -> bool:
        return all(started[peer] > kb for peer, kb in (match[(r, k, i)] for i in range(len(plans[r].batches[k]))))

    progressed = True
    while progressed:
        progressed = False
        for r, plan in plans.items():
            while True:
                k, c = started[r], computed[r]
                if k < len(plan.batches) and done[r] == k and c >= k:  # issued after action k-1
                    started[r] += 1
                elif done[r] < started[r] and batch_complete(r, done[r]):
                    done[r] += 1
                elif c < len(plan.actions) and (wait_on[r][c] is None or done[r] > wait_on[r][c]):
                    computed[r] += 1
                else:
                    break
                progressed = True
    stuck = {r: _stuck(plans[r], started[r], done[r], computed[r]) for r in plans
             if done[r] < len(plans[r].batches) or computed[r] < len(plans[r].actions)}
    if stuck:
        raise ScheduleError(f"deadlock under NCCL's rules: {stuck}")


def _stuck(plan: RankPlan, started: int, done: int, computed: int) -> str:
    if done < started:
        ops = ", ".join(f"{op.op} {op.msg} {'to' if op.op == 'send' else 'from'} rank {op.peer}"
                        for op in plan.batches[done])
        return f"batch [{ops}] never completes"
    return f"{plan.actions[computed]} waits" if computed < len(plan.actions) else "batch never starts"


def check(name: str, pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """Build and prove a schedule (its lists, and the executor's batches under NCCL's
    rules); returns the lists."""
    lists = build_schedule(name, pp, m, v, steps)
    async_ = name in ASYNC_SCHEDULES
    n = m * steps if async_ else m
    if sorted(lists) != list(range(pp)):
        raise ScheduleError(f"lists for ranks {sorted(lists)}, expected 0..{pp - 1}")
    _check_lists(lists, pp, v, n, async_)
    simulate(lists, pp, v)
    nccl_simulate(comm_plan(lists, pp, v), pp, v)
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
