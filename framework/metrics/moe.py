"""MoE metrics of one step, from the per-layer sums framework/models/moe_layer.py reduces
(`MoERuntime.take_step`: summed over the step's micro-batches and every dp rank, and over tp
with sequence parallelism), into the metrics.jsonl row (docs/metrics.md):

- `moe_layers`: per MoE layer (keyed by its index in the model):
  - `tokens_per_expert`: (token, slot) assignments the router made to each expert, before
    any capacity drop: the load histogram;
  - `load_max_over_mean` (1 = perfectly balanced; E / k = every token on the same k experts)
    and `load_cv` (standard deviation / mean of the loads, population form);
  - `dead_experts`: experts that received no token this step;
  - `dropped_fraction`: assignments dropped by the capacity limit / all assignments;
  - `router_entropy`: mean over tokens of the entropy (nats) of the router's distribution
    (ln E = uniform, 0 = one expert);
  - `aux`, `seq_aux`, `z`: the configured auxiliary losses, mean over micro-batches and dp
    ranks (uncoefficiented);
  - `tokens_received_per_ep_rank`: rows each ep rank's experts processed (summed over its
    edp replicas); `ep_straggler`: their max / mean (1 = even);
  - `route_margin`: the smallest score gap at any routing decision of the step (a token's
    k-th against its best unchosen score; an over-full expert's last kept against its first
    dropped score, drop policy probs), min over micro-batches and ranks; null without any.
    The decisions are discontinuous: two layouts route alike while their scores' round-off
    stays below it (docs/moe.md, Capacity).
- `moe_load_cv_max`, `moe_dead_experts`, `moe_dropped_fraction`, `moe_aux_loss`,
  `moe_route_margin`: over layers (the worst CV, the dead experts summed, assignments dropped
  over all, the aux losses summed with their coefficients as trained, the smallest margin),
  for plots and sweeps.
- `a2a_bytes` (max over ranks of the bytes a rank sent to other ranks by all-to-all, counts
  and tokens, forward and backward) and `a2a_s` (max over ranks of seconds inside
  all-to-all: the step's `ep` spans; on CPU the transfer and the wait for peers, on CUDA the
  compute stream's wait, CUDA events read after the step).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional


def layer_metrics(s: dict, top_k: int) -> dict:
    counts = s["tokens_per_expert"]
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    received = s["received_per_ep_rank"]
    r_mean = sum(received) / len(received)
    out = {"tokens_per_expert": counts,
           "load_max_over_mean": max(counts) / mean if mean else None,
           "load_cv": std / mean if mean else None,
           "dead_experts": sum(1 for c in counts if c == 0),
           "dropped_fraction": s["dropped"] / (s["tokens"] * top_k) if s["tokens"] else 0.0,
           "router_entropy": s["entropy_sum"] / s["tokens"] if s["tokens"] else None,
           "tokens_received_per_ep_rank": received,
           "ep_straggler": max(received) / r_mean if r_mean else None,
           "route_margin": s["margin"] if math.isfinite(s["margin"]) else None}  # inf: no decision
    out.update({k: v / s["calls"] for k, v in s["aux"].items()})  # per micro-batch (and dp rank)
    return out


def step_metrics(per_rank: list[Optional[dict]], moe_cfg) -> dict:
    """The row's MoE keys from every rank's `take_step` result (layers live on their pipeline
    stage; dp / tp replicas report the same sums, so the first report of a layer is kept)."""
    layers: dict[int, dict] = {}
    for rank_layers in per_rank:
        for i, s in (rank_layers or {}).items():
            layers.setdefault(int(i), s)
    if not layers:
        return {}
    rows = {str(i): layer_metrics(layers[i], moe_cfg.top_k) for i in sorted(layers)}
    assignments = sum(layers[i]["tokens"] * moe_cfg.top_k for i in layers)
    coeff = {a["type"]: float(a["coeff"]) for a in moe_cfg.aux_losses}
    return {"moe_layers": rows,
            "moe_load_cv_max": max((r["load_cv"] for r in rows.values() if r["load_cv"] is not None), default=None),
            "moe_load_max_over_mean": max((r["load_max_over_mean"] for r in rows.values()
                                           if r["load_max_over_mean"] is not None), default=None),
            "moe_dead_experts": sum(r["dead_experts"] for r in rows.values()),
            "moe_dropped_fraction": sum(layers[i]["dropped"] for i in layers) / assignments if assignments else 0.0,
            "moe_aux_loss": sum(coeff[k] * r[k] for r in rows.values() for k in coeff),
            "moe_route_margin": min((r["route_margin"] for r in rows.values() if r["route_margin"] is not None),
                                    default=None)}


def summary(rows: list[dict]) -> dict:
    """summary.json's MoE line over the measured steps (medians): the worst layer's load max
    / mean, the dropped share of assignments and, with ep > 1, the all-to-all's share of the
    step (a2a_s / step_time_s: both the slowest rank's); {} for a dense model."""
    def median(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    if not any("moe_dropped_fraction" in r for r in rows):
        return {}
    shares = [r["a2a_s"] / r["step_time_s"] for r in rows if r.get("a2a_s") is not None and r["step_time_s"] > 0]
    return {"moe_load_max_over_mean": median("moe_load_max_over_mean"),
            "moe_dropped_fraction": median("moe_dropped_fraction"),
            "moe_a2a_share": statistics.median(shares) if shares else None}


def line(summary_: dict) -> str:
    """The console's MoE line under the summary."""
    share = summary_.get("moe_a2a_share")
    load = summary_.get("moe_load_max_over_mean")
    return (f"MoE: all-to-all {'n/a (ep = 1)' if share is None else format(share, '.0%') + ' of the step'} | "
            f"load max/mean {'n/a' if load is None else format(load, '.2f')} (the worst layer) | "
            f"dropped {summary_['moe_dropped_fraction']:.1%} of assignments")
