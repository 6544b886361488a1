"""Context parallelism reproduces the single process (fp64, rtol 1e-9: losses, gradient norms,
final parameters), for GPT-2 (learned positions), Llama (rotary, grouped-query attention) and
the Qwen3-MoE (dropless, every aux loss), alone and with each other dimension: dp, tp with
sequence parallelism, pp (flush, and Llama interleaved), ZeRO 3 over dp x cp (ours and FSDP2),
ep, head-tail and contiguous chunks, cp 2 and 4, K / V all-gathered, passed around the ring,
and heads <-> sequence all-to-all (Ulysses). Same global batch everywhere (8 sequences of 32
tokens); a cp rank holds 32 / cp of each sequence's tokens. Plus the cp metrics, the cost
model's cp traffic against the runs' bytes, a 128k-token plan, and what the rank layout and
the token cut are, checked without processes."""

import pytest
import torch

from framework.parallel.context_parallel import token_index
from framework.topology import Coords, ParallelDims

from .conftest import (FP64, TINY, assert_config_error, assert_same_training, final_params, modelled_activation_peak,
                       read_metrics, run_local)

MODELS = {"gpt2": ["model=gpt2-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=4"],
          "llama": ["model=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
                    "model.n_inner=64"],
          # dropless, every aux loss and the bias update: their counts span the cp ranks' pieces
          "moe": ["model=moe-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
                  "model.moe.expert_inner=32", "model.moe.bias_update_rate=0.01",
                  "model.moe.aux_losses=[{type:aux,coeff:0.01},{type:seq_aux,coeff:0.01},{type:z,coeff:0.001}]"]}
SP = "parallelism.sequence_parallel=true"
LAYOUTS = {
    "single": ["parallelism=single", "schedule.microbatches=4"],
    "cp2": ["parallelism=single", "parallelism.cp=2", "schedule.microbatches=4"],
    "cp4_contiguous": ["parallelism=single", "parallelism.cp=4", "parallelism.cp_balance=contiguous",
                       "schedule.microbatches=4"],
    "cp2_dp2_zero3": ["parallelism=dp2", "parallelism.cp=2", "parallelism.zero=3", "schedule.microbatches=2"],
    "cp2_dp2_fsdp2": ["parallelism=dp2", "parallelism.cp=2", "parallelism.zero=3", "parallelism.zero_impl=fsdp2",
                      "schedule.microbatches=2"],
    "cp2_tp2_sp": ["parallelism=tp2", "parallelism.cp=2", SP, "schedule.microbatches=4"],
    "cp2_pp2": ["parallelism=pp2", "parallelism.cp=2", "schedule=flush", "schedule.microbatches=4"],
    "cp2_pp2_interleaved": ["parallelism=pp2", "parallelism.cp=2", "schedule=interleaved",
                            "schedule.virtual_stages=2", "schedule.microbatches=4"],
    "cp4_ring": ["parallelism=single", "parallelism.cp=4", "parallelism.cp_comm=ring", "schedule.microbatches=4"],
    "cp2_ring_dp2_pp2": ["parallelism=dp2_pp2", "parallelism.cp=2", "parallelism.cp_comm=ring", "schedule=flush",
                         "schedule.microbatches=2"],
    "cp4_ring_contiguous": ["parallelism=single", "parallelism.cp=4", "parallelism.cp_comm=ring",
                            "parallelism.cp_balance=contiguous", "schedule.microbatches=4"],
    # parallelism.overlap_cp_ring: each pass's transfer issued before the previous block's product
    "cp4_ring_overlap": ["parallelism=single", "parallelism.cp=4", "parallelism.cp_comm=ring",
                         "parallelism.overlap_cp_ring=true", "schedule.microbatches=4"],
    "cp4_ring_contiguous_overlap": ["parallelism=single", "parallelism.cp=4", "parallelism.cp_comm=ring",
                                    "parallelism.cp_balance=contiguous", "parallelism.overlap_cp_ring=true",
                                    "schedule.microbatches=4"],
    "cp2_ring_tp2_sp": ["parallelism=tp2", "parallelism.cp=2", "parallelism.cp_comm=ring", SP,
                        "schedule.microbatches=4"],
    "cp2_ep2_tp2_sp": ["parallelism=tp2", "parallelism.cp=2", "parallelism.ep=2", SP, "schedule.microbatches=4"],
    "cp2_a2a": ["parallelism=single", "parallelism.cp=2", "parallelism.cp_comm=a2a", "schedule.microbatches=4"],
    "cp2_a2a_tp2_sp": ["parallelism=tp2", "parallelism.cp=2", "parallelism.cp_comm=a2a", SP,
                       "schedule.microbatches=4"],
}
CASES = [("gpt2", k) for k in ("cp2", "cp4_contiguous", "cp2_dp2_zero3", "cp2_tp2_sp", "cp2_pp2", "cp4_ring",
                               "cp2_ring_dp2_pp2", "cp2_a2a_tp2_sp", "cp2_dp2_fsdp2", "cp4_ring_overlap")] + [
    ("llama", k) for k in ("cp2", "cp2_tp2_sp", "cp2_pp2_interleaved", "cp2_ring_tp2_sp", "cp2_a2a",
                           "cp4_ring_contiguous", "cp4_ring_contiguous_overlap")] + [
    ("moe", "cp2"), ("moe", "cp2_ep2_tp2_sp")]


def _common(data_cache):
    return [*[a for a in TINY if not a.startswith("model.")], "data=pycode", "data.max_files=20",
            f"data.cache_dir={data_cache}", "trainer.steps=3", "trainer.warmup_steps=1",
            "trainer.save_checkpoint=true", "optimizer.lr=3e-3", FP64]


class _Runs(dict):
    """(model, layout) -> (summary, metrics rows, final parameters, job dir), each run on first
    use: a test run alone (-k) costs only the runs it reads."""

    def __init__(self, factory, data_cache: str):
        super().__init__()
        self.factory, self.data_cache = factory, data_cache

    def __missing__(self, key):
        model, layout = key
        job = self.factory.mktemp(f"{model}_{layout}")
        summary = run_local(job, *MODELS[model], *LAYOUTS[layout], *_common(self.data_cache))
        self[key] = (summary, read_metrics(job), final_params(job), job)
        return self[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    return _Runs(tmp_path_factory, data_cache)


@pytest.mark.parametrize("model,layout", CASES)
def test_cp_reproduces_the_single_process(runs, model, layout):
    summary, metrics, params, job = runs[model, layout]
    _, ref_metrics, ref_params, _ = runs[model, "single"]
    assert summary["world_size"] == {"cp2": 2, "cp2_a2a": 2, "cp2_ring_dp2_pp2": 8}.get(layout, 4)
    assert_same_training(metrics, params, ref_metrics, ref_params)
    # parallelism.overlap_cp_ring: the share of the passes' time the blocks' work hid (the
    # summary's median; observed ~0.2-0.3 on 2 CPU cores, each pass waited for at once
    # ~0.002); the synchronous ring hides none. Every step: the passes' whole time (comm_total_cp_s)
    # above the exposed waits (time_comm_cp_s) with the overlap, the same without it
    hidden = [m["comm_hidden_cp"] for m in metrics]
    times = [(m["comm_total_cp_s"], m["time_comm_cp_s"]) for m in metrics]
    if "ring" in layout and "overlap" in layout:
        assert summary["comm_hidden_cp"] > 0.08, hidden
        assert all(total > exposed > 0 for total, exposed in times), times
    elif "ring" in layout:
        assert summary["comm_hidden_cp"] == 0.0, hidden
        assert all(total == pytest.approx(exposed, rel=1e-9, abs=0) and exposed > 0 for total, exposed in times), times
    # the activation model (framework/sim/cost/activations.py): the cp core's saved tensors,
    # byte for byte, but for Llama under tp + SP (all-gather and ring alike 4,096 B high at one
    # layer, the same runs without SP exact: not worked out yet) and MoE (within 2 % without
    # ep; with ep the measured rank is the fullest, the model the expectation, and 16 tokens a
    # micro-batch per rank route unevenly: -15 % here)
    rel = 0.2 if "ep2" in layout else 0.02 if model == "moe" or (model == "llama" and "tp2_sp" in layout) else 0.0
    assert modelled_activation_peak(job) == pytest.approx(summary["activation_peak_bytes_max"], rel=rel, abs=0)


def test_cp_comm_bytes_count_the_key_value_gathers(runs):
    """Per layer and micro-batch: K and V all-gathered forward, dK and dV reduce-scattered
    backward, each (cp - 1) / cp of the gathered (B, heads, T, d) tensor (fp64: 8 bytes)."""
    layers, micro, batch, seq, hidden = 4, 4, 2, 32, 32
    expected = layers * micro * 4 * batch * seq * hidden * 8 // 2  # cp 2
    assert {m["cp_comm_bytes"] for m in runs["gpt2", "cp2"][1]} == {expected}
    assert {m["cp_comm_bytes"] for m in runs["gpt2", "single"][1]} == {0}
    assert runs["gpt2", "cp2"][0]["cp_comm_bytes"] == expected
    # the ring at cp 4: 3 passes of a rank's K and V (B, heads, T / 4, 2 d) forward, 3 of their
    # gradients backward: what the all-gather sends too, in 6 messages to neighbours
    ring = layers * micro * 6 * batch * (seq // 4) * 2 * hidden * 8
    assert ring == 3 * expected // 2 and {m["cp_comm_bytes"] for m in runs["gpt2", "cp4_ring"][1]} == {ring}
    # the overlap moves when a pass is waited for, not what it sends
    assert {m["cp_comm_bytes"] for m in runs["gpt2", "cp4_ring_overlap"][1]} == {ring}
    # a2a at tp 2: q, k, v to (all tokens, heads / cp) and the output back, forward, and their
    # conjugates backward: 8 all-to-alls of a (B, heads / tp, T / cp, d) tensor, half of it sent
    a2a = layers * micro * 8 * batch * (seq // 2) * (hidden // 2) * 8 // 2
    assert {m["cp_comm_bytes"] for m in runs["gpt2", "cp2_a2a_tp2_sp"][1]} == {a2a}


@pytest.mark.parametrize("model,layout", [("gpt2", "cp2"), ("gpt2", "cp4_ring"), ("gpt2", "cp2_a2a_tp2_sp"),
                                          ("llama", "cp2"), ("llama", "cp2_a2a")])
def test_the_cost_models_cp_traffic_is_what_the_run_sent(runs, model, layout):
    """traffic.py's cp collectives of a step, counted as the run counts them (each rank's
    (n - 1) / n of a gathered, scattered or all-to-all'd buffer; a ring pass whole), equal the
    run's cp_comm_bytes."""
    from framework.config import read_config
    from framework.sim.cost.collectives import FACTORS
    from framework.sim.cost.price import job_of
    from framework.sim.cost.traffic import step_collectives

    summary, _, _, job_dir = runs[model, layout]
    job = job_of(read_config(str(job_dir / "config.yaml")), summary["vocab_size"] if "vocab_size" in summary
                 else __import__("json").loads((job_dir / "run_info.json").read_text())["vocab_size"])
    calls = [c for c in step_collectives(job, 0) if c.dim == "cp"]
    modelled = sum(c.total * (1.0 if c.op == "ring" else FACTORS[c.op](c.n)) for c in calls)
    assert modelled == summary["cp_comm_bytes"] > 0


def test_cp_times_its_comm_and_each_ranks_attention(runs):
    """cp_comm_s and the attention compute per rank are measured in every step (their values
    are machine-dependent; experiments/long_context compares them); none at cp = 1."""
    for layout, ranks in (("cp2", 2), ("cp4_ring", 4), ("cp2_a2a_tp2_sp", 4)):
        summary, metrics = runs["gpt2", layout][:2]
        for m in metrics:
            assert m["cp_comm_s"] > 0 and len(m["rank_cp_attention_s"]) == ranks
            assert min(m["rank_cp_attention_s"]) > 0 and m["cp_attention_imbalance"] >= 1.0
        assert summary["cp_comm_s"] > 0 and summary["cp_attention_imbalance"] >= 1.0
    summary, metrics = runs["gpt2", "single"][:2]
    assert summary["cp_comm_s"] == 0 and summary["cp_attention_imbalance"] is None
    assert all("rank_cp_attention_s" not in m for m in metrics)


def _ring_hidden_share(monkeypatch, overlap: bool, transfer_s: float = 0.001) -> float:
    """One ring attention forward and backward at cp 2 on this process, each pass's transfer
    a Work as gloo's p2p gives it (no future; done `transfer_s` after its issue), the block
    products (milliseconds) outlasting it: `comm_hidden_cp` of the step's CommTimer."""
    import time
    from types import SimpleNamespace

    from framework.metrics.breakdown import PARTS, row
    from framework.comm.comm_timer import CommTimer
    from framework.parallel import ring_attention as ring
    from framework.parallel.context_parallel import ContextParallel
    from framework.comm.tp_comm import TPComm

    class Transfer:  # the "peer" sends back this rank's block: the timing is what is tested
        def __init__(self, sent, out):
            self.sent, self.out, self.due = sent, out, time.time() + transfer_s

        def wait(self, timeout=None):
            time.sleep(max(0.0, self.due - time.time()))
            self.out.copy_(self.sent)
            return True

        def get_future(self):
            raise RuntimeError("Work::getFuture not implemented.")

    def batch(ops):
        (_, sent, _, _), (_, out, _, _) = ops
        return [Transfer(sent, out)]

    monkeypatch.setattr(ring, "dist", SimpleNamespace(isend="isend", irecv="irecv", batch_isend_irecv=batch,
                                                      P2POp=lambda op, t, peer, group: (op, t, peer, group)))
    timer = CommTimer(torch.device("cpu"))
    cp = ContextParallel(TPComm(None, 2, 0, timer=timer, dim="cp"), 512, "headtail", torch.device("cpu"),
                         "ring", ranks=[0, 1], overlap=overlap)
    q, k, v = (torch.randn(1, 4, 256, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
    timer.begin_step()
    ring.ring_attention(cp, q, k, v, 0.1).sum().backward()
    exposed = sum(e - s for d, _, s, e in timer.take() if d == "cp")
    assert exposed > 0
    return row([dict.fromkeys(PARTS, 0.0) | {"comm_cp": exposed}], [timer.totals])["comm_hidden_cp"]


def test_the_ring_overlap_shows_the_transfer_time_its_products_hid(monkeypatch):
    """parallelism.overlap_cp_ring: each pass's transfer (a Work with no future, as gloo's
    p2p) runs under a block's product forward and backward; its completion is stamped by the
    CommTimer's watcher, so most of the cp time reads as hidden. Without the overlap, or with
    each pass waited for right after its issue, none is (the old code read 0 either way: the
    p2p Works' completion went unseen). The runs above check the same on real gloo Works."""
    assert _ring_hidden_share(monkeypatch, overlap=True) > 0.5
    assert _ring_hidden_share(monkeypatch, overlap=False) == 0.0


def test_the_ring_passes_its_blocks_on_the_cp_group(monkeypatch):
    """Each pass's isend and irecv name the cp group (its own communicator: under NCCL its
    own ordered stream, so a pass never queues behind a pipeline receive posted early on
    the default one), with the ring's neighbours at that step as peers."""
    from types import SimpleNamespace

    from framework.parallel import ring_attention as ring

    built = []

    def batch(ops):
        built.append(ops)
        return []

    monkeypatch.setattr(ring, "dist", SimpleNamespace(isend="isend", irecv="irecv", batch_isend_irecv=batch,
                                                      P2POp=lambda op, t, peer, group: (op, peer, group)))
    group = object()
    cp = SimpleNamespace(comm=SimpleNamespace(group=group, rank=1, size=4, bytes_sent=0, timer=None, dim="cp"),
                         ranks=[10, 11, 12, 13])
    for step in (1, 2):
        ring.start(cp, torch.zeros(3), step, overlapped=False)
    assert built == [[("isend", 12, group), ("irecv", 10, group)], [("isend", 13, group), ("irecv", 13, group)]]


def test_the_imbalance_is_the_worst_cp_groups_max_over_mean():
    from types import SimpleNamespace

    from framework.metrics.cp import step_metrics

    per_rank = [SimpleNamespace(cp_comm_bytes=b, cp_comm_s=c, cp_attention_s=a)
                for b, c, a in ((8, 0.1, 1.0), (8, 0.3, 3.0), (8, 0.2, 2.0), (4, 0.2, 2.0))]
    out = step_metrics(per_rank, [[0, 1], [2, 3]])
    assert out == {"cp_comm_bytes": 8, "cp_comm_s": 0.3, "cp_attention_imbalance": 1.5,
                   "rank_cp_attention_s": [1.0, 3.0, 2.0, 2.0]}
    assert step_metrics(per_rank, [[0], [1], [2], [3]])["cp_attention_imbalance"] is None


def test_the_dry_run_estimates_the_activation_peak_the_run_measured(runs, data_cache, tmp_path):
    """plan.json's per-rank activation estimate (launch/plan.py through the activation model,
    with the plan's own partition and schedule) for the cp 2 x pp 2 run: the measured peak."""
    import json

    summary = runs["gpt2", "cp2_pp2"][0]
    run_local(tmp_path, *MODELS["gpt2"], *LAYOUTS["cp2_pp2"], *_common(data_cache), "dry_run=true")
    plan = json.loads((tmp_path / "plan.json").read_text())
    estimate = [m["activation_bytes"] for m in plan["memory_estimate_per_rank"]]
    assert max(estimate) == summary["activation_peak_bytes_max"] and estimate[0] > estimate[1]
    assert plan["activation_estimate"].startswith("saved tensors at their peak")


def test_headtail_gives_every_rank_an_early_and_a_late_chunk():
    cut = [token_index(16, 4, r, "headtail").tolist() for r in range(4)]
    assert cut == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # causal attention work of rank r: sum over its queries of the keys at or before them
    work = [sum(q + 1 for q in c) for c in cut]
    assert len(set(work)) == 1
    contiguous = [token_index(16, 4, r, "contiguous").tolist() for r in range(4)]
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert sorted(sum(cut, [])) == list(range(16))


def test_cp_groups_sit_between_tp_and_dp():
    """Megatron's order tp-cp-dp-pp: a cp group is cp neighbouring tp blocks; the dp group,
    over which gradients are averaged, spans data x cp."""
    d = ParallelDims(pp=2, dp=4, tp=2, cp=2)  # dp 2 x cp 2 replicas
    assert d.world_size == 16 and d.data == 2
    assert d.groups("cp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert d.group_of("dp", 0) == [0, 2, 4, 6]
    c = d.coords(6)
    assert (c.pp, c.dp, c.tp, d.data_rank(c), d.cp_rank(c)) == (0, 3, 0, 1, 1)
    assert d.rank(Coords(pp=1, dp=1, tp=1)) == 11


@pytest.mark.parametrize("overrides, head, problem", [
    (["parallelism.cp=3"], "data.seq_len=128", "2 x cp = 6 chunks"),
    (["parallelism.cp=2", "parallelism=tp4", SP, "data.seq_len=12"], "data.seq_len=12", "splits a cp rank's 6"),
    (["parallelism.cp=2", "model=moe-tiny", "model.moe.capacity_factor=1.0"], "model.moe.capacity_factor=1.0",
     "a cp rank's pieces are not contiguous"),
    (["parallelism.cp=4", "parallelism.cp_comm=a2a", "model=llama-tiny", "model.n_head=4", "model.n_kv_head=2"],
     "model.n_kv_head=2", "a tp rank's 2 heads"),
    (["parallelism.cp=2", "parallelism=tp2", "parallelism.cp_comm=a2a", "model.n_head=2"], "model.n_head=2",
     "a tp rank's 1 heads"),
    (["parallelism.cp=2", "model.dropout=0.1"], "model.dropout=0.1", "same dropout masks"),
    (["parallelism.cp=2", "parallelism=pp2", "schedule=1f1b"], "parallelism.cp=2", "asynchronous"),
])
def test_what_cp_cannot_take_is_rejected_before_launch(overrides, head, problem):
    assert_config_error(["data=synthetic", *overrides], head, problem)


def test_a_128k_token_layout_is_planned_on_an_h100_cluster(capsys):
    """Llama 3 405B's long-context stage (its paper's Table 4: 131,072 tokens, tp 8, cp 16,
    pp 16, dp 8 on 16,384 H100s), priced from the command line's entry point: the cp ranks'
    token shares add up to the global batch, the attention's model FLOPs over the 16 cp ranks
    are the whole sequence's and so are its executed ones (causal work only: the all-gather's
    SDPA runs the causal share; the ring's explicit products its chunk pairs, the diagonal
    chunks whole: 1 + 1 / 32 of it); the all-gather is exposed, the ring's passes hide behind the
    blockwise products at this length with parallelism.overlap_cp_ring; only full
    recomputation fits 80 GB."""
    import json

    from framework.sim.cli import main
    from framework.sim.cost.ops import block_ops
    from framework.sim.cost.shapes import Layout, ModelShape

    from .test_cost_model import LLAMA_405B

    seq = 131072
    layout = [*[a for a in LLAMA_405B if not a.startswith(("data.seq_len", "model.max_positions"))],
              f"data.seq_len={seq}", f"model.max_positions={seq}", "hardware=h100-sxm", "hardware.gpus=16384",
              "parallelism.dp=8", "parallelism.cp=16", "parallelism.tp=8", "parallelism.pp=16",
              "parallelism.sequence_parallel=true", "parallelism.zero=1", "schedule=interleaved",
              "schedule.virtual_stages=2", "schedule.microbatches=16"]
    reps = {}
    for comm, recompute, extra in (("allgather", "full", []), ("ring", "full", []), ("allgather", "selective", []),
                                   ("ring", "overlap", ["trainer.recompute=full", "parallelism.overlap_cp_ring=true"])):
        args = [f"trainer.recompute={recompute}"] if recompute != "overlap" else extra
        assert main([*layout, f"parallelism.cp_comm={comm}", *args, "--json"]) == 0
        reps[comm, recompute] = json.loads(capsys.readouterr().out)
    full, ring, overlap = reps["allgather", "full"], reps["ring", "full"], reps["ring", "overlap"]
    assert full["gpus"] == 16384 and full["fits"] and not reps["allgather", "selective"]["fits"]
    assert full["tokens_per_s_per_gpu"] == pytest.approx(seq * 16 * 8 / full["step_s"] / 16384)
    # priced as the run would go: the ring's passes exposed without parallelism.overlap_cp_ring;
    # with it they hide behind their blockwise products at this length
    assert full["comm_s"]["cp"] > ring["comm_s"]["cp"] > overlap["comm_s"]["cp"] == 0
    # the ring's diagonal chunks multiplied whole (1/32 more attention) outweigh its smaller
    # exposed passes without the overlap; with it the ring is fastest
    assert overlap["step_s"] < full["step_s"] < ring["step_s"]
    shape = ModelShape(arch="llama", layers=1, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, tied=False)

    def attention(cp, model, comm="allgather"):
        ops = block_ops(shape, Layout(1, seq, tp=8, sp=True, cp=cp, cp_comm=comm))
        return sum(o.model_flops if model else o.flops for o in ops if o.kind == "attention")
    assert 16 * attention(16, True) == pytest.approx(attention(1, True))
    assert 16 * attention(16, False) == pytest.approx(attention(1, False))
    assert 16 * attention(16, False, "ring") == pytest.approx(33 / 32 * attention(1, False))


def test_a_cp_run_exports_the_single_processs_model(runs):
    """trainer.save_checkpoint's transformers export after a cp 2 x tp 2 + SP Llama run:
    from_pretrained loads it, its weights are the run's final ones bit for bit, and those are
    the single process's (fp64, rtol 1e-9): cp leaves no trace in the export."""
    from transformers import AutoModelForCausalLM

    job, ref = runs["llama", "cp2_tp2_sp"][3], runs["llama", "single"][2]
    state = AutoModelForCausalLM.from_pretrained(job / "final_model", dtype=torch.float64).state_dict()
    for name, tensor in final_params(job).items():
        assert torch.equal(state[name], tensor), name
        torch.testing.assert_close(tensor, ref[name], rtol=1e-9, atol=0)
