"""What an action receives before it computes and sends when it is done.

F on stage g receives the activation from stage g-1 (none on stage 0) and sends its output
to g+1 (none on the last stage). B and I receive the gradient of the stage output from
g+1 (the last stage starts from its loss) and send the stage input's gradient to g-1;
W and U exchange nothing. Stages map to ranks through the schedule's `StageMap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from framework.schedules.base import Action, Op, StageMap


@dataclass(frozen=True)
class Message:
    kind: str  # "act" (forward output) | "grad" (gradient of a stage's input)
    microbatch: int
    stage: int  # the receiving stage

    def __str__(self) -> str:
        return f"{self.kind}(mb {self.microbatch} -> stage {self.stage})"


def needs(a: Action, rank: int, smap: StageMap) -> Optional[Message]:
    """The message action `a` must receive before it computes, or None."""
    g = smap.stage(rank, a.chunk)
    if a.op is Op.F and g > 0:
        return Message("act", a.microbatch, g)
    if a.op.sends_input_grad and g < smap.num_stages - 1:
        return Message("grad", a.microbatch, g)
    return None


def produces(a: Action, rank: int, smap: StageMap) -> Optional[Message]:
    """The message action `a` sends when it is done, or None."""
    g = smap.stage(rank, a.chunk)
    if a.op is Op.F and g < smap.num_stages - 1:
        return Message("act", a.microbatch, g + 1)
    if a.op.sends_input_grad and g > 0:
        return Message("grad", a.microbatch, g - 1)
    return None


def receiver_of(msg: Message, smap: StageMap) -> int:
    return smap.rank(msg.stage)


def sender_of(msg: Message, smap: StageMap) -> int:
    return smap.rank(msg.stage - 1 if msg.kind == "act" else msg.stage + 1)
