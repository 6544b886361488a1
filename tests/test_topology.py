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
        ParallelDims(pp=1, dp=1, tp=1).groups("sp")


def _megatron_groups(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron-core's `generate_masked_orthogonal_rank_groups` (parallel_state.py), written
    out here as the outside reference: the groups of the masked dimensions of `sizes`
    (innermost first, in its `order` string)."""
    def prefix_product(a):
        out = [1]
        for v in a:
            out.append(out[-1] * v)
        return out

    def decompose(index, shape):
        return [(index // d) % s for s, d in zip(shape, prefix_product(shape))]

    stride = prefix_product(sizes)
    masked = [s for s, m in zip(sizes, mask) if m]
    unmasked = [s for s, m in zip(sizes, mask) if not m]
    m_stride = [d for d, m in zip(stride, mask) if m]
    u_stride = [d for d, m in zip(stride, mask) if not m]
    size = prefix_product(masked)[-1]
    groups = []
    for gi in range(world // size):
        g_idx = decompose(gi, unmasked)
        groups.append([sum(a * b for a, b in zip(decompose(r, masked), m_stride))
                       + sum(a * b for a, b in zip(g_idx, u_stride)) for r in range(size)])
    return groups


@pytest.mark.parametrize("pp,dp,tp,ep", [(1, 2, 1, 2), (1, 4, 1, 2), (1, 4, 1, 4), (2, 4, 2, 2), (2, 8, 1, 4),
                                         (3, 6, 2, 3)])
def test_ep_and_expert_dp_groups_are_megatrons(pp, dp, tp, ep):
    """Megatron's expert rank generator (order tp-cp-ep-dp-pp, expert tp = tp, cp = 1, expert
    dp = dp / ep) gives the same ep and expert-dp groups, and the dense generator (ep = 1)
    the same tp / dp / pp groups."""
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, ep=ep)
    world = dims.world_size
    expert_sizes = [tp, 1, ep, dp // ep, pp]  # tp-cp-ep-dp-pp
    assert dims.groups("ep") == sorted(_megatron_groups(world, expert_sizes, [False, False, True, False, False]))
    assert dims.groups("edp") == sorted(_megatron_groups(world, expert_sizes, [False, False, False, True, False]))
    dense_sizes = [tp, 1, 1, dp, pp]
    for dim, i in (("tp", 0), ("dp", 3), ("pp", 4)):
        mask = [j == i for j in range(5)]
        assert dims.groups(dim) == sorted(_megatron_groups(world, dense_sizes, mask))
    for r in range(world):  # each ep group: consecutive dp ranks; edp strides by ep through dp
        c = dims.coords(r)
        assert dims.ep_rank(c) * 1 + dims.edp_rank(c) * ep == c.dp


def test_eight_ranks_ep2_groups_by_hand():
    dims = ParallelDims(pp=1, dp=4, tp=2, ep=2)
    assert dims.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelDims(pp=1, dp=4, tp=1, ep=3)


@pytest.mark.parametrize("pp,data,cp,tp", [(1, 1, 2, 1), (1, 2, 2, 2), (2, 2, 4, 1), (2, 3, 2, 2)])
def test_cp_groups_are_megatrons(pp, data, cp, tp):
    """Megatron's dense rank generator in its order tp-cp-dp-pp: its cp groups, its data-parallel
    groups (same cp rank) and its dp-cp groups (over which it reduces gradients) are ours, with
    our dp coordinate holding data x cp."""
    dims = ParallelDims(pp=pp, dp=data * cp, tp=tp, cp=cp)
    world = dims.world_size
    sizes = [tp, cp, data, pp]
    assert dims.groups("cp") == sorted(_megatron_groups(world, sizes, [False, True, False, False]))
    assert dims.groups("dp") == sorted(_megatron_groups(world, sizes, [False, True, True, False]))
    for dim, i in (("tp", 0), ("pp", 3)):
        assert dims.groups(dim) == sorted(_megatron_groups(world, sizes, [j == i for j in range(4)]))
    same_cp_rank = sorted(_megatron_groups(world, sizes, [False, False, True, False]))
    assert sorted([r for r in g if dims.cp_rank(dims.coords(r)) == k] for g in dims.groups("dp")
                  for k in range(cp)) == same_cp_rank


def test_each_pair_of_pipeline_neighbours_gets_its_own_group_in_one_global_order(monkeypatch):
    """topology._pair_groups (the pipeline p2p's communicators): at pp 4 x dp 2 every rank
    makes all 8 pair groups in one order and keeps its two, keyed by the neighbour's pp
    rank; a rank's groups come in creation order (the order NCCL's barriers on them run:
    any two ranks meet their shared groups in the same order). At pp 2 the pp group is the
    pair; at pp 1 there is none."""
    import torch.distributed as dist

    from framework.topology import _pair_groups

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: made.append(tuple(ranks)) or tuple(ranks))
    dims = ParallelDims(pp=4, dp=2, tp=1)
    seen = {}
    for rank in range(dims.world_size):
        made.clear()
        seen[rank] = _pair_groups(dims, rank, "pp-group", None)
        assert len(made) == 8 and len(set(made)) == 8
        order = list(made)
    for rank, pairs in seen.items():
        pp = dims.coords(rank).pp
        assert sorted(pairs) == sorted({(pp - 1) % 4, (pp + 1) % 4})
        ranks = dims.group_of("pp", rank)
        for peer, group in pairs.items():
            assert set(group) == {rank, ranks[peer]}
        assert [order.index(g) for g in pairs.values()] == sorted(order.index(g) for g in pairs.values())
    assert _pair_groups(ParallelDims(pp=2, dp=2, tp=1), 1, "pp-group", None) == {1: "pp-group"}
    assert _pair_groups(ParallelDims(pp=1, dp=2, tp=1), 0, None, None) == {}
