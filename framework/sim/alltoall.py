"""Expert parallelism's all-to-all in the simulator (`parallelism.ep` what-ifs,
framework/sim/cli.py): how many bytes a rank sends per step, and what that costs.

Volume: what framework/comm/expert_parallel.py counts (bytes a rank sends to the other
ranks of its ep group), per MoE layer on the rank and per micro-batch:
- the count exchange, in forward only: (ep - 1) x E / ep int64s;
- the tokens: each of the N x k (token, expert) assignments of the rank's N tokens is a row
  of H elements. With the E experts spread evenly over ep ranks, (ep - 1) / ep of the rows go
  to another rank in expectation, and exactly when k = E (every token visits every expert).
  Dispatch sends them; combine sends back the rows this rank's experts received from the
  others (as many, in expectation); backward repeats both with gradients. So
  2 x (ep - 1) / ep x N x k x H x (b_dispatch + b_combine) bytes, the 4 x (ep - 1) / ep x
  N x k x H x b of issue 22 when both element sizes are b. b_dispatch: the hidden states'
  dtype (the parameters'); b_combine: the experts' outputs' (the compute dtype: bf16 under
  bf16-autocast, where the hidden states stay fp32). Gradients have their tensor's dtype, so
  backward has the same sizes, swapped between the two all-to-alls.
N = micro_batch_size x seq_len, / tp with sequence parallelism (each tp rank routes its own
shard); without it every tp rank routes the whole micro-batch over its own ep group.
Assignments dropped by a finite capacity factor are not sent: the volume is then an upper
bound. Every layer of qwen3_moe is a MoE layer (decoder_sparse_step = 1), so a stage's MoE
layers are its blocks.

Time (`A2ACost`): with a job that ran with ep > 1, from its own measurement: its all-to-all
bytes / seconds per step (calibration.json's: the ranks' mean, the median over steps) as
one effective bandwidth, latency and the wait for the slowest peer folded in (one ep
measured: as for p2p, latency and bandwidth are not separable). Without one (the job ran with ep = 1),
there is no all-to-all calibration: the pipeline's p2p link is used, alpha + bytes / beta per
call, 3 calls per layer and micro-batch in forward (counts, dispatch, combine) and 2 in
backward. A job with neither (pp = 1 and ep = 1) cannot price an all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from framework.config import ConfigError, RunConfig
from framework.precision import bytes_of, policy_of
from framework.metrics.calibrate import Calibration

CALLS = {"F": 3, "B": 2}  # all-to-alls per MoE layer and micro-batch: counts, dispatch, combine | their conjugates
COUNT_BYTES = 8  # the exchanged counts are int64 (torch.bincount)


def moe_layers(run: RunConfig) -> int:
    return run.model.n_layer if run.model.arch == "qwen3_moe" else 0


def layer_bytes(run: RunConfig) -> dict[str, float]:
    """Bytes a rank sends per MoE layer and micro-batch, {"F": forward, "B": backward}."""
    p, moe = run.parallelism, run.model.moe
    if p.ep == 1 or run.model.arch != "qwen3_moe":
        return {"F": 0.0, "B": 0.0}
    policy = policy_of(run)
    elem = bytes_of(policy.param_dtype) + bytes_of(policy.compute_dtype or policy.param_dtype)
    tokens = run.trainer.micro_batch_size * run.data.seq_len
    if p.sequence_parallel and p.tp > 1:
        tokens //= p.tp
    rows = (p.ep - 1) / p.ep * tokens * moe.top_k  # expected rows sent to other ranks by dispatch
    token_bytes = rows * run.model.n_embd * elem  # dispatch + combine, one direction of the pass
    return {"F": token_bytes + (p.ep - 1) * (moe.experts // p.ep) * COUNT_BYTES, "B": token_bytes}


def step_bytes(run: RunConfig, layers: Optional[int] = None) -> float:
    """Bytes one rank sends per step: its MoE `layers` (default: all, pp = 1) x micro-batches."""
    per = layer_bytes(run)
    return (moe_layers(run) if layers is None else layers) * run.schedule.microbatches * (per["F"] + per["B"])


@dataclass(frozen=True)
class A2ACost:
    """Seconds of all-to-all for a volume; `measured`: the job's own all-to-all bandwidth."""

    measured: bool
    bandwidth_Bps: Optional[float] = None  # measured: bytes / seconds of the job's all-to-all
    alpha_s: float = 0.0  # else the p2p link's, per call
    beta_Bps: Optional[float] = None

    def seconds(self, nbytes: float, calls: float) -> float:
        if self.measured:
            return nbytes / self.bandwidth_Bps
        return calls * self.alpha_s + (nbytes / self.beta_Bps if self.beta_Bps else 0.0)

    def layer_seconds(self, run: RunConfig) -> dict[str, float]:
        """{"F", "B"}: seconds per MoE layer and micro-batch under `run`'s ep."""
        per = layer_bytes(run)
        return {op: self.seconds(per[op], CALLS[op] if run.parallelism.ep > 1 else 0) for op in per}

    def describe(self) -> str:
        if self.measured:
            return f"from the job's own all-to-all: {self.bandwidth_Bps / 1e6:,.1f} MB/s effective"
        beta = "beta not separable from alpha" if not self.beta_Bps else f"beta {self.beta_Bps / 1e6:,.1f} MB/s"
        return (f"no all-to-all calibration (the job ran with ep = 1): the p2p link's alpha "
                f"{self.alpha_s * 1e3:.3f} ms per call ({beta})")


def cost_of(cal: Calibration, src: RunConfig, job_dir: str) -> A2ACost:
    if src.parallelism.ep > 1 and cal.a2a_bytes and cal.a2a_s:
        return A2ACost(True, bandwidth_Bps=cal.a2a_bytes / cal.a2a_s)
    if src.parallelism.pp > 1:
        return A2ACost(False, alpha_s=cal.alpha_s, beta_Bps=cal.beta_Bps)
    raise ConfigError("sim.from", job_dir, "ran with parallelism.ep=1 and pp=1: it measured neither an "
                      "all-to-all nor a p2p link, so it cannot price the all-to-all of another ep",
                      "simulate from a job with parallelism.ep > 1 (or a pipeline job)")


def shift_stages(cal: Calibration, stage_of, blocks: list[int], delta: dict[str, float]) -> Calibration:
    """`cal` with each stage's ops moved by its MoE layers x `delta` (seconds per layer and
    micro-batch, {"F", "B"}): the all-to-all sits inside F and the backward. A split
    backward's all-to-all is in I (it carries the input gradient), except on the first stage,
    whose I computes nothing and W the whole backward (framework/sim/whatif.py).
    `stage_of(rank, chunk)`: the stage a calibration key's (rank, chunk) holds."""
    compute = {}
    for key, sec in cal.compute.items():
        r, c, op = key.split(",")
        g = stage_of(int(r), int(c))
        carries = op in ("F", "B") or (op == "I" and g > 0) or (op == "W" and g == 0)
        d = delta["F" if op == "F" else "B"] * blocks[g] if carries else 0.0
        compute[key] = max(sec + d, 0.0)
    return Calibration(**{**cal.to_json(), "compute": compute})
