"""Which point-to-point ops go into which batch: ONE description, run by the executor and
proved by the checker.

A pipeline rank issues one `batch_isend_irecv` after each action (and one before its
first): the `P2POp`s in `RankPlan.batches[k]`, issued after action k-1 (k = 0: before the
first action). Every op names a `Message` (activation or gradient of one micro-batch for
one stage), so the executor sends exactly the tensor the plan names, and `check.py`
simulates exactly the batches the executor issues, under gloo's rules and under NCCL's.

Why the placement matters: under NCCL a rank's p2p ops on one communicator (here one per
pair of neighbours, framework/schedules/matching.py) run in issue order on its stream, a
send completes only when the peer's matching receive runs, and a pair's messages match in
issue order (tags are ignored). Posting each receive with the *receiver's* next action (the
executor's first design, Megatron's send_forward_recv_backward pairing) deadlocks
Megatron's interleaved 1F1B: the sender's stream stalls on a send whose receive the peer posts only
much later, behind receives that need that very sender's later sends.

Placement rule ("lockstep"): run all ranks' lists in the unit-time simulation (F = B = I =
W = 1, U = 0). A message is sent in the batch after the action that produced it, at that
action's end time t. The receiver posts it in its latest batch issued at a time <= t,
i.e. about when the sender sends it, in the sender's send order. Each batch then holds
receives of messages sent in [its time, the rank's next batch time), and sends whose
receives are already posted, so in the simulated timeline every batch completes before
the rank's next one starts: no stream ever waits on a later op. That argument assumes the
simulated timing; `check.nccl_simulate` proves deadlock-freedom for any timing.

Gating rule: a receive posted early (for a later action) must not hold up the action that
consumes an earlier one. Each batch is cut into groups, one `batch_isend_irecv` each (one
coalesced Work under NCCL): group 0 holds the receive consumed first, with the batch's
sends (a pair's opposite messages in one group: split apart, NCCL's ordered stream can
deadlock them); each later-consumed receive is a group of its own, in consumer order. A
compute waits for its receive's group (NCCL) or its receive alone (gloo). Measured on the
clock at the zero-bubble paper's op times, one Work per batch cost ZB-H1 0.09 of bubble
and interleaved-zb 0.10; with the groups, each on its pair of neighbours' communicator, the
replay equals the batch-free schedule (tests/test_p2p_gating.py).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace

from framework.schedules.messages import Message, needs, produces, receiver_of, sender_of
from framework.schedules.base import Action, StageMap, pair_starts
from framework.schedules.clock import simulate


@dataclass(frozen=True)
class P2POp:
    op: str  # "send" | "recv"
    peer: int  # pipeline rank on the other side
    msg: Message
    group: int = 0  # which batch_isend_irecv of its batch (the gating rule above)


@dataclass
class RankPlan:
    """`batches[k]` is issued after action k-1 (k = 0: before the first action); one more
    than there are actions (the last goes out after the last action)."""

    actions: list[Action]
    batches: list[list[P2POp]] = field(default_factory=list)


def comm_plan(lists: dict[int, list[Action]], smap: StageMap, pairs: bool = False) -> dict[int, RankPlan]:
    """Every rank's batches under the lockstep rule (module docstring); `pairs`
    (parallelism.overlap_dualpipe): each F / B pair of `pair_starts` runs as one unit."""
    timeline = simulate(lists, smap, "unit")
    plans = {r: RankPlan(list(acts), [[] for _ in range(len(acts) + 1)]) for r, acts in lists.items()}
    sent_at: dict[Message, float] = {}
    for r, acts in lists.items():
        for k, a in enumerate(acts):
            msg = produces(a, r, smap)
            if msg is not None and receiver_of(msg, smap) != r:  # same rank: handed over in memory
                plans[r].batches[k + 1].append(P2POp("send", receiver_of(msg, smap), msg))
                sent_at[msg] = timeline[r][k][1]
    for r, acts in lists.items():
        # batch k's issue time: the end of action k-1 (batch 0 at the start)
        issue = [0] + [end for _, end, _ in timeline[r]]
        recvs = []
        for k, a in enumerate(acts):
            msg = needs(a, r, smap)
            if msg is not None and sender_of(msg, smap) != r:
                latest = bisect_right(issue, sent_at[msg]) - 1
                recvs.append((min(latest, k), sent_at[msg], msg))
        # within a batch, receives follow the senders' order (a pair matches in issue order)
        for k, _, msg in sorted(recvs, key=lambda x: (x[0], x[1], _order(x[2]))):
            plans[r].batches[k].append(P2POp("recv", sender_of(msg, smap), msg))
    for r, plan in plans.items():
        if pairs:
            _pair(plan, r, smap)
        _gate(plan, r, smap, pairs)
    return plans


def _pair(plan: RankPlan, rank: int, smap: StageMap) -> None:
    """A pair (F at k, B at k + 1) starts once both its inputs are there and both results
    leave at its end (DualPipe's unit): batch k + 1, issued between the two, is emptied. B's
    receive (with any receive from the same peer before it, so a channel keeps its order) is
    appended to batch k; the rest (F's sends, receives for later actions) goes ahead of batch
    k + 2, in its order. A rank then issues nothing between the two computes, so the
    sequential NCCL model (check.nccl_simulate) proves the concurrent run too."""
    for k in pair_starts(plan.actions):
        moved, want = plan.batches[k + 1], needs(plan.actions[k + 1], rank, smap)
        last = next((i for i, op in enumerate(moved) if op.op == "recv" and op.msg == want), -1)
        early = [i for i, op in enumerate(moved[:last + 1]) if op.op == "recv" and op.peer == moved[last].peer]
        plan.batches[k] = plan.batches[k] + [moved[i] for i in early]
        plan.batches[k + 2] = [op for i, op in enumerate(moved) if i not in early] + plan.batches[k + 2]
        plan.batches[k + 1] = []


def _gate(plan: RankPlan, rank: int, smap: StageMap, pairs: bool = False) -> None:
    """Cut each batch into groups (the gating rule): the receive consumed first, with the
    batch's sends, is group 0; every later-consumed receive is a group of its own, in the
    order of its consumers (a pair's two receives: one group, its unit waits for both).
    Sorted by group, so the order within a channel is kept."""
    consumer = {needs(a, rank, smap): k for k, a in enumerate(plan.actions)}
    for k in pair_starts(plan.actions) if pairs else ():  # a pair waits for both: one consumer
        consumer[needs(plan.actions[k + 1], rank, smap)] = k
    for k, batch in enumerate(plan.batches):
        recvs = sorted((op for op in batch if op.op == "recv"), key=lambda op: consumer[op.msg])
        order = list(dict.fromkeys(consumer[op.msg] for op in recvs))
        group = {op.msg: order.index(consumer[op.msg]) for op in recvs}
        ops = [replace(op, group=group.get(op.msg, 0) if op.op == "recv" else 0) for op in batch]
        plan.batches[k] = sorted(ops, key=lambda op: op.group)  # stable: a channel's order is kept


def _order(msg: Message) -> tuple:
    return (msg.microbatch, msg.stage, msg.kind)
