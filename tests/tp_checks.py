"""Run on every rank of a tp group: each primitive and layer next to the unsplit computation.

Every check returns (ours, expected) pairs, outputs and gradients, where `expected` is what
the single-device computation gives for this rank's part. All ranks draw the same random
tensors (one seed), so the unsplit reference is computed locally on each rank. In fp64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from framework.comm import tp_comm as C
from framework.comm.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                VocabParallelHead, column_index, full_tensor, padded_vocab)
from framework.comm.tp_comm import TPComm

B, T, H = 2, 8, 12


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _primitives(comm: TPComm, r: int, n: int) -> dict:
    x, w = torch.randn(B, T, H), torch.randn(B, T, H)
    per_rank = [torch.randn(B, T, H) for _ in range(n)]  # rank r's own input / loss weight
    total = sum(per_rank)
    out = {}

    xr = _leaf(x)
    y = C.copy_to_tp_region(xr, comm)
    (y * per_rank[r]).sum().backward()  # unsplit: sum_r (x * p_r) -> d/dx = sum_r p_r
    out["copy_to_tp_region"] = [(y, x), (xr.grad, total)]

    xr = _leaf(per_rank[r])
    y = C.reduce_from_tp_region(xr, comm)
    (y * w).sum().backward()
    out["reduce_from_tp_region"] = [(y, total), (xr.grad, w)]

    xr = _leaf(x)
    y = C.scatter_to_tp_region(xr, comm)
    (y * w.chunk(n, -1)[r]).sum().backward()  # the ranks' pieces make up (x * w).sum()
    out["scatter_to_tp_region"] = [(y, x.chunk(n, -1)[r]), (xr.grad, w)]

    xr = _leaf(x.chunk(n, -1)[r])
    y = C.gather_from_tp_region(xr, comm)
    (y * w).sum().backward()
    out["gather_from_tp_region"] = [(y, x), (xr.grad, w.chunk(n, -1)[r])]

    xr = _leaf(x.chunk(n, 1)[r])
    y = C.gather_from_sequence_parallel_region(xr, comm)
    (y * per_rank[r]).sum().backward()
    out["gather_from_sequence_parallel_region"] = [(y, x), (xr.grad, total.chunk(n, 1)[r])]

    xr = _leaf(per_rank[r])
    y = C.reduce_scatter_to_sequence_parallel_region(xr, comm)
    (y * w.chunk(n, 1)[r]).sum().backward()
    out["reduce_scatter_to_sequence_parallel_region"] = [(y, total.chunk(n, 1)[r]), (xr.grad, w)]
    return out


def _column(comm: TPComm, full: nn.Module, parts: int, n_out: int) -> list:
    x, w = torch.randn(B, T, H), torch.randn(B, T, n_out)
    index = column_index(n_out, comm, parts)
    xf = _leaf(x)
    yf = full(xf)
    (yf * w).sum().backward()
    layer = ColumnParallelLinear(full, comm, parts)
    xr = _leaf(x)
    y = layer(C.copy_to_tp_region(xr, comm))  # (B, T, n_out/tp)
    (y * w[..., index]).sum().backward()  # the ranks' index sets partition the outputs
    conv = isinstance(full, Conv1D)
    return [(y, yf[..., index]), (xr.grad, xf.grad), (layer.bias.grad, full.bias.grad[index]),
            (layer.weight.grad, full.weight.grad[:, index] if conv else full.weight.grad[index]),
            (full_tensor(layer.weight, layer.weight.tp_shard, comm), full.weight)]


def _column_sequence_parallel(comm: TPComm, full: nn.Module, n_out: int) -> list:
    """Sequence shards in, re-gathered in backward (only the shard is saved)."""
    x, w = torch.randn(B, T, H), torch.randn(B, T, n_out)
    index = column_index(n_out, comm)
    xf = _leaf(x)
    (full(xf) * w).sum().backward()
    layer = ColumnParallelLinear(full, comm, enters=True, sequence_parallel=True)
    xr = _leaf(x.chunk(comm.size, 1)[comm.rank])
    y = layer(xr)  # (B, T, n_out/tp)
    (y * w[..., index]).sum().backward()
    conv = isinstance(full, Conv1D)
    return [(y, full(x)[..., index]), (xr.grad, xf.grad.chunk(comm.size, 1)[comm.rank]),
            (layer.weight.grad, full.weight.grad[:, index] if conv else full.weight.grad[index]),
            (layer.bias.grad, full.bias.grad[index])]


def _row(comm: TPComm, full: nn.Module, n_in: int, sequence_parallel: bool) -> list:
    x, w = torch.randn(B, T, n_in), torch.randn(B, T, H)
    index = column_index(n_in, comm)
    xf = _leaf(x)
    yf = full(xf)
    (yf * w).sum().backward()
    layer = RowParallelLinear(full, comm, sequence_parallel)
    full.bias.grad, bias_ref = None, full.bias.grad.clone()  # the layer shares the bias
    xr = _leaf(x[..., index])
    y = layer(xr)
    r, n = comm.rank, comm.size
    if sequence_parallel:
        (y * w.chunk(n, 1)[r]).sum().backward()
        pairs = [(y, yf.chunk(n, 1)[r]), (comm.all_reduce(full.bias.grad), bias_ref)]  # shards' parts sum up
    else:
        (y * w).sum().backward()
        pairs = [(y, yf), (full.bias.grad, bias_ref)]
    conv = isinstance(full, Conv1D)
    ref_w = full.weight.grad[index] if conv else full.weight.grad[:, index]
    return pairs + [(xr.grad, xf.grad[..., index]), (layer.weight.grad, ref_w)]


def _vocab(comm: TPComm, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (B, T))
    labels = torch.randint(0, vocab, (B, T))
    emb, head = nn.Embedding(vocab, H), nn.Linear(H, vocab, bias=False)
    w = torch.randn(B, T, H)
    width = padded_vocab(vocab, comm.size) // comm.size
    start = comm.rank * width
    valid = max(0, min(width, vocab - start))

    yf = emb(ids)
    (yf * w).sum().backward()
    layer = VocabParallelEmbedding(emb, comm, False)
    y = layer(ids)
    (y * w).sum().backward()
    out = {"vocab_parallel_embedding": [
        (y, yf), (layer.weight.grad[:valid], emb.weight.grad[start:start + valid]),
        (layer.weight.grad[valid:], torch.zeros(width - valid, H))]}  # padding rows: no gradient

    h = torch.randn(B, T, H)
    hf = _leaf(h)
    ref = F.cross_entropy(head(hf).reshape(-1, vocab), labels.reshape(-1))
    ref.backward()
    lm = VocabParallelHead(head, comm, False, None)
    hr = _leaf(h)
    logits = lm(hr)
    assert logits.shape == (B, T, width), logits.shape  # never the full vocabulary on one rank
    loss = lm.loss(logits, labels)
    loss.backward()
    out["vocab_parallel_cross_entropy"] = [
        (loss, ref), (hr.grad, hf.grad), (lm.weight.grad[:valid], head.weight.grad[start:start + valid]),
        (lm.weight.grad[valid:], torch.zeros(width - valid, H))]
    return out


def all_checks(rank: int, world: int) -> dict:
    # fp64: a split layer sums in another order than the unsplit one (partial matmuls, then
    # an all-reduce), so the two agree to round-off only; in fp64 that is ~1e-16 relative,
    # and the comparison can be tight (tests/conftest.py's FP64_TOL) without depending on
    # how fp32 round-off falls on this CPU's kernels.
    torch.set_default_dtype(torch.float64)  # this rank's process only (run_ranks spawns it)
    torch.manual_seed(0)
    comm = TPComm(dist.group.WORLD, world, rank)
    out = _primitives(comm, rank, world)
    out["column_parallel_linear"] = _column(comm, nn.Linear(H, 2 * H), 1, 2 * H)
    out["column_parallel_conv1d_qkv"] = _column(comm, Conv1D(3 * H, H), 3, 3 * H)
    out["column_parallel_sequence_parallel"] = _column_sequence_parallel(comm, nn.Linear(H, 2 * H), 2 * H)
    out["column_parallel_sequence_parallel_conv1d"] = _column_sequence_parallel(comm, Conv1D(2 * H, H), 2 * H)
    out["row_parallel_linear"] = _row(comm, nn.Linear(2 * H, H), 2 * H, False)
    out["row_parallel_conv1d"] = _row(comm, Conv1D(H, 2 * H), 2 * H, False)
    out["row_parallel_sequence_parallel"] = _row(comm, nn.Linear(2 * H, H), 2 * H, True)
    out.update(_vocab(comm, vocab=4 * world + 3))  # not a multiple of tp: padded
    return {k: [(a.detach().clone(), b.detach().clone()) for a, b in pairs] for k, pairs in out.items()}
