"""The cost model's parts against outside counts (framework/sim/cost/): the op lists'
FLOPs against metrics/flops.py's count of the real model's parameters, the shapes' parameter
counts against the built (meta) model, a measured GEMM table read back at its own points,
and the collectives' ring algebra on a hand-computed case. In process, no run."""

from __future__ import annotations

import pytest

from framework.config import ModelConfig, MoEConfig
from framework.metrics.flops import flops_per_token, matmul_params
from framework.models import meta_hf_model
from framework.sim.cost.collectives import collective_s, crosses_nodes, first_group, group_link
from framework.sim.cost.ops import block_ops, flops, stage_ops
from framework.sim.cost.price import Job, price
from framework.sim.cost.hardware import Link, Profile
from framework.sim.cost.shapes import Layout, ModelShape
from framework.topology import ParallelDims

from .conftest import assert_config_error, compose

VOCAB, SEQ, MB = 320, 32, 3
MODELS = {
    "gpt2": ModelConfig(arch="gpt2", n_layer=4, n_embd=48, n_head=4, max_positions=64),
    "gpt2-untied": ModelConfig(arch="gpt2", n_layer=4, n_embd=32, n_head=2, n_inner=80, tie_embeddings=False),
    "llama": ModelConfig(arch="llama", n_layer=4, n_embd=64, n_head=8, n_kv_head=2, n_inner=176, tie_embeddings=False),
    "moe": ModelConfig(arch="qwen3_moe", n_layer=4, n_embd=64, n_head=4, n_kv_head=2, tie_embeddings=False,
                       moe=MoEConfig(experts=8, top_k=2, expert_inner=40)),
}
# (tp, sequence parallel, pp, ep, recompute): the layouts a run of these models can take
LAYOUTS = [(1, False, 1, 1, False), (2, False, 1, 1, False), (2, True, 2, 1, False), (4, True, 4, 1, True),
           (1, False, 2, 2, False), (2, True, 1, 4, True)]


@pytest.fixture(scope="module")
def meta_models():
    return {name: meta_hf_model(m, VOCAB) for name, m in MODELS.items()}


@pytest.mark.parametrize("name", MODELS)
def test_shapes_count_the_built_models_parameters(name, meta_models):
    model, shape = meta_models[name], ModelShape.of(MODELS[name], VOCAB)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert shape.matmul_params() == matmul_params(model)
    assert shape.param_tensors() == len(list(model.parameters()))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}{'sp' if x[1] else ''}_pp{x[2]}_ep{x[3]}"
                         f"{'_ac' if x[4] else ''}")
@pytest.mark.parametrize("name", MODELS)
def test_op_lists_model_flops_equal_metrics_flops(name, layout, meta_models):
    """Summed over every rank of a model replica (tp ranks x pipeline stages), the op lists'
    model FLOPs of one micro-batch are metrics/flops.py's count, computed from the meta
    model's own parameters; recomputation adds executed FLOPs only: each block's forward
    again (the embedding and the head are not checkpointed)."""
    tp, sp, pp, ep, ac = layout
    m = MODELS[name]
    want = flops_per_token(matmul_params(meta_models[name]), m.n_layer, m.n_embd, SEQ) * MB * SEQ
    shape, lay = ModelShape.of(m, VOCAB), Layout(MB, SEQ, tp, sp, ep, ac)
    per_stage = m.n_layer // pp
    stages = [stage_ops(shape, lay, per_stage, i == 0, i == pp - 1) for i in range(pp)]
    assert sum(flops(ops) for ops in stages) * tp == pytest.approx(want, rel=1e-12)
    executed = sum(flops(ops, model=False) for ops in stages)
    plain = [stage_ops(shape, Layout(MB, SEQ, tp, sp, ep), per_stage, i == 0, i == pp - 1) for i in range(pp)]
    forward = flops(block_ops(shape, Layout(MB, SEQ, tp, sp, ep)), "F", model=False) * m.n_layer  # blocks only
    assert executed == pytest.approx(sum(flops(ops, model=False) for ops in plain) + (forward if ac else 0.0))


def test_dense_gemm_flops_split_two_four_between_forward_and_backward(meta_models):
    """Of a dense model's 6N per token, the forward's GEMMs execute 2N (minus what the norms,
    the lookups and the bias adds account for) and I and W as much each."""
    shape, lay = ModelShape.of(MODELS["llama"], VOCAB), Layout(MB, SEQ)
    ops = [o for o in stage_ops(shape, lay, 4, True, True) if o.kind == "gemm"]
    f, i, w = (flops([o for o in ops if o.phase == ph], model=False) for ph in "FIW")
    assert f == i == w
    gemm_params = shape.matmul_params() - (2 * 4 + 1) * shape.hidden  # llama: RMSNorm weights are no GEMM
    assert f == 2 * MB * SEQ * gemm_params


def table_profile(**extra) -> Profile:
    rows = [[m, n, k, 10.0 * (m * n * k) ** (1 / 3) / 4096] for m in (128, 1024, 4096) for n in (128, 1024, 4096)
            for k in (128, 1024, 4096) if m * n * k <= 1024 * 4096 * 4096]
    return Profile(name="t", peak_tflops={"bf16": 100.0}, memory_GBps=1000.0, kernel_us=5.0,
                   gemm_tflops={"bf16": rows}, **extra)


def test_a_measured_gemm_table_is_read_back_at_its_points_and_completed_upward():
    prof = table_profile()
    assert prof.gemm_rate(1024, 128, 4096, "bf16") / 1e12 == pytest.approx(10.0 * (1024 * 128 * 4096) ** (1 / 3) / 4096)
    # between grid points: between the neighbours' rates
    mid = prof.gemm_rate(2048, 1024, 1024, "bf16")
    assert prof.gemm_rate(1024, 1024, 1024, "bf16") < mid < prof.gemm_rate(4096, 1024, 1024, "bf16")
    # left out by the bench (too large): the best of its smaller neighbours, never above them
    top = prof.gemm_rate(4096, 4096, 4096, "bf16")
    assert top == pytest.approx(max(prof.gemm_rate(*p, "bf16") for p in
                                    ((1024, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024))))
    # beyond the grid: clamped; a tiny GEMM still lasts the kernel floor
    assert prof.gemm_rate(10 ** 6, 4096, 1024, "bf16") == pytest.approx(prof.gemm_rate(4096, 4096, 1024, "bf16"))
    from framework.sim.cost.ops import CostOp
    assert prof.op_seconds(CostOp("x", "gemm", "F", flops=2.0, shape=(1, 1, 1)), "bf16") == pytest.approx(5e-6)


def test_ring_collectives_on_a_hand_computed_case():
    """8 ranks, 1 GB, 100 GB/s, 10 us per step: a ring all-reduce moves 2 x 7/8 GB in 14
    steps (17.5 ms + 140 us); an all-gather 7/8 GB in 7 steps; one rank is free."""
    link = Link(alpha_us=10.0, GBps=100.0)
    assert collective_s("all_reduce", 1e9, 8, link) == pytest.approx(17.5e-3 + 140e-6)
    assert collective_s("all_gather", 1e9, 8, link) == pytest.approx(8.75e-3 + 70e-6)
    assert collective_s("reduce_scatter", 1e9, 8, link) == collective_s("all_gather", 1e9, 8, link)
    assert collective_s("all_reduce", 1e9, 1, link) == 0.0


def test_a_collective_measured_on_its_own_is_priced_from_its_own_curve():
    """gloo's reduce-scatter is an all-reduce of the whole buffer: a link whose bench measured
    it so prices a ZeRO reduce-scatter at its own curve (the whole buffer's bytes), twice the
    ring's bytes the all-reduce curve alone would give; 2 ranks, two rows, log-log between."""
    ar = {"ranks": 2, "rows": [[1e3, 1e-4], [1e6, 1e-2]]}
    plain = Link(alpha_us=10.0, GBps=1.0, all_reduce_s=ar)
    gloo = Link(alpha_us=10.0, GBps=1.0, all_reduce_s=ar, reduce_scatter_s=ar,
                all_gather_s={"ranks": 2, "rows": [[1e3, 3e-4], [1e6, 3e-2]]})
    # without its own curve: the all-reduce moving the same bus bytes (half the buffer at n = 2)
    assert collective_s("reduce_scatter", 1e6, 2, plain) == pytest.approx(collective_s("all_reduce", 5e5, 2, plain))
    assert collective_s("reduce_scatter", 1e6, 2, gloo) == pytest.approx(1e-2)
    assert collective_s("reduce_scatter", 1e4, 2, gloo) == pytest.approx(1e-4 * 10 ** (2 / 3))
    assert collective_s("all_gather", 1e6, 2, gloo) == pytest.approx(3e-2)
    assert collective_s("all_reduce", 1e6, 2, gloo) == pytest.approx(1e-2)  # its own curve, as before
    # a curve measured over another group size is not read
    assert collective_s("all_gather", 1e6, 4, gloo) == pytest.approx(collective_s("all_gather", 1e6, 4, plain))


def test_groups_are_placed_by_the_frameworks_rank_order():
    """tp innermost (topology.py): tp 8 stays in an 8-GPU node, dp and pp cross nodes."""
    prof = table_profile(gpus_per_node=8, links={"intra": {"alpha_us": 1, "GBps": 300}, "inter": {"alpha_us": 5, "GBps": 25}})
    dims = ParallelDims(pp=4, dp=2, tp=8)
    assert group_link(prof, dims, "tp").GBps == 300
    assert group_link(prof, dims, "dp").GBps == 25 and group_link(prof, dims, "pp").GBps == 25
    assert not crosses_nodes(dims.group_of("tp", 13), 8) and crosses_nodes(dims.group_of("dp", 13), 8)
    assert group_link(prof, ParallelDims(pp=1, dp=4, tp=2), "dp").GBps == 300  # 8 ranks: one node
    for d in (ParallelDims(pp=4, dp=8, tp=2, ep=4), ParallelDims(pp=2, dp=2, tp=4, ep=2)):  # topology's own groups
        assert all(first_group(d, dim) == d.group_of(dim, 0) for dim in ("tp", "dp", "pp", "ep"))


def test_a_layout_is_priced_with_its_pipeline_and_its_reductions():
    prof = table_profile(gpus_per_node=8, host_overlaps=True,
                         links={"intra": {"alpha_us": 1, "GBps": 300}, "inter": {"alpha_us": 5, "GBps": 25}})
    # a small vocabulary: the head's GEMM weighs little beside two blocks per stage
    shape = ModelShape.of(ModelConfig(arch="llama", n_layer=8, n_embd=1024, n_head=8, tie_embeddings=False), 512)
    lay = Layout(2, 1024, tp=2, sp=True)
    one = price(prof, Job(shape, lay, dp=1, pp=1, microbatches=8))
    piped = price(prof, Job(shape, lay, dp=1, pp=4, microbatches=8))
    assert one.bubble == 0 and one.comm_s["dp"] == 0
    # 1F1B at m = 8 on 4 equal stages: about (p-1) / (m+p-1) of each rank idles (stage 0 also embeds)
    assert 0.2 < piped.bubble < 0.35
    reduced = price(prof, Job(shape, lay, dp=4, pp=1, microbatches=8))
    assert reduced.comm_s["dp"] > 0 and reduced.step_s > one.step_s
    assert reduced.tokens_per_s_per_gpu < one.tokens_per_s_per_gpu


# --- the hardware group: conf/hardware/*.yaml, checked, and priced in the dry run ----------

@pytest.mark.parametrize("profile", ["a100-dgx", "h100-sxm", "h200"])
def test_each_hardware_profile_prices_a_run(profile):
    from framework.sim.cost.price import job_of

    run = compose(f"hardware={profile}", "model=gpt2", "data=synthetic", "data.vocab_size=50304", "data.seq_len=1024",
                  "trainer.micro_batch_size=8", "trainer.precision=bf16-mixed", "parallelism=single")
    prof = Profile.of(run.hardware)
    r = price(prof, job_of(run, 50304))
    # GPT-2 124M at 8 x 1024 tokens on one GPU of this class: a step of tens to hundreds of ms,
    # below the device's peak and the model's 6N + attention FLOPs over it
    assert 0.02 < r.step_s < 1.0 and 0.05 < r.mfu < 1.0
    assert r.tflops_per_gpu == pytest.approx(r.mfu * prof.peak_tflops["bf16"])


def test_bad_hardware_tables_are_told_by_key():
    from framework.config import ConfigError, HardwareConfig
    from framework.validate.hardware import check_tables

    good = dict(name="x", peak_tflops={"bf16": 100.0}, gemm_efficiency={"max": 0.8, "half_dim": 64},
                links={"intra": {"alpha_us": 1, "GBps": 100}, "inter": {"alpha_us": 5, "GBps": 10}})
    check_tables(HardwareConfig(**good))
    for change, key in [({"peak_tflops": {"bf17": 1.0}}, "hardware.peak_tflops.bf17"),
                        ({"peak_tflops": {}}, "hardware.peak_tflops"),
                        ({"gemm_tflops": {"bf16": [[1, 2, 3]]}}, "hardware.gemm_tflops.bf16"),
                        ({"gemm_efficiency": {"max": 1.5, "half_dim": 64}}, "hardware.gemm_efficiency"),
                        ({"gemm_efficiency": {}}, "hardware.gemm_efficiency"),
                        ({"attention_tflops": [[1024, 64, -1, 2]]}, "hardware.attention_tflops"),
                        ({"host_us": {"gpt2": {"F": 1}}}, "hardware.host_us.gpt2"),
                        ({"links": {"intra": {"alpha_us": 1, "GBps": 100}}}, "hardware.links.inter"),
                        ({"links": {**good["links"], "rack": {"alpha_us": 1, "GBps": 1}}}, "hardware.links"),
                        ({"links": {**good["links"], "intra": {"alpha_us": 1, "GBps": 100, "reduce_scatter_s":
                                                               {"ranks": 2, "rows": [[8, 1e-4]]}}}},
                         "hardware.links.intra.reduce_scatter_s"),
                        ({"links": {**good["links"], "inter": {"alpha_us": 1, "GBps": 100, "all_gather_s":
                                                               {"ranks": 1, "rows": [[8, 1e-4], [16, 2e-4]]}}}},
                         "hardware.links.inter.all_gather_s"),
                        ({"links": {**good["links"], "intra": {"alpha_us": 1, "GBps": 100, "p2p_s": {}}}},
                         "hardware.links.intra")]:
        with pytest.raises(ConfigError) as e:
            check_tables(HardwareConfig(**{**good, **change}))
        assert e.value.key == key and "\n" not in str(e.value), (change, str(e.value))


def test_a_profile_without_the_runs_dtype_or_gpus_for_its_layout_is_refused():
    assert_config_error(["hardware=h100-sxm", "trainer.precision=fp64", "parallelism=single"],
                        "hardware.peak_tflops={'fp8': 1979.0, 'bf16': 989.5, 'fp16': 989.5, 'fp32': 66.9}", "has no fp64 peak, the dtype of trainer.precision=fp64")
    assert_config_error(["hardware=h100-sxm", "hardware.gpus=2", "parallelism=dp4"],
                        "hardware.gpus=2", "is fewer than the layout's 4 ranks")


def test_the_dry_run_prices_the_layout_on_the_cluster(tmp_path, capsys):
    """dry_run=true hardware=...: the plan gains the cost model's step, MFU, bubble,
    communication per dimension and memory fit, with its assumptions, for a layout far larger
    than this machine (a Llama-3-70B shape on 512 GPUs), on the meta device."""
    import json

    from framework.launch.job import run_job
    from framework.validate import validate

    run = compose("model=llama-tiny", "model.n_layer=80", "model.n_embd=8192", "model.n_head=64", "model.n_kv_head=8",
                  "model.n_inner=28672", "model.max_positions=8192", "model.vocab_size=128256", "data=synthetic",
                  "data.seq_len=8192", "trainer.micro_batch_size=1", "trainer.precision=bf16-mixed", "logger=none",
                  "parallelism.dp=8", "parallelism.tp=8", "parallelism.pp=8", "parallelism.sequence_parallel=true",
                  "parallelism.zero=1", "schedule=interleaved", "schedule.microbatches=32", "dry_run=true",
                  "hardware=h100-sxm", "hardware.gpus=512")
    validate(run)
    run_job(run, str(tmp_path))
    out = capsys.readouterr().out
    cost = json.loads((tmp_path / "plan.json").read_text())["cost_model"]
    assert cost["hardware"] == "h100-sxm" and cost["gpus"] == 512 and cost["fits"]
    assert 0.1 < cost["mfu"] < 0.8 and 0 < cost["bubble"] < 0.3
    assert cost["comm_s"]["tp"] > 0 and cost["comm_s"]["dp"] > 0 and cost["comm_s"]["ep"] == 0
    assert "cost model on h100-sxm" in out and "assumed: no overlap of communication" in out


LLAMA_405B = ["model=llama-tiny", "model.name=llama3-405b", "model.n_layer=126", "model.n_embd=16384", "model.n_head=128",
              "model.n_kv_head=8", "model.n_inner=53248", "model.max_positions=8192", "model.vocab_size=128256",
              "data.seq_len=8192", "trainer.micro_batch_size=1", "trainer.precision=bf16-mixed", "logger=none"]


def test_a_cluster_is_planned_with_no_job(capsys):
    """python -m framework.simulate hardware=... (no job directory): a Llama-3-405B shape on
    16,384 H100s, the model read as shapes (never built). Its pipeline bubble is the
    interleaved schedule's at m = 16, v = 2, p = 16 ((p-1)/(v m + p - 1) = 0.319 at equal
    stages; priced 0.310, each rank's window starting at its own first action, since the
    pipeline's p2p runs on each pair of neighbours' own communicator: 0.372 on one stream
    for the whole pp group), and MFU lands
    where published Llama 3 training did (38-43 % on 16k H100s), give or take the
    unmodelled overlap."""
    import json

    from framework.sim.cli import main

    layout = ["hardware=h100-sxm", "hardware.gpus=16384", "parallelism.dp=128", "parallelism.tp=8", "parallelism.pp=16",
              "parallelism.sequence_parallel=true", "parallelism.zero=1", "schedule=interleaved",
              "schedule.virtual_stages=2", "schedule.microbatches=16"]
    assert main([*LLAMA_405B, *layout, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["gpus"] == 16384 and rep["layout"]["tp"] == 8
    assert abs(rep["bubble"] - 15 / 47) < 0.02 and 0.2 < rep["mfu"] < 0.5
    # 8,192 tokens a micro-batch, up to 2 p chunks in flight on the first rank: the saved
    # activations, not the ZeRO-1 states, put it out of memory; recomputation brings it back
    assert not rep["fits"] and rep["activation_peak_bytes_max"] > 5 * rep["model_state_bytes_max"]
    assert rep["memory_per_gpu_bytes"] == rep["model_state_bytes_max"] + rep["activation_peak_bytes_max"]
    assert main([*LLAMA_405B, *layout, "trainer.activation_checkpointing=true", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["fits"] and again["activation_peak_bytes_max"] < rep["activation_peak_bytes_max"] / 10
    assert again["recompute_transient_bytes"] > 0 and again["hfu"] > again["mfu"]
    assert rep["tokens_per_s_per_gpu"] == pytest.approx(8192 * 16 * 128 / rep["step_s"] / 16384)
    assert main([*LLAMA_405B, *layout[:-1], "schedule.microbatches=64"]) == 0  # more micro-batches: less bubble
    assert "bubble 0.1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["hardware=none", "model.vocab_size=100"], "hardware='none': prices nothing"),
    (["hardware=h100-sxm", "data=pycode"], "model.vocab_size=None: is needed to plan with no job"),
    (["hardware=h100-sxm", "hardware.gpus=4", "parallelism=dp4", "parallelism.dp=8", "model.vocab_size=100"],
     "hardware.gpus=4: is fewer than the layout's 8 ranks"),
    (["hardware=h999", "model.vocab_size=100"], "hardware='h999': no such option in conf/hardware/"),
])
def test_planning_errors_are_one_line(argv, words, capsys):
    from framework.sim.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and words in err and err.count("\n") == 1, err


# Narayanan et al. 2021, Table 1's parameter column (billions), and Llama 3's published sizes
PUBLISHED_PARAMS = {"gpt-1.7b": 1.7, "gpt-3.6b": 3.6, "gpt-7.5b": 7.5, "gpt-18b": 18.4, "gpt-39b": 39.1, "gpt-76b": 76.1,
                    "gpt-145b": 145.6, "gpt-310b": 310.1, "gpt-530b": 529.6, "gpt-1t": 1008.0, "gpt3-175b": 174.6}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_planning_presets_have_their_papers_parameter_counts(preset):
    """The planning presets, read as shapes, count the parameters the paper prints for them
    (its equation (2) differs from the model only by the final LayerNorm: 2h)."""
    run = compose(f"model={preset}")
    assert ModelShape.of(run.model, run.model.vocab_size).total_params() / 1e9 == pytest.approx(
        PUBLISHED_PARAMS[preset], abs=0.051)


@pytest.mark.parametrize("preset, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_llama3_presets_have_their_parameter_counts(preset, billions):
    """Llama 3's sizes as transformers builds them (8.03B, 70.55B, 405.85B): here from the
    shapes, checked against the meta-built model for the 8B (the larger build the same code)."""
    run = compose(f"model={preset}")
    shape = ModelShape.of(run.model, run.model.vocab_size)
    assert shape.total_params() / 1e9 == pytest.approx(billions, abs=0.01)
    if preset == "llama3-8b":
        assert shape.total_params() == sum(p.numel() for p in meta_hf_model(run.model, 128256).parameters())


def test_a_simulated_search_ranks_layouts_for_a_cluster(tmp_path):
    """search.mode=simulate hardware=...: every candidate priced by the cost model, none
    launched, ranked by tokens/s per GPU with the out-of-memory ones last (no speed, a reason), and drawn. Four
    layouts of GPT-3 175B on 64-GiB GPUs, bf16 with fp32 master weights and AdamW: without
    ZeRO, tp 8 x pp 2 holds 175B / 16 parameters x 16 bytes, about 163 GiB per GPU, and
    cannot fit; ZeRO 1 over dp 8 brings that to 2 + 2 + 12 / 8 bytes each, about 56 GiB. On
    top come the first rank's saved activations: 1F1B keeps p micro-batches of L / p layers
    there, the same L layers' worth at pp 2 and pp 8 (31.5 GiB at s 2048, tp 8 without SP),
    so only ZeRO 1 at pp 8 (14.5 GiB of states) fits."""
    import json

    from .conftest import run_cli

    r = run_cli(["-m", "model=gpt3-175b", "hardware=a100-dgx", "hardware.gpus=1024", "hardware.memory_gib=64",
                 "search.mode=simulate", "data=synthetic", "trainer.micro_batch_size=1", "logger=none",
                 "trainer.precision=bf16-mixed", "trainer.global_batch_size=512", "parallelism.tp=8",
                 "parallelism.pp=2,8", "parallelism.dp=8", "parallelism.zero=0,1", "data.seq_len=2048",
                 f"hydra.sweep.dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "simulated_search.json").read_text())
    assert len(rows) == 4 and not any(row["launched"] for row in rows)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing ran here
    fits = {(row["layout"]["pp"], row["layout"]["zero"]): row["fits"] for row in rows}
    assert fits == {(2, 0): False, (2, 1): False, (8, 0): False, (8, 1): True}
    acts = sorted(row["activation_peak_bytes_max"] for row in rows)  # + the embedding's ids: p of them
    assert acts[-1] == pytest.approx(acts[0], rel=1e-5) and 30 * 2 ** 30 < acts[0] < 33 * 2 ** 30
    assert [row["fits"] for row in rows] == [True, False, False, False]  # the one that fits ranks first
    # the others: no predicted speed (null, not 0.0) and why, closest to fitting first
    need = [row["memory_per_gpu_bytes"] for row in rows[1:]]
    assert need == sorted(need)
    for row in rows[1:]:
        assert row["predicted_tokens_per_s"] is None and row["predicted_tokens_per_s_per_gpu"] is None
        assert row["predicted_tokens_per_s_cluster"] is None and row["ranked_by"] is None
        assert row["reason"] == f"out of memory: {row['memory_per_gpu_bytes'] / 2 ** 30:.1f} GiB > 64.0 GiB per GPU"
        assert row["line"].split(": ", 1)[1].startswith(row["reason"] + "; priced as if it fit")
    best = rows[0]  # per GPU and the total of the layout's 512 GPUs, under names that say which
    assert best["reason"] is None and best["gpus"] == 512
    assert best["predicted_tokens_per_s_per_gpu"] == best["ranked_by"] == best["tokens_per_s_per_gpu"] > 0
    assert best["predicted_tokens_per_s_cluster"] == best["predicted_tokens_per_s"] == best["tokens_per_s_cluster"] \
        == pytest.approx(512 * best["tokens_per_s_per_gpu"])
    assert (tmp_path / "simulated_search.png").stat().st_size > 10_000
    # the sweep's report: its first line says what ranked the candidates; the columns say per GPU or in all
    from framework.report.compare import collect, headline, markdown

    report = collect(tmp_path)
    assert headline(tmp_path, report)[0] == ("search.mode=simulate: 4 candidates priced by the cost model on a100-dgx "
                                             "(1 fit in memory, 3 do not; none run: the cluster is not here)")
    assert "| predicted_rank | predicted_tokens_per_s_cluster | predicted_tokens_per_s_per_gpu |" in markdown(report)
    oom = [r for r in report if r["predicted_rank"] > 1]
    assert all(r["reason"].startswith("out of memory: ") and r["predicted_tokens_per_s_cluster"] is None for r in oom)



def test_overlap_grad_reduce_hides_what_the_cooldown_leaves_after_a_chunks_last_backward():
    """The dp all-reduce of a chunk starts after its last backward. Flush (one chunk per rank):
    rank 0's only chunk ends the pipeline, so nothing of its reduction hides and the step is
    unchanged. Interleaved (v 2): rank 0's chunk 1 finishes a stretch of cooldown before its
    chunk 0, so part of the reduction hides; exposed + hidden = the reduction without overlap."""
    prof = table_profile(gpus_per_node=8, host_overlaps=True,
                         links={"intra": {"alpha_us": 1, "GBps": 300}, "inter": {"alpha_us": 5, "GBps": 2}})
    shape = ModelShape.of(ModelConfig(arch="llama", n_layer=8, n_embd=1024, n_head=8, tie_embeddings=False), 512)
    lay = Layout(2, 1024)
    for schedule, v in (("flush", 1), ("interleaved", 2)):
        off = price(prof, Job(shape, lay, dp=2, pp=2, microbatches=8, schedule=schedule, virtual_stages=v))
        on = price(prof, Job(shape, lay, dp=2, pp=2, microbatches=8, schedule=schedule, virtual_stages=v,
                             overlap_grad_reduce=True))
        assert on.comm_s["dp"] + on.comm_hidden_s["dp"] == pytest.approx(off.comm_s["dp"])
        zero1 = [price(prof, Job(shape, lay, dp=2, pp=2, microbatches=8, schedule=schedule, virtual_stages=v, zero=1,
                                 overlap_grad_reduce=over)) for over in (False, True)]  # the units' reduce-scatters
        assert zero1[1].comm_s["dp"] + zero1[1].comm_hidden_s["dp"] == pytest.approx(zero1[0].comm_s["dp"])
        assert zero1[0].step_s - zero1[1].step_s == pytest.approx(zero1[1].comm_hidden_s["dp"])
        if schedule == "flush":
            assert on.step_s == pytest.approx(off.step_s) and on.comm_hidden_s["dp"] < 1e-6 * off.step_s
        else:
            assert on.step_s < off.step_s and 0 < on.comm_hidden_s["dp"] < off.comm_s["dp"]
            assert off.step_s - on.step_s == pytest.approx(on.comm_hidden_s["dp"])
            assert 0 < zero1[1].comm_hidden_s["dp"] < zero1[0].comm_s["dp"]


def test_zero_overlap_hides_reduce_scatters_under_the_backward_of_earlier_units():
    """Our ZeRO at pp 1 with overlap_grad_reduce: a unit's reduce-scatter is issued when its
    gradients complete, so all but the unit finished last can run under the rest of the
    backward. Whatever the link: exposed + hidden = the reduction without overlap, the step
    shrinks by exactly what is hidden, and what hides is at most the backward it runs under
    (ZeRO 1: the last micro-batch's; 2 and 3: every one's; ZeRO 3's gathers there use the
    same link) and at most all units but one."""
    shape = ModelShape.of(ModelConfig(arch="llama", n_layer=8, n_embd=1024, n_head=8, tie_embeddings=False), 512)
    lay, m, units = Layout(2, 1024), 4, 9  # 8 blocks and the embedding with the head
    for gbps in (0.01, 1000.0):  # a link much slower than the backward, and one much faster
        prof = table_profile(gpus_per_node=1, host_overlaps=True,
                             links={"intra": {"alpha_us": 1, "GBps": 300}, "inter": {"alpha_us": 5, "GBps": gbps}})
        for zero in (1, 2, 3):
            off = price(prof, Job(shape, lay, dp=2, microbatches=m, zero=zero))
            on = price(prof, Job(shape, lay, dp=2, microbatches=m, zero=zero, overlap_grad_reduce=True))
            hidden = on.comm_hidden_s["dp"]
            assert on.comm_s["dp"] + hidden == pytest.approx(off.comm_s["dp"])
            assert off.step_s - on.step_s == pytest.approx(hidden) and hidden > 0
            # the link's free time in the backward: its compute (ZeRO 3's gathers take the rest)
            compute_b = price(prof, Job(shape, lay, dp=2, microbatches=m, zero=2)).stage_s[(0, 0, "B")]
            backward = compute_b * (1 if zero == 1 else m)
            assert hidden <= backward * (1 + 1e-9)
            if gbps < 1:  # the link is the bottleneck: the whole backward hides transfer
                assert hidden == pytest.approx(backward)
            else:  # the backward is: all units' reduce-scatters but one hide (off: the gathers too)
                assert hidden <= off.comm_s["dp"] * (units - 1) / units * (1 + 1e-9)
    # the run's keys reach the job: ZeRO 3's prefetch and the ring's forward-only overlap
    from framework.sim.cost.price import job_of

    run = compose("parallelism=zero3", "parallelism.overlap_param_gather=true", "parallelism.cp=2",
                  "parallelism.cp_comm=ring", "parallelism.overlap_cp_ring=true", "data.seq_len=64")
    job = job_of(run, 256)
    assert job.zero3_prefetch and job.cp_ring_overlap
    assert not job_of(compose("parallelism=zero3", "parallelism.cp=2", "parallelism.cp_comm=ring"), 256).cp_ring_overlap


def test_zero_overlap_on_a_hand_computed_case():
    """The test above checks price.py's sums against each other; here its numbers, worked by
    hand. Llama, h = 1024, 8 blocks, vocabulary 512, untied: a block holds 4h^2 (attention)
    + 3 h 4h (MLP) + 2h (norms) = 16 779 264 parameters, the embedding with the head and the
    final norm 2 x 512h + h = 1 049 600: 9 ZeRO units, P = 135 283 712. dp 2 across nodes
    (5 us, 1000 GB/s): a ring reduce-scatter of n = 2 moves half its bytes in one step, so a
    unit's fp32 gradients take 2u ps + 5 us: 270.567424 + 45 = 315.567424 us for all nine;
    the bf16 gather of the updated parameters u ps + 5 us each, 180.283712 us. A 35 us unit
    beside a 0.25 s backward: all units but the last hide, 8/9 of the reduce-scatters.
    ZeRO 1 reduces once per step; ZeRO 2 in each of the m = 4 micro-batches."""
    shape = ModelShape.of(ModelConfig(arch="llama", n_layer=8, n_embd=1024, n_head=8, tie_embeddings=False), 512)
    prof = table_profile(gpus_per_node=1, host_overlaps=True,
                         links={"intra": {"alpha_us": 1, "GBps": 300}, "inter": {"alpha_us": 5, "GBps": 1000.0}})
    assert shape.total_params() == 8 * 16_779_264 + 1_049_600
    reduce, gather = 315.567424e-6, 180.283712e-6
    for zero, times in ((1, 1), (2, 4)):
        off, on = (price(prof, Job(shape, Layout(2, 1024), dp=2, microbatches=4, zero=zero, overlap_grad_reduce=o))
                   for o in (False, True))
        assert on.stage_s[(0, 0, "B")] > 9 * reduce  # the regime above: the backward outlasts the units
        assert off.comm_s["dp"] == pytest.approx(times * reduce + gather, rel=1e-9)
        assert on.comm_hidden_s["dp"] == pytest.approx(8 / 9 * times * reduce, rel=1e-9)
        assert on.comm_s["dp"] == pytest.approx(times * reduce / 9 + gather, rel=1e-9)


def test_the_rings_passes_hide_only_where_the_run_overlaps_them():
    """cp ring at a slow link: each pass hides its block's attention where overlapped
    (overlap_cp_ring; Megatron's always), so the step without the overlap is longer by what
    the passes hid, and the exposed cp time shrinks by as much."""
    prof = table_profile(gpus_per_node=8, host_overlaps=True,
                         links={"intra": {"alpha_us": 5, "GBps": 1}, "inter": {"alpha_us": 5, "GBps": 1}})
    shape = ModelShape.of(ModelConfig(arch="llama", n_layer=4, n_embd=1024, n_head=8, tie_embeddings=False), 512)
    lay = Layout(1, 8192, cp=4, cp_comm="ring")
    off, on = (price(prof, Job(shape, lay, dp=4, microbatches=2, cp_ring_overlap=mode)) for mode in (False, True))
    assert off.step_s > on.step_s and off.comm_s["cp"] > on.comm_s["cp"]
    assert off.step_s - on.step_s == pytest.approx(off.comm_s["cp"] - on.comm_s["cp"])


def test_dualpipe_pairs_hide_each_all_to_all_under_the_other_ops_compute():
    """Job.dualpipe_overlap (a run's parallelism.overlap_dualpipe): in each dualpipev pair an
    op's all-to-alls are exposed only past the other op's compute (sim/cost/pairs.py). A
    hand case: F of chunk 0 (3.0 s, 1.0 of it all-to-all) beside B of chunk 1 (5.0, 2.5):
    F = 2.0 + max(0, 1.0 - 2.5) = 2.0, B = 2.5 + max(0, 2.5 - 2.0) = 3.0 (1.0 + 2.0 hidden).
    Priced: MoE at ep 2 x dp 2 x pp 2 on a slow link; the ramps keep their whole times, the
    exposed ep time shrinks by what the pairs hid, and the step gets shorter."""
    from framework.sim.cost.pairs import paired_costs
    from framework.sim.cost.price import job_of

    compute = {(0, 0, "F"): 3.0, (0, 1, "B"): 5.0, (0, 1, "F"): 2.0, (0, 0, "B"): 4.0}
    a2a = {(0, 0, "F"): 1.0, (0, 1, "B"): 2.5, (0, 1, "F"): 0.5, (0, 0, "B"): 0.5}
    got = paired_costs(compute, a2a, 1)
    assert (got[(0, 0, "F")], got[(0, 1, "B")]) == (2.0, 3.0)
    assert (got[(0, 1, "F")], got[(0, 0, "B")]) == (1.5, 3.5)  # nothing exposed: 0.5 < 3.5 and 0.5 < 1.5
    prof = table_profile(gpus_per_node=8, host_overlaps=True,
                         links={"intra": {"alpha_us": 5, "GBps": 2}, "inter": {"alpha_us": 5, "GBps": 2}})
    shape = ModelShape.of(ModelConfig(arch="qwen3_moe", n_layer=8, n_embd=512, n_head=8, n_kv_head=2,
                                      tie_embeddings=False, moe=MoEConfig(experts=8, top_k=2, expert_inner=512)), 512)
    off, on = (price(prof, Job(shape, Layout(2, 1024, ep=2), dp=2, pp=2, microbatches=8, schedule="dualpipev",
                               virtual_stages=2, dualpipe_overlap=mode)) for mode in (False, True))
    hidden = on.comm_hidden_s["ep"]
    assert hidden > 0 and "ep" not in off.comm_hidden_s and on.stage_s == off.stage_s
    assert off.comm_s["ep"] - on.comm_s["ep"] == pytest.approx(hidden)
    assert 0 < off.step_s - on.step_s <= 2 * hidden  # at most each rank's hidden part leaves the pipeline
    run = compose("model=moe-tiny", "parallelism=dp2_pp2", "parallelism.ep=2", "schedule=dualpipev",
                  "schedule.microbatches=4", "parallelism.overlap_dualpipe=true")
    assert job_of(run, 256).dualpipe_overlap
