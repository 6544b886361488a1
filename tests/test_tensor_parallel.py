"""Tensor-parallel primitives and layers against the unsplit computation, at tp = 2 and 4.

Each check (tests/tp_checks.py) runs on every rank of a gloo tp group and compares the
rank's outputs and gradients with the single-device module's, including a vocabulary
that tp does not divide (padding rows stay out of the loss and get no gradient). In fp64
at tests/conftest.py's FP64_TOL: the split sums in another order than the unsplit module.
"""

import pytest
import torch

from .conftest import FP64_TOL
from .distributed import run_ranks
from .tp_checks import all_checks

CHECKS = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
          "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
          "column_parallel_linear", "column_parallel_conv1d_qkv",
          "column_parallel_sequence_parallel", "column_parallel_sequence_parallel_conv1d", "row_parallel_linear", "row_parallel_conv1d",
          "row_parallel_sequence_parallel", "vocab_parallel_embedding", "vocab_parallel_cross_entropy"]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def results(request):
    return request.param, run_ranks(all_checks, request.param)


def test_every_check_ran(results):
    _, per_rank = results
    assert all(sorted(r) == sorted(CHECKS) for r in per_rank)


@pytest.mark.parametrize("check", CHECKS)
def test_matches_the_unsplit_computation(results, check):
    tp, per_rank = results
    for rank, out in enumerate(per_rank):
        pairs = out[check]
        assert len(pairs) >= 2
        for i, (ours, expected) in enumerate(pairs):
            assert ours.shape == expected.shape, (rank, i)
            assert ours.dtype == expected.dtype == torch.float64, (rank, i)
            torch.testing.assert_close(ours, expected, **FP64_TOL, msg=f"tp={tp} rank {rank} item {i}")
