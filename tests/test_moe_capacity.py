"""MoE capacity is the single process's in every layout (issue 29; docs/moe.md, Capacity).

The capacity group is one sequence: each expert takes at most ceil(cf * T * k / E) of a
sequence's assignments, whatever micro-batch the sequence is in and however tp + sequence
parallelism shards it (framework/models/moe_routing.py all-gathers the shards' decisions
inputs). In process: a micro-batch routes as its sequences routed one by one, and two SP
shards (the gather faked) as the whole; the old per-call capacity differs on the same data.
In training, fp64 at rtol 1e-9 with capacity dropping tokens: dp2 x tp2 x ep2 + SP and pp2 x
ep2 reproduce the single process, each at another micro-batch size.

A drop or top-k decision is discontinuous: layouts whose scores differ by round-off agree only
if no decision is closer than that to a tie. Every run here asserts its logged routing margin
(`moe_route_margin`) against MARGIN."""

from dataclasses import replace

import pytest
import torch

import framework.models.moe_routing as moe_routing
from framework.config import MoEConfig
from framework.models.moe_routing import _within_capacity, expert_capacity, route

from .conftest import assert_same_training, run_layouts
from .test_moe import MOE

# fp64 layouts differ in the router's scores by summation-order round-off, ~1e-16 relative per
# operation and at most ~1e-11 after a few AdamW steps (the params' measured worst, conftest);
# a decision 1e-8 from a tie is 1000x beyond that.
MARGIN = 1e-8
T, E, K = 32, 4, 2


def _data(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 16, generator=g, dtype=torch.float64),
            torch.randn(b * T, 16, generator=g, dtype=torch.float64))  # (E, H), (B*T, H)


def _per_call(weight, hidden, cfg):
    """The old rule, as a reference that must differ: capacity over all the call's tokens."""
    free = route(weight, hidden, replace(cfg, capacity_factor=None), seq_len=T)
    chosen = torch.softmax(free.logits, -1).gather(-1, free.index)
    n = hidden.shape[0]
    keep, _ = _within_capacity(free.index, chosen, expert_capacity(cfg.capacity_factor, n, K, E), cfg.drop_policy,
                               E, n)
    return free.index.masked_fill(~keep, E)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_a_micro_batch_routes_as_its_sequences_one_by_one(policy):
    cfg = MoEConfig(experts=E, top_k=K, capacity_factor=1.0, drop_policy=policy)
    weight, hidden = _data(2)  # the example: 64 tokens, two sequences of 32
    whole = route(weight, hidden, cfg, seq_len=T)
    alone = [route(weight, hidden[i * T:(i + 1) * T], cfg, seq_len=T) for i in range(2)]
    assert torch.equal(whole.index, torch.cat([r.index for r in alone]))
    assert torch.equal(whole.weights, torch.cat([r.weights for r in alone]))
    assert whole.stats["dropped"] == sum(r.stats["dropped"] for r in alone) > 0
    assert whole.stats["margin"] == min(r.stats["margin"] for r in alone) > MARGIN
    # capacity over the call: 64 tokens drop other assignments than two calls of 32
    assert not torch.equal(_per_call(weight, hidden, cfg),
                           torch.cat([_per_call(weight, hidden[i * T:(i + 1) * T], cfg) for i in range(2)]))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_sequence_parallel_shards_drop_what_the_whole_micro_batch_drops(monkeypatch, policy):
    """Two tp ranks, each with positions [r T/2, (r+1) T/2) of both sequences; the all-gather
    over the SP group faked in process (two passes: collect each rank's input, then answer)."""
    cfg = MoEConfig(experts=E, top_k=K, capacity_factor=1.0, drop_policy=policy)
    weight, hidden = _data(2, seed=1)
    shards = [hidden.view(2, T, -1)[:, r * T // 2:(r + 1) * T // 2].reshape(T, -1) for r in range(2)]  # (B*T/2, H)
    me, sent = [0], {}

    def gather(out, x, group):
        sent[me[0]] = x.clone()
        out.copy_(torch.cat([sent.get(r, x) for r in range(2)]))

    monkeypatch.setattr(moe_routing.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(moe_routing.dist, "get_rank", lambda group: me[0])
    monkeypatch.setattr(moe_routing, "all_gather_single", gather)
    for _ in range(2):  # the first pass only fills `sent`
        parts = []
        for me[0], shard in enumerate(shards):
            parts.append(route(weight, shard, cfg, seq_len=T // 2, sp_group="sp"))
    whole = route(weight, hidden, cfg, seq_len=T)

    def joined(key):  # the shards' rows back in (sequence, position) order
        return torch.cat([getattr(p, key).view(2, T // 2, K) for p in parts], dim=1).reshape(2 * T, K)

    assert torch.equal(joined("index"), whole.index) and torch.equal(joined("weights"), whole.weights)
    assert sum(p.stats["dropped"] for p in parts) == whole.stats["dropped"] > 0
    assert min(p.stats["margin"] for p in parts) == whole.stats["margin"] > MARGIN
    # each shard with a capacity of its own tokens (the old rule) drops otherwise
    old = torch.cat([_per_call(weight, s, cfg).view(2, T // 2, K) for s in shards], dim=1).reshape(2 * T, K)
    assert not torch.equal(old, whole.index)


def _capacity_edges(scores, index, cap: int) -> list:
    """(last kept - first dropped score, the first dropped (token, slot)) of every over-full
    (sequence, expert), by a plain loop."""
    edges = []
    for s in range(index.shape[0] // T):
        for e in range(E):
            mine = sorted(((scores[t, e].item(), t) for t in range(s * T, (s + 1) * T) if e in index[t]),
                          key=lambda x: -x[0])
            if len(mine) > cap:
                t = mine[cap][1]
                edges.append((mine[cap - 1][0] - mine[cap][0], (t, index[t].tolist().index(e))))
    return edges


def test_the_margin_is_the_closest_decision_to_a_tie():
    """The margin is the smallest of every token's k-th minus best unchosen score and every
    over-full expert's last kept minus first dropped score (per sequence), by a plain loop; the
    keep decisions hold under any perturbation of the scores below half of it, and moving the
    closest dropped score up by the capacity margin flips one."""
    cfg = MoEConfig(experts=E, top_k=K, capacity_factor=1.0)
    weight, hidden = _data(2, seed=2)
    r = route(weight, hidden, cfg, seq_len=T)
    free = route(weight, hidden, replace(cfg, capacity_factor=None), seq_len=T)
    scores = torch.softmax(free.logits, -1)  # (N, E)
    top = scores.sort(-1, descending=True).values
    topk_gap = (top[:, K - 1] - top[:, K]).min().item()
    cap = expert_capacity(1.0, T, K, E)
    gap, first_dropped = min(_capacity_edges(scores, free.index, cap))
    assert r.stats["margin"].item() == min(topk_gap, gap) > MARGIN
    # A bias of 10 on experts 0 and 1 puts every token's top-k choice ~10 from a tie: the
    # route's margin is then its capacity decisions' (over the unbiased scores, policy probs)
    bias = torch.tensor([10.0, 10.0, 0.0, 0.0], dtype=torch.float64)
    biased = route(weight, hidden, cfg, seq_len=T, bias=bias)
    by_bias = route(weight, hidden, replace(cfg, capacity_factor=None), seq_len=T, bias=bias)
    assert biased.stats["margin"].item() == min(_capacity_edges(scores, by_bias.index, cap))[0] < 1
    chosen = scores.gather(-1, free.index)
    keep, margin = _within_capacity(free.index, chosen, cap, "probs", E, T)
    assert margin.item() == gap
    noise = torch.rand(chosen.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) - 0.5
    assert torch.equal(_within_capacity(free.index, chosen + noise * margin, cap, "probs", E, T)[0], keep)
    moved = chosen.clone()
    moved[first_dropped] += 1.5 * gap
    flipped = _within_capacity(free.index, moved, cap, "probs", E, T)[0]
    assert flipped[first_dropped] and not keep[first_dropped] and (flipped != keep).sum() == 2


CAPACITY = [*(a for a in MOE if not a.startswith("data")), "data=synthetic", "data.seq_len=32", "model.n_kv_head=2",
            "model.moe.capacity_factor=1.0",
            "model.moe.aux_losses=[{type:seq_aux,coeff:0.01},{type:z,coeff:0.001}]",
            "model.moe.bias_update_rate=0.01"]
# Global batch 8 sequences of 32 in each; the micro-batch differs (2, 4, 1): so does a per-call capacity.
LAYOUTS = {
    "single": ["parallelism=single", "schedule.microbatches=4"],
    "dp2_tp2_ep2_sp": ["parallelism=dp2", "parallelism.tp=2", "parallelism.sequence_parallel=true",
                       "parallelism.ep=2", "trainer.micro_batch_size=4", "schedule.microbatches=1"],
    "dp2_pp2_ep2": ["parallelism=dp2_pp2", "parallelism.ep=2", "trainer.micro_batch_size=1",
                    "schedule.microbatches=4"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    return run_layouts(tmp_path_factory, "cap", LAYOUTS, *CAPACITY, f"data.cache_dir={data_cache}")


@pytest.mark.parametrize("layout", ["dp2_tp2_ep2_sp", "dp2_pp2_ep2"])
def test_capacity_layouts_reproduce_the_single_process_in_fp64(runs, layout):
    (metrics, params), (ref, ref_params) = runs[layout], runs["single"]
    for m in (*metrics, *ref):  # no decision near a tie in either run (module docstring)
        assert m["moe_route_margin"] > MARGIN, m["moe_route_margin"]
    assert all(m["moe_dropped_fraction"] > 0 for m in ref)  # the capacity drops tokens every step
    assert_same_training(metrics, params, ref, ref_params)
    for m in (*metrics, *ref):  # the router's drop count is the assignments no expert processed
        for row in m["moe_layers"].values():  # 8 sequences x 32 tokens x top-2 per layer and step
            assert row["dropped_fraction"] == (512 - sum(row["tokens_received_per_ep_rank"])) / 512
        kept = sum(sum(row["tokens_received_per_ep_rank"]) for row in m["moe_layers"].values())
        assert m["moe_dropped_fraction"] == pytest.approx(1 - kept / (512 * len(m["moe_layers"])), rel=1e-12)
    for mine, theirs in zip(metrics, ref, strict=True):  # the very same assignments dropped, per layer
        assert mine["moe_dropped_fraction"] == theirs["moe_dropped_fraction"]
        # the scores are not the same bits (the margin, a score difference, moves by ~1e-17):
        # the decisions agree because MARGIN is 1e4 x that round-off, not by luck
        assert abs(mine["moe_route_margin"] - theirs["moe_route_margin"]) < MARGIN * 1e-4
        for layer, row in theirs["moe_layers"].items():
            assert mine["moe_layers"][layer]["dropped_fraction"] == row["dropped_fraction"]
            assert mine["moe_layers"][layer]["tokens_per_expert"] == row["tokens_per_expert"]
