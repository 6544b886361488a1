"""An asynchronous (never-flushed) run's plan at constant start-up cost: built and proved
for a short template run, then tiled.

1F1B never flushes, so its action list covers the whole run and grows with `steps`; so did
building its p2p plan (a unit-time simulation of the whole run) and proving it (NCCL's
model on every batch). But the list is periodic: after the fill, every step's share is the
previous one's with micro-batch ids shifted by m, until the drain. A run is cut into
segments, one per step, after the update of the step's last micro-batch. Here:

- `F` = ceil((p-1)/m) + 1 fill segments and as many drain segments bound how far the
  warm-up reaches across steps (it runs p-1 micro-batches ahead on stage 0);
- the template is a run of T = F + 2 + F steps: fill, two steady segments, drain. Its plan
  (`p2p.comm_plan`) is built and proved (`check.nccl_simulate`) like any other;
- segment k of an N-step run (N > T) is template segment k for k < F, template segment F
  shifted by (k - F)·m for the steady middle, and template segment k - N + T shifted by
  (N - T)·m for the drain. A run of N <= T steps is built directly.

Why the template's proof covers the tiling: (1) the template's two steady segments are
checked to be shifts of each other, action for action and batch for batch, so the steady
state is periodic from segment F on; the tiled plan is the N-step plan itself (the lockstep
placement depends only on the periodic unit-time timeline; tests/test_tiling.py compares
tiled and direct plans op for op). (2) NCCL's rules are checked over every kind of segment
boundary an N-step run has: fill -> steady, steady -> steady and steady -> drain all occur
in the template, and a message never travels further than into the next segment (checked
here), so the state the model reaches at a steady boundary is the same, shifted, at every
one: the steady -> steady boundary proved once is proved for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from framework.schedules.check import ScheduleError, nccl_simulate
from framework.schedules.messages import Message
from framework.schedules.p2p import P2POp, RankPlan, comm_plan
from framework.schedules.base import Action, Op, Schedule, StageMap


def cut(actions: list[Action], m: int) -> list[range]:
    """Index ranges of each step's actions: after the update of the step's last micro-batch."""
    cuts = [k + 1 for k, a in enumerate(actions) if a.op is Op.U and (a.microbatch + 1) % m == 0]
    cuts[-1] = len(actions)
    return [range(a, b) for a, b in zip([0] + cuts[:-1], cuts)]


@dataclass(frozen=True)
class Segment:
    """One step's actions, and the batches issued after each of them (`batches[i]` after
    `actions[i]`); `first` is the batch before the run's first action (segment 0 only)."""

    actions: list[Action]
    batches: list[list[P2POp]]
    first: list[P2POp]

    def shifted(self, by: int) -> Segment:
        if by == 0:
            return self
        return Segment([replace(a, microbatch=a.microbatch + by) for a in self.actions],
                       [[_shift(op, by) for op in b] for b in self.batches], [_shift(op, by) for op in self.first])


def _shift(op: P2POp, by: int) -> P2POp:
    return replace(op, msg=Message(op.msg.kind, op.msg.microbatch + by, op.msg.stage))


def _segments(plan: RankPlan, m: int) -> list[Segment]:
    return [Segment(plan.actions[r.start:r.stop], plan.batches[r.start + 1:r.stop + 1],
                    plan.batches[0] if r.start == 0 else []) for r in cut(plan.actions, m)]


def fill_segments(pp: int, m: int) -> int:
    return math.ceil((pp - 1) / m) + 1


class TiledPlan:
    """Every rank's per-step segments of an asynchronous run of `steps` steps, proved."""

    def __init__(self, schedule: Schedule, smap: StageMap, m: int, steps: int):
        self.m, self.steps = m, steps
        f = fill_segments(smap.pp, m)
        self.template_steps = t = f + 2 + f
        self.fill = f
        n = min(steps, t)
        plans = comm_plan(schedule.generate(smap.pp, m, smap.v, n), smap)
        nccl_simulate(plans, smap)
        self.segments = {r: _segments(p, m) for r, p in plans.items()}
        if steps > t:
            for r, segs in self.segments.items():
                if segs[f + 1] != segs[f].shifted(m):
                    raise ScheduleError(f"{schedule.name}: rank {r}'s steady state is not periodic from step {f}: "
                                        "the template cannot be tiled")
            _check_reach(plans, m)

    def segment(self, rank: int, k: int) -> Segment:
        """Step k's (0-based, from this process's first step) segment on `rank`."""
        segs, n, t, f = self.segments[rank], self.steps, self.template_steps, self.fill
        if n <= t or k < f:
            return segs[k]
        if k < n - f:
            return segs[f].shifted((k - f) * self.m)
        return segs[k - n + t].shifted((n - t) * self.m)


def _check_reach(plans: dict[int, RankPlan], m: int) -> None:
    """A message's receive is posted in its send's segment or a neighbour (the tiling argument)."""
    sent, received = {}, {}
    for r, plan in plans.items():
        seg_of_batch = {}
        for s, rng in enumerate(cut(plan.actions, m)):
            for k in range(rng.start + (rng.start > 0), rng.stop + 1):
                seg_of_batch[k] = s
        for k, batch in enumerate(plan.batches):
            for op in batch:
                (sent if op.op == "send" else received)[op.msg] = seg_of_batch[k]
    far = [msg for msg, s in sent.items() if abs(received[msg] - s) > 1]
    if far:
        raise ScheduleError(f"messages received more than one step after their send: {far[:3]}")
