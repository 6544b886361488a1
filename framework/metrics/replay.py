"""Predicted step time, bubble and activation peak of a pipeline layout, from a calibration.

`replay` runs the schedule's real plan (`p2p.comm_plan`: the batches the executor issues)
through the clock (framework/schedules/clock.py) with a `Calibration`'s
durations. What it predicts and how each number maps to a measured one:
- bubble_fraction: mean over pipeline ranks of 1 - busy / window, the measured definition
  (flushing schedules: per step, the window ends at the flush; asynchronous ones: over the
  whole run, each rank's window ending at its last action).
- step_time_s: the slowest rank's simulated window plus its measured time outside the
  window (data, the optimizer step, the dp all-reduce: replayed, not simulated). For the
  asynchronous schedules the run's simulated span / steps plus that outside time.
- activation_peak_bytes[rank]: the most (micro-batch, chunk) activations the rank's list
  holds at once x the calibration's bytes per micro-batch and chunk.
- the step-time breakdown (`breakdown_of`, flushing schedules): per part, the mean over
  pipeline ranks of the replayed step cut as the measured one is (framework/metrics/
  breakdown.py): compute (the ops less the communication measured inside them), that
  communication (`comm_inside`: tp, ep, cp), each receive wait split at the simulated send
  into bubble and comm_pp (the step's tail to the flush is bubble), host (the gaps between
  actions) and `outside` (the measured time outside the window, replayed). The summary
  shows each beside its measurement (`predicted_time_<part>_s`).

A pp = 1 run with ep > 1 has no pipeline to simulate; it is calibrated all the same
(`FlatPredictor`: fwd/bwd, the rest of the step, the all-to-all; medians, calibrate.py says
why) for the simulator's ep what-if, and its replay (`flat_replay`) is fwd/bwd + the rest:
beside the measured median step its error says how far the median of a sum is from the sum
of the medians, nothing about a model (the what-if to another ep is where one enters).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from framework.files import write_atomic
from framework.schedules.check import alive_peak
from framework.schedules.p2p import comm_plan
from framework.schedules import Schedule
from framework.schedules.clock import Prediction, predict
from framework.metrics.calibrate import Calibration

ASYNC_STEPS = (4, 8)  # never-flushed runs: simulate this many steps, extrapolate linearly


@dataclass
class Predicted:
    step_time_s: float
    bubble_fraction: float
    rank_bubble_fraction: list[float]
    activation_peak_bytes: list[float]
    pipeline_s: float  # the simulated step (async: the simulated run / its steps); pp = 1: fwd/bwd
    sim: Optional[Prediction]  # the simulated timeline (async: of the shorter simulated run); None: pp = 1

    def keys(self) -> dict:
        """The summary / metrics.jsonl / W&B keys."""
        return {"predicted_step_time_s": self.step_time_s, "predicted_bubble_fraction": self.bubble_fraction}


def rules_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def alive_per_rank(schedule: Schedule, p: int, m: int, v: int) -> dict[int, int]:
    lists = schedule.generate(p, m, v, 1 if schedule.flushes else 2)
    return {r: alive_peak(acts) for r, acts in lists.items()}


def replay(cal: Calibration, schedule: Schedule, p: int, m: int, v: int, steps: int = 1,
           rules: str = "gloo", plans: Optional[dict] = None, alive: Optional[dict] = None) -> Predicted:
    """`plans` (a flushing step's) and `alive` (`alive_per_rank`): built here unless a caller
    that replays the same layout again and again (RunPredictor) passes its own."""
    smap = schedule.stage_map(p, v)
    costs = cal.costs()
    outside = [cal.outside_s.get(str(r), 0.0) for r in range(p)]
    if schedule.flushes:
        plans = plans or comm_plan(schedule.generate(p, m, v, 1), smap)
        sim = predict(plans, smap, costs, True, rules)
        step = max(sim.window_s[r] + outside[r] for r in range(p))
        busy = _busy(sim, cal.comm_in)
        bubbles = {r: 1 - busy[r] / sim.window_s[r] if sim.window_s[r] > 0 else 0.0 for r in range(p)}
        pipeline_s = sim.pipeline_s
    else:
        sim, bubbles, pipeline_s = _async(schedule, smap, p, m, v, steps, costs, rules, cal.comm_in)
        step = pipeline_s + max(outside)
    alive = alive or alive_per_rank(schedule, p, m, v)
    act = [alive[r] * cal.act_bytes.get(str(r), 0.0) for r in range(p)]
    rank_b = [bubbles[r] for r in range(p)]
    return Predicted(step, sum(rank_b) / p, rank_b, act, pipeline_s, sim)


def breakdown_of(pred: Predicted, cal: Calibration, smap) -> dict:
    """The replayed step's parts, mean over pipeline ranks (module docstring); they sum to
    the mean of the ranks' window plus outside time."""
    from types import SimpleNamespace

    from framework.metrics.breakdown import split_waits

    tl, ranks = pred.sim.timeline, sorted(pred.sim.timeline)
    per_rank = []
    for r in ranks:
        acts = tl[r]
        inside = sum(cal.comm_in.get(f"{r},{t.action.chunk},{t.action.op.value}", 0.0) for t in acts)
        span = acts[-1].end - acts[0].start if acts else 0.0
        parts = {"compute": sum(t.end - t.compute_start for t in acts) - inside, "comm_inside": inside,
                 "host": sum(acts[k].start - acts[k - 1].end for k in range(1, len(acts))),
                 "wait": sum(t.compute_start - t.start for t in acts), "comm_pp": 0.0,
                 "bubble": pred.sim.window_s[r] - span, "outside": cal.outside_s.get(str(r), 0.0)}
        per_rank.append(SimpleNamespace(parts=parts, actions=[(str(t.action), t.start, t.compute_start, t.end)
                                                              for t in acts]))
    split = split_waits(per_rank, smap, [ranks])
    return {k: sum(p[k] for p in split) / len(split)
            for k in ("compute", "comm_inside", "comm_pp", "bubble", "host", "outside")}


def _busy(sim, comm_in: dict) -> dict:
    """Each rank's busy time as the measured bubble counts it: the actions' durations less
    the communication measured inside them (calibration's comm_in; none in older files)."""
    return {r: sim.busy_s[r] - sum(comm_in.get(f"{r},{t.action.chunk},{t.action.op.value}", 0.0) for t in tl)
            for r, tl in sim.timeline.items()}


def _async(schedule, smap, p, m, v, steps, costs, rules, comm_in=None):
    """Simulate `ASYNC_STEPS` steps (fewer when the run is shorter) and extrapolate each
    rank's busy and window time linearly to `steps`: past the fill every step adds the
    same amount (the tiling of tiling.py is periodic)."""
    runs = {}
    for s in sorted({min(steps, n) for n in ASYNC_STEPS}):
        runs[s] = predict(comm_plan(schedule.generate(p, m, v, s), smap), smap, costs, False, rules)
    s1, s2 = min(runs), max(runs)
    a, b = runs[s1], runs[s2]

    def at(x1: float, x2: float) -> float:
        return x2 if s1 == s2 else x2 + (x2 - x1) / (s2 - s1) * (steps - s2)

    busy_a, busy_b = _busy(a, comm_in or {}), _busy(b, comm_in or {})
    bubbles = {r: 1 - at(busy_a[r], busy_b[r]) / at(a.window_s[r], b.window_s[r]) for r in range(p)}
    return b, bubbles, at(a.pipeline_s, b.pipeline_s) / steps


class RunPredictor:
    """The logging rank's replay of its own run: fed each gathered step's records, it
    predicts at each log interval (the medians so far) and at the end (calibration.json)."""

    def __init__(self, schedule: Schedule, p: int, m: int, v: int, steps: int, coords: list,
                 message_bytes: int, device_type: str, measured_from: int):
        """`coords[i]`: global rank i's coordinates (.pp, .dp, .tp)."""
        from framework.metrics.calibrate import RunningCalibration

        self.schedule, self.p, self.m, self.v, self.steps = schedule, p, m, v, steps
        self.rules, self.measured_from = rules_for(device_type), measured_from
        pipes: dict[tuple, dict[int, int]] = {}
        for g, c in enumerate(coords):
            pipes.setdefault((c.dp, c.tp), {})[c.pp] = g
        self.pipelines = [[ranks[pp] for pp in range(p)] for ranks in pipes.values()]
        self.smap = schedule.stage_map(p, v)
        self.plans = comm_plan(schedule.generate(p, m, v, 1), self.smap) if schedule.flushes else None
        self._new = lambda: RunningCalibration(self.smap, self.pipelines, message_bytes, schedule.flushes, self.plans)
        self.calib = self._new()
        self.alive = alive_per_rank(schedule, p, m, v)

    def add(self, step: int, per_rank: list) -> None:
        if step >= self.measured_from:
            self.calib.add_step(per_rank)

    def calibration(self, per_rank: list | None = None) -> Calibration:
        """The measured steps' so far; before the first measured step, this step's own."""
        if self.calib.steps == 0 and per_rank is not None:
            one = self._new()
            one.add_step(per_rank)
            return one.calibration(self.alive)
        return self.calib.calibration(self.alive)

    def predict(self, per_rank: list | None = None) -> tuple[Calibration, Predicted | None]:
        cal = self.calibration(per_rank)
        try:
            return cal, replay(cal, self.schedule, self.p, self.m, self.v, self.steps, self.rules, self.plans,
                               self.alive)
        except KeyError:  # an op never recorded yet (no measured step): nothing to predict
            return cal, None


def flat_replay(cal: Calibration, microbatches: float = 1.0, extra_s: float = 0.0) -> Predicted:
    """A pp = 1 calibration's step: its fwd/bwd x `microbatches` (target m / the job's: the
    same work per micro-batch) + `extra_s` (seconds added to the fwd/bwd, e.g. another ep's
    all-to-all) + the rest of the step as measured. No pipeline: bubble 0 by definition."""
    fwd_bwd = cal.fwd_bwd_s * microbatches + extra_s
    return Predicted(fwd_bwd + cal.outside_s.get("0", 0.0), 0.0, [0.0], [cal.act_bytes.get("0", 0.0)], fwd_bwd, None)


class FlatPredictor(RunPredictor):
    """RunPredictor's place in a pp = 1 run with ep > 1: no action records, so the
    calibration keeps the step's fwd/bwd, the rest and the all-to-all, and the replay is
    `flat_replay`."""

    def __init__(self, measured_from: int):  # not RunPredictor's: no schedule plans or pipelines at pp = 1
        from framework.metrics.calibrate import RunningCalibration

        self.measured_from, self.alive = measured_from, {0: 1}  # one micro-batch alive at a time
        self._new = lambda: RunningCalibration(None, [], 0, True)
        self.calib = self._new()

    def predict(self, per_rank: list | None = None) -> tuple[Calibration, Predicted | None]:
        cal = self.calibration(per_rank)
        return cal, (flat_replay(cal) if cal.fwd_bwd_s is not None else None)


def predicted_keys(pred: Optional[Predicted]) -> dict:
    return pred.keys() if pred is not None else {"predicted_step_time_s": None, "predicted_bubble_fraction": None}


def summary_prediction(predictor: RunPredictor, med: dict, job_dir: str) -> tuple[dict, Optional[Predicted]]:
    """The summary's keys: the replay of the run's measured steps beside what it predicts,
    with signed errors (step time: predicted / measured - 1; bubble: predicted - measured,
    points), and a flushing pipeline's replayed breakdown (`predicted_time_<part>_s`);
    writes calibration.json."""
    cal, pred = predictor.predict()
    write_atomic(os.path.join(job_dir, "calibration.json"), json.dumps(cal.to_json(), indent=1))
    if pred is None:
        return predicted_keys(None), None
    parts = {}
    if pred.sim is not None and getattr(predictor, "schedule", None) is not None and predictor.schedule.flushes:
        parts = {f"predicted_time_{k}_s": v for k, v in breakdown_of(pred, cal, predictor.smap).items()}
    return {**pred.keys(), "predicted_step_time_error": pred.step_time_s / med["step_time_s"] - 1,
            "predicted_bubble_error": pred.bubble_fraction - med["bubble_fraction"],
            "predicted_rank_bubble_fraction": pred.rank_bubble_fraction,
            "predicted_activation_peak_bytes_max": max(pred.activation_peak_bytes), **parts}, pred


def timeline_records(pred: Predicted) -> list[list[tuple]]:
    """The simulated step as action records (name, start, compute start, end) per pipeline
    rank: what trace.json and timeline.png draw."""
    return [[(str(t.action), t.start, t.compute_start, t.end) for t in pred.sim.timeline[r]]
            for r in sorted(pred.sim.timeline)]
