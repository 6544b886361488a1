"""Prove a schedule valid before any rank runs it.

`check` (a registered schedule) and `prove` (lists from anywhere, e.g. a CSV) prove:
1. The lists on their own: every (micro-batch, chunk) has one F and one backward per rank
   (B, or I and W, each W after its I on the same rank), a backward never precedes its
   forward, only the ops the schedule declares appear, and no rank holds more activations
   at once than the schedule's declared bound (F to its B or W).
2. The lists run together in a simulation where a send never blocks and a receive waits
   for its message (gloo's behaviour, `framework/schedules/clock.py`): ScheduleError when the ranks
   deadlock, a channel's messages are consumed in another order than sent, or an
   asynchronous schedule runs a forward before the weight version it needs exists.
3. The batches the executor really issues (`p2p.comm_plan`, the one shared description)
   under NCCL's rules (`nccl_simulate`): each rank's p2p ops on one communicator (one per
   pair of pipeline neighbours: matching.stream_of) run in issue order on its stream (a
   unit starts when the one before it on that stream completed and the compute issued
   before it is done); a send completes only together with its matching receive, i.e. once both
   sides' batches have started; a pair's messages match in issue order, tags ignored, so
   the n-th send r -> q must carry the message q's n-th receive from r expects; a group
   of a batch (one `batch_isend_irecv`, p2p.py) completes as a unit, and a compute that
   needs a received tensor waits for its whole group. ScheduleError on a deadlock (for any
   timing: the model has no clock) or on a message that would land in another message's
   buffer.
"""

from __future__ import annotations

from framework.schedules.p2p import RankPlan, comm_plan
from framework.schedules.base import Action, Op, Schedule, StageMap, get
from framework.schedules.clock import simulate
from framework.schedules.matching import ScheduleError, match_pairs, recv_units, stream_prev, units

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


def nccl_simulate(plans: dict[int, RankPlan], smap: StageMap, shared: bool = False, cp: int = 1) -> None:
    """Run every rank's units (one per p2p group and communicator, matching.py) and computes
    under NCCL's rules (module docstring) until nothing can move; anything left is a deadlock.
    `shared`: every p2p op of a rank on the pp group's one stream (the design before the
    pairs' own groups). `cp` > 1: each pipeline rank is cp processes whose F, B and I pass
    the context-parallel ring (`_ring_units`), pipeline p2p going between processes of one
    cp rank."""
    procs = [(r, c) for r in plans for c in range(cp)]
    base = {r: units(plan, shared) for r, plan in plans.items()}
    match = match_pairs(plans, base)
    ul, pos = {}, {}
    for r, plan in plans.items():
        ul[r], pos[r] = _ring_units(plan, base[r], shared) if cp > 1 else (base[r], list(range(len(base[r]))))
    prev = {r: stream_prev(ul[r]) for r in plans}
    old = {r: {e: u for u, e in enumerate(pos[r])} for r in plans}
    wait_on = {r: [pos[r][where[0]] if kind == "unit" else None for kind, where in recv_units(plan, base[r], r, smap)]
               for r, plan in plans.items()}
    ring = {r: {u[3]: e for e, u in enumerate(ul[r]) if len(u) > 3} for r in plans}  # action k -> its ring unit
    started = {q: [False] * len(ul[q[0]]) for q in procs}
    done = {q: [False] * len(ul[q[0]]) for q in procs}
    issued = {q: 0 for q in procs}  # units issued (a prefix: the host issues in order)
    low = {q: 0 for q in procs}  # every unit before it is done
    computed = {q: 0 for q in procs}  # actions whose compute is done (a prefix)

    def complete(q: tuple, u: int) -> bool:
        r, c = q
        if len(ul[r][u]) > 3:  # a ring pass: every cp process of this pipeline rank has started it
            return all(started[(r, c2)][u] for c2 in range(cp))
        return all(started[(peer, c)][pos[peer][up]] for peer, up in (match[(r, old[r][u], i)]
                                                                       for i in range(len(ul[r][u][1]))))

    def may_start(q: tuple, u: int) -> bool:
        r, p = q[0], prev[q[0]][u]
        if p is not None and not done[q][p]:
            return False
        if len(ul[r][u]) > 3:  # issued inside its action: after the action's receive
            w = wait_on[r][ul[r][u][3]]
            return w is None or done[q][w]
        return True

    progressed = True
    while progressed:
        progressed = False
        for q in procs:
            r, plan = q[0], plans[q[0]]
            while True:
                moved = False
                while issued[q] < len(ul[r]) and computed[q] >= ul[r][issued[q]][0]:  # after action k-1
                    issued[q] += 1
                    moved = True
                for u in range(low[q], issued[q]):  # a unit starts once the one before it on its stream is done
                    if not started[q][u] and may_start(q, u):
                        started[q][u] = moved = True
                    if started[q][u] and not done[q][u] and complete(q, u):
                        done[q][u] = moved = True
                while low[q] < issued[q] and done[q][low[q]]:
                    low[q] += 1
                c = computed[q]
                if c < len(plan.actions) and (wait_on[r][c] is None or done[q][wait_on[r][c]]) \
                        and (c not in ring[r] or done[q][ring[r][c]]):
                    computed[q] += 1
                    moved = True
                if not moved:
                    break
                progressed = True
    stuck = {q if cp > 1 else q[0]: _stuck(plans[q[0]], ul[q[0]], low[q], started[q], computed[q]) for q in procs
             if low[q] < len(ul[q[0]]) or computed[q] < len(plans[q[0]].actions)}
    if stuck:
        raise ScheduleError(f"deadlock under NCCL's rules: {stuck}")


def _ring_units(plan: RankPlan, unit_list: list, shared: bool) -> tuple[list, list]:
    """The units with a ring pass added for each F, B and I (attention's blocks go round the cp
    ring in the forward and in the input-gradient backward; W passes nothing): issued as its
    action starts, after the units of the batch before it, on the cp group's stream (or, with
    `shared`, on the one stream of the design before). Returns (units, position of each old
    unit); a ring unit is (k, [], stream, k)."""
    out, pos, u = [], [], 0
    for k in range(len(plan.actions) + 1):
        while u < len(unit_list) and unit_list[u][0] == k:
            pos.append(len(out))
            out.append(unit_list[u])
            u += 1
        if k < len(plan.actions) and plan.actions[k].op in (Op.F, Op.B, Op.I):
            out.append((k, [], "pp" if shared else "cp", k))
    return out, pos


def _stuck(plan: RankPlan, unit_list: list, low: int, started: list, computed: int) -> str:
    if low < len(unit_list) and started[low]:
        if len(unit_list[low]) > 3:
            return f"the ring pass of {plan.actions[unit_list[low][3]]} never completes"
        ops = ", ".join(f"{op.op} {op.msg} {'to' if op.op == 'send' else 'from'} rank {op.peer}"
                        for op in unit_list[low][1])
        return f"batch [{ops}] never completes"
    return f"{plan.actions[computed]} waits" if computed < len(plan.actions) else "batch never starts"


def prove(sched: Schedule, lists: dict[int, list[Action]], pp: int, m: int, v: int = 1, steps: int = 1,
          pairs: bool = False, cp: int = 1) -> None:
    """Prove given lists for a schedule's declarations: the rules above, the declared
    activation-memory bound, and the executor's batches under gloo's and NCCL's rules
    (`pairs`: those of parallelism.overlap_dualpipe, p2p._pair; `cp` > 1: with the
    context-parallel ring's passes inside F, B and I)."""
    smap = sched.stage_map(pp, v)
    n = m * steps if not sched.flushes else m
    if sorted(lists) != list(range(pp)):
        raise ScheduleError(f"lists for ranks {sorted(lists)}, expected 0..{pp - 1}")
    _check_lists(sched, lists, v, n)
    _check_memory(sched, lists, pp, n if not sched.flushes else m, v)
    simulate(lists, smap)
    nccl_simulate(comm_plan(lists, smap, pairs), smap, cp=min(cp, 2))  # 2: every ring has the same rendezvous
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
