"""Pipeline bubble: the schedule's declared share of idle time, beside the measured one.

Convention: bubble = idle / step time per pipeline rank. Each schedule declares its bubble
in the registry (framework/schedules/) as a function of p, m, v and the
op times T_F, T_I, T_W (T_B = T_I + T_W), and where it comes from (`bubble_source`):
- a closed form (CLOSED_FORM) where a paper gives one that holds here (GPipe and 1F1B:
  (p-1)/(m+p-1); interleaved 1F1B: (p-1)/(v·m+p-1); ZB-H1 / ZB-H2 for m >= p / 2p-1: the
  zero-bubble paper's idle time, floored by the flush's fill), reported as "analytic";
- else the schedule model (SCHEDULE_MODEL): the idle share of the schedule's own
  dependency graph run with those op times and no communication cost
  (framework/schedules/clock.py), a simulation, reported as "schedule model" (interleaved-zb,
  zbv, dualpipev, zb-auto, a CSV file's schedule).
The key stays `bubble_fraction_analytic`; `bubble_analytic_source` says which it is.
docs/schedules.md lists them. A run reports it for its own measured op times
(`measured_op_times`: medians of the actions' compute). One stage has no pipeline, so no bubble.

The measured counterpart, per rank and step, is 1 - busy / window
(framework/train/pipeline_runner.py), with per-action marks from
framework/timestamps.py:
- busy: the sum of the rank's compute (F, B, I, W; for the asynchronous schedules also
  the updates), each from the moment its input was received to the end of its compute. The
  receive wait and the issuing of sends are outside it.
  CPU (gloo): host timestamps; the host runs every op to completion, so they are exact.
  CUDA (NCCL): CUDA events on the compute stream, one recorded after `work.wait()` (it
  fires when the stream has really received) and one after the compute, read once after
  the step; no action synchronises the host. A send's transfer runs on NCCL's stream,
  overlapped; its completion shows up as the peer's receive wait.
- window: from the first mark of the rank's first action of the step (before its receive
  wait; on CUDA the stream is idle then, after the previous step's synchronisation) to the
  flush: a pp-group all-reduce issued once every send of the step is waited for, after
  which the host waits for the stream (CUDA), so the window ends when every stage has
  finished its compute. For the asynchronous schedules (never flushed) it ends at the
  rank's last action of the step.
Neither busy nor idle: the learning-rate update and ZeRO's buffer reset before the first
action; the dp all-reduce, clipping and optimizer step after the flush.
"""

from __future__ import annotations

import statistics
from typing import Optional

from framework.schedules import CLOSED_FORM, Action, OpTimes, get


def analytic_bubble(schedule, pp: int, microbatches: int, virtual_stages: int = 1, steps: int = 1,
                    times: Optional[OpTimes] = None) -> float:
    """The schedule's declared idle share per rank (flushing schedules: per step; the
    asynchronous ones: over the whole run), for op times `times` (default: T_F = T_I = T_W,
    the papers' assumption; the classics' formulas hold for any times)."""
    if pp == 1:
        return 0.0
    schedule = get(schedule) if isinstance(schedule, str) else schedule  # a name or a resolved Schedule
    return schedule.bubble(pp, microbatches, virtual_stages, times or OpTimes(), steps)


def analytic_source(schedule, pp: int, microbatches: int, virtual_stages: int = 1) -> str:
    """Where `analytic_bubble` comes from for this layout: CLOSED_FORM or SCHEDULE_MODEL
    (pp = 1: no pipeline, a bubble of 0 by definition: a closed form)."""
    if pp == 1:
        return CLOSED_FORM
    schedule = get(schedule) if isinstance(schedule, str) else schedule
    return schedule.bubble_source(pp, microbatches, virtual_stages)


def analytic_label(source: str) -> str:
    """What a person reads beside the number: "analytic" for a closed form, "schedule
    model" for a simulation of the schedule's graph."""
    return "analytic" if source == CLOSED_FORM else source


def timed_records(per_rank: list, pp_of: list[int], smap) -> list:
    """Every rank's action records for the op times, less the first stage's I and W: that
    stage has no input gradient, so its I computes nothing and its W the whole backward
    (split_backward.py), which would pull the median T_I down and T_W up. `per_rank[i]` are
    global rank i's records, `pp_of[i]` its pipeline rank."""
    out = []
    for records, pp in zip(per_rank, pp_of, strict=True):
        for rec in records:
            a = Action.parse(rec[0])
            if not (a.op.value in "IW" and smap.stage(pp, a.chunk) == 0):
                out.append(rec)
    return out


def measured_op_times(records) -> tuple[Optional[OpTimes], dict[str, float]]:
    """Median compute seconds per op over action records (name, start, compute_start, end),
    and OpTimes for the analytic bubble: T_F, T_I, T_W as measured; a schedule without a
    split backward has only B, which stands in as T_I with T_W = 0 (T_B = T_I + T_W)."""
    by_op: dict[str, list[float]] = {}
    for name, _start, cstart, end in records:
        by_op.setdefault(Action.parse(name).op.value, []).append(end - cstart)
    med = {op: statistics.median(v) for op, v in by_op.items() if op != "U"}
    if "F" not in med:
        return None, med
    if "I" in med:
        return OpTimes(med["F"], med["I"], med.get("W", 0.0)), med
    return OpTimes(med["F"], med.get("B", 0.0), 0.0), med


def analytic_at_measured(schedule, pp: int, m: int, v: int, steps: int, per_rank: list, pp_of: list[int],
                         fallback: float) -> tuple[float, dict]:
    """(The schedule's analytic bubble at the median op times of these action records, the
    median op times {op: seconds}); `fallback` (e.g. the equal-times value) without records."""
    if pp == 1 or not any(per_rank):
        return fallback, {}
    records = timed_records(per_rank, pp_of, schedule.stage_map(pp, v))
    times, med = measured_op_times(records) if records else (None, {})
    return (fallback if times is None else analytic_bubble(schedule, pp, m, v, steps, times)), med
