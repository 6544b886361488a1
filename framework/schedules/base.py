"""The schedule IR and the registry: ops, actions, stage placement, what a schedule declares.

An `Action(op, microbatch, chunk)` is one compute step of one pipeline rank: `F` forward,
`B` full backward, `I` the backward to the stage input only (its gradient is sent at once),
`W` the weight gradients of an earlier `I` (zero-bubble schedules), `U` an optimizer
update (asynchronous schedules). Printed as the papers and torch write them: `F3`, `1I3`
(chunk 1), `U7`; torch's CSV cells carry the global stage instead of the chunk
(`csv_format.py` converts).

A schedule is one module that builds a `Schedule` and `register`s it: nothing outside the
registry's modules names a schedule. Every consumer (validation, checker, executor, bubble,
logging, evaluation, timeline, async reference) reads these declarations.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class Op(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # backward to the stage input only  # noqa: E741 (torch's letter)
    W = "W"  # weight gradients of an earlier I
    U = "U"  # optimizer update (asynchronous schedules)

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self is not Op.U

    @property
    def sends_input_grad(self) -> bool:
        """B and I produce (and I sends at once) the stage input's gradient."""
        return self in (Op.B, Op.I)

    @property
    def ends_backward(self) -> bool:
        """After B or W a micro-batch's activations on this chunk are no longer needed."""
        return self in (Op.B, Op.W)


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "op", Op(self.op))  # Action("F", 0) reads as Action(Op.F, 0)

    def __str__(self) -> str:
        return f"{self.chunk}{self.op.value}{self.microbatch}" if self.chunk else f"{self.op.value}{self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """`1I3` -> Action(I, 3, chunk 1): the inverse of str (action records, traces)."""
        m = _ACTION_TEXT.match(text)
        if m is None:
            raise ValueError(f"not an action: {text!r} (e.g. F3, 1I3, W0, U7)")
        return Action(Op(m.group(2)), int(m.group(3)), int(m.group(1) or 0))


_ACTION_TEXT = re.compile(r"^(\d*)([FBIWU])(\d+)$")


@dataclass(frozen=True)
class StageMap:
    """Where the pp * v model stages live. `loop` (Megatron's interleaving): chunk c of rank
    r is stage c*pp + r. `v` (ZB-V, DualPipeV; v = 2): rank r holds stages r and 2pp-1-r,
    so the first and the last stage share rank 0 and activations turn back at rank pp-1."""

    pp: int
    v: int = 1
    placement: str = "loop"

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def stage(self, rank: int, chunk: int) -> int:
        if self.placement == "v":
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank(self, stage: int) -> int:
        if self.placement == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def chunk(self, stage: int) -> int:
        return stage // self.pp  # the same for both placements


@dataclass(frozen=True)
class OpTimes:
    """Per-op compute seconds of one micro-batch on one chunk (medians of a run, or units).
    A fused B costs what I + W cost."""

    F: float = 1.0
    I: float = 1.0  # noqa: E741
    W: float = 1.0

    @property
    def B(self) -> float:
        return self.I + self.W


# Where a schedule's declared bubble comes from (`Schedule.bubble_source`), as reports label it.
CLOSED_FORM = "closed form"  # a formula in p, m, v and the op times (`Schedule.bubble_formula`: which, whose)
SCHEDULE_MODEL = "schedule model"  # the schedule's own lists run on the unit-time clock (framework/schedules/clock.py)


def modelled(pp: int, m: int, v: int) -> str:
    """`bubble_source` of a schedule whose bubble is its schedule model's at every (pp, m, v)."""
    return SCHEDULE_MODEL


@dataclass(frozen=True)
class Violation:
    """Why (pp, m, v) cannot run a schedule: the config key at fault, the reason, the fix."""

    key: str
    reason: str
    fix: str


@dataclass(frozen=True)
class AsyncRule:
    """What an asynchronous (never-flushed) schedule declares for its updates.
    `version_of(j, stage, num_stages, m)`: the weight version micro-batch j runs on (the
    executor's rule); `updates_per_step`: m (every micro-batch) or 1 (every step);
    `microbatch_weight(m)`: what each micro-batch's loss is multiplied by before its backward."""

    version_of: Callable[[int, int, int, int], int]
    updates_per_step: Callable[[int], int]
    microbatch_weight: Callable[[int], float]


@dataclass(frozen=True)
class Schedule:
    name: str
    generate: Callable[[int, int, int, int], dict[int, list[Action]]]  # (pp, m, v, steps) -> lists
    ops: frozenset
    doc: str
    bubble: Callable[..., float]  # (pp, m, v, times: OpTimes, steps) -> idle share per rank
    memory_bound: Callable[[int, int, int, int], int]  # (pp, m, v, rank) -> (microbatch, chunk) pairs alive
    placement: str = "loop"
    chunks: Optional[int] = None  # a fixed virtual_stages (V schedules: 2); None: any allowed by min_chunks
    min_chunks: int = 1
    max_chunks: Optional[int] = 1  # None: any v >= min_chunks
    single_stage: bool = False  # runs at pp = 1 (gradient accumulation)
    constraint: Callable[[int, int, int], Optional[Violation]] = lambda pp, m, v: None
    asynchronous: Optional[AsyncRule] = None
    preset_chunks: int = 1  # conf/schedule/<name>.yaml's virtual_stages
    extra: dict = field(default_factory=dict)
    # Schedules with keys of their own (zb-auto: schedule.memory_limit_microbatches,
    # schedule.op_times): the run's ScheduleConfig -> the Schedule it asks for (`resolve`).
    configure: Optional[Callable[[Any], "Schedule"]] = None
    # Where `bubble` comes from at (pp, m, v): CLOSED_FORM, a formula (`bubble_formula` names
    # it and its paper), or SCHEDULE_MODEL, the idle share of the schedule's own lists run on
    # the clock at the given op times: a simulation, which reports must not call analytic.
    bubble_source: Callable[[int, int, int], str] = lambda pp, m, v: CLOSED_FORM
    bubble_formula: str = ""
    # Its steady state pairs one chunk's F with the other chunk's B (DualPipe): with
    # parallelism.overlap_dualpipe the pair runs side by side (`pair_starts`, executor.py).
    pairs: bool = False

    @property
    def flushes(self) -> bool:
        return self.asynchronous is None

    @property
    def splits_backward(self) -> bool:
        return Op.I in self.ops

    def stage_map(self, pp: int, v: int) -> StageMap:
        return StageMap(pp, v, self.placement)

    def why_not(self, pp: int, m: int, v: int) -> Optional[Violation]:
        """The first reason (pp, m, v) cannot run this schedule, or None."""
        if pp == 1 and not self.single_stage:
            return Violation("schedule.name", f"{self.name} needs a pipeline (pp > 1); with pp = 1 only "
                             f"{', '.join(n for n in names() if REGISTRY[n].single_stage)} run (gradient accumulation)",
                             "use schedule=flush, or set parallelism.pp > 1")
        if self.chunks is not None and v != self.chunks:
            return Violation("schedule.virtual_stages", f"{self.name} places exactly {self.chunks} chunks per rank "
                             f"({self.placement} placement)", f"set schedule.virtual_stages={self.chunks}")
        if self.chunks is None and (v < self.min_chunks or (self.max_chunks is not None and v > self.max_chunks)):
            allowed = (f"exactly {self.min_chunks}" if self.max_chunks == self.min_chunks
                       else f">= {self.min_chunks}")
            multi = [n for n in names() if REGISTRY[n].max_chunks != 1]
            return Violation("schedule.virtual_stages", f"{self.name} runs {allowed} chunk(s) per rank",
                             f"set schedule.virtual_stages={self.min_chunks}" +
                             (f", or use a schedule with several chunks ({', '.join(multi)})" if v > 1 else ""))
        return self.constraint(pp, m, v)


def pair_starts(actions: list[Action]) -> list[int]:
    """Indices k where actions k, k + 1 form an overlapped pair: an F followed at once by a
    B of another chunk (DualPipe's F&B; a split backward's I is not paired: it must send its
    gradient before the W that follows)."""
    out, k = [], 0
    while k + 1 < len(actions):
        a, b = actions[k], actions[k + 1]
        if a.op is Op.F and b.op is Op.B and a.chunk != b.chunk:
            out.append(k)
            k += 2
        else:
            k += 1
    return out


def pairs_forward_backward(name: str) -> bool:
    """Whether schedule `name` is registered with overlappable F / B pairs."""
    return name in REGISTRY and REGISTRY[name].pairs


REGISTRY: dict[str, Schedule] = {}
DEFAULT = "flush"  # the schema's default (conf/config.yaml picks it too): Megatron's 1F1B
AUTO = "zb-auto"  # the schedule that builds its lists from op times (zb_auto.py): its keys' rules name it


def register(schedule: Schedule) -> Schedule:
    """Add a schedule (a module's one call; a test may register its own)."""
    if schedule.name in REGISTRY and REGISTRY[schedule.name] is not schedule:
        raise ValueError(f"schedule {schedule.name!r} is registered twice")
    REGISTRY[schedule.name] = schedule
    return schedule


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Schedule:
    if name not in REGISTRY:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   steps: int = 1) -> dict[int, list[Action]]:
    """Every rank's action list (asynchronous schedules: the whole run of `steps` steps)."""
    s = get(name)
    bad = s.why_not(pp, microbatches, virtual_stages)
    if bad is not None:
        raise ValueError(f"{bad.key}: {bad.reason}")
    return s.generate(pp, microbatches, virtual_stages, steps)
