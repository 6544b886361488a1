"""Per-rank materialisation: the model is built on the meta device (shapes, no memory); each
rank then allocates and fills only the parameters it keeps (its pipeline stage, its tp
shards; under ZeRO one unit at a time, framework/parallel/zero.py), so no rank ever holds
the whole model unless it keeps it.

Values, the same in every layout and in the single process (which is built the same way):
- Random init (`RandomInit`): each module's parameters are drawn by transformers' own
  `_init_weights` on a standalone copy of that module, with the CPU generator seeded by
  (trainer.seed, the module's transformers name): normal(0, initializer_range) for linear
  and embedding weights, zeros for biases, ones for norm weights, plus the architecture's
  own additions (GPT-2 scales its residual projections, `gpt2.init_module`). So any rank
  makes any parameter alone: the whole tensor, then its tp rows / columns. Transient memory:
  one module's full tensors (the embedding is the largest). Drawn on the CPU in fp32 and
  then moved and cast, so CUDA and fp64 runs start from exactly the CPU fp32 values.
- Pretrained (`PretrainedWeights`): each kept tensor is read from the safetensors files with
  `safe_open(...).get_slice`, only this rank's rows / columns of a tp shard.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Callable, Iterable, Optional

import torch
from torch import nn


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from framework.comm.expert_parallel import shard_spec
    from framework.comm.tensor_parallel import shard_tensor

    spec = shard_spec(p)
    return shard_tensor(full, spec) if spec is not None else full


class RandomInit:
    """Seeded values per module, from a pristine meta model (no tp wrappers, fp32)."""

    def __init__(self, reference: nn.Module, seed: int, init_module: Optional[Callable] = None):
        self.ref, self.seed, self.init_module = reference, seed, init_module
        self._cached: tuple[str, dict[str, torch.Tensor]] = ("", {})

    def _module_values(self, path: str) -> dict[str, torch.Tensor]:
        if self._cached[0] != path:
            module = copy.deepcopy(self.ref.get_submodule(path)).to_empty(device="cpu")
            for p in module.parameters(recurse=False):
                p.__dict__.pop("_is_hf_initialized", None)  # transformers skips tensors marked done
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                # the CPU generator only (the values are drawn on the CPU): torch.manual_seed
                # also queues a CUDA seed with the caller's stack trace when CUDA is not
                # initialised, ~0.7 ms a module on the launch path for nothing
                torch.random.default_generator.manual_seed(_seed_of(self.seed, path))
                self.ref._init_weights(module)
                if self.init_module is not None:
                    self.init_module(self.ref, path, module)
            self._cached = (path, {n: p.detach() for n, p in module.named_parameters(recurse=False)})
        return self._cached[1]

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """A fresh tensor (the cache gives each tensor away once: no second copy of it)."""
        path, _, attr = name.rpartition(".")
        return _local(self._module_values(path).pop(attr), p)

    def clear(self) -> None:
        self._cached = ("", {})


class PretrainedWeights:
    """Tensors of a transformers checkpoint directory, read per tensor and per slice."""

    def __init__(self, path: str, base_prefix: str):
        self.path, self.prefix = path, base_prefix + "."
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = os.path.join(path, "model.safetensors")
            with safe_open(single, "pt") as f:
                self.files = {k: single for k in f.keys()}

    def _key(self, name: str) -> str:
        for key in (name, name.removeprefix(self.prefix)):  # hub GPT-2 files lack "transformer."
            if key in self.files:
                return key
        raise KeyError(f"{name} is not in the checkpoint {self.path}")

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        from framework.comm.expert_parallel import shard_spec

        if name.endswith(FUSED_EXPERTS) and not any(k in self.files for k in (name, name.removeprefix(self.prefix))):
            return self._per_expert(name, p)
        key = self._key(name)
        with safe_open(self.files[key], "pt") as f:
            sl = f.get_slice(key)
            spec = shard_spec(p)
            if spec is None:
                return sl[:]  # a tensor of its own, read from the mapped file
            return _read_rows(sl, spec, len(sl.get_shape()))


    def _per_expert(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """A fused expert tensor from a checkpoint that stores one tensor per expert (what
        transformers 5 writes and the hub's Qwen3-MoE / Mixtral files hold:
        `experts.{e}.gate_proj / up_proj / down_proj.weight`): gate_up_proj[e] = [gate; up]
        (2I, H), down_proj[e] = down (H, I), reading only this rank's experts (`ep_shard`)."""
        from safetensors import safe_open

        base, _, fused = name.rpartition(".")
        spec = getattr(p, "ep_shard", None)
        experts = spec.index.tolist() if spec is not None else range(p.shape[0])
        parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        rows = []
        for e in experts:
            pieces = []
            for part in parts:
                key = self._key(f"{base}.{e}.{part}.weight")
                with safe_open(self.files[key], "pt") as f:
                    pieces.append(f.get_tensor(key))
            rows.append(torch.cat(pieces, 0))
        return torch.stack(rows)


FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5's fused (E, ...) tensors


def _read_rows(sl, spec, ndim: int) -> torch.Tensor:
    """The positions `spec.index` along `spec.dim`, read as contiguous runs; indices past the
    tensor (vocab padding, always last) are zero rows."""
    index = spec.index.tolist()
    valid = [i for i in index if i < spec.full_size]
    assert valid == index[:len(valid)], "padding must come last"
    runs, start = [], None
    for k, i in enumerate(valid):
        if start is None:
            start = i
        if k + 1 == len(valid) or valid[k + 1] != i + 1:
            runs.append((start, i + 1))
            start = None
    parts = []
    for a, b in runs:
        sel = [slice(None)] * ndim
        sel[spec.dim] = slice(a, b)
        parts.append(sl[tuple(sel)])
    out = torch.cat(parts, spec.dim)
    pad = len(index) - len(valid)
    if pad:
        shape = list(out.shape)
        shape[spec.dim] = pad
        out = torch.cat([out, out.new_zeros(shape)], spec.dim)
    return out


def materialise(hf: nn.Module, params: Iterable[nn.Parameter], values, device) -> None:
    """Give each meta parameter in `params` its values (in its own dtype, on `device`). The
    parameter objects stay the same (`torch.utils.swap_tensors`): modules, tied weights and
    tp attributes keep pointing at them."""
    names = {id(p): n for n, p in hf.named_parameters()}  # a tied weight: its first name
    seen: set[int] = set()
    for p in params:
        if id(p) in seen or not p.is_meta:
            continue
        seen.add(id(p))
        # Each source returns a tensor of its own (no cache or file mapping keeps it alive).
        _swap(p, values.local(names[id(p)], p).to(device=device, dtype=p.dtype).contiguous())
    if hasattr(values, "clear"):
        values.clear()


def release(p: nn.Parameter, device) -> None:
    """A parameter this rank does not keep: an empty tensor under the same name."""
    _swap(p, torch.empty(0, dtype=p.dtype, device=device))
    p.requires_grad_(False)


def _swap(p: nn.Parameter, t: torch.Tensor) -> None:
    new = nn.Parameter(t, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


def materialise_buffers(hf: nn.Module, device) -> None:
    """Buffers are small and computed, not drawn (Llama's rotary frequencies): every rank makes
    all of them, by transformers' own `_init_weights` of their module."""
    for module in hf.modules():
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                hf._init_weights(module)
