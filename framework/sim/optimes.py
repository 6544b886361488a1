"""A schedule at given op times, with no job: a published schedule study replayed.

    python -m framework.simulate --op-times F=18.5,B=18.1,W=9.3,comm=0.6 schedule=NAME \\
        parallelism.pp=8 schedule.microbatches=24 [schedule.virtual_stages=V]

Op times are per pipeline rank and micro-batch, the zero-bubble paper's convention (Qi et
al. 2024, arXiv 2401.10241): T_F the forward, T_B the input's gradient, T_W the weights',
T_comm a p2p transfer, in any one unit. With v model chunks per rank each chunk's op takes
1 / v of them. A schedule that does not split the backward runs a fused B of T_B + T_W.

Two timelines, each with its bubble in two definitions:
- the schedule's own (its dependency graph: `clock.simulate`, each receive gating only its
  op, a message arriving T_comm after its producer ends);
- the executor's (`clock.predict` on the real p2p batches of `p2p.comm_plan` under NCCL's
  rules: a compute waits for its receive's group, a pair of neighbours' groups run in order
  on its communicator's stream).
  The two differ where the executor's batches gate a compute on a receive it does not need.
Definitions: `paper` = (cost - m (T_F + T_B + T_W)) / cost, cost the longest rank's span
(its first op's start to its last op's end); `ours` = the mean over ranks of 1 - busy /
window, the window from the step's start to its end (the measured bubble's).
"""

from __future__ import annotations

import json

from framework.config import ConfigError
from framework.commands import MOST_MICROBATCHES, MOST_STAGES, MOST_CHUNKS
from framework.schedules.p2p import comm_plan
from framework.schedules import Schedule, get, names
from framework.schedules.base import DEFAULT
from framework.schedules.clock import Costs, idle_share, predict, simulate
from framework.validate.common import suggest

NAMES = ("F", "B", "W", "comm")
KEYS = ("schedule", "schedule.name", "parallelism.pp", "schedule.microbatches", "schedule.virtual_stages")


def parse_op_times(text: str) -> dict:
    """"F=18.5,B=18.1,W=9.3,comm=0.6" -> {F, B, W, comm}; ValueError naming what is wrong."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if key not in NAMES or not sep:
            raise ValueError(f"{item.strip()!r} is not one of {', '.join(n + '=<time>' for n in NAMES)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a number") from None
        if not 0 <= out[key] < 1e12:
            raise ValueError(f"{key}={value}: a time is a finite number >= 0")
    missing = [n for n in ("F", "B", "W") if n not in out]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing (comm may be left out: 0)")
    if out["F"] + out["B"] + out["W"] <= 0:
        raise ValueError("F + B + W is 0: nothing to schedule")
    out.setdefault("comm", 0.0)
    return out


def _durations(t: dict, v: int) -> dict:
    return {"F": t["F"] / v, "I": t["B"] / v, "W": t["W"] / v, "B": (t["B"] + t["W"]) / v, "U": 0.0}


def _paper(spans: list[float], m: int, t: dict) -> float:
    cost = max(spans)
    return (cost - m * (t["F"] + t["B"] + t["W"])) / cost if cost > 0 else 0.0


def bubbles(schedule: Schedule, p: int, m: int, v: int, times: dict) -> dict:
    """{own: {paper, ours, step}, executor: {paper, ours, step}} at `times` (parse_op_times)."""
    lists = schedule.generate(p, m, v, 1)
    smap = schedule.stage_map(p, v)
    d = _durations(times, v)
    own = simulate(lists, smap, d, comm=times["comm"])
    own_spans = [tl[-1][1] - tl[0][0] for tl in own.values() if tl]
    compute = {(r, c, op): d[op] for r in range(p) for c in range(v) for op in ("F", "I", "W", "B")}
    pred = predict(comm_plan(lists, smap), smap, Costs(compute, {}, times["comm"]), True, "nccl")
    ex_spans = [tl[-1].end - tl[0].start for tl in pred.timeline.values() if tl]
    return {"own": {"paper": _paper(own_spans, m, times), "ours": idle_share(own),
                    "step": max(e for tl in own.values() for _, e, _ in tl)},
            "executor": {"paper": _paper(ex_spans, m, times), "ours": pred.bubble, "step": pred.pipeline_s}}


def describe(name: str, p: int, m: int, v: int, times: dict, b: dict) -> str:
    head = (f"{name}: pp {p}, {m} micro-batches, {v} chunk(s) per rank | op times per rank and micro-batch: "
            f"T_F {times['F']:g}, T_B {times['B']:g}, T_W {times['W']:g}, T_comm {times['comm']:g}")
    rows = [f"  {label:<40s} step {b[k]['step']:.4g} | bubble {b[k]['paper']:.3f} (zero-bubble paper's: "
            f"(cost - m(T_F+T_B+T_W)) / cost) | {b[k]['ours']:.3f} (ours: mean of 1 - busy / window)"
            for k, label in (("own", "schedule's own graph (receive gates its op)"),
                             ("executor", "executor's p2p batches (NCCL's rules)"))]
    return "\n".join([head, *rows])


def command_line(job_dir, op_times: str, overrides: list[str], as_json: bool, png) -> int:
    """`python -m framework.simulate --op-times ...` (framework/sim/cli.py hands it over): a
    bad argument is a ConfigError naming it."""
    if job_dir is not None:
        raise ConfigError("--op-times", op_times, f"replays a schedule with no job, but a job was given ({job_dir})",
                          "leave the job directory out, or --op-times out")
    if png:
        raise ConfigError("--png", png, "is not drawn for --op-times", "leave --png out")
    try:
        times = parse_op_times(op_times)
    except ValueError as e:
        raise ConfigError("--op-times", op_times, str(e), "write e.g. --op-times F=18.5,B=18.1,W=9.3,comm=0.6") \
            from None
    given = dict(o.partition("=")[::2] for o in overrides)
    for key in given:
        if key not in KEYS:
            raise ConfigError(key, given[key], "does not act with --op-times", "give only schedule=, parallelism.pp=, "
                              "schedule.microbatches= and schedule.virtual_stages=")
    name = given.get("schedule", given.get("schedule.name", DEFAULT))
    if name not in names():
        close = suggest(name, names())
        raise ConfigError("schedule", name, "no such schedule" + (f". Did you mean {' or '.join(close)}?" if close else ""),
                          f"use one of {', '.join(names())} (python -m framework.schedules list)")
    sched = get(name)
    if not sched.flushes:
        raise ConfigError("schedule", name, "never flushes (asynchronous weight updates): a step has no end to "
                          "measure a bubble against", f"give a flushing schedule ({DEFAULT} is the paper's 1F1B)")
    nums = {}
    for key, most in (("parallelism.pp", MOST_STAGES), ("schedule.microbatches", MOST_MICROBATCHES),
                      ("schedule.virtual_stages", MOST_CHUNKS)):
        raw = given.get(key, str(sched.preset_chunks) if key == "schedule.virtual_stages" else None)
        if raw is None:
            raise ConfigError(key, None, "is needed with --op-times", f"give {key}=<count>")
        try:
            nums[key] = int(raw)
        except ValueError:
            raise ConfigError(key, raw, "is not an integer", f"give {key}=<count>") from None
        if not 1 <= nums[key] <= most:
            raise ConfigError(key, raw, f"is outside 1..{most}", f"give {key}=<count in 1..{most}>")
    p, m, v = nums["parallelism.pp"], nums["schedule.microbatches"], nums["schedule.virtual_stages"]
    why = sched.why_not(p, m, v)
    if why is not None:
        raise ConfigError(why.key, {"schedule.name": name, "schedule.virtual_stages": v}.get(why.key, m), why.reason,
                          why.fix)
    result = bubbles(sched, p, m, v, times)
    print(json.dumps({"schedule": name, "pp": p, "microbatches": m, "virtual_stages": v, "op_times": times, **result},
                     indent=1) if as_json else describe(name, p, m, v, times, result))
    return 0
