"""The pipeline schedule a run asks for (schedule.*, on the config alone): a registered
name, or a CSV file; schedule modules that register more; the schedule's own constraints;
and the exact (pp, m, v) proved by the checker under gloo's and NCCL's rules. A schedule
file's error names its row (pipeline rank), its cell and the rule broken."""

from __future__ import annotations

import math
import re

from framework.config import ConfigError, RunConfig
from framework.parallel.pipeline.partition import uniform
from framework.schedules import CSV, CsvError, csv_schedule, get, load_modules, names, resolve
from framework.validate.common import choice, positive


def load_schedule_modules(run: RunConfig) -> None:
    """schedule.modules: imported here, before any name is checked (and again in each rank)."""
    for name in run.schedule.modules:
        try:
            load_modules([name])
        except Exception as e:  # noqa: BLE001 - whatever the module raised, named with the key
            raise ConfigError("schedule.modules", list(run.schedule.modules),
                              f"importing {name} failed ({type(e).__name__}: {e})",
                              "give a Python file (path ending .py) or an importable module that calls "
                              "framework.schedules.register") from None


def check_schedule(run: RunConfig) -> None:
    s, pp = run.schedule, run.parallelism.pp
    choice("schedule.name", s.name, [*names(), CSV])
    where = _csv(run) if s.name == CSV else None
    positive("schedule.microbatches", s.microbatches)
    positive("schedule.virtual_stages", s.virtual_stages)
    _auto_keys(run)
    sched = csv_schedule(s.csv)[0] if where is not None else resolve(s)
    bad = sched.why_not(pp, s.microbatches, s.virtual_stages)
    if bad is not None:
        value = {"schedule.name": s.name, "schedule.microbatches": s.microbatches,
                 "schedule.virtual_stages": s.virtual_stages}[bad.key]
        raise ConfigError(bad.key, value, bad.reason, bad.fix)
    if not sched.flushes:
        _async_schedule(run)
    stages = pp * s.virtual_stages
    if stages > run.model.n_layer and not run.model.pretrained:
        raise ConfigError("parallelism.pp", pp, f"{stages} stages (pp * virtual_stages) for model.n_layer="
                          f"{run.model.n_layer} blocks: a stage would hold no block",
                          f"use pp * virtual_stages <= {run.model.n_layer}")
    _partition(run, stages)
    _overlap_dualpipe(run)
    if pp > 1:
        _prove(run, sched, where)


def _overlap_dualpipe(run: RunConfig) -> None:
    """A pair's F and B run on two threads, and a process group's collectives must be issued
    in one order on every rank: ep's all-to-alls get a second group for the F thread
    (topology.py); tp's and cp's collectives inside a block have none."""
    p = run.parallelism
    if not p.overlap_dualpipe:
        return
    import torch

    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        raise ConfigError("parallelism.overlap_dualpipe", True, "on CUDA the pair's F and B threads share one compute "
                          "stream: each synchronous all-to-all (and the MoE dispatch's host reads) makes it wait, "
                          "and two ranks can issue ep's and ep_side's all-to-alls in opposite orders, a cycle NCCL "
                          "deadlocks on (issue 47: the F thread on a stream of its own is not built yet)",
                          "use parallelism.overlap_dualpipe=false on CUDA (dualpipev runs without the overlap), "
                          "or device=cpu")
    for k, n in (("parallelism.tp", p.tp), ("parallelism.cp", p.cp)):
        if n > 1:
            raise ConfigError(k, n, "with parallelism.overlap_dualpipe=true: a pair's F and B run on two threads, "
                              f"and only ep's collectives have a group per thread ({k.split('.')[1]}'s would "
                              "interleave in a different order on each rank)",
                              f"use {k}=1, or parallelism.overlap_dualpipe=false")


def _auto_keys(run: RunConfig) -> None:
    """zb-auto's keys: a memory limit >= 1, op times {F, I, W (seconds > 0, or one per pp
    rank), comm (>= 0)}; the keys mean nothing to other schedules, so setting them there is
    an error rather than silently ignored."""
    s, pp = run.schedule, run.parallelism.pp
    if not (s.name in names() and get(s.name).configure is not None):
        for key in ("memory_limit_microbatches", "op_times"):
            if getattr(s, key) is not None:
                raise ConfigError(f"schedule.{key}", getattr(s, key), f"schedule={s.name} builds its lists without it",
                                  f"remove it, or use a schedule that reads it "
                                  f"({', '.join(n for n in names() if get(n).configure is not None)})")
        return
    if s.memory_limit_microbatches is not None:
        positive("schedule.memory_limit_microbatches", s.memory_limit_microbatches)
    t = s.op_times
    if t is None:
        return
    fix = "e.g. schedule.op_times={F: 0.014, I: 0.012, W: 0.011, comm: 0.0005} (seconds), or null with sim.from"
    if set(t) - {"F", "I", "W", "comm"} or not {"F", "I", "W"} <= set(t):
        raise ConfigError("schedule.op_times", dict(t), "needs keys F, I, W (and optionally comm)", fix)
    for key, x in t.items():
        values = list(x) if isinstance(x, (list, tuple)) else [x]
        if key != "comm" and isinstance(x, (list, tuple)) and len(values) != pp:
            raise ConfigError(f"schedule.op_times.{key}", values, f"lists one time per pipeline rank, and pp={pp}", fix)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   and (v >= 0 if key == "comm" else v > 0) for v in values):
            raise ConfigError(f"schedule.op_times.{key}", x, "must be finite seconds > 0 (comm: >= 0)", fix)


def _csv(run: RunConfig) -> dict:
    """schedule=csv: the file is readable, well formed, and sized like the run."""
    s = run.schedule
    if not s.csv:
        raise ConfigError("schedule.csv", s.csv, "schedule=csv reads its schedule from a file",
                          "set schedule.csv=<path> (torch's compute-only CSV: one row per pipeline rank)")
    m = s.microbatches if isinstance(s.microbatches, int) and s.microbatches > 0 else None
    try:
        sched, where = csv_schedule(s.csv, m)  # CsvError: anything wrong with the file, its reading included
    except (CsvError, OSError) as e:
        what = "fix that cell" if getattr(e, "cell", None) is not None else "give a schedule file"
        raise ConfigError("schedule.csv", s.csv, str(e), f"{what} (python -m framework.schedules dump "
                          "writes any registered schedule in this format)") from None
    for key, have, want in (("parallelism.pp", run.parallelism.pp, sched.extra["pp"]),
                            ("schedule.microbatches", s.microbatches, sched.extra["microbatches"]),
                            ("schedule.virtual_stages", s.virtual_stages, sched.extra["virtual_stages"])):
        if have != want:
            raise ConfigError(key, have, f"{s.csv} is a schedule for {key.split('.')[1]}={want}",
                              f"set {key}={want}, or use another file")
    return where


def _prove(run: RunConfig, sched, where) -> None:
    """The exact (pp, m, v) the ranks will run, proved under gloo's and NCCL's rules before
    launch (tests cover pp <= 8, m <= 16; this covers whatever a user asks for). Two steps
    show an asynchronous schedule's steady state across a step boundary."""
    from framework.schedules.check import ScheduleError, prove

    s, pp = run.schedule, run.parallelism.pp
    steps = min(2, run.trainer.steps) if not sched.flushes else 1
    try:
        prove(sched, sched.generate(pp, s.microbatches, s.virtual_stages, steps), pp, s.microbatches,
              s.virtual_stages, steps, run.parallelism.overlap_dualpipe, run.parallelism.cp)
    except ScheduleError as e:
        if where is not None:
            raise ConfigError("schedule.csv", s.csv, f"{_cells(e, where)}breaks a rule: {e}",
                              "reorder or fix the named cell(s); the rules are in docs/schedules.md") from None
        raise ConfigError("schedule.name", s.name, f"fails the schedule checker at pp={pp}, "
                          f"microbatches={s.microbatches}, virtual_stages={s.virtual_stages}: {e}",
                          "choose another schedule or micro-batch count, and report this as a bug") from None


def _cells(e, where: dict) -> str:
    """`row 2 (pp rank 1), cell 5 '3W0': ` for each (rank, action) the error concerns."""
    out = []
    for rank, action in getattr(e, "where", ()):
        if action is not None and (rank, action) in where:
            col, text = where[rank, action]
            out.append(f"row {rank + 1} (pp rank {rank}), cell {col + 1} {text!r}")
        else:
            out.append(f"row {rank + 1} (pp rank {rank})")
    return "; ".join(out) + ": " if out else ""


def _async_schedule(run: RunConfig) -> None:
    s, p = run.schedule, run.parallelism
    if p.dp > 1:
        raise ConfigError("parallelism.dp", p.dp, f"schedule={s.name} is asynchronous; its per-update gradient "
                          "all-reduce over dp is not implemented", f"use parallelism.dp=1 with {s.name}")
    if run.model.tie_embeddings and p.pp > 1:
        raise ConfigError("model.tie_embeddings", True,
                          f"schedule={s.name} updates the first and last stage at different times from different "
                          "weight versions, so their two copies of a tied embedding cannot stay one weight",
                          "set model.tie_embeddings=false (schedule presets set only schedule keys: pass it on "
                          "the command line, for every trial of a layout search)")


def _partition(run: RunConfig, stages: int) -> None:
    method = run.parallelism.partition
    if isinstance(method, (list, tuple)):
        if len(method) != stages or any(not isinstance(b, int) or b < 1 for b in method) \
                or (not run.model.pretrained and sum(method) != run.model.n_layer):
            raise ConfigError("parallelism.partition", list(method),
                              f"an explicit balance lists {stages} positive block counts summing to model.n_layer",
                              f"e.g. parallelism.partition={[len(r) for r in uniform(run.model.n_layer, stages)]}")
        return
    if method in ("uniform", "parameters"):
        return
    if isinstance(method, str) and method.startswith("type:"):
        try:
            re.compile(method[5:])
            return
        except re.error as e:
            raise ConfigError("parallelism.partition", method, f"bad regular expression ({e})", "e.g. type:Block") from None
    raise ConfigError("parallelism.partition", method, "unknown partition method",
                      "use uniform, parameters, type:<regex> or a list of blocks per stage")
