"""The simulator's calibration: per-stage op durations, the host gap between actions, the
link cost (alpha, beta) and the time around the pipeline, from a run's own action records.

Bounded: each quantity keeps a bounded sample (`Sample`: every value until `limit`, then
every 2nd, 4th, ... value, so the kept values stay spread over the whole run) and reports
its mean or median (below); nothing grows with the number of steps.

What is fitted, per step and pipeline (global ranks sharing dp / tp coordinates), with the
executor's records (action, start, compute start, end) in unix seconds:
- compute[(pp rank, chunk, op)]: end - compute start. Keyed per stage: a stage holding the
  head is slower than one holding only blocks, and replicas of a stage (dp, tp) pool.
- gap_s[pp rank]: start of action k - end of action k-1 (issuing the p2p batch between).
  Compute, gap and outside time are means, the rest medians (`calibration`).
- alpha_s / beta_Bps: a transfer's latency, from the end of the producing action to the
  compute start of the consuming one, on messages the consumer really waited for (its
  receive wait is over `WAITED_S`; otherwise the message had arrived earlier and the
  difference is only an upper bound). A run sends one message size (activations and
  gradients share a shape), so alpha and beta are not separable from one run: the whole
  latency is alpha and beta is infinite (documented in docs/simulator.md). A receive
  posted after its send (the plan says which batch posts it) is timed from the posting
  instead, as alpha_late_s: gloo's rendezvous for it costs more.
- flush_s: the end of a flushing step's window minus its last compute's end.
- outside_s[pp rank]: the rank's step time minus its window (data, the optimizer step, the
  dp all-reduce): replayed as measured, never simulated.
- act_bytes[pp rank]: the rank's activation peak / the most (micro-batch, chunk)
  activations its list holds at once: bytes per micro-batch and chunk.
- a2a_bytes / a2a_s (expert parallelism, ep > 1): the step's all-to-all bytes sent and host
  seconds, each the mean over ranks (metrics.jsonl shows the max: the per-stage compute the
  all-to-all sits in pools ranks too, and the mean of bytes is what the volume model
  expects), medians over steps (a link cost, as the latency): the simulator's all-to-all
  bandwidth (framework/sim/alltoall.py).
- pp = 1 (no pipeline, no action records; written with ep > 1, for the ep what-if):
  fwd_bwd_s, the step's forward and backward of its m micro-batches, and outside_s["0"], the
  rest of the step (each the max over ranks, as the metrics.jsonl row), act_bytes["0"].
  Medians, unlike a pipeline's means: the step is the sum of just these two, and on this
  2-core CPU (moe-tiny, dp 2, ep 2, 12 measured steps, three runs) the sum of their medians
  was -0.3 %, -1.0 % and -4.4 % off the median step time, the sum of their means +4.3 %,
  +4.4 % and +14.6 % (one or two steps of 2x the median pull a mean of 12 steps).
Keys added later default to None, so an older calibration.json still loads. Read back
(`read_calibration`, `Calibration.from_json`) it is checked before anything uses it: a JSON
object of known fields, the first version's present, every time and byte count a finite
number >= 0, some op times; anything else is a ConfigError naming sim.from.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from framework.config import ConfigError
from framework.schedules.messages import needs, produces, receiver_of
from framework.schedules import Action, Op, StageMap
from framework.schedules.clock import Costs
from framework.files import read_json

WAITED_S = 2e-4  # a receive wait longer than this: the message was not there yet


class Sample:
    """A bounded, run-spanning sample of one quantity (its mean or median is reported)."""

    def __init__(self, limit: int = 256):
        self.limit, self.values, self.stride, self.seen = limit, [], 1, 0

    def add(self, x: float) -> None:
        if self.seen % self.stride == 0:
            self.values.append(x)
            if len(self.values) >= self.limit:
                self.values, self.stride = self.values[::2], self.stride * 2
        self.seen += 1

    def median(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None

    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None


@dataclass
class Calibration:
    """What `simulate.Costs` needs, plus what a what-if rescales (calibration.json)."""

    compute: dict = field(default_factory=dict)  # "rank,chunk,op" -> seconds
    gap_s: dict = field(default_factory=dict)  # "rank" -> seconds
    alpha_s: float = 0.0
    beta_Bps: Optional[float] = None  # None: not separable from alpha (one message size)
    alpha_late_s: Optional[float] = None  # latency from a receive posted after its send; None: alpha_s
    message_bytes: int = 0
    flush_s: float = 0.0
    outside_s: dict = field(default_factory=dict)  # "rank" -> seconds
    act_bytes: dict = field(default_factory=dict)  # "rank" -> bytes per (micro-batch, chunk)
    latency_samples: int = 0
    steps: int = 0
    a2a_bytes: Optional[float] = None  # ep > 1: all-to-all bytes sent per step, the ranks' mean; None: none measured
    a2a_s: Optional[float] = None  # and the host seconds inside it
    fwd_bwd_s: Optional[float] = None  # pp = 1 only: forward + backward per step; None: a pipeline job
    # "rank,chunk,op" -> seconds of communication inside that op's compute (tp, ep, cp): busy
    # excludes it, as the measured bubble does (framework/metrics/breakdown.py)
    comm_in: dict = field(default_factory=dict)

    def costs(self) -> Costs:
        compute = {}
        for key, sec in self.compute.items():
            r, c, op = key.split(",")
            compute[(int(r), int(c), op)] = sec
        return Costs(compute, {int(r): s for r, s in self.gap_s.items()}, self.alpha_s,
                     self.beta_Bps or float("inf"), self.message_bytes, self.flush_s, self.alpha_late_s)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: Any) -> Calibration:
        """A calibration.json's content, checked (CalibrationError: the first thing wrong)."""
        problem = _shape_problem(d)
        if problem is not None:
            raise CalibrationError(f"{CALIBRATION} {problem}")
        return Calibration(**d)


class CalibrationError(ValueError):
    """A calibration.json of the wrong shape or with impossible values."""


CALIBRATION = "calibration.json"
MAX_CALIBRATION_BYTES = 16 << 20  # a pp = 64 job's is well under 1 MiB
_REQUIRED = ("compute", "gap_s", "alpha_s", "message_bytes", "flush_s", "outside_s", "act_bytes")  # since version 1
_RANK = re.compile(r"^\d+$")
_OP_KEY = re.compile(rf"^\d+,\d+,[{''.join(o.value for o in Op)}]$")
_MAPS = {"compute": _OP_KEY, "gap_s": _RANK, "outside_s": _RANK, "act_bytes": _RANK,
         "comm_in": _OP_KEY}  # key -> the form of its keys ("rank,chunk,op" or "rank"); comm_in: optional
_NULLABLE = ("beta_Bps", "alpha_late_s", "a2a_bytes", "a2a_s", "fwd_bwd_s")


def _short(x: Any, n: int = 40) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n - 3] + "..."


def _finite(x: Any) -> bool:
    """A finite number >= 0 (a time or a byte count; json reads NaN and Infinity too)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _shape_problem(d: Any) -> Optional[str]:
    """Why `d` is not a calibration, as a phrase after the file's name; None when it is."""
    if not isinstance(d, dict):
        return f"is a JSON {type(d).__name__}, not an object of calibration fields"
    unknown = sorted(set(d) - {f.name for f in fields(Calibration)})
    missing = [k for k in _REQUIRED if k not in d]
    if unknown or missing:
        return (f"has unknown fields {_short(unknown, 80)} (another version's file?)" if unknown
                else f"lacks {', '.join(missing)}")
    for key, form in _MAPS.items():
        if key not in d:  # an optional map (comm_in, since the step-time breakdown)
            continue
        if not isinstance(d[key], dict):
            return f"{key} is {_short(d[key])}, not an object"
        for k, x in d[key].items():
            if not form.match(k) or not _finite(x):
                return f"{key}[{_short(k)}] = {_short(x)}: not a finite number >= 0 under a key like " \
                       f"{'0,0,F' if key == 'compute' else '0'}"
    for key in ("alpha_s", "flush_s", "message_bytes", "latency_samples", "steps", *_NULLABLE):
        x = d.get(key)
        if not (_finite(x) or (x is None and key in _NULLABLE)) or (key == "beta_Bps" and x == 0):
            return f"{key} = {_short(x)}: not a finite number >= 0" + (" (or null)" if key in _NULLABLE else "")
    if not d["compute"] and d.get("fwd_bwd_s") is None:
        return "holds no op times (compute is empty and fwd_bwd_s null)"
    return None


def read_calibration(job_dir: str) -> Calibration:
    """`sim.from`'s calibration.json, read defensively (bounded, checked): anything wrong with
    it is a ConfigError naming sim.from, before any rank starts."""
    fix = ("give the directory of a finished pipeline job (parallelism.pp > 1) or expert-parallel job "
           "(parallelism.ep > 1): its run writes calibration.json")
    path = os.path.join(job_dir, CALIBRATION)
    if not os.path.isfile(path):
        raise ConfigError("sim.from", job_dir, f"has no {CALIBRATION}: not the directory of a finished pipeline job",
                          fix)
    d = read_json("sim.from", job_dir, path, fix, MAX_CALIBRATION_BYTES)
    try:
        return Calibration.from_json(d)
    except CalibrationError as e:
        raise ConfigError("sim.from", job_dir, str(e), fix) from None


def _posting(recs: dict, r: int, k: int) -> float:
    """When rank r issued its batch k: the end of action k-1 (batch 0: the first's start)."""
    return recs[r][k - 1][3] if k > 0 else recs[r][0][1]


class RunningCalibration:
    """Fed one step at a time (rank 0, at each gather); `calibration()` at any time."""

    def __init__(self, smap: Optional[StageMap], pipelines: list[list[int]], message_bytes: int, flushes: bool,
                 plans: Optional[dict] = None):
        """`plans`: the flushing step's {pp rank: p2p.RankPlan}, for when each receive was
        posted (None, asynchronous schedules: every latency counts from the send).
        `pipelines` empty (and `smap` None): a pp = 1 run, whose steps have no action records."""
        self.smap, self.pipelines, self.message_bytes, self.flushes = smap, pipelines, message_bytes, flushes
        self.posted_in, self.batches = None, None
        if plans is not None:
            self.batches = {r: plan.batches for r, plan in plans.items()}  # message -> (receiver, index of the batch that posts its receive)
            self.posted_in = {op.msg: (r, k) for r, plan in plans.items() for k, batch in enumerate(plan.batches)
                              for op in batch if op.op == "recv"}
        self.samples: dict[tuple, Sample] = {}
        self.steps = 0

    def _add(self, key: tuple, x: float) -> None:
        self.samples.setdefault(key, Sample()).add(x)

    def add_step(self, per_rank: list) -> None:
        """`per_rank[i]`: global rank i's StepRecord of one step."""
        self.steps += 1
        if max(r.a2a_bytes for r in per_rank):  # ep > 1: every step exchanges at least the counts
            self._add(("a2a_bytes",), statistics.fmean(r.a2a_bytes for r in per_rank))
            self._add(("a2a_s",), statistics.fmean(r.a2a_s for r in per_rank))
        if not self.pipelines:  # pp = 1: the row's fwd/bwd and the rest of its step
            fwd_bwd = max(r.fwd_bwd_s for r in per_rank)
            self._add(("fwd_bwd",), fwd_bwd)
            self._add(("rest",), max(r.step_time_s for r in per_rank) - fwd_bwd)
            self._add(("act", 0), max(r.activation_peak_bytes for r in per_rank))
        for ranks in self.pipelines:
            recs = {pp: per_rank[g].actions for pp, g in enumerate(ranks)}
            for pp, g in enumerate(ranks):
                rec = per_rank[g]
                for k, (name, start, cstart, end) in enumerate(recs[pp]):
                    a = Action.parse(name)
                    self._add(("compute", pp, a.chunk, a.op.value), end - cstart)
                    self._add(("comm_in", pp, a.chunk, a.op.value), rec.action_comm_s[k] if rec.action_comm_s else 0.0)
                    if k:
                        self._add(("gap", pp), start - recs[pp][k - 1][3])
                if recs[pp]:
                    self._add(("outside", pp), rec.step_time_s - rec.window_s)
                    self._add(("act", pp), rec.activation_peak_bytes)
            if self.flushes and all(recs.values()):
                last = max(r[-1][3] for r in recs.values())
                ends = [recs[pp][0][1] + per_rank[g].window_s for pp, g in enumerate(ranks)]
                self._add(("flush_s",), statistics.median(ends) - last)
            self._latencies(recs)

    def _latencies(self, recs: dict) -> None:
        """Latency of each message the consumer waited for: from its send (the producing
        action's end) or, when the receive was posted after that (`latency_late`), from the
        posting (the end of the action before the posting batch).

        An action waits for its receive's whole batch (executor.py), so a wait is this
        message's only when nothing else in that batch became ready later: another receive
        whose send came later, or a send whose peer posted its receive later (gloo and NCCL
        complete a send with its receive). Otherwise the wait is that other op's, which the
        clock simulates as such, and the sample is left out.

        A wait just over `WAITED_S` that began long after the message could have arrived is
        the cost of the wait call on a message already there, not a transfer: a sample
        counts only when the wait covers at least half of it. Without that, a zbh1 run with a
        40 ms delayed stage (tests/test_simulator.py) in about one of twelve took a 0.25 ms
        wait at 45.7 ms after the posting as a late-posted latency (two such samples in six
        steps: median 24 ms instead of 1.1 ms) and replayed 16 % over the measured step."""
        sent, got = {}, {}
        for pp, rs in recs.items():
            for name, start, cstart, end in rs:
                a = Action.parse(name)
                out = produces(a, pp, self.smap)
                if out is not None and receiver_of(out, self.smap) != pp:
                    sent[out] = end
                msg = needs(a, pp, self.smap)
                if msg is not None and cstart - start > WAITED_S:
                    got[msg] = (start, cstart)
        for msg, (start, t) in got.items():
            if msg not in sent or t < sent[msg]:
                continue
            posted = None
            if self.posted_in is not None and msg in self.posted_in:
                r, k = self.posted_in[msg]
                posted = _posting(recs, r, k)
                if self._held_by_another(recs, sent, r, k, msg, max(posted, sent[msg])):
                    continue
            late = posted is not None and posted > sent[msg]
            ready = posted if late else sent[msg]
            if t - start < (t - ready) / 2:
                continue  # the wait began long after the message could arrive: see the docstring
            self._add(("latency_late",) if late else ("latency",), t - ready)

    def _held_by_another(self, recs: dict, sent: dict, r: int, k: int, msg, ready: float) -> bool:
        """Whether another op of msg's group in rank r's batch k became ready after `ready`
        (msg's own): under NCCL the wait ends with the group's one Work."""
        group = next(op.group for op in self.batches[r][k] if op.msg == msg)
        for op in self.batches[r][k]:
            if op.msg == msg or op.group != group:
                continue
            if op.op == "recv":
                other = sent.get(op.msg)
            else:  # a send completes with its receive, posted by the peer's batch
                peer = self.posted_in.get(op.msg)
                other = None if peer is None or not recs.get(peer[0]) else _posting(recs, *peer)
            if other is None or other > ready + WAITED_S:
                return True
        return False

    def calibration(self, alive: dict[int, int]) -> Calibration:
        """`alive[pp rank]`: the most (micro-batch, chunk) activations its list holds at once."""
        # Compute, gaps and outside time: means. A step is a sum of them, the expectation of a
        # sum is the sum of the means, and on a shared CPU they are right-skewed (default pp2
        # flush job: mean compute -0.2 %, median -4.4 % step time; gaps' mean is 2-5x their
        # median, and mean gaps took the pp 2 replay grid from 2.5 % to 1.3 % median error).
        # Latency and flush: medians (a wait's outliers are the peer's, already in its compute).
        # All-to-all and pp = 1's fwd/bwd and rest: medians (module docstring).
        med = {k: (s.mean() if k[0] in ("compute", "outside", "gap", "comm_in") else s.median())
               for k, s in self.samples.items()}
        lat = self.samples.get(("latency",))
        return Calibration(
            compute={f"{k[1]},{k[2]},{k[3]}": v for k, v in med.items() if k[0] == "compute"},
            comm_in={f"{k[1]},{k[2]},{k[3]}": v for k, v in med.items() if k[0] == "comm_in"},
            gap_s={str(k[1]): v for k, v in med.items() if k[0] == "gap"},
            alpha_s=med.get(("latency",)) or 0.0, beta_Bps=None, message_bytes=self.message_bytes,
            alpha_late_s=med.get(("latency_late",)),
            flush_s=max(med.get(("flush_s",)) or 0.0, 0.0),
            outside_s={str(k[1]): v for k, v in med.items() if k[0] == "outside"} or (
                {"0": med[("rest",)]} if ("rest",) in med else {}),
            act_bytes={str(k[1]): v / max(alive.get(k[1], 1), 1) for k, v in med.items() if k[0] == "act"},
            latency_samples=lat.seen if lat else 0, steps=self.steps,
            a2a_bytes=med.get(("a2a_bytes",)), a2a_s=med.get(("a2a_s",)), fwd_bwd_s=med.get(("fwd_bwd",)))
