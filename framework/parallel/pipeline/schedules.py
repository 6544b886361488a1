"""Pipeline schedules as data: one pure generator per schedule, no torch.distributed.

A schedule maps (pp, microbatches, virtual_stages) to each pipeline rank's ordered list of
`Action`s. `F3` / `B3` are the forward / backward of micro-batch 3 on model chunk 0,
`1F3` on chunk 1, `U3` an optimizer update after micro-batch 3 (asynchronous schedules
only; the flushing schedules end every step with one synchronous update that is not an
action). With v chunks per rank there are p*v model stages; chunk c of rank r is stage
c*p + r (Megatron-LM's interleaving), so activations go 0 -> 1 -> ... -> p-1 -> 0 (next
chunk) -> ...

Synchronous schedules give one step's list; the executor repeats it every step.
Asynchronous schedules (1f1b, 2bw) never flush, so their list covers a whole run of
`steps` steps; micro-batch ids are then global (step * m + j).

Papers: GPipe (Huang et al., 2019); PipeDream 1F1B with weight stashing (Narayanan et al.,
SOSP 2019); PipeDream-2BW and PipeDream-Flush (Narayanan et al., ICML 2021); interleaved
1F1B (Narayanan et al., SC 2021, "Efficient large-scale language model training on GPU
clusters using Megatron-LM").
"""

from __future__ import annotations

from dataclasses import dataclass

SYNC_SCHEDULES = ("gpipe", "flush", "interleaved")
ASYNC_SCHEDULES = ("1f1b", "2bw")
SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES


@dataclass(frozen=True)
class Action:
    op: str  # "F" | "B" | "U"
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.chunk}{self.op}{self.microbatch}" if self.chunk else f"{self.op}{self.microbatch}"

    __repr__ = __str__


def stage_of(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def gpipe(pp: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    return {r: [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)] for r in range(pp)}


def flush_warmup(pp: int, rank: int, m: int) -> int:
    """Forwards before the first backward: what is in flight below this stage."""
    return min(pp - rank - 1, m)


def flush(pp: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """PipeDream-Flush / Megatron 1F1B: warm-up, steady 1F1B, cool-down; one update per step."""
    out = {}
    for r in range(pp):
        w = flush_warmup(pp, r, m)
        warmup = [Action("F", j) for j in range(w)]
        steady = [a for j in range(m - w) for a in (Action("F", j + w), Action("B", j))]
        cooldown = [Action("B", j) for j in range(m - w, m)]
        out[r] = warmup + steady + cooldown
    return out


def interleaved_check(pp: int, m: int, v: int) -> str | None:
    """Why (pp, m, v) cannot run interleaved, or None."""
    if m % pp:
        return (f"interleaved 1F1B sends micro-batches through the {v} chunks in groups of pp={pp}; "
                f"microbatches={m} must be a multiple of pp")
    return None


def _interleaved_action(k: int, pp: int, v: int, op: str) -> Action:
    """The k-th forward (or backward) on a rank: micro-batch groups of pp cycle through chunks."""
    group, within = divmod(k, pp * v)
    chunk = within // pp
    if op == "B":
        chunk = v - 1 - chunk  # backward visits the chunks in reverse
    return Action(op, group * pp + k % pp, chunk)


def interleaved(pp: int, m: int, v: int) -> dict[int, list[Action]]:
    """Megatron's interleaved 1F1B: v chunks per rank, warm-up deepened by the extra chunks."""
    why = interleaved_check(pp, m, v)
    if why:
        raise ValueError(why)
    total = m * v
    out = {}
    for r in range(pp):
        w = min((pp - r - 1) * 2 + (v - 1) * pp, total)  # Megatron-LM's warm-up count
        warmup = [_interleaved_action(k, pp, v, "F") for k in range(w)]
        steady = [a for k in range(total - w)
                  for a in (_interleaved_action(k + w, pp, v, "F"), _interleaved_action(k, pp, v, "B"))]
        cooldown = [_interleaved_action(k, pp, v, "B") for k in range(total - w, total)]
        out[r] = warmup + steady + cooldown
    return out


def _async(pp: int, m: int, steps: int, update_after) -> dict[int, list[Action]]:
    """1F1B over the whole run, never flushed; `update_after(j)` says where a U goes."""
    n = m * steps
    out = {}
    for r in range(pp):
        w = min(pp - r - 1, n)
        acts = [Action("F", j) for j in range(w)]
        for j in range(n):
            if j + w < n:
                acts.append(Action("F", j + w))
            acts.append(Action("B", j))
            if update_after(j):
                acts.append(Action("U", j))
        out[r] = acts
    return out


def pipedream_1f1b(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """PipeDream: every stage updates after every micro-batch's backward (weight stashing)."""
    return _async(pp, m, steps, lambda j: True)


def pipedream_2bw(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    """PipeDream-2BW: gradients accumulated over a step's m micro-batches, one update per step."""
    return _async(pp, m, steps, lambda j: (j + 1) % m == 0)


GENERATORS = {"gpipe": gpipe, "flush": flush, "interleaved": interleaved,
              "1f1b": pipedream_1f1b, "2bw": pipedream_2bw}


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   steps: int = 1) -> dict[int, list[Action]]:
    if name not in GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if name in ASYNC_SCHEDULES:
        return GENERATORS[name](pp, microbatches, virtual_stages, steps)
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank; virtual_stages={virtual_stages} needs interleaved")
    return GENERATORS[name](pp, microbatches, virtual_stages)


def version_of(schedule: str, microbatch: int, stage: int, num_stages: int, m: int) -> int:
    """Weight version (number of updates applied) a micro-batch uses on a stage.

    1f1b: stage s runs p-s-1 micro-batches ahead of its updates (weight stashing keeps the
    version for the backward), so micro-batch j sees max(0, j - (p-s-1)) updates.
    2bw: every micro-batch of step t uses the version from before step t-1's update,
    W(t+1) = W(t) - lr * grad(W(t-1)), on every stage alike.
    """
    if schedule == "1f1b":
        return max(0, microbatch - (num_stages - stage - 1))
    if schedule == "2bw":
        return max(0, microbatch // m - 1)
    return 0
