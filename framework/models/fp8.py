"""FP8 linears (`precision.fp8`: tensorwise | rowwise) through torchao's float8 training.

Each matmul of a transformer block's linears runs on FP8 operands with dynamic scaling:
forward `y = x @ W^T`, backward `dx = dy @ W` and `dW = dy^T @ x`, each operand cast from
its high-precision value (the parameters' dtype, or autocast's) right before its GEMM, with a
scale `fp8_max / amax` over the whole tensor (tensorwise: x and W in e4m3, dy in e5m2) or per
row along the GEMM's reduced dimension (rowwise: all e4m3, scales rounded down to powers of
two: torchao's recipe names). The GEMM returns the high-precision dtype (tensorwise's forward
with cuBLAS's fast accumulation, as torchao configures it). On devices without FP8 matrix units (this CPU) torchao emulates the GEMM: the same casts,
then an fp32 matmul of the dequantised operands (`precision.fp8_emulate`).

What runs in FP8: every linear inside the transformer blocks (q / k / v / o, the MLP's), our
tensor-parallel column and row linears included (their `mm`). Not: the embedding, the LM
head (torchtitan leaves its `output` in high precision too: the logits' range), norms,
attention's score and value products, MoE experts (refused: framework/validate/precision.py).

The same parameters, the same state dict: a converted module keeps its `weight` and `bias`
(its class is swapped for a subclass whose forward is the FP8 matmul), so checkpoints,
materialisation and the tp plan's shards are untouched. Dynamic scaling keeps no state: the
FP8 copies and scales live for one GEMM (model states per parameter are the mode's;
framework/metrics/model_states.py). A tp shard is scaled by its own amax (torchtitan reduces
the amax over the DTensor's tp mesh instead), so tp > 1 is close to, not bitwise, tp 1.

Sequence parallelism: the column entry gathers the sequence shards with the tp region's
autograd all-gather and torchao's matmul saves the gathered (B, T, H) input, where the
high-precision path saves the shard alone (_SequenceGatherLinear): more activation memory.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores (torch._scaled_mm)
ALIGN = 16  # torch._scaled_mm takes widths that are multiples of 16


PAYS_FROM = 4096  # hidden widths from which torchao reports end-to-end gains (Llama 3 8B: 1.25x; 405B: 1.5x)


def note(recipe: str, hidden: int, device_type: str):
    """What the launch says about FP8 where it will not pay (None where it may)."""
    if recipe == "none":
        return None
    if device_type != "cuda":
        return (f"precision.fp8={recipe} on {device_type} is emulated (the casts, then an fp32 GEMM): its numerics, "
                "not its speed")
    if hidden < PAYS_FROM:
        return (f"precision.fp8={recipe} at n_embd {hidden}: each FP8 GEMM first reads and casts its operands "
                f"(memory-bound); below widths of ~{PAYS_FROM} that costs about what the faster GEMM saves "
                "(torchao reports gains at Llama 3 8B and up). The cost model prices it: docs/precision.md")
    return None


def fp8_config(recipe: str, emulate: bool, all_gather: bool = False):
    """torchao's Float8LinearConfig of a recipe name, emulated or not."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def emulated(emulate, device: torch.device) -> bool:
    """precision.fp8_emulate resolved: null emulates off CUDA (validated before launch)."""
    return device.type != "cuda" if emulate is None else bool(emulate)


class FP8Matmul:
    """`(x, w, conv1d) -> x @ w` (Conv1D's (in, out) layout) or `x @ w^T` (nn.Linear's), on FP8
    operands: torchao's autograd function, which casts in forward and backward."""

    def __init__(self, config):
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config = config
        mm = [ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
              for g in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)]
        self.mm_config = LinearMMConfig(*mm)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, conv1d: bool) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled(x.device.type):  # as torchao's Float8Linear: the input only (the
            x = x.to(torch.get_autocast_dtype(x.device.type))  # weight goes to FP8 from its own dtype)
        return matmul_with_hp_or_float8_args.apply(x, w if conv1d else w.t(), self.mm_config, self.config)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.fp8(x, self.weight, self.fp8_conv1d)
    return y if self.bias is None else y + self.bias.to(y.dtype)


@functools.lru_cache(maxsize=None)
def _fp8_class(cls: type) -> type:
    """A subclass of the module's class whose forward is the FP8 matmul (isinstance, the
    parameters' names and the state dict unchanged)."""
    return type(f"FP8{cls.__name__}", (cls,), {"forward": _forward})


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linears, weight stored (in, out)), converted or not."""
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linears(blocks: nn.Module):
    """(name, module, is_tp_layer) of every linear inside the blocks FP8 would convert: plain
    linears and the tensor-parallel layers (a `mm` and a `conv1d` attribute)."""
    for name, m in blocks.named_modules():
        if is_plain_linear(m):
            yield name, m, False
        elif hasattr(m, "mm") and hasattr(m, "conv1d"):
            yield name, m, True


def widths(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of this rank's weight."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if getattr(module, "conv1d", is_conv1d(module)) else (w.shape[1], w.shape[0])


def install(blocks: nn.Module, recipe: str, emulate: bool, all_gather: bool = False) -> int:
    """Convert every linear in `blocks` (the model's transformer blocks) to FP8; returns how
    many. Before recomputation, compilation and the dp wrappers (torchtitan's order)."""
    fp8 = FP8Matmul(fp8_config(recipe, emulate, all_gather))
    n = 0
    for _, m, tp_layer in list(linears(blocks)):
        if tp_layer:
            m.mm = fp8
        else:
            m.fp8, m.fp8_conv1d = fp8, is_conv1d(m)
            m.__class__ = _fp8_class(type(m))
        n += 1
    return n


# What torchao's WeightWithDynamicFloat8CastTensor keeps in a parameter's __dict__ (its _tensor
# is the whole weight): never copied onto FSDP2's sharded parameters, or the full weight stays alive.
WRAPPER_KEYS = frozenset({"_tensor", "_linear_mm_config", "_dtype", "_precomputed_scale", "_is_param"})


def fp8_weights_for_all_gather(module: nn.Module) -> int:
    """FSDP2's FP8 all-gather (`precision.fp8_all_gather`, tensorwise): each FP8 linear's
    weight becomes torchao's WeightWithDynamicFloat8CastTensor, which FSDP2 casts to FP8 before
    gathering (1 byte per element on the wire, not 2) and the matmul takes as cast. Call after
    the weights have their values and before fully_shard; returns how many."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    n = 0
    for _, m, tp_layer in list(linears(module)):
        fp8: Optional[FP8Matmul] = m.mm if tp_layer else getattr(m, "fp8", None)
        if not isinstance(fp8, FP8Matmul):
            continue
        w = m.weight
        m.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
            w.data, fp8.mm_config, fp8.config.cast_config_weight.target_dtype), requires_grad=w.requires_grad)
        m.weight.__dict__.update({k: v for k, v in w.__dict__.items() if k != "_is_param"})
        n += 1
    return n
