"""Rank math: Megatron's layout (tp innermost, then dp, then pp), without processes."""

import pytest

from framework.topology import Coords, ParallelDims


def test_sixteen_ranks_tp2_pp4_groups_are_megatrons():
    dims = ParallelDims(pp=4, dp=2, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert dims.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (1, 4, 1), (2, 2, 2), (4, 2, 2), (3, 5, 2), (8, 16, 8)])
def test_coords_and_rank_are_inverse_and_groups_partition_the_world(pp, dp, tp):
    dims = ParallelDims(pp=pp, dp=dp, tp=tp)
    world = range(dims.world_size)
    assert [dims.rank(dims.coords(r)) for r in world] == list(world)
    for dim, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        groups = dims.groups(dim)
        assert sorted(r for g in groups for r in g) == list(world)  # each rank in exactly one group
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only in `dim`
            cs = [dims.coords(r) for r in g]
            assert [getattr(c, dim) for c in cs] == list(range(size))
            others = {tuple(getattr(c, d) for d in ("pp", "dp", "tp") if d != dim) for c in cs}
            assert len(others) == 1


def test_tp_peers_are_neighbours():
    dims = ParallelDims(pp=2, dp=2, tp=4)
    assert all(g == list(range(g[0], g[0] + 4)) for g in dims.groups("tp"))
    assert dims.coords(13) == Coords(pp=1, dp=1, tp=1)
    assert dims.group_of("dp", 13) == [9, 13]


def test_bad_dims_and_ranks_are_errors():
    with pytest.raises(ValueError, match="dp=0"):
        ParallelDims(pp=1, dp=0, tp=1)
    with pytest.raises(ValueError, match="outside world size 4"):
        ParallelDims(pp=1, dp=4, tp=1).coords(4)
    with pytest.raises(ValueError, match="unknown dimension"):
        ParallelDims(pp=1, dp=1, tp=1).groups("ep")
