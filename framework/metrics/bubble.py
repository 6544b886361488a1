"""Pipeline bubble: the analytic share of idle time for a schedule.

Convention: bubble = idle / step time per pipeline rank. For p stages, m micro-batches
and v model chunks per rank, with forward+backward of one micro-batch on one stage as the
time unit: gpipe and flush idle (p-1) units out of (m+p-1); interleaved (p-1)/(v·m+p-1)
(Narayanan et al., 2021). The asynchronous schedules (1f1b, 2bw) never flush: only the
run's start-up and drain idle, (p-1)/(N+p-1) for N micro-batches in all. One stage has no
pipeline, so no bubble.

The measured counterpart, per rank and step, is 1 - busy / window
(framework/parallel/pipeline/runner.py), with per-action marks from
framework/metrics/clock.py:
- busy: the sum of the rank's compute (forward, backward; for 1f1b / 2bw also the
  updates), each from the moment its input was received to the end of its compute. The
  receive wait and the issuing of sends are outside it.
  CPU (gloo): host timestamps; the host runs every op to completion, so they are exact.
  CUDA (NCCL): CUDA events on the compute stream, one recorded after `work.wait()` (it
  fires when the stream has really received) and one after the compute, read once after
  the step; no action synchronises the host. A send's transfer runs on NCCL's stream,
  overlapped; its completion shows up as the peer's receive wait.
- window: from the step's first action (host time at the start of the step; on CUDA the
  stream is idle then, after the previous step's synchronisation) to the flush: a pp-group
  all-reduce issued once every send of the step is waited for, after which the host waits
  for the stream (CUDA), so the window ends when every stage has finished its compute. For
  1f1b / 2bw (never flushed) it ends at the rank's last action of the step.
The dp all-reduce, clipping and optimizer step after the flush are in neither.
"""

from __future__ import annotations


def analytic_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, steps: int = 1) -> float:
    """Idle share per step (flushing schedules) or over the whole run (asynchronous ones)."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "flush"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule in ("1f1b", "2bw"):
        # Never flushed: the pipeline fills once and drains once over all steps * m micro-batches.
        return (p - 1) / (steps * m + p - 1)
    raise ValueError(f"no analytic bubble for schedule {schedule!r}")
