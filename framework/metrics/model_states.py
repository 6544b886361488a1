"""Model-state bytes per rank by formula: this configuration's exactly, and the ZeRO paper's form.

Two formulas sit beside the measured bytes (framework/metrics/memory.py measures the
tensors themselves):
- `config_model_states`: what THIS configuration holds, to the byte: the precision policy's
  dtypes (framework/precision.py), the ZeRO stage, ZeRO's flat units padded to a multiple of
  dp, master copies (mixed precision, ZeRO-Offload) and the optimizer's 0-d states (AdamW's
  step count, one per stepped tensor). Tests hold the measured bytes to it exactly.
- `zero_model_states`: the paper's accounting (Rajbhandari et al., 2020, sec. 5), psi
  parameters, no padding: fp32 4 + 4 + K, mixed precision 2 + 2 + (4 + K).

Per element of the stepped tensors (P: parameter bytes, S: state bytes = master dtype's,
else the parameters'; r: optimizer states per element, AdamW 2), with N = dp:
| stage | parameters | gradients | master | optimizer |
|---|---|---|---|---|
| 0 | P | P | S if master | r S |
| 1 | P | P | S / N if master | r S / N |
| 2 | P | P / N | S / N if master | r S / N |
| 3 | P / N | P / N | S / N if master | r S / N |
(ZeRO's full buffers and slices round each unit up to a multiple of N elements.)
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from framework.precision import Policy, bytes_of


def optimizer_state_ratio(spec: dict) -> float:
    """Optimizer-state bytes per parameter byte (AdamW 2.0, SGD with momentum 1.0, plain SGD 0),
    found by stepping the configured optimizer once on a small tensor."""
    return _probe(spec)[0]


def _probe(spec: dict) -> tuple[float, int]:
    from framework.optim.build import build_optimizer

    p = nn.Parameter(torch.zeros(256))
    p.grad = torch.ones(256)
    opt = build_optimizer(spec, [p])
    opt.step()
    tensors = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    state = [v for v in tensors if v.numel() == p.numel()]
    scalars = [v for v in tensors if v.dim() == 0]
    return (sum(v.numel() * v.element_size() for v in state) / (p.numel() * p.element_size()),
            sum(v.element_size() for v in scalars))


def config_model_states(stage: int, numels: list[int], n: int, policy: Policy, state_ratio: float,
                        scalar_bytes: int = 0, offload: bool = False, params_on_drive: bool = False,
                        states_on_drive: bool = False) -> dict[str, int]:
    """Exact per-rank bytes. `numels`: the element counts of the tensors the optimizer steps,
    before sharding: ZeRO's flat units (each padded to a multiple of n), else each parameter.
    Bytes in memory: `states_on_drive` (parallelism.offload_device=nvme): the per-element states
    on the drive (framework/optim/swap.py), the 0-d ones in memory; `params_on_drive` (stage 3
    with parallelism.offload_params): no parameter slice (framework/optim/param_swap.py)."""
    if stage:
        whole = sum(-(-u // n) * n for u in numels)
        part = sum(-(-u // n) for u in numels)
    else:
        whole = part = sum(numels)
    p, s = policy.param_bytes, bytes_of(policy.state_dtype)
    stepped = part if stage >= 1 else whole
    return {"params_bytes": 0 if params_on_drive and stage == 3 else p * (part if stage == 3 else whole),
            "grads_bytes": p * (part if stage >= 2 else whole),
            "master_bytes": s * stepped if (policy.mixed or offload) else 0,
            "optimizer_bytes": (0 if states_on_drive else round(s * state_ratio) * stepped) + scalar_bytes * len(numels)}


def zero_model_states(stage: int, psi: int, n: int, state_ratio: float, bf16: bool = False,
                      word: int = 4) -> dict[str, float]:
    """Per-rank model-state bytes by the ZeRO paper's accounting (Rajbhandari et al., 2020, sec. 5):
    psi parameters on this rank's model-parallel part, n = dp. fp32 training: 4 bytes of
    parameters, 4 of gradients and K = 4 * state_ratio of optimizer states per parameter
    (Adam: K = 8, so 16 psi in all). bf16 (the paper's mixed precision): 2 + 2 bytes, and K =
    4 (fp32 master weights) + 4 * state_ratio. Stage s shards the optimizer (s >= 1), the
    gradients (s >= 2) and the parameters (s = 3) over n. `word`: bytes of a full-precision
    element, 4 (fp32) or 8 (fp64 verification mode: every 4-byte state takes 8)."""
    p_bytes, g_bytes = (2, 2) if bf16 else (word, word)
    k = (word if bf16 else 0) + word * state_ratio
    return {"params_bytes": p_bytes * psi / (n if stage >= 3 else 1),
            "grads_bytes": g_bytes * psi / (n if stage >= 2 else 1),
            "optimizer_bytes": k * psi / (n if stage >= 1 else 1)}


def stepped_numels(runner, experts: bool = False) -> list[int]:
    """The element counts `config_model_states` takes: ZeRO's flat units, else the parameters
    the optimizer steps; `experts`: only the expert-parallel ones (ZeRO shards them over edp),
    else only the others."""
    from framework.comm.expert_parallel import is_expert

    zero = getattr(runner, "zero", None)
    if zero is not None and hasattr(zero, "flat"):
        return [sum(p.numel() for p in f.params) for f in zero.flat if is_expert(f.shard) == experts]
    if zero is not None:  # FSDP2: each parameter (global numel), sharded by dim-0 rows, not elements
        return [] if experts else [p.numel() for p in zero.shards]  # (expert parallelism: ours only)
    return [p.numel() for p in runner.params if is_expert(p) == experts]


def _added(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def formula_report(runner, run) -> dict:
    """summary.json's formula keys for one rank: psi (its tp / pp part's parameters), this
    configuration's exact formula (in all and by component) and the paper's two forms."""
    from framework.comm.expert_parallel import is_expert
    from framework.precision import policy_of

    p = run.parallelism
    edp = p.dp // p.ep  # expert parallel experts are replicated (and ZeRO-sharded) over edp
    psi_experts = sum(q.numel() for q in runner.module.parameters() if is_expert(q))
    psi = sum(q.numel() for q in runner.module.parameters()) - psi_experts
    ratio, scalars = _probe(run.optimizer)
    policy, stage = policy_of(run), p.zero
    if p.zero_impl == "fsdp2":
        # FSDP2 steps its shards between steps at zero 2 too (zero 3's states), and in the
        # mixed modes its sharded parameters are the fp32 masters (docs/fsdp2.md); its
        # padding is by dim-0 rows, so this is exact only where rows divide by dp.
        stage = 3
        policy = replace(policy, param_dtype=policy.state_dtype, master_dtype=None)
    drive = dict(params_on_drive=p.params_on_drive, states_on_drive=p.states_on_drive)
    exact = _added(config_model_states(stage, stepped_numels(runner), p.replicas, policy, ratio, scalars,
                                       p.offload_optimizer, **drive),
                   config_model_states(stage, stepped_numels(runner, experts=True), edp, policy, ratio, scalars,
                                       p.offload_optimizer, **drive))
    policy = policy_of(run)
    mixed = sum(zero_model_states(p.zero, psi, p.replicas, ratio, bf16=True).values()) + \
        sum(zero_model_states(p.zero, psi_experts, edp, ratio, bf16=True).values())
    word = bytes_of(policy.state_dtype)
    full = sum(zero_model_states(p.zero, psi, p.replicas, ratio, word=word).values()) + \
        sum(zero_model_states(p.zero, psi_experts, edp, ratio, word=word).values())
    psi += psi_experts
    return {"psi": psi, "model_state_formula_bytes": sum(exact.values()), "model_state_formula": exact,
            # the paper's form of this mode: 2 + 2 + 12 with master weights, else 4 + 4 + 8 (fp64: 8 + 8 + 16)
            "model_state_formula_paper_bytes": mixed if policy.mixed else full,
            "model_state_formula_bf16_bytes": mixed}


def paper_form(mode: str) -> str:
    """The ZeRO paper's bytes per parameter for a precision mode (parameters + gradients +
    optimizer states), from its policy: with fp32 master weights 2 + 2 + 12, in fp64 8 + 8 +
    16, else 4 + 4 + 8 (also for an unknown mode: an older summary's)."""
    from framework.precision import policy_of

    try:
        policy = policy_of(mode)
    except (KeyError, ValueError, TypeError, AttributeError):
        return "4 + 4 + 8"
    return "2 + 2 + 12" if policy.mixed else "8 + 8 + 16" if bytes_of(policy.state_dtype) == 8 else "4 + 4 + 8"
