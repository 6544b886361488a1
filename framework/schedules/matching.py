"""A plan's p2p batches as the backends run them: units in issue order, and which send meets
which receive. Shared by the clock (`clock.py`) and the checker's NCCL model (`check.py`).

A `p2p.RankPlan` issues, after action k-1, the ops of `batches[k]`, cut into groups
(`P2POp.group`) and each group by peer (one communicator per pair of pipeline neighbours,
`stream_of`): each piece is one `batch_isend_irecv`, one *unit* here. Under NCCL a unit is
one coalesced Work, a rank's units on one communicator run in issue order on its stream
(the communicators' streams run side by side), and a compute that needs a received tensor
waits for the unit holding its receive; under gloo each op is its own Work and the compute
waits for its receive alone.
"""

from __future__ import annotations

from collections import defaultdict

from framework.schedules.messages import needs, sender_of
from framework.schedules.base import StageMap


class ScheduleError(ValueError):
    """A rule a schedule breaks; `where`: the (rank, action) pairs it concerns (action None:
    the rank as a whole), so a schedule file's error can name its row and cell."""

    def __init__(self, message: str, where: tuple = ()):
        super().__init__(message)
        self.where = tuple(where)


def stream_of(op, shared: bool = False):
    """The communicator (NCCL: the stream) an op runs on: one per pair of pipeline neighbours
    (`PipelinePeers.pair_groups`), so a send to one neighbour never queues behind a receive
    from the other posted early for a later action (what held interleaved-zb's stream up to
    0.0135 of bubble when every op shared the pp group's one stream). `shared`: that design
    before, one stream for the whole pp group (kept to show what the pairs gained)."""
    return "pp" if shared else ("pp", op.peer)


def units(plan, shared: bool = False) -> list[tuple[int, list, object]]:
    """[(k, ops, stream)] in issue order: k, the batch index (issued after action k-1); ops,
    one group's ops on one communicator (`stream_of`); stream, that communicator (None for
    an empty batch's placeholder)."""
    out = []
    for k, batch in enumerate(plan.batches):
        groups: dict[tuple, list] = {}
        for op in batch:
            groups.setdefault((op.group, -1 if shared else op.peer), []).append(op)  # shared: one call per group
        out.extend((k, groups[g], stream_of(groups[g][0], shared)) for g in sorted(groups))
        if not batch:
            out.append((k, [], None))  # every batch index keeps a unit, so units stay ordered by issue point
    return out


def stream_prev(unit_list: list) -> list:
    """Per unit: the index of the unit before it on its stream (None: first, or no stream)."""
    last: dict = {}
    out = []
    for u, unit in enumerate(unit_list):
        stream = unit[2]
        out.append(last.get(stream) if stream is not None else None)
        if stream is not None:
            last[stream] = u
    return out


def match_pairs(plans: dict, unit_lists: dict) -> dict:
    """NCCL's matching (and the coalesced gloo's): the n-th send r -> q meets q's n-th
    receive from r, tags ignored. {(rank, unit, op index): (peer, peer's unit)} for every
    op; ScheduleError when a channel's counts differ or a message would land in another
    message's buffer (check.py proves plans with it; the clock runs proved ones)."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r in plans:
        for u, (_, ops, _) in enumerate(unit_lists[r]):
            for i, op in enumerate(ops):
                (sends[(r, op.peer)] if op.op == "send" else recvs[(op.peer, r)]).append((r, u, i, op.msg))
    match = {}
    for pair in set(sends) | set(recvs):
        s, rv = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(rv):
            raise ScheduleError(f"channel {pair[0]}->{pair[1]}: {len(s)} sends but {len(rv)} receives")
        for (r, u, i, msg), (q, uq, iq, want) in zip(s, rv):
            if msg != want:
                raise ScheduleError(f"channel {pair[0]}->{pair[1]}: NCCL matches in issue order, so {msg} "
                                    f"would land in the buffer of {want}")
            match[(r, u, i)], match[(q, uq, iq)] = (q, uq), (r, u)
    return match


def recv_units(plan, unit_list: list, rank: int, smap: StageMap) -> list[tuple]:
    """Per action: ("unit", (u, i)) when it waits for op i of unit u, ("local", message) for
    a message from this rank's other chunk (handed over in memory), (None, None) when it
    needs nothing. ScheduleError when no batch before the action receives what it needs."""
    where = {op.msg: (u, i, k) for u, (k, ops, _) in enumerate(unit_list) for i, op in enumerate(ops) if op.op == "recv"}
    out = []
    for k, a in enumerate(plan.actions):
        msg = needs(a, rank, smap)
        if msg is None:
            out.append((None, None))
        elif sender_of(msg, smap) == rank:
            out.append(("local", msg))
        elif msg not in where or where[msg][2] > k:
            raise ScheduleError(f"rank {rank}: {a} needs {msg}, which no earlier batch receives", [(rank, a)])
        else:
            out.append(("unit", where[msg][:2]))
    return out
