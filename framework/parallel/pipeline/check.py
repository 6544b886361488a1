"""Prove a schedule valid before any rank runs it.

`check` (a registered schedule) and `prove` (lists from anywhere, e.g. a CSV) prove:
1. The lists on their own: every (micro-batch, chunk) has one F and one backward per rank
   (B, or I and W, each W after its I on the same rank), a backward never precedes its
   forward, only the ops the schedule declares appear, and no rank holds more activations
   at once than the schedule's declared bound (F to its B or W).
2. The lists run together in a simulation where a send never blocks and a receive waits
   for its message (gloo's behaviour, `framework/sim/clock.py`): ScheduleError when the ranks
   deadlock, a channel's messages are consumed in another order than sent, or an
   asynchronous schedule runs a forward before the weight version it needs exists.
3. The batches the executor really issues (`p2p.comm_plan`, the one shared description)
   under NCCL's rules (`nccl_simulate`): each rank's p2p ops run in issue order on one
   stream (a batch starts when the previous one completed and the compute issued before
   it is done); a send completes only together with its matching receive, i.e. once both
   sides' batches have started; a pair's messages match in issue order, tags ignored, so
   the n-th send r -> q must carry the message q's n-th receive from r expects; a group
   of a batch (one `batch_isend_irecv`, p2p.py) completes as a unit, and a compute that
   needs a received tensor waits for its whole group. ScheduleError on a deadlock (for any
   timing: the model has no clock) or on a message that would land in another message's
   buffer.
"""

from __future__ import annotations

from framework.parallel.pipeline.p2p import RankPlan, comm_plan
from framework.parallel.pipeline.schedules.base import Action, Op, Schedule, StageMap, get
from framework.sim.clock import simulate
from framework.sim.matching import ScheduleError, match_pairs, recv_units, units

__all__ = ["ScheduleError", "check", "prove", "nccl_simulate", "alive_peak"]


def _check_lists(sched: Schedule, lists: dict[int, list[Action]], v: int, n: int) -> None:
    """Each (micro-batch, chunk) runs F once and its backward once per rank: B, or I then W
    (W after its I); only the ops the schedule declares; U only in asynchronous schedules."""
    want = {(j, c) for j in range(n) for c in range(v)}
    for r, acts in lists.items():
        seen: set[Action] = set()
        for a in acts:
            if a.op not in sched.ops:
                raise ScheduleError(f"rank {r}: {a} uses op {a.op.value}, which {sched.name} does not declare "
                                    f"(its ops: {''.join(sorted(o.value for o in sched.ops))})", [(r, a)])
            if a in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice", [(r, a)])
            if (a.microbatch, a.chunk) not in want and a.op is not Op.U:
                raise ScheduleError(f"rank {r}: {a} names micro-batch {a.microbatch} / chunk {a.chunk}, outside "
                                    f"{n} micro-batches x {v} chunks", [(r, a)])
            if a.op in (Op.B, Op.I) and Action(Op.F, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {r}: {a} before its forward", [(r, a)])
            if a.op is Op.W and Action(Op.I, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {r}: {a} before its I (W after its I on the same rank)", [(r, a)])
            if a.op is Op.B and Action(Op.I, a.microbatch, a.chunk) in seen or \
                    a.op is Op.I and Action(Op.B, a.microbatch, a.chunk) in seen:
                raise ScheduleError(f"rank {r}: {a}: micro-batch {a.microbatch} runs both B and I", [(r, a)])
            seen.add(a)
        dangling = [a for a in seen if a.op is Op.I and Action(Op.W, a.microbatch, a.chunk) not in seen]
        if dangling:
            raise ScheduleError(f"rank {r}: {dangling[0]} has no W (I and W counts differ)", [(r, dangling[0])])
        for op, label in ((Op.F, "F"), (None, "backward")):
            done = {(a.microbatch, a.chunk) for a in seen
                    if (a.op is op if op else (a.op is Op.B or a.op is Op.W))}
            if done != want:
                missing = sorted(f"{c}:{j}" for j, c in want - done)
                raise ScheduleError(f"rank {r}: {label} missing for (chunk:micro-batch) {missing[:5]}", [(r, None)])
        if sched.flushes and any(a.op is Op.U for a in acts):
            raise ScheduleError(f"rank {r}: update action in a synchronous schedule")


def alive_peak(acts: list[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose activations a rank holds at once: from F
    to the end of its backward (B, or W: a W still needs the stage's saved tensors)."""
    alive = peak = 0
    for a in acts:
        if a.op is Op.F:
            alive += 1
            peak = max(peak, alive)
        elif a.op.ends_backward:
            alive -= 1
    return peak


def _check_memory(sched: Schedule, lists: dict[int, list[Action]], pp: int, m: int, v: int) -> None:
    for r, acts in lists.items():
        bound, peak = sched.memory_bound(pp, m, v, r), alive_peak(acts)
        if peak > bound:
            raise ScheduleError(f"rank {r}: holds {peak} (micro-batch, chunk) activations at once, over "
                                f"{sched.name}'s declared bound {bound}", [(r, None)])


def _check_versions(sched: Schedule, lists: dict[int, list[Action]], smap: StageMap, m: int) -> None:
    rule = sched.asynchronous
    for r, acts in lists.items():
        updates = 0
        for a in acts:
            if a.op is Op.U:
                updates += 1
            elif a.op is Op.F:
                want = rule.version_of(a.microbatch, smap.stage(r, a.chunk), smap.num_stages, m)
                if want > updates:
                    raise ScheduleError(f"rank {r}: {a} needs weight version {want} before it exists", [(r, a)])


def nccl_simulate(plans: dict[int, RankPlan], smap: StageMap) -> None:
    """Run every rank's units (one per p2p group, matching.py) and computes under NCCL's
    rules (module docstring) until nothing can move; anything left is a deadlock."""
    ul = {r: units(plan) for r, plan in plans.items()}
    match = match_pairs(plans, ul)
    wait_on = {r: [where[0] if kind == "unit" else None for kind, where in recv_units(plan, ul[r], r, smap)]
               for r, plan in plans.items()}
    started = {r: 0 for r in plans}  # units started (a prefix: the stream is ordered)
    done = {r: 0 for r in plans}  # units completed (a prefix)
    computed = {r: 0 for r in plans}  # actions whose compute is done (a prefix)

    def unit_complete(r: int, u: int) -> bool:
        return all(started[peer] > up for peer, up in (match[(r, u, i)] for i in range(len(ul[r][u][1]))))

    progressed = True
    while progressed:
        progressed = False
        for r, plan in plans.items():
            while True:
                u, c = started[r], computed[r]
                if u < len(ul[r]) and done[r] == u and c >= ul[r][u][0]:  # issued after action k-1
                    started[r] += 1
                elif done[r] < started[r] and unit_complete(r, done[r]):
                    done[r] += 1
                elif c < len(plan.actions) and (wait_on[r][c] is None or done[r] > wait_on[r][c]):
                    computed[r] += 1
                else:
                    break
                progressed = True
    stuck = {r: _stuck(plans[r], ul[r], started[r], done[r], computed[r]) for r in plans
             if done[r] < len(ul[r]) or computed[r] < len(plans[r].actions)}
    if stuck:
        raise ScheduleError(f"deadlock under NCCL's rules: {stuck}")


def _stuck(plan: RankPlan, unit_list: list, started: int, done: int, computed: int) -> str:
    if done < started:
        ops = ", ".join(f"{op.op} {op.msg} {'to' if op.op == 'send' else 'from'} rank {op.peer}"
                        for op in unit_list[done][1])
        return f"batch [{ops}] never completes"
    return f"{plan.actions[computed]} waits" if computed < len(plan.actions) else "batch never starts"


def prove(sched: Schedule, lists: dict[int, list[Action]], pp: int, m: int, v: int = 1, steps: int = 1,
          pairs: bool = False) -> None:
    """Prove given lists for a schedule's declarations: the rules above, the declared
    activation-memory bound, and the executor's batches under gloo's and NCCL's rules
    (`pairs`: those of parallelism.overlap_dualpipe, p2p._pair)."""
    smap = sched.stage_map(pp, v)
    n = m * steps if not sched.flushes else m
    if sorted(lists) != list(range(pp)):
        raise ScheduleError(f"lists for ranks {sorted(lists)}, expected 0..{pp - 1}")
    _check_lists(sched, lists, v, n)
    _check_memory(sched, lists, pp, n if not sched.flushes else m, v)
    simulate(lists, smap)
    nccl_simulate(comm_plan(lists, smap, pairs), smap)
    if not sched.flushes:
        _check_versions(sched, lists, smap, m)


def check(name: str, pp: int, m: int, v: int = 1, steps: int = 1, pairs: bool = False) -> dict[int, list[Action]]:
    """Build and prove a registered schedule; returns the lists."""
    sched = get(name)
    bad = sched.why_not(pp, m, v)
    if bad is not None:
        raise ScheduleError(f"{bad.key}: {bad.reason}")
    lists = sched.generate(pp, m, v, steps if not sched.flushes else 1)
    prove(sched, lists, pp, m, v, steps, pairs)
    return lists
