"""The sparse MoE block's forward as this framework runs it, in every layout: route
(framework/models/moe_routing.py), run the experts here or over the ep group
(framework/comm/expert_parallel.py), hang the auxiliary losses on the output (their
gradient enters backward scaled as the LM loss's), and count what the router did.

`MoERuntime` is one per model (built in `framework.models.build_model`, held as
`SplitLM.moe`): the routing config, the ep communicator, the group a micro-batch's tokens
are split over (tp with sequence parallelism), the aux-loss scale the runner sets each step,
and the per-layer statistics of the step so far. `take_step` ends a step: it sums the
statistics over the ranks that saw other tokens (dp, and tp with sequence parallelism) in
one all-reduce (the routing margin's minimum in a second, tiny one), applies DeepSeek-V3's
bias update to the global counts, and returns the step's per-layer numbers
(framework/metrics/moe.py turns them into metrics).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from framework.config import MoEConfig
from framework.device import to_host
from framework.comm.expert_parallel import EPComm, run_routed
from framework.models.moe_routing import AuxLossScale, attach_aux_loss, route, updated_bias


class MoERuntime:
    def __init__(self, cfg: MoEConfig, ep_comm: Optional[EPComm], sp_group=None):
        self.cfg, self.ep_comm, self.sp_group = cfg, ep_comm, sp_group
        # context parallelism (context_parallel.install): the cp group holds the other pieces of
        # these sequences; its ranks' gradients are averaged, so each aux share counts cp times
        self.cp_group, self.cp = None, 1
        self.aux_scale = AuxLossScale()
        self.gates: dict[int, nn.Module] = {}  # layer -> its router (which holds expert_bias)
        self.sums: dict[int, torch.Tensor] = {}  # layer -> the step's statistics so far (_row's layout)
        self.margins: dict[int, torch.Tensor] = {}  # layer -> the step's smallest routing margin so far

    def install(self, hf: nn.Module, block_class: type, device) -> None:
        """Every `block_class` module (a sparse block with `.gate` and `.experts`) runs `forward`."""
        blocks = [m for m in hf.modules() if isinstance(m, block_class)]
        for layer, block in enumerate(blocks):
            block.forward = functools.partial(forward, block, self, layer)
            block.experts.grouped = grouped_gemm(self.cfg.experts_impl, block.experts, device)
            self.gates[layer] = block.gate
            if self.cfg.bias_update_rate > 0:  # a buffer: stepped by take_step, not the optimizer
                block.gate.register_buffer("expert_bias", torch.zeros(self.cfg.experts, device=device))

    def _row(self, stats: dict, received: int, device) -> torch.Tensor:
        """[tokens per expert (E) | dropped, entropy sum, tokens, micro-batches | aux values |
        received per ep rank (ep)]: summed over micro-batches and ranks."""
        ep = self.ep_comm.size if self.ep_comm is not None else 1
        mine = torch.zeros(ep, dtype=torch.float64, device=device)
        mine[self.ep_comm.rank if self.ep_comm is not None else 0] = received
        head = [stats["tokens_per_expert"].double(),
                torch.stack([stats["dropped"].double(), stats["entropy_sum"].double(), stats["tokens"].double(),
                             torch.ones((), dtype=torch.float64, device=device)])]
        aux = [stats[a["type"]].double().reshape(1) for a in self.cfg.aux_losses]
        return torch.cat([*head, *aux, mine])

    def record(self, layer: int, stats: dict, received: int, device) -> None:
        row = self._row(stats, received, device)
        self.sums[layer] = self.sums[layer] + row if layer in self.sums else row
        margin = stats["margin"].reshape(1)
        self.margins[layer] = torch.minimum(self.margins[layer], margin) if layer in self.margins else margin

    def take_step(self, dp_group, tp_group=None, update_bias: bool = True) -> dict[int, dict]:
        """Sum the step's statistics over dp (and tp when tokens are split over it), update the
        expert biases (not on a step fp16-mixed skipped), reset. Collective over dp (and tp):
        every rank of a stage calls it."""
        if not self.sums:
            return {}
        layers = sorted(self.sums)
        flat = torch.stack([self.sums[i] for i in layers])
        margins = torch.cat([self.margins[i] for i in layers])
        for group in (dp_group, tp_group):
            if group is not None:
                dist.all_reduce(flat, group=group)
                dist.all_reduce(margins, op=dist.ReduceOp.MIN, group=group)
        self.sums, self.margins = {}, {}
        e, out = self.cfg.experts, {}
        # once per step; fp64 carries both exactly
        host = to_host(torch.cat([flat.flatten().double(), margins.double()]), "moe statistics")
        rows, margins = host[:flat.numel()].view_as(flat).to(flat.dtype), host[flat.numel():]
        for i, row, margin in zip(layers, rows, margins.tolist(), strict=True):
            counts = row[:e]
            dropped, entropy_sum, tokens, calls = row[e:e + 4].tolist()
            if tp_group is not None:  # each tp rank ran the micro-batch's sequence shard: one call
                calls /= dist.get_world_size(tp_group)
            calls /= self.cp  # and each cp rank its pieces (the dp group spans cp)
            aux = {a["type"]: float(v) for a, v in zip(self.cfg.aux_losses, row[e + 4:e + 4 + len(self.cfg.aux_losses)],
                                                        strict=True)}
            out[i] = {"tokens_per_expert": counts.tolist(), "dropped": dropped, "entropy_sum": entropy_sum,
                      "tokens": tokens, "calls": calls, "aux": aux, "margin": margin,
                      "received_per_ep_rank": row[e + 4 + len(self.cfg.aux_losses):].tolist()}
            gate = self.gates[i]
            if self.cfg.bias_update_rate > 0 and update_bias:
                gate.expert_bias.copy_(updated_bias(gate.expert_bias, counts.to(gate.expert_bias.device),
                                                    self.cfg.bias_update_rate))
        return out


def grouped_gemm(impl: str, experts: nn.Module, device) -> bool:
    """`grouped` / `loop` as asked; `auto`: grouped GEMM where the device has it (CUDA, a
    dtype torch._grouped_mm takes, 16-byte-aligned rows), the per-expert loop elsewhere (the
    CPU, fp64 verification runs)."""
    if impl != "auto":
        return impl == "grouped"
    w = experts.gate_up_proj
    if torch.device(device).type != "cuda" or not hasattr(torch, "_grouped_mm") or w.dtype == torch.float64:
        return False
    per_row = 8  # 16-byte rows in 2-byte dtypes: also what autocast may cast fp32 weights to
    aligned = w.shape[-1] % per_row == 0 and experts.down_proj.shape[-1] % per_row == 0
    return aligned and _device_runs_grouped_mm(str(device), w.dtype)


@functools.lru_cache(maxsize=None)
def _device_runs_grouped_mm(device: str, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM on the device: its kernels exist for some GPU generations and
    dtypes only, so `auto` asks the device rather than a table."""
    try:
        a = torch.zeros(8, 8, dtype=dtype, device=device)
        torch._grouped_mm(a, torch.zeros(1, 8, 8, dtype=dtype, device=device).transpose(-2, -1),
                          offs=torch.tensor([8], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def moe_step(rt: Optional[MoERuntime], run, ctx, tp_comm, skipped: bool = False) -> Optional[dict]:
    """A runner's end of step: the routing sums over dp (and tp with sequence parallelism),
    the bias update unless the step was `skipped` (None for a dense model)."""
    if rt is None:
        return None
    sp = run.parallelism.sequence_parallel and tp_comm.size > 1
    return rt.take_step(ctx.dp_group if ctx.dims.dp > 1 else None, tp_comm.group if sp else None,
                        update_bias=not skipped)


def _counting() -> bool:
    """A training forward, not an evaluation one nor activation checkpointing's recompute
    inside backward (which would count the micro-batch twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def forward(block: nn.Module, rt: MoERuntime, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    r = route(block.gate.weight, x, rt.cfg, seq_len=shape[1] if len(shape) == 3 else x.size(0),
              bias=getattr(block.gate, "expert_bias", None), sp_group=rt.sp_group, cp_group=rt.cp_group)
    y, received = run_routed(block.experts, x, r.index, r.weights, rt.ep_comm)
    if r.aux_loss is not None and torch.is_grad_enabled():  # x cp: the cp ranks' gradients are averaged
        y = attach_aux_loss(y, r.aux_loss * rt.cp if rt.cp > 1 else r.aux_loss, rt.aux_scale)
    if _counting():
        rt.record(layer, r.stats, received, x.device)
    return y.reshape(shape)
