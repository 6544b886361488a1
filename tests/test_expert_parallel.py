"""Expert parallelism (parallelism.ep, framework/comm/expert_parallel.py) and MoE routing
in training (framework/models/moe_layer.py), docs/moe.md.

Every layout reproduces the single process in fp64 at rtol 1e-9 (losses, gradient norms,
every final parameter: routers and experts included) with the auxiliary losses (aux, seq_aux,
z) and DeepSeek-V3's bias update switched on, so both are invariant to ep, dp, tp (with and
without sequence parallelism), pp (flush and zbh1), ZeRO-1 / 3 and accumulation. Without ZeRO,
ep 2 of dp 4 (pp 1 and pp 2) holds each expert on two expert-dp replicas: made a no-op,
grads.py's reduce_expert_grads fails both. Every rank's measured activation peak is the cost
model's priced with the rows its experts received (ep 4). A capacity
factor of infinity is the dropless run bit for bit; a finite one drops the same tokens under ep
(on random tokens: pycode's runs of equal tokens tie up to round-off, tests/test_moe_capacity.py;
every compared run's routing margin is asserted). A
checkpoint saved under ep 2 resumes under ep 4 with ZeRO-1. A dispatch where an expert and a
whole ep rank receive nothing runs and matches the local computation."""

import json

import pytest
import torch

from .conftest import assert_same_training, final_params, modelled_activation_peak, read_metrics, run_local
from .distributed import run_ranks
from .test_checkpoint import _fail
from .test_moe import MOE
from .test_moe_capacity import MARGIN

ROUTING = ["model.n_kv_head=2", "trainer.steps=4",
           "model.moe.aux_losses=[{type:aux,coeff:0.01},{type:seq_aux,coeff:0.01},{type:z,coeff:0.001}]",
           "model.moe.bias_update_rate=0.01"]
LAYOUTS = {
    "single": ["parallelism=single", "schedule.microbatches=4"],
    "ep2": ["parallelism=dp2", "parallelism.ep=2", "schedule.microbatches=2"],
    "ep4_zero1": ["parallelism=zero1", "parallelism.dp=4", "parallelism.ep=4", "schedule.microbatches=1"],
    "ep2_dp4_zero3": ["parallelism=zero3", "parallelism.dp=4", "parallelism.ep=2", "schedule.microbatches=1"],
    # ZeRO 0 with edp = dp / ep = 2 replicas of each expert: reduce_expert_grads averages their
    # gradients (accumulation.py at pp 1, pipeline_runner.py at pp 2); with ep = dp it does nothing
    "ep2_dp4": ["parallelism=dp4", "parallelism.ep=2", "schedule.microbatches=1"],
    "ep2_dp4_pp2_flush": ["parallelism=dp2_pp2", "parallelism.dp=4", "parallelism.ep=2", "schedule.microbatches=1"],
    "ep2_pp2_zbh1": ["parallelism=dp2_pp2", "parallelism.ep=2", "schedule=zbh1", "schedule.microbatches=2"],
    "ep2_tp2": ["parallelism=dp2", "parallelism.tp=2", "parallelism.ep=2", "schedule.microbatches=2"],
    "ep2_tp2_sp": ["parallelism=dp2", "parallelism.tp=2", "parallelism.sequence_parallel=true", "parallelism.ep=2",
                   "schedule.microbatches=2"],
    "single_inf": ["parallelism=single", "schedule.microbatches=4", "model.moe.capacity_factor=inf"],
    "single_no_aux": ["parallelism=single", "schedule.microbatches=4", "model.moe.aux_losses=[]",
                      "model.moe.bias_update_rate=0"],
    # random tokens: pycode's sequences open with runs of one token (indentation), whose near-equal
    # states make capacity decisions that round-off decides (a margin of 0; docs/moe.md, Capacity)
    "single_cap": ["parallelism=single", "schedule.microbatches=4", "model.moe.capacity_factor=1.0", "data=synthetic"],
    "ep2_cap": ["parallelism=dp2", "parallelism.ep=2", "schedule.microbatches=2", "model.moe.capacity_factor=1.0",
                "data=synthetic"],
}
EQUIVALENT = ["ep2_dp4", "ep4_zero1", "ep2_dp4_zero3", "ep2_dp4_pp2_flush", "ep2_pp2_zbh1", "ep2_tp2", "ep2_tp2_sp"]


class _Runs(dict):
    """LAYOUTS' runs, each on first use: a test run alone costs only the runs it reads."""

    def __init__(self, factory, data_cache: str):
        super().__init__()
        self.factory, self.data_cache = factory, data_cache

    def __missing__(self, name: str):
        job, layout = self.factory.mktemp(f"ep_{name}"), LAYOUTS[name]
        base = [a for a in MOE if not (a.startswith("data=") and "data=synthetic" in layout)]
        run_local(job, *base, *ROUTING, f"data.cache_dir={self.data_cache}", *layout)
        self[name] = (read_metrics(job), final_params(job), job)
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    return _Runs(tmp_path_factory, data_cache)


@pytest.mark.parametrize("layout", EQUIVALENT)
def test_expert_parallel_layouts_reproduce_the_single_process_in_fp64(runs, layout):
    metrics, params, _ = runs[layout]
    assert all(m["moe_route_margin"] > MARGIN for m in (*metrics, *runs["single"][0]))  # no top-k near a tie
    assert_same_training(metrics, params, *runs["single"][:2])
    experts = [k for k in params if k.endswith("mlp.experts.gate_up_proj")]
    assert experts and all(params[k].shape[0] == 4 for k in experts)  # exported whole: all E experts
    # the routing statistics are global (summed over dp, tp shards and micro-batches): equal too
    for mine, ref in zip(metrics, runs["single"][0], strict=True):
        for layer, row in ref["moe_layers"].items():
            assert mine["moe_layers"][layer]["tokens_per_expert"] == row["tokens_per_expert"]
            for key in ("aux", "seq_aux", "z", "router_entropy"):
                assert mine["moe_layers"][layer][key] == pytest.approx(row[key], rel=1e-9)


def test_aux_losses_and_bias_train_but_the_logged_loss_is_the_lm_loss(runs):
    """Same weights at step 1, so the logged (LM) loss is equal with or without aux losses;
    after that the aux gradients and the biased choice make the runs differ."""
    with_aux, without = runs["single"][0], runs["single_no_aux"][0]
    assert with_aux[0]["loss"] == without[0]["loss"]
    assert with_aux[0]["moe_aux_loss"] > 0 and without[0]["moe_aux_loss"] == 0
    assert with_aux[-1]["loss"] != without[-1]["loss"]
    row = with_aux[0]["moe_layers"]["0"]
    # aux = E * sum f_e P_e >= 1 (equality iff balanced); z >= 0; entropy <= ln E
    assert row["aux"] >= 1.0 and row["z"] > 0 and 0 < row["router_entropy"] <= torch.log(torch.tensor(4.0))


def test_infinite_capacity_is_dropless_and_a_finite_one_drops_the_same_under_ep(runs):
    single, inf = runs["single"], runs["single_inf"]
    assert [m["loss"] for m in single[0]] == [m["loss"] for m in inf[0]]
    assert all(torch.equal(single[1][k], inf[1][k]) for k in single[1])
    cap, ep_cap = runs["single_cap"], runs["ep2_cap"]
    # Drops are discontinuous in the scores, which the layouts compute with other round-off: no
    # decision of either run may be that close to a tie (a flip once failed this test on AMD CPUs).
    assert all(m["moe_route_margin"] > MARGIN for m in (*cap[0], *ep_cap[0]))
    assert_same_training(ep_cap[0], ep_cap[1], cap[0], cap[1])
    dropped = [m["moe_dropped_fraction"] for m in cap[0]]
    assert all(d > 0 for d in dropped) and dropped == [m["moe_dropped_fraction"] for m in ep_cap[0]]
    assert all(m["moe_dropped_fraction"] == 0 for m in single[0])


def test_moe_metrics_are_in_every_row(runs):
    metrics = runs["ep2_dp4"][0]  # ep 2 of dp 4: each ep rank's experts on 2 expert-dp replicas
    for m in metrics:
        assert set(m["moe_layers"]) == {"0", "1"}
        for row in m["moe_layers"].values():
            load, received = row["tokens_per_expert"], row["tokens_received_per_ep_rank"]
            assert sum(load) == 8 * 32 * 2  # global batch tokens x top-2
            # dropless: ep rank r's experts 2r, 2r + 1 process every assignment made to them
            assert received == [load[0] + load[1], load[2] + load[3]]
            assert row["load_max_over_mean"] == pytest.approx(max(load) / (sum(load) / 4), rel=1e-12)
            assert row["ep_straggler"] == pytest.approx(max(received) / (sum(received) / 2), rel=1e-12)
            assert row["dead_experts"] == load.count(0) and row["dropped_fraction"] == 0
        assert m["a2a_bytes"] > 0 and m["a2a_s"] > 0
    assert "a2a_bytes" not in runs["single"][0][0]  # no all-to-all without ep
    # trace.json: every all-to-all call as its own slice: per layer and micro-batch the count
    # exchange, dispatch and combine, and the two backward ones; per rank they add up to a2a_s
    events = json.loads((runs["ep2_dp4"][2] / "trace.json").read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "a2a"]
    for m in metrics:
        per_rank = [[e for e in calls if e["args"]["step"] == m["step"] and e["tid"] == r] for r in range(4)]
        assert all(len(c) == 2 * 1 * 5 for c in per_rank)  # 2 layers x 1 micro-batch x 5 calls
        assert {e["name"] for e in per_rank[0]} == {"a2a counts", "a2a dispatch", "a2a combine",
                                                    "a2a dispatch (backward)", "a2a combine (backward)"}
        assert max(sum(e["dur"] for e in c) for c in per_rank) == pytest.approx(m["a2a_s"] * 1e6, rel=1e-6)


def test_the_activation_model_priced_with_each_rank_s_own_routing_is_exact(runs):
    """framework/sim/cost/activations.py under ep, given the rows each rank's experts received
    (ep 4 = dp 4, one micro-batch a step: each `tokens_received_per_ep_rank` number is one
    rank's in one forward), equals every rank's tracker peak (the max over steps) byte for
    byte. The model leaves out the aux losses' and the bias's saved tensors, bytes that depend
    on the micro-batch's shape only: the single process's measured excess, which is 0 without them."""
    from framework.config import read_config
    from framework.sim.cost.activations import chunk_bytes
    from framework.sim.cost.price import job_of

    def summary(job_dir):
        return json.loads((job_dir / "summary.json").read_text())

    no_aux, single, (metrics, _, job_dir) = runs["single_no_aux"][2], runs["single"][2], runs["ep4_zero1"]
    assert modelled_activation_peak(no_aux) == summary(no_aux)["activation_peak_bytes_max"]
    left_out = summary(single)["activation_peak_bytes_max"] - modelled_activation_peak(single)
    assert left_out > 0
    vocab = json.loads((job_dir / "run_info.json").read_text())["vocab_size"]
    job = job_of(read_config(str(job_dir / "config.yaml")), vocab)
    ranks = summary(job_dir)["ranks"]
    assert job.lay.ep == len(ranks) == 4 and job.pp == 1
    peaks = {}
    for r in ranks:  # tp = pp = 1, edp = 1: rank r is ep rank r
        received = [[row["tokens_received_per_ep_rank"][r["rank"]] for row in m["moe_layers"].values()]
                    for m in metrics]  # per step, per layer
        priced = [chunk_bytes(job.shape, job.lay, 2, True, True, step) for step in received]
        peaks[r["rank"]] = (max(priced) + left_out, r["activation_peak_bytes"])
    assert all(model == measured for model, measured in peaks.values()), peaks
    assert len({measured for _, measured in peaks.values()}) > 1  # the ranks' routing differed


def test_a_checkpoint_saved_under_ep2_resumes_under_ep4_with_zero1(tmp_path, runs, data_cache):
    args = [*MOE, *ROUTING, f"data.cache_dir={data_cache}", "trainer.checkpoint_interval=2"]
    _fail(tmp_path / "a", *args, *LAYOUTS["ep2"], "debug.fail_rank=1", "debug.fail_step=3")
    ckpt = tmp_path / "a" / "checkpoints" / "step_2"
    run_local(tmp_path / "b", *args, *LAYOUTS["ep4_zero1"], f"trainer.resume={ckpt}")
    metrics, params = read_metrics(tmp_path / "b"), final_params(tmp_path / "b")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert_same_training(metrics, params, *runs["single"][:2])
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["first_step"] == 3


def _empty_rank(rank, world):
    """ep = 2 over 2 ranks, 4 experts: every token of both ranks goes to experts 0 and 1 (rank
    0's), so experts 2 and 3 and all of rank 1 receive nothing; the output and every gradient
    equal the local computation of the same routing."""
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from framework.comm.expert_parallel import EPComm, run_routed, shard_experts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4)
    whole = Qwen3MoeExperts(cfg).double()
    for p in whole.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 6, 8, dtype=torch.float64)[rank].requires_grad_()
    index = torch.tensor([[0, 1]] * 6)
    weights = torch.rand(6, 2, dtype=torch.float64)
    comm = EPComm(dist.group.WORLD, world, rank)
    split = Qwen3MoeExperts(cfg).double()
    split.load_state_dict(whole.state_dict())
    shard_experts(split, comm)
    y, received = run_routed(split, x, index, weights, comm)
    y.sum().backward()
    xs_grad = x.grad.clone()
    x.grad = None
    y_local, _ = run_routed(whole, x, index, weights, None)
    y_local.sum().backward()
    grads = [p.grad for p in split.parameters()]  # ep = dp: no expert-dp replicas to average over
    return received, torch.allclose(y, y_local), torch.allclose(xs_grad, x.grad), \
        [g.clone() for g in grads], [p.grad.clone() for p in whole.parameters()], comm.rank


def test_an_expert_and_an_ep_rank_with_no_tokens_run_and_match():
    out = run_ranks(_empty_rank, 2)
    (rec0, y0, gx0, g0, whole0, _), (rec1, y1, gx1, g1, whole1, _) = out
    assert rec0 == 24 and rec1 == 0  # 2 ranks x 6 tokens x 2 slots, all to rank 0's experts
    assert y0 and y1 and gx0 and gx1
    # rank 0's experts: the mean over ranks of the local gradients; rank 1's: zero (unused)
    for got, a, b in zip(g0, whole0, whole1, strict=True):
        torch.testing.assert_close(got, (a[:2] + b[:2]) / 2, rtol=1e-12, atol=1e-12)
    assert all(torch.count_nonzero(g) == 0 for g in g1)


def test_a_training_step_where_one_ep_rank_receives_no_token(tmp_path, data_cache):
    """A pretrained checkpoint whose routers are all zero: every score ties, so top-2 sends
    every token of every rank to the same two experts (ties break alike on every rank), both on
    one ep rank. Step 1 then leaves the other ep rank and two experts per layer without a
    token; it runs, and trains as the single process does."""
    import dataclasses

    from framework.config import ModelConfig, MoEConfig
    from framework.models import build_hf_model

    cfg = ModelConfig(arch="qwen3_moe", n_layer=2, n_embd=32, n_head=2, n_kv_head=1, max_positions=64,
                      tie_embeddings=False, moe=MoEConfig(experts=4, top_k=2, expert_inner=16))
    model = build_hf_model(dataclasses.replace(cfg), 64, seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    model.save_pretrained(tmp_path / "ckpt")
    base = [a for a in MOE if not a.startswith("data")] + [
        "data=synthetic", "data.vocab_size=64", "data.seq_len=32", f"data.cache_dir={data_cache}",
        f"model.pretrained={tmp_path / 'ckpt'}", "trainer.steps=2"]
    out = {}
    for name in ("single", "ep2"):
        run_local(tmp_path / name, *base, *LAYOUTS[name])
        out[name] = (read_metrics(tmp_path / name), final_params(tmp_path / name))
    first = out["ep2"][0][0]["moe_layers"]
    for row in first.values():
        received = row["tokens_received_per_ep_rank"]
        assert sorted(received) == [0.0, 2 * 8 * 32] and row["dead_experts"] == 2
    assert_same_training(*out["ep2"], *out["single"])
