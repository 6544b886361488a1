"""Runs one pipeline rank's action list: receive, compute, send; timestamps every action.

Sharded: the model's blocks, by stage (`stage.py`); each rank holds v chunks, placed by
the schedule's `StageMap` (loop or V).
Forward of F(j, c): receive the activation of micro-batch j from the previous stage (none
on stage 0, which embeds the tokens), run the chunk, send the output to the next stage.
Backward of B(j, c): receive the gradient of that output from the next stage (the last
stage starts from its loss), backpropagate, send the input's gradient to the previous
stage. I(j, c) is the part of B that gives the input's gradient (sent at once); W(j, c)
the weight gradients, later (`split_backward.py`). A message between two stages of the
same rank (the turn of a V) is handed over in memory, never through p2p.

Point-to-point: exactly the batches of `p2p.comm_plan` (the description `check.py` proves
under gloo's and NCCL's rules): batch k goes out after action k-1, one `batch_isend_irecv`
per group (p2p.py's gating rule). An action that needs a received tensor waits for its
receive's Work: its own on gloo (one Work per op), its group's under NCCL (ONE coalesced
Work per call). `debug.coalesced_p2p` makes gloo behave as NCCL: one merged Work per
group, and every tag 0, so gloo also matches a pair's messages in issue order.
Sends are waited for at the end of a flushing step (every receive has run by then).

DualPipe's pairs (`parallelism.overlap_dualpipe`, a schedule registered with `pairs`): an F
followed at once by a B of the other chunk runs as one unit (`_pair`): both receives waited
for, the F on a second thread (framework/comm/side_thread.py: its ep all-to-alls on a
group of their own) beside the B on this one, both results sent after (p2p.py's `_pair`).

Timing (framework/timestamps.py): per action a mark before the receive wait, one after
it (compute starts) and one after the compute; host time on CPU, CUDA events on GPUs,
read after the step, so the measured bubble is step time minus compute, never time spent
inside a receive (which mixes transfer and waiting).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from framework.topology import NullRecorder
from framework.metrics.memory import tensor_bytes
from framework.schedules.messages import Message, needs, produces
from framework.schedules.p2p import RankPlan
from framework.parallel.pipeline.p2p_work import BatchWork, batch_isend_irecv
from framework.schedules.base import Action, Op, StageMap, pair_starts
from framework.comm.side_thread import SideThread
from framework.parallel.pipeline.split_backward import PendingWeight, backward_input, backward_weight


@dataclass
class ActionRecord:
    action: str
    start: float  # unix time the action began (before any receive wait)
    compute_start: float  # after the receive
    end: float

    @property
    def compute_s(self) -> float:
        return self.end - self.compute_start


@dataclass
class PipelinePeers:
    """Where this rank's stages send and receive: global rank of each pipeline stage."""

    pp_ranks: list[int]  # the pp group: global rank of pipeline rank 0..p-1
    pp_rank: int
    smap: StageMap
    # The pp group: its own communicator (NCCL: its own ordered stream), so a context-parallel
    # ring pass or a collective on another group never queues behind a receive posted early
    # for a later action. None: the default group.
    group: object = None
    # pp rank of a neighbour -> the pair's own group (ParallelContext.pp_pairs): a P2POp
    # names its pair's, so a send to one neighbour never queues behind a receive from the
    # other (framework/schedules/matching.py stream_of); a peer without one uses `group`
    pair_groups: dict = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return len(self.pp_ranks)

    @property
    def num_stages(self) -> int:
        return self.smap.num_stages


def _tag(msg: Message, num_stages: int) -> int:
    return ((msg.microbatch * num_stages + msg.stage) * 2 + (msg.kind == "grad")) % (2 ** 31 - 1)


def stage_delay(device: torch.device, seconds: float) -> None:
    """debug.stage_delay_ms: make this stage's compute slower by a known amount (on CUDA
    the stream sleeps, so the GPU time grows, not only the host's)."""
    if seconds <= 0:
        return
    if device.type == "cuda":
        khz = torch.cuda.get_device_properties(device).clock_rate
        torch.cuda._sleep(int(seconds * khz * 1e3))
    else:
        time.sleep(seconds)


class PipelineExecutor:
    def __init__(self, chunks: list[nn.Module], peers: PipelinePeers, device: torch.device,
                 act_shape: tuple[int, ...], forward_context: Callable, on_backward_done: Callable,
                 act_dtype: torch.dtype, plan: RankPlan, clock, coalesced_p2p: bool = False,
                 delay_s: float = 0.0, recorder=None, pairs: bool = False):
        self.chunks, self.peers, self.device = chunks, peers, device
        # parallelism.overlap_dualpipe: the indices k whose F runs beside B k + 1 (`_pair`)
        self.pairs = set(pair_starts(plan.actions)) if pairs else set()
        self.side = SideThread(device) if pairs else None
        self.pair_marks: list[tuple] = []
        self.recorder = recorder or NullRecorder()  # framework.train.flight: what the hang watchdog reads
        self.act_shape = act_shape  # (micro_batch_size, seq_len, hidden)
        self.act_dtype = act_dtype  # fp32 (also under bf16 autocast), fp64 in verification mode
        self.forward_context = forward_context  # (microbatch, chunk) -> context (activation tracking, autocast)
        self.on_backward_done = on_backward_done
        self.plan, self.clock, self.coalesced, self.delay_s = plan, clock, coalesced_p2p, delay_s
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.produced: dict[Message, torch.Tensor] = {}  # computed, not yet handed to a batch
        self.posted: dict[Message, tuple[BatchWork, torch.Tensor]] = {}  # receives issued, not consumed
        self.local: dict[Message, torch.Tensor] = {}  # from a stage of this rank to another (a V's turn)
        self.pending_w: dict[tuple[int, int], PendingWeight] = {}  # I done, W not yet
        self.trainable = [[q for q in c.parameters() if q.requires_grad] for c in chunks]  # what W computes
        self.inflight: list[BatchWork] = []
        self.segment = 0  # run() calls so far
        self.losses: dict[int, torch.Tensor] = {}
        self.p2p_peak_bytes = 0

    def _issue(self, k: int) -> None:
        """Batch k of the plan: sends of what earlier actions produced, receives posted; one
        `batch_isend_irecv` per group (p2p.py's gating rule) and peer (its pair's group)."""
        groups: dict[int, list] = {}
        for op in self.plan.batches[k]:
            groups.setdefault(op.group, []).append(op)
        for g in sorted(groups):  # each group per peer: one call per pair's communicator
            for peer in sorted({op.peer for op in groups[g]}):
                self._issue_group([op for op in groups[g] if op.peer == peer])

    def _issue_group(self, group: list) -> None:
        ops, recvs, tensors = [], [], []
        comm = self.peers.pair_groups.get(group[0].peer, self.peers.group)
        for op in group:
            peer = self.peers.pp_ranks[op.peer]
            tag = 0 if self.coalesced else _tag(op.msg, self.peers.num_stages)
            if op.op == "send":
                t = self.produced.pop(op.msg).contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, group=comm, tag=tag))
            else:
                t = torch.empty(self.act_shape, device=self.device, dtype=self.act_dtype)
                ops.append(dist.P2POp(dist.irecv, t, peer, group=comm, tag=tag))
                recvs.append((op.msg, t, len(ops) - 1))
            tensors.append(t)
        self.recorder.note("p2p batch " + ", ".join(f"{o.op} {o.msg.kind} mb{o.msg.microbatch} "
                                                    f"{'->' if o.op == 'send' else '<-'} pp{o.peer}"
                                                    for o in group))
        work = BatchWork(batch_isend_irecv(ops, self.coalesced), tensors, self.segment)
        self.inflight = [w for w in self.inflight if not w.is_completed()] + [work]
        for msg, t, i in recvs:
            self.posted[msg] = (work, t, i)
        held = [t for w in self.inflight for t in w.tensors] + [t for _, t, _ in self.posted.values()]
        self.p2p_peak_bytes = max(self.p2p_peak_bytes, tensor_bytes(held))

    def _received(self, a: Action) -> Optional[torch.Tensor]:
        msg = needs(a, self.peers.pp_rank, self.peers.smap)
        if msg is None:
            return None
        if msg in self.local:
            return self.local.pop(msg)
        work, buf, i = self.posted.pop(msg)
        self.recorder.note(f"{a}: wait for its receive ({msg.kind} mb{msg.microbatch})", wait=True)
        work.wait_for(i)  # gloo: this receive alone; NCCL: its group (CUDA: the compute stream waits)
        return buf

    def _produce(self, a: Action, t: torch.Tensor) -> None:
        msg = produces(a, self.peers.pp_rank, self.peers.smap)
        if msg is None:
            return
        if self.peers.smap.rank(msg.stage) == self.peers.pp_rank:
            self.local[msg] = t.detach().clone()  # a fresh leaf, as a received buffer would be
        else:
            self.produced[msg] = t

    def forward(self, a: Action, x, y, microbatch_weight: float, params: Optional[dict] = None) -> None:
        g = self.peers.smap.stage(self.peers.pp_rank, a.chunk)
        chunk = self.chunks[a.chunk]
        last = g == self.peers.num_stages - 1
        if g > 0:
            self.inputs[a.microbatch, a.chunk] = x
        with self.forward_context(a.microbatch, a.chunk):
            args = (x, y) if last else (x,)
            out = torch.func.functional_call(chunk, params, args) if params is not None else chunk(*args)
        if last:
            self.losses[a.microbatch] = out.detach()
            out = out * microbatch_weight
        else:
            out = out.to(self.act_dtype)  # activations travel in fp32 (fp64), whatever autocast produced
            self._produce(a, out.detach())
        self.outputs[a.microbatch, a.chunk] = out

    def backward(self, a: Action, grad: Optional[torch.Tensor]) -> None:
        out = self.outputs.pop((a.microbatch, a.chunk))
        torch.autograd.backward(out, grad)
        if (a.microbatch, a.chunk) in self.inputs:
            self._produce(a, self.inputs.pop((a.microbatch, a.chunk)).grad)
        self.on_backward_done(a.microbatch, a.chunk)

    def backward_input(self, a: Action, grad: Optional[torch.Tensor]) -> None:
        """I: the input's gradient, sent at once; the weight gradients wait for W."""
        key = (a.microbatch, a.chunk)
        out, x = self.outputs.pop(key), self.inputs.pop(key, None)
        dx, self.pending_w[key] = backward_input(out, grad, x, self.trainable[a.chunk])
        if dx is not None:
            self._produce(a, dx)

    def backward_weight(self, a: Action) -> None:
        backward_weight(self.pending_w.pop((a.microbatch, a.chunk)))
        self.on_backward_done(a.microbatch, a.chunk)

    def run(self, first: int, last: int, batch_of, microbatch_weight: float, params_of=None,
            update: Optional[Callable[[int], None]] = None) -> list:
        """Actions first..last-1 of the plan, each followed by its batch; `batch_of(j)` gives
        micro-batch j's (tokens, labels). Returns raw marks (action, start, compute start,
        end): `clock.seconds` reads them once the step is over. An overlapped pair's threads'
        own marks are in `pair_marks` (`_pair`)."""
        marks = []
        self.segment += 1
        self.pair_marks = []
        if first == 0:
            self._issue(0)
        k = first
        while k < last:
            if k in self.pairs and k + 1 < last:
                marks += self._pair(k, len(marks), batch_of, microbatch_weight)
                self._issue(k + 1)  # empty (p2p._pair): the pair's sends go with batch k + 2
                self._issue(k + 2)
                k += 2
                continue
            a = self.plan.actions[k]
            start = self.clock.mark()
            received = self._received(a)
            compute_start = self.clock.mark()
            self._compute(a, received, batch_of, microbatch_weight, params_of, update)
            marks.append((str(a), start, compute_start, self.clock.mark()))
            self._issue(k + 1)
            k += 1
        return marks

    def _compute(self, a: Action, received, batch_of, microbatch_weight: float, params_of=None,
                 update: Optional[Callable[[int], None]] = None) -> None:
        self.recorder.note(str(a))
        if a.op is Op.F:
            x, y = batch_of(a.microbatch)
            x = received.requires_grad_(True) if received is not None else x
            self.forward(a, x, y, microbatch_weight, params_of(a.microbatch, a.chunk) if params_of else None)
        elif a.op is Op.B:
            self.backward(a, received)
        elif a.op is Op.I:
            self.backward_input(a, received)
        elif a.op is Op.W:
            self.backward_weight(a)
        else:
            update(a.microbatch)
        if a.op.is_compute:
            stage_delay(self.device, self.delay_s)

    def _pair(self, k: int, index: int, batch_of, microbatch_weight: float) -> list:
        """parallelism.overlap_dualpipe: F (action k) on the side thread beside B (k + 1) on
        this one, once both receives are in (DualPipe's unit). Marks: F (start, its receive
        waited, the same), B (then, both waited, both done); each thread's compute (start,
        end) goes to `pair_marks` as (index of F's mark, F start, F end, B start, B end)."""
        f, b = self.plan.actions[k], self.plan.actions[k + 1]
        start = self.clock.mark()
        x = self._received(f)
        f_waited = self.clock.mark()
        g = self._received(b)
        both = self.clock.mark()
        f_marks = []

        def forward() -> None:
            f_marks.append(self.clock.mark())
            self._compute(f, x, batch_of, microbatch_weight)
            f_marks.append(self.clock.mark())

        running = self.side.submit(forward)
        b_start = self.clock.mark()
        self._compute(b, g, batch_of, microbatch_weight)
        b_end = self.clock.mark()
        running.result()  # re-raises the F thread's exception here
        end = self.clock.mark()
        self.pair_marks.append((index, *f_marks, b_start, b_end))
        return [(str(f), start, f_waited, f_waited), (str(b), f_waited, both, end)]

    def wait_sends(self) -> None:
        """End of a flushing step: every message of the step has been received by now."""
        assert not self.posted and not self.produced and not self.local and not self.pending_w, \
            "a flushing step ended with messages in flight or weight gradients pending"
        self.recorder.note("wait for this step's sends", wait=True)
        for work in self.inflight:
            work.wait()
        self.inflight.clear()

    def prune_sends(self) -> None:
        """Asynchronous steps: this step's sends may be matched only in the peer's next
        step (the warm-up runs ahead), so they are not waited for here. Earlier steps' are:
        their receives were posted in the peer's same or next step, which has begun (and on
        gloo a send never reports completion until waited, so without this the run's
        send-only batches would pile up)."""
        for w in self.inflight:
            if w.segment < self.segment:
                w.wait()
        self.inflight = [w for w in self.inflight if not w.is_completed()]

    def take_losses(self) -> dict[int, torch.Tensor]:
        out, self.losses = self.losses, {}
        return out
