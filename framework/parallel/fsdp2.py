"""ZeRO-2 / ZeRO-3 by torch's FSDP2 (`fully_shard`) over the dp group: a peer of zero.py.

Selected by `parallelism.zero_impl=fsdp2` (pp = 1 only; framework/validate/fsdp2.py rejects
the rest before launch). Units are zero.py's: each transformer block, then the root (the
embedding with the head and their tied weight). Each unit's parameters are replaced by
DTensor parameters sharded on dim 0 over the dp mesh (`DeviceMesh.from_group(dp_group)`):
dp rank r holds rows [r*c, (r+1)*c) of every parameter, c = ceil(rows / dp), in a buffer
padded to c rows. Gradients and AdamW states are sharded the same way; the optimizer steps
the sharded parameters (the plain torch optimizer over DTensors). With tp, each tp rank's
local shard is what FSDP2 shards over dp (our tp is not DTensor-based), the 2-D layout.

Collectives over the dp group (gloo on CPU, NCCL on CUDA):
- forward: an all-gather of a unit's parameters before its forward (zero 3: freed after it;
  zero 2 and the root: kept until its backward);
- backward: zero 3 all-gathers a block again before its backward (FSDP2 prefetches the next
  block's during the current one), then every unit's gradients are reduce-scattered (mean
  over dp) into the sharded gradient as soon as its backward ends, every micro-batch.
- nothing after the step: the updated shards are gathered by the next forward.
- `parallelism.overlap_param_gather`: each block's pre-forward also issues the next block's
  all-gather and its pre-backward the previous block's (`set_modules_to_forward_prefetch`,
  `set_modules_to_backward_prefetch`), so two blocks are gathered at once.
Under zero 2 a block is gathered once per step (the first micro-batch's forward) and freed
after the last micro-batch's backward (`set_reshard_after_backward` on the last only).

How it differs from zero.py: zero.py keeps one flat buffer per unit padded once to a multiple
of dp, slices it by elements (a slice may cut a parameter anywhere) and, at zero 1-2, keeps
full parameters between steps and all-gathers the updated slices after the step. FSDP2 pads
and chunks each parameter on dim 0, and its optimizer steps sharded parameters, so between
steps it always holds zero 3's layout: its zero 2 differs from zero 3 only between a forward
and its backward (no re-gather), and its measured model states between steps are stage 3's
(16 psi / dp with AdamW), not stage 2's. It has no optimizer-state-only stage (zero 1).
Per-parameter dim-0 padding: each rank's parameter and gradient buffers hold
sum(ceil(rows / dp) * row_size) elements; optimizer states are unpadded (shaped like the
local chunk, uneven across ranks).

gloo: `reduce_scatter_single` on gloo is an all-reduce of the whole buffer followed by taking
this rank's chunk (pytorch#118911), so each reduce-scatter moves an all-reduce's bytes, about
twice a ring reduce-scatter's; zero.py goes through the same gloo call (tp_comm.py), so both
pay it.

Precision (framework/precision.py): fp32, fp64 and bf16-autocast shard the parameters in
their dtype, no casts. bf16-mixed: the model is materialised in the master dtype (fp32) and
those fp32 shards ARE the master weights; `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=policy.grad_reduce_dtype)` all-gathers bf16 copies for compute and
reduce-scatters in fp32 into fp32 gradients. fp16-mixed (loss scaling) is rejected.
`precision.fp8_all_gather` (tensorwise FP8): each block's FP8 linear weights become torchao's
`WeightWithDynamicFloat8CastTensor` before sharding, so FSDP2 casts a shard to FP8 (its own
amax all-reduced over dp: one scale for the whole weight) and gathers 1 byte per element;
the matmul takes the gathered FP8 weight as cast.

Measurement (`state_bytes`, as zero.py's): exact bytes of the local tensors' storages
(parameters and gradients include the dim-0 padding). The transient peak is read from FSDP2's
own buffers at its gather, free and reduce points; FSDP2 has no public hook for those, so
this module wraps four methods of each of its param groups (`unshard`, `wait_for_unshard`,
`reshard`, `post_backward`), touching only bookkeeping, and also tells the activation tracker
which storages are gathered weights.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from framework.metrics.memory import tensor_bytes
from framework.models import fp8
from framework.precision import policy_of


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part: a DTensor's local tensor (FSDP2's dim-0 chunk, its padding not part
    of it), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def chunk_start(p: DTensor) -> int:
    """The first element (row-major) of this rank's dim-0 chunk of `p` in the whole parameter:
    FSDP2 chunks as torch.chunk does, c = ceil(rows / n) rows each, the last ranks short or empty."""
    mesh = p.device_mesh
    n, r = mesh.size(), mesh.get_local_rank()
    rows = p.shape[0]
    first = min(r * -(-rows // n), rows)
    assert local(p).shape[0] == min(rows, first + -(-rows // n)) - first, "not FSDP2's dim-0 chunking"
    return first * math.prod(p.shape[1:])


def framework_attrs(p: nn.Parameter) -> dict:
    """The attributes the framework set on a parameter (tp_shard, ...), which FSDP2's new
    DTensor parameters need back; not an FP8 wrapper's own fields (fp8.WRAPPER_KEYS)."""
    return {k: v for k, v in p.__dict__.items() if k not in fp8.WRAPPER_KEYS}


class FSDP2:
    """The FSDP2 state of one rank, with zero.Zero's duck-typed interface (AccumulationRunner)."""

    sharded_between_steps = True  # at zero 2 too (the optimizer steps the shards): export gathers

    def __init__(self, run, model: nn.Module, ctx, tracker=None):
        self.stage = run.parallelism.zero  # 2 or 3 (validated)
        self.microbatches = run.schedule.microbatches
        self.tracker = tracker
        self.policy = policy = policy_of(run)
        self.mesh = DeviceMesh.from_group(ctx.dp_group, ctx.device.type)
        mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype if policy.mixed else None,
                                  reduce_dtype=policy.grad_reduce_dtype)
        fill = getattr(model, "fill", None)
        self.root, self.fp8_all_gather = model, run.precision.fp8_all_gather
        self.modules: list[FSDPModule] = []
        self.attrs: dict[int, dict] = {}  # id(sharded parameter) -> the framework's attributes
        for block in model.blocks:
            self._shard(block, list(block.parameters()), mp, fill, after_forward=self.stage == 3)
        # The root: the embedding and the head (tied weight once). Kept gathered from the
        # embedding's forward to the head's backward, as zero.py's io unit: the tied head is
        # used last in forward and first in backward.
        root = [p for m in (model.embedding, model.head) for p in m.parameters()]
        self._shard(model, root, mp, fill, after_forward=False)
        if run.parallelism.overlap_param_gather:  # FSDP2's explicit prefetch: the next block's all-gather
            blocks = list(model.blocks)           # issued in this one's pre-forward (pre-backward)
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
                block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
        self.shards: list[nn.Parameter] = list(dict.fromkeys(model.parameters()))  # DTensors, tied once
        assert all(isinstance(p, DTensor) for p in self.shards), "a parameter outside every unit"
        self.transient_peak_bytes = 0
        self._mb = 0
        for m in self.modules:
            for group in m._get_fsdp_state()._fsdp_param_groups:
                self._watch(group)

    # --- sharding ---
    def _shard(self, module: nn.Module, params: list[nn.Parameter], mp, fill, after_forward: bool) -> None:
        params = list(dict.fromkeys(p for p in params if p.requires_grad))
        master = self.policy.master_dtype
        if master is not None:  # bf16-mixed: the shards are the fp32 master weights
            for p in params:
                p.data = p.data.to(master)  # still on the meta device: no values yet
        if fill is not None:
            fill(params)  # one unit whole at a time, then only its shard stays (as zero.py)
        if self.fp8_all_gather and module is not self.root and fp8.fp8_weights_for_all_gather(module):
            params = [p for p in module.parameters() if p.requires_grad]  # the FP8-cast weights replaced them
        ids = {id(p) for p in params}
        # Every (module, name) holding one of them: FSDP2 registers new parameters there.
        places = [(m, n, framework_attrs(p)) for m in module.modules() for n, p in m._parameters.items()
                  if p is not None and id(p) in ids]
        fully_shard(module, mesh=self.mesh, reshard_after_forward=after_forward, mp_policy=mp)
        # FSDP2's new DTensor parameters drop custom attributes: put the framework's back
        # (tp_shard, which the grad norm, checkpoints and export read).
        for m, n, saved in places:
            new = m._parameters[n]
            new.__dict__.update(saved)
            self.attrs[id(new)] = saved
        self.modules.append(module)

    # --- bookkeeping around FSDP2's gathers, frees and reduce-scatters ---
    def _gathered(self) -> list[torch.Tensor]:
        """Every gathered-parameter buffer alive now: the units' unsharded parameters and the
        flat all-gather outputs not yet copied out (or kept for the next copy-out)."""
        out = []
        for m in self.modules:
            for g in m._get_fsdp_state()._fsdp_param_groups:
                out += [t for fp in g.fsdp_params for t in fp.all_gather_outputs]
                if g._all_gather_result is not None:
                    out.append(g._all_gather_result.all_gather_output)
                kept = getattr(g.comm_ctx, "all_gather_state", None)
                if kept is not None:
                    out.append(kept.all_gather_result.all_gather_output)
        return out

    def _note_peak(self, extra: list[torch.Tensor] = (), extra_bytes: int = 0) -> None:
        live = tensor_bytes(self._gathered() + list(extra))  # storages once; freed ones count 0
        self.transient_peak_bytes = max(self.transient_peak_bytes, live + extra_bytes)

    def _watch(self, g) -> None:
        unshard, wait, reshard, post_backward = g.unshard, g.wait_for_unshard, g.reshard, g.post_backward
        tracker = self.tracker

        def weights():
            return [fp.unsharded_param for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")]

        def on_unshard(*args, **kwargs):
            unshard(*args, **kwargs)
            self._note_peak()

        def on_wait(*args, **kwargs):
            res = g._all_gather_result
            wait(*args, **kwargs)
            # The copy-out's instant: the flat all-gather output beside the unit's parameters.
            self._note_peak([res.all_gather_output] if res is not None else [])
            if tracker is not None and g.is_unsharded:
                tracker.exclude(weights())  # weights, not activations, when saved for backward

        def on_reshard(*args, **kwargs):
            held = weights() if g.is_unsharded else []
            if tracker is not None:
                tracker.include_again(held)  # before the free: the address may come back
            reshard(*args, **kwargs)
            if tracker is not None and g.is_unsharded:  # reshard kept them (no reshard after forward)
                tracker.exclude(held)

        def on_post_backward(*args, **kwargs):
            # The reduce-scatter input: every gradient of the unit, dim-0 padded, in the reduce dtype.
            n = self.mesh.size()
            dtype = g._reduce_dtype or g._orig_dtype
            numel = sum(fp.padded_sharded_param_size.numel() * n for fp in g.fsdp_params
                        if hasattr(fp, "_unsharded_param") and fp.unsharded_param.grad is not None)
            if dtype is not None:
                self._note_peak(extra_bytes=numel * torch.empty((), dtype=dtype).element_size())
            return post_backward(*args, **kwargs)

        g.unshard, g.wait_for_unshard, g.reshard, g.post_backward = on_unshard, on_wait, on_reshard, on_post_backward

    # --- the step (zero.Zero's hooks; FSDP2 runs its collectives inside forward / backward) ---
    def start_step(self) -> None:
        self._mb = 0

    def start_microbatch(self, last: bool = True) -> None:
        """`last` is zero.py's interface; FSDP2 counts its micro-batches itself."""
        if self.stage == 2:  # keep blocks gathered over the step's micro-batches, free after the last
            last = self._mb == self.microbatches - 1
            for m in self.modules:
                m.set_reshard_after_backward(last, recurse=False)
        self._mb += 1

    def finish_backward(self) -> None:
        """Nothing: FSDP2's post-backward reduce-scatters every unit (its root waits for them)."""

    def reduce_gradients(self) -> None:
        """Nothing: the reduce-scatters ran in backward."""

    def after_step(self) -> None:
        """Nothing: the next forward gathers the updated shards."""

    def gather_all(self) -> None:
        """Whole parameters on every dp rank (for the final model), the framework's attributes
        on them too (export gathers tp shards by `tp_shard`). Collective over dp."""
        for m in self.modules:
            m.unshard()
        for m in self.modules:
            for g in m._get_fsdp_state()._fsdp_param_groups:
                for fp in g.fsdp_params:
                    fp.unsharded_param.__dict__.update(self.attrs.get(id(fp.sharded_param), {}))

    def free_gathered(self) -> None:
        """Every unit back to its shard (after an evaluation's forward, which has no backward)."""
        for m in self.modules:
            m.reshard()

    def build_optimizer(self, spec: dict, offload=None, policy=None):
        """The plain optimizer over the sharded parameters: in the mixed modes they are the
        fp32 masters already (compute gathers 16-bit copies), so no MasterOptimizer."""
        from framework.optim.build import build_optimizer

        assert not offload, "fsdp2 with offload_optimizer is rejected before launch"
        return build_optimizer(spec, self.shards)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Model states this rank holds between steps (storage-deduplicated exact bytes, as
        zero.Zero.state_bytes): the local shards, with FSDP2's dim-0 padding."""
        params = [local(p) for p in self.shards] + self._gathered()
        grads = [local(p.grad) for p in self.shards]
        opt = [local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params_bytes": tensor_bytes(params), "grads_bytes": tensor_bytes(grads),
                "optimizer_bytes": tensor_bytes(opt), "zero_transient_peak_bytes": self.transient_peak_bytes}
