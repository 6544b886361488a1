"""Context parallelism's step metrics, merged from the ranks' step records (sinks.py).

  cp_comm_bytes      bytes one rank sent in its cp group's collectives (max over ranks)
  cp_comm_s          seconds one rank spent inside them, waits for peers included (max)
  cp_attention_imbalance  max over cp groups of (max / mean) of the group's `cp_attention_s`,
                     each rank's attention compute (forward + backward seconds of the
                     attention functions less cp_comm_s, ContextParallel.take): 1.0 when the
                     ranks' attention work is equal; null at cp = 1
  rank_cp_attention_s  the per-rank values it is computed from (cp > 1 only)

Host seconds: on CUDA the compute stream is synchronised around each collective and stamp
(framework/timestamps.py's `now`), which costs time the run without cp does not pay.
"""

from __future__ import annotations


def step_metrics(per_rank: list, cp_groups: list[list[int]]) -> dict:
    """`per_rank`: the step's StepRecords in global-rank order; `cp_groups`: ranks per cp group."""
    out = {"cp_comm_bytes": max(r.cp_comm_bytes for r in per_rank),
           "cp_comm_s": max(r.cp_comm_s for r in per_rank), "cp_attention_imbalance": None}
    if len(cp_groups[0]) > 1:
        times = [r.cp_attention_s for r in per_rank]
        out["cp_attention_imbalance"] = max(imbalance([times[i] for i in g]) for g in cp_groups)
        out["rank_cp_attention_s"] = times
    return out


def imbalance(seconds: list[float]) -> float:
    """max / mean; 1.0 for a group with no attention time at all (nothing to compare)."""
    mean = sum(seconds) / len(seconds)
    return max(seconds) / mean if mean > 0 else 1.0
