"""Rescale one run's calibration to another layout: schedule, micro-batches, virtual stages
or pipeline size (the same model, micro-batch size and hardware).

With the same stages (pp x v and blocks per stage unchanged: another schedule of the same
placement depth, or another m) every stage keeps its own measured times and every rank its
own time outside the pipeline. Otherwise, per op, a stage's time is modelled as
n_blocks x t + (first stage) e + (last stage) h: t
per transformer block, e the embedding's extra, h the head's (its logits and loss). Fitted
from the measured stages: t from the middle stages when there are any (e, h from the
ends); with only first and last stages (pp 2, v 1), e is taken as 0 (an embedding lookup
is cheap next to a block) and t from the first stage. Activation bytes per micro-batch and
chunk are rescaled the same way.

Assumptions a prediction inherits (docs/simulator.md):
- Backward split: a measured I / W pair gives the split share rho = I / (I + W) (mean over
  stages after the first); a run without one assumes rho = 1/2 (the zero-bubble paper's
  T_I = T_W), and I + W = B (a split backward costs what the fused one does; on this CPU it
  costs more, so predicting a split schedule from a fused run is optimistic). On the
  first stage I computes nothing and W the whole backward.
- Updates (asynchronous targets): U per block from a measured U, else the source's
  time outside the pipeline (mostly the optimizer step) per block.
- Time outside the pipeline: the source's mean per rank, scaled by blocks per rank.
- Gap, link latency and flush cost: as measured (independent of the layout).
- Communication inside an op (calibration's `comm_in`: tp, ep, cp spans, which busy
  excludes): rescaled per op as its compute is (F; B = I + W), a backward's given to I (the
  input gradient is what tp and cp reduce) and, on the first stage, to W.

What it cannot rescale (another model, micro-batch, sequence length, precision or tp) is
refused before it gets here: framework/sim/source.py.
"""

from __future__ import annotations

import statistics

from framework.schedules import Schedule
from framework.metrics.calibrate import Calibration


def fit_blocks(values: dict[int, float], blocks: list[int]) -> tuple[float, float, float]:
    """(t, e, h) from {stage: value} and blocks per stage (module docstring)."""
    last = len(blocks) - 1
    mids = [g for g in values if 0 < g < last]
    if mids:
        t = sum(values[g] for g in mids) / sum(blocks[g] for g in mids)
    else:
        t = values[0] / blocks[0] if 0 in values else 0.0
    e = max(values.get(0, 0.0) - blocks[0] * t, 0.0) if mids else 0.0
    h = max(values.get(last, 0.0) - blocks[last] * t, 0.0) if last > 0 else 0.0
    return t, e, h


class _Measured:
    """A stage's own measured value where there is one (the same stage layout), else the fit."""

    def __init__(self, values: dict[int, float], fit):
        self.values, self.fit = values, fit


def _at(fit, g: int, n: int, stages: int) -> float:
    if isinstance(fit, _Measured):
        return fit.values[g] if g in fit.values else _at(fit.fit, g, n, stages)
    t, e, h = fit
    return n * t + (e if g == 0 else 0.0) + (h if g == stages - 1 else 0.0)


def rescale(cal: Calibration, src: Schedule, src_p: int, src_v: int, src_blocks: list[int],
            dst: Schedule, dst_p: int, dst_v: int, dst_blocks: list[int]) -> Calibration:
    """The calibration the target layout would measure, under the module's model."""
    smap, tmap = src.stage_map(src_p, src_v), dst.stage_map(dst_p, dst_v)
    per_stage: dict[str, dict[int, float]] = {}
    for key, sec in cal.compute.items():
        r, c, op = key.split(",")
        per_stage.setdefault(op, {})[smap.stage(int(r), int(c))] = sec
    backward = per_stage.get("B") or {g: per_stage.get("I", {}).get(g, 0.0) + w
                                      for g, w in per_stage.get("W", {}).items()}
    split = [per_stage["I"][g] / backward[g] for g in per_stage.get("I", {}) if g > 0 and backward.get(g)]
    rho = statistics.fmean(split) if split else 0.5
    outside = statistics.fmean(cal.outside_s.values()) if cal.outside_s else 0.0
    src_per_rank = sum(src_blocks) / src_p
    fits = {"F": fit_blocks(per_stage.get("F", {}), src_blocks), "B": fit_blocks(backward, src_blocks)}
    fits["U"] = (fit_blocks(per_stage["U"], src_blocks) if "U" in per_stage
                 else (outside / src_per_rank, 0.0, 0.0))
    comm: dict[str, dict[int, float]] = {}
    for key, sec in cal.comm_in.items():
        r, c, op = key.split(",")
        comm.setdefault("B" if op in "IW" else op, {}).setdefault(smap.stage(int(r), int(c)), 0.0)
        comm["B" if op in "IW" else op][smap.stage(int(r), int(c))] += sec
    comm_fits = {op: fit_blocks(comm.get(op, {}), src_blocks) for op in ("F", "B")}
    acts = {smap.stage(int(r), c): b for r, b in cal.act_bytes.items() for c in range(src_v)}
    act_fit = fit_blocks(acts, src_blocks)
    stages = tmap.num_stages
    if list(src_blocks) == list(dst_blocks):  # the same stages: each keeps its own measured values
        fits = {op: _Measured(values, fits[op]) for op, values in (("F", per_stage.get("F", {})), ("B", backward),
                                                                     ("U", per_stage.get("U", {})))}
        act_fit = _Measured(acts, act_fit)
        comm_fits = {op: _Measured(comm.get(op, {}), comm_fits[op]) for op in ("F", "B")}
    compute, act_bytes, outside_s, comm_in = {}, {}, {}, {}
    for r in range(dst_p):
        rank_act = []
        for c in range(dst_v):
            g = tmap.stage(r, c)
            n = dst_blocks[g]
            f, b = _at(fits["F"], g, n, stages), _at(fits["B"], g, n, stages)
            compute[f"{r},{c},F"], compute[f"{r},{c},B"] = f, b
            compute[f"{r},{c},I"] = 0.0 if g == 0 else rho * b
            compute[f"{r},{c},W"] = b if g == 0 else (1 - rho) * b
            compute[f"{r},{c},U"] = _at(fits["U"], g, n, stages)
            if comm:
                cb = _at(comm_fits["B"], g, n, stages)
                comm_in.update({f"{r},{c},F": _at(comm_fits["F"], g, n, stages), f"{r},{c},B": cb,
                                f"{r},{c},I": cb if g else 0.0, f"{r},{c},W": 0.0 if g else cb, f"{r},{c},U": 0.0})
            rank_act.append(_at(act_fit, g, n, stages))
        act_bytes[str(r)] = statistics.fmean(rank_act)
        per_rank = sum(dst_blocks[tmap.stage(r, c)] for c in range(dst_v))
        # The optimizer step is outside a flushing pipeline and inside an asynchronous one (U).
        # Same ranks and stages: each rank's own measured outside time; else the mean, scaled.
        same = dst_p == src_p and list(src_blocks) == list(dst_blocks) and str(r) in cal.outside_s
        scaled = cal.outside_s[str(r)] if same else outside * per_rank / src_per_rank
        if "U" in per_stage:  # measured outside: data and the rest, no update
            updates = sum(compute[f"{r},{c},U"] for c in range(dst_v))
            outside_s[str(r)] = scaled + updates if dst.flushes else scaled
        else:  # measured outside: mostly the update
            outside_s[str(r)] = scaled if dst.flushes else 0.0
    gap = statistics.fmean(cal.gap_s.values()) if cal.gap_s else 0.0
    return Calibration(compute=compute, gap_s={str(r): gap for r in range(dst_p)}, alpha_s=cal.alpha_s,
                       alpha_late_s=cal.alpha_late_s,
                       beta_Bps=cal.beta_Bps, message_bytes=cal.message_bytes, flush_s=cal.flush_s,
                       outside_s=outside_s, act_bytes=act_bytes, latency_samples=cal.latency_samples,
                       steps=cal.steps, comm_in=comm_in)
