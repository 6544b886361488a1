"""MoE routing and balancing (framework/models/moe_routing.py, docs/moe.md "Routing and
balancing"), in process: the defaults are qwen3_moe's router bit for bit; capacity and both drop
policies against a brute-force loop; aux / seq_aux / z on a hand-worked example, and split over
a (faked) sequence-parallel group; the injected aux gradient equals the direct one; sigmoid
scores with DeepSeek-V3's bias; the bias update; the config keys' validation."""

import math
import types
from dataclasses import replace

import pytest
import torch

import framework.models.moe_routing as moe_routing
from framework.config import ConfigError, MoEConfig, RunConfig
from framework.models.moe_routing import AuxLossScale, attach_aux_loss, expert_capacity, route, updated_bias
from framework.models.qwen3_moe import _router
from framework.validate.expert import check_moe as _moe

from .conftest import assert_config_error, compose

LN3 = math.log(3.0)


def _random(n: int, h: int, e: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, h, generator=g, dtype=dtype), torch.randn(n, h, generator=g, dtype=dtype)


def _by_logits(logits: torch.Tensor):
    """(weight, hidden) whose router logits are exactly `logits`: the identity map."""
    return torch.eye(logits.shape[1], dtype=logits.dtype), logits.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", [True, False])
def test_defaults_reproduce_qwen3_moe_router_bit_for_bit(dtype, norm):
    # Bitwise in fp32 too: the defaults run transformers' router ops (linear, softmax, top-k,
    # the normalisation) in its order, which is the claim; the choices then come from
    # bit-identical logits, so no tie can fall differently.
    weight, hidden = _random(48, 16, 8, dtype)
    cfg = MoEConfig(experts=8, top_k=2, norm_topk_prob=norm)
    ref_logits, ref_top, ref_index = _router(types.SimpleNamespace(hidden_dim=16, weight=weight, top_k=2,
                                                                  norm_topk_prob=norm), hidden)
    r = route(weight, hidden, cfg, seq_len=16)
    assert torch.equal(r.logits, ref_logits) and torch.equal(r.index, ref_index)
    assert r.weights.dtype == dtype and torch.equal(r.weights, ref_top)
    assert r.aux_loss is None and r.stats["dropped"].item() == 0
    assert r.stats["tokens_per_expert"].sum().item() == 48 * 2 and r.stats["tokens"].item() == 48


def _brute_force_keep(index, chosen, capacity: int, policy: str, later_first: bool = False,
                      seq_len: int = 0) -> torch.Tensor:
    """Each expert's assignments of each sequence of `seq_len` tokens (0: all one group) in
    priority order (score descending, then earlier flattened position; or position only), the
    first `capacity` kept: a plain loop. `later_first` flips the tie-break, to show that the
    example's ties decide something."""
    n, k = index.shape
    seq_len = seq_len or n
    keep = torch.zeros(n, k, dtype=torch.bool)
    for start in range(0, n, seq_len):
        for expert in range(int(index.max()) + 1):
            slots = [(t, j) for t in range(start, start + seq_len) for j in range(k) if index[t, j] == expert]
            if policy == "probs":
                slots.sort(key=lambda s: (-chosen[s[0], s[1]].item(), (s[0] * k + s[1]) * (-1 if later_first else 1)))
            for t, j in slots[:capacity]:
                keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_highest_scores_or_earliest_tokens(policy):
    # Logits on a grid of halves: many equal scores, so the tie-break is exercised too. Two
    # sequences of 20: the capacity is per sequence (tests/test_moe_capacity.py says why).
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-2, 3, (40, 4), generator=g).double() / 2
    weight, hidden = _by_logits(logits)
    base = MoEConfig(experts=4, top_k=2)
    free = route(weight, hidden, base, seq_len=20)
    inf = route(weight, hidden, replace(base, capacity_factor=math.inf), seq_len=20)
    assert torch.equal(inf.index, free.index) and torch.equal(inf.weights, free.weights)

    cfg = replace(base, capacity_factor=0.6, drop_policy=policy)
    capacity = expert_capacity(0.6, 20, 2, 4)
    assert capacity == math.ceil(0.6 * 20 * 2 / 4) == 6
    r = route(weight, hidden, cfg, seq_len=20)
    chosen = torch.softmax(logits, -1).gather(-1, free.index)
    keep = _brute_force_keep(free.index, chosen, capacity, policy, seq_len=20)
    if policy == "probs":
        assert not torch.equal(keep, _brute_force_keep(free.index, chosen, capacity, policy, True, seq_len=20))
    assert r.stats["margin"].item() == 0  # the grid's ties: top-k ties too, so the margin says "a tie decided"
    assert torch.equal(r.index != 4, keep)
    assert torch.equal(r.index, free.index.masked_fill(~keep, 4))
    assert torch.equal(r.weights, free.weights.masked_fill(~keep, 0))  # kept weights untouched, not renormalised
    assert int(r.stats["dropped"]) == int((~keep).sum()) > 0
    for half in (r.index[:20], r.index[20:]):
        assert torch.bincount(half[half != 4], minlength=4).max() <= capacity
    assert torch.equal(r.stats["tokens_per_expert"], free.stats["tokens_per_expert"])  # counted before dropping


def _hand_example(score: str, aux_losses: list, seq_len: int = 2):
    """N = 4 tokens, E = 2, k = 1, logits (ln 3, 0) for tokens 0, 1, 3 (expert 0 chosen) and
    (0, ln 3) for token 2 (expert 1). Normalised scores (p, 1 - p) and (1 - p, p): softmax
    p = 3/4; sigmoid (3/4, 1/2) / (5/4), p = 3/5."""
    logits = torch.tensor([[LN3, 0.0], [LN3, 0.0], [0.0, LN3], [LN3, 0.0]], dtype=torch.float64)
    weight, hidden = _by_logits(logits)
    cfg = MoEConfig(experts=2, top_k=1, score=score, aux_losses=aux_losses)
    return route(weight.requires_grad_(), hidden, cfg, seq_len=seq_len)


@pytest.mark.parametrize("score,p", [("softmax", 3 / 4), ("sigmoid", 3 / 5)])
def test_aux_seq_aux_and_z_losses_by_hand(score, p):
    """f = (3/4, 1/4), P = ((2p + 1)/4, (3 - 2p)/4): aux = 2 (3/4 P_0 + 1/4 P_1) = p/2 + 3/4
    (9/8 for softmax). Sequences of 2: (0, 1) f = (1, 0), P = (p, 1 - p): 2p; (2, 3)
    f = P = (1/2, 1/2): 1; seq_aux = p + 1/2. z = (ln 4)^2: logsumexp(ln 3, 0) for every token."""
    coeffs = {"aux": 0.1, "seq_aux": 0.2, "z": 0.3}
    r = _hand_example(score, [{"type": t, "coeff": c} for t, c in coeffs.items()])
    expect = {"aux": p / 2 + 3 / 4, "seq_aux": p + 1 / 2, "z": math.log(4.0) ** 2}
    for name, value in expect.items():
        assert r.stats[name].item() == pytest.approx(value, rel=1e-14, abs=0), name
    assert r.aux_loss.item() == pytest.approx(sum(coeffs[t] * v for t, v in expect.items()), rel=1e-14)
    assert r.aux_loss.requires_grad
    assert r.index.flatten().tolist() == [0, 0, 1, 0]
    assert r.stats["tokens_per_expert"].tolist() == [3.0, 1.0]
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert r.stats["entropy_sum"].item() == pytest.approx(4 * entropy, rel=1e-14)
    assert set(_hand_example(score, [{"type": "z", "coeff": 1.0}]).stats) == {
        "tokens_per_expert", "dropped", "entropy_sum", "tokens", "margin", "z"}


def test_shares_over_a_sequence_parallel_group_sum_to_the_whole_micro_batch(monkeypatch):
    """Two 'ranks' hold the two halves of each of 3 sequences of 8 (sequence parallelism). With
    the counts summed over the group (all_reduce faked in process), the ranks' aux losses and
    their router gradients sum to the whole micro-batch's, for aux, seq_aux and z."""
    b, t, h, e = 3, 8, 6, 4
    weight, hidden = _random(b * t, h, e, torch.float64, seed=2)
    cfg = MoEConfig(experts=e, top_k=2, aux_losses=[{"type": "aux", "coeff": 1.0}, {"type": "seq_aux", "coeff": 0.5},
                                                    {"type": "z", "coeff": 0.25}])
    halves = [hidden.view(b, t, h)[:, i * t // 2:(i + 1) * t // 2].reshape(-1, h) for i in range(2)]
    local = []
    monkeypatch.setattr(moe_routing.dist, "all_reduce", lambda x, group: local.append(x.clone()))
    for half in halves:
        route(weight, half, cfg, seq_len=t // 2, sp_group="sp")
    total = local[0] + local[1]
    monkeypatch.setattr(moe_routing.dist, "all_reduce", lambda x, group: x.copy_(total))

    full_w = weight.clone().requires_grad_()
    full = route(full_w, hidden, cfg, seq_len=t)
    full.aux_loss.backward()
    split_w = weight.clone().requires_grad_()
    shares = [route(split_w, half, cfg, seq_len=t // 2, sp_group="sp") for half in halves]
    (shares[0].aux_loss + shares[1].aux_loss).backward()
    for name in ("aux", "seq_aux", "z"):
        whole = shares[0].stats[name] + shares[1].stats[name]
        torch.testing.assert_close(whole, full.stats[name], rtol=1e-14, atol=0)
        assert (shares[0].stats[name] - full.stats[name]).abs() > 1e-3  # one share alone is not the loss
    torch.testing.assert_close(split_w.grad, full_w.grad, rtol=1e-13, atol=1e-15)


def test_injected_aux_gradient_equals_the_direct_gradient():
    weight, hidden = _random(32, 8, 4, torch.float64, seed=3)
    cfg = MoEConfig(experts=4, top_k=2, aux_losses=[{"type": "aux", "coeff": 0.01}, {"type": "z", "coeff": 0.001}])
    experts_out = torch.randn(32, 2, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def forward(w):
        r = route(w, hidden, cfg, seq_len=8)
        return (r.weights.unsqueeze(-1) * experts_out).sum(1), r.aux_loss  # (N, H)

    grads = []
    for attach in (True, False, None):
        w = weight.clone().requires_grad_()
        out, aux = forward(w)
        scale = AuxLossScale()
        if attach:
            y = attach_aux_loss(out, aux, scale)
            assert torch.equal(y, out)
            scale.value = 0.37  # set after forward, as the runner does before backward
            y.sum().backward()
        elif attach is False:
            (out.sum() + 0.37 * aux).backward()
        else:
            out.sum().backward()  # no aux loss: the reference must differ
        grads.append(w.grad)
    assert (grads[0] - grads[1]).abs().max() <= 1e-15
    assert (grads[0] - grads[2]).abs().max() > 1e-6


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_weights_are_unbiased_scores_of_the_biased_choice(norm):
    weight, hidden = _random(20, 8, 4, torch.float64, seed=5)
    cfg = MoEConfig(experts=4, top_k=2, score="sigmoid", norm_topk_prob=norm)
    scores = torch.sigmoid(hidden @ weight.T)

    def expected(index):
        w = scores.gather(-1, index)
        return w / w.sum(-1, keepdim=True) if norm else w

    # The choice is compared across two computations of the scores (route's and this one), so
    # the data keeps a margin from every tie (2nd against 3rd score: 2.4e-4 at least, 0.05 with
    # the bias below) that round-off (~1e-16 in fp64) cannot cross.
    for b in (0.0, torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)):
        top3 = (scores + b).topk(3, dim=-1).values
        assert (top3[:, 1] - top3[:, 2]).min() > 1e-9
    plain = route(weight, hidden, cfg, seq_len=20)
    assert torch.equal(plain.index, torch.topk(scores, 2, dim=-1).indices)
    torch.testing.assert_close(plain.weights, expected(plain.index), rtol=1e-15, atol=0)
    assert not (plain.index == 3).any(dim=-1).all()  # unbiased, some tokens choose no expert 3
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    biased = route(weight, hidden, cfg, seq_len=20, bias=bias)
    assert (biased.index == 3).any(dim=-1).all()  # the bias forces expert 3 into every token's choice
    assert not torch.equal(biased.index, plain.index)
    torch.testing.assert_close(biased.weights, expected(biased.index), rtol=1e-15, atol=0)
    assert (biased.weights < 1).all()  # no trace of the bias of 10 in the weights


def test_updated_bias_raises_under_loaded_experts():
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    new = updated_bias(bias, torch.tensor([10.0, 2.0, 5.0, 3.0]), rate=0.01)  # mean 5
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.11, -0.1, 0.01]), rtol=0, atol=1e-7)


BAD = [(dict(score="tanh"), "model.moe.score", "must be softmax or sigmoid"),
       (dict(drop_policy="random"), "model.moe.drop_policy", "must be probs or position"),
       (dict(capacity_factor=0.0), "model.moe.capacity_factor", "must be a number > 0"),
       (dict(capacity_factor=-1.0), "model.moe.capacity_factor", "must be a number > 0"),
       (dict(capacity_factor=math.nan), "model.moe.capacity_factor", "must be a number > 0"),
       (dict(capacity_factor=-math.inf), "model.moe.capacity_factor", "must be a number > 0"),
       (dict(aux_losses=[{"type": "balance", "coeff": 0.1}]), "model.moe.aux_losses[0]", "type one of aux"),
       (dict(aux_losses=[{"type": "aux"}]), "model.moe.aux_losses[0]", "needs keys type and coeff"),
       (dict(aux_losses=[{"type": "z", "coeff": 0.1}, {"type": "z", "coeff": 0.2}]), "model.moe.aux_losses[1]",
        "each type once"),
       (dict(aux_losses=[{"type": "aux", "coeff": -0.1}]), "model.moe.aux_losses[0].coeff", "finite number >= 0"),
       (dict(aux_losses=[{"type": "aux", "coeff": math.inf}]), "model.moe.aux_losses[0].coeff", "finite number"),
       (dict(bias_update_rate=-0.001), "model.moe.bias_update_rate", "finite number >= 0"),
       (dict(bias_update_rate=math.nan), "model.moe.bias_update_rate", "finite number >= 0")]


@pytest.mark.parametrize("fields,key,problem", BAD, ids=[f"{k}={list(f.values())[0]}" for f, k, _ in BAD])
def test_bad_routing_keys_are_rejected_naming_the_key(fields, key, problem):
    run = RunConfig()
    run.model.moe = replace(run.model.moe, **fields)
    with pytest.raises(ConfigError) as e:
        _moe(run)
    assert str(e.value).startswith(key + "=") and problem in str(e.value) and "Fix: " in str(e.value), str(e.value)


def test_routing_keys_compose_from_the_command_line():
    """Hydra parses inf and a list of dicts; they validate, and a bad one is named. `++` because
    conf/model/moe-*.yaml do not list the routing keys yet (a plain override needs them there)."""
    from framework.validate import validate

    run = compose("model=moe-tiny", "++model.moe.capacity_factor=inf", "++model.moe.score=sigmoid",
                  "++model.moe.aux_losses=[{type:aux,coeff:0.01},{type:z,coeff:1e-3}]",
                  "++model.moe.bias_update_rate=1e-3")
    validate(run)
    moe = run.model.moe
    assert moe.capacity_factor == math.inf and moe.score == "sigmoid" and moe.bias_update_rate == 1e-3
    assert moe.aux_losses == [{"type": "aux", "coeff": 0.01}, {"type": "z", "coeff": 1e-3}]
    assert type(moe.aux_losses[0]) is dict
    for good in (dict(), dict(capacity_factor=1.25, drop_policy="position")):
        run.model.moe = replace(moe, **good)
        _moe(run)
    assert_config_error(["model=moe-tiny", "++model.moe.score=tanh"], "model.moe.score='tanh'",
                        "unknown name. Fix: use one of softmax, sigmoid")  # the schema's rule, before _moe
