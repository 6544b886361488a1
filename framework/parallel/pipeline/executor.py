"""Runs one pipeline rank's action list: receive, compute, send; timestamps every action.

Sharded: the model's blocks, by stage (`stage.py`); each rank holds v chunks.
Forward of F(j, c): receive the activation of micro-batch j from the previous stage (none
on stage 0, which embeds the tokens), run the chunk, send the output to the next stage.
Backward of B(j, c): receive the gradient of that output from the next stage (the last
stage starts from its loss), backpropagate, send the input's gradient to the previous
stage. After each action, its send and the next action's receive go out together in one
`batch_isend_irecv` (Megatron's send_forward_recv_backward pattern; see `_exchange`);
sends are waited for at the end of the step, a receive right before the compute that
needs it, so no order of sends can deadlock;
`check.py` proves every schedule's receives also match its sends' order, which NCCL
needs (it ignores tags; gloo matches by tag). A message between two chunks of the same
rank (interleaved with pp = 1, or stage p-1 -> p) goes through a local buffer.

Each action's record keeps the receive wait apart from the compute, so the measured bubble
is step time minus compute, never time spent inside a receive (which mixes transfer and
waiting). On CUDA every action is synchronised before its end timestamp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .schedules import Action, stage_of


@dataclass
class ActionRecord:
    action: str
    start: float  # unix time the action began (before any receive wait)
    compute_start: float  # after the receive
    end: float

    @property
    def wait_s(self) -> float:
        return self.compute_start - self.start

    @property
    def compute_s(self) -> float:
        return self.end - self.compute_start


@dataclass
class PipelinePeers:
    """Where this rank's stages send and receive: global rank of each pipeline stage."""

    pp_ranks: list[int]  # the pp group: global rank of pipeline rank 0..p-1
    pp_rank: int
    virtual_stages: int

    @property
    def pp(self) -> int:
        return len(self.pp_ranks)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of_stage(self, g: int) -> int:
        return self.pp_ranks[g % self.pp]


def _tag(kind: str, microbatch: int, stage: int, num_stages: int) -> int:
    return ((microbatch * num_stages + stage) * 2 + (kind == "grad")) % (2 ** 31 - 1)


class PipelineExecutor:
    def __init__(self, chunks: list[nn.Module], peers: PipelinePeers, device: torch.device,
                 act_shape: tuple[int, ...], forward_context: Callable, on_backward_done: Callable):
        self.chunks, self.peers, self.device = chunks, peers, device
        self.act_shape = act_shape  # (micro_batch_size, seq_len, hidden)
        self.forward_context = forward_context  # (microbatch, chunk) -> context (activation tracking, autocast)
        self.on_backward_done = on_backward_done
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.local: dict[int, torch.Tensor] = {}  # messages between chunks of this rank
        self.posted: dict[int, tuple] = {}  # tag -> (irecv work, buffer), posted ahead of need
        self.outbox: list = []  # sends waiting for the next exchange
        self.sends: list = []
        self.losses: dict[int, torch.Tensor] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            # The compute stream only: a device-wide sync would also wait for sends still
            # pending on the communication stream, i.e. for a peer's later receive.
            torch.cuda.current_stream(self.device).synchronize()

    def _send(self, t: torch.Tensor, kind: str, mb: int, to_stage: int) -> None:
        """Queue a send; it goes out in the next `_exchange`, together with a receive."""
        dst = self.peers.rank_of_stage(to_stage)
        tag = _tag(kind, mb, to_stage, self.peers.num_stages)
        if dst == dist.get_rank():
            self.local[tag] = t
        else:
            self.outbox.append(dist.P2POp(dist.isend, t.contiguous(), dst, tag=tag))

    def _needed_recv(self, a: Action):
        """The (source rank, tag) of the message action `a` must receive, or None."""
        g = stage_of(self.peers.pp_rank, a.chunk, self.peers.pp)
        if a.op == "F" and g > 0:
            kind, src_stage = "act", g - 1
        elif a.op == "B" and g < self.peers.num_stages - 1:
            kind, src_stage = "grad", g + 1
        else:
            return None
        src = self.peers.rank_of_stage(src_stage)
        return None if src == dist.get_rank() else (src, _tag(kind, a.microbatch, g, self.peers.num_stages))

    def _exchange(self, next_action: Optional[Action]) -> None:
        """Send what the last action produced and post the next action's receive in one
        batch_isend_irecv, as Megatron's send_forward_recv_backward: NCCL runs a pair's
        point-to-point ops in issue order, so a send and a receive issued apart could each
        wait for the other's peer op; in one group they progress together. The receive is
        posted before the next action starts, so its transfer overlaps this rank's work."""
        ops, recv = self.outbox, None
        need = self._needed_recv(next_action) if next_action is not None else None
        if need is not None and need[1] not in self.posted:
            buf = torch.empty(self.act_shape, device=self.device, dtype=torch.float32)
            ops.append(dist.P2POp(dist.irecv, buf, need[0], tag=need[1]))
            recv = (need[1], buf)
        if ops:
            works = dist.batch_isend_irecv(ops)
            for op, work in zip(ops, works, strict=True):
                if op.op is dist.isend:
                    self.sends.append((work, op.tensor))  # keep the tensor alive until sent
            if recv is not None:
                self.posted[recv[0]] = (works[-1], recv[1])
        self.outbox = []

    def _recv(self, kind: str, mb: int, stage: int) -> torch.Tensor:
        src = self.peers.rank_of_stage(stage - 1 if kind == "act" else stage + 1)
        tag = _tag(kind, mb, stage, self.peers.num_stages)
        if src == dist.get_rank():
            return self.local.pop(tag)
        work, buf = self.posted.pop(tag)  # posted by the _exchange before this action
        work.wait()
        return buf

    def forward(self, a: Action, batch, loss_scale: float, params: Optional[dict] = None) -> None:
        g = stage_of(self.peers.pp_rank, a.chunk, self.peers.pp)
        chunk = self.chunks[a.chunk]
        x, y = batch
        if g > 0:
            x = self._recv("act", a.microbatch, g).requires_grad_(True)
            self.inputs[a.microbatch, a.chunk] = x
        last = g == self.peers.num_stages - 1
        compute_start = time.time()
        with self.forward_context(a.microbatch, a.chunk):
            args = (x, y) if last else (x,)
            out = torch.func.functional_call(chunk, params, args) if params is not None else chunk(*args)
        if last:
            self.losses[a.microbatch] = out.detach()
            out = out * loss_scale
        else:
            out = out.float()  # activations travel in fp32, whatever autocast produced
            self._send(out.detach(), "act", a.microbatch, g + 1)
        self.outputs[a.microbatch, a.chunk] = out
        return compute_start

    def backward(self, a: Action) -> float:
        g = stage_of(self.peers.pp_rank, a.chunk, self.peers.pp)
        out = self.outputs.pop((a.microbatch, a.chunk))
        grad = None if g == self.peers.num_stages - 1 else self._recv("grad", a.microbatch, g)
        compute_start = time.time()
        torch.autograd.backward(out, grad)
        if g > 0:
            self._send(self.inputs.pop((a.microbatch, a.chunk)).grad, "grad", a.microbatch, g - 1)
        self.on_backward_done(a.microbatch, a.chunk)
        return compute_start

    def run(self, actions: list[Action], batch_of, loss_scale: float, params_of=None,
            update: Optional[Callable[[int], None]] = None) -> list[ActionRecord]:
        """Run the actions in order; `batch_of(j)` gives micro-batch j's (tokens, labels)."""
        records = []
        if actions:
            self._exchange(actions[0])  # the first action's receive
        for i, a in enumerate(actions):
            start = time.time()
            if a.op == "F":
                cs = self.forward(a, batch_of(a.microbatch), loss_scale,
                                  params_of(a.microbatch, a.chunk) if params_of else None)
            elif a.op == "B":
                cs = self.backward(a)
            else:
                cs = start
                update(a.microbatch)
            self._sync()
            records.append(ActionRecord(str(a), start, cs, time.time()))
            self._exchange(actions[i + 1] if i + 1 < len(actions) else None)
        return records

    def wait_sends(self) -> None:
        """End of a flushing step: every message of the step has been received by now."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    def prune_sends(self) -> None:
        """Asynchronous steps: a send may be matched only in the next step (the warm-up runs
        ahead), so waiting here could deadlock against a peer already in a collective."""
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def take_losses(self) -> dict[int, torch.Tensor]:
        out, self.losses = self.losses, {}
        return out

