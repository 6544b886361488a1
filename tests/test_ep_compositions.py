"""Expert parallelism (parallelism.ep) composed with every flushing pipeline schedule not run
with ep in tests/test_expert_parallel.py (interleaved, interleaved-zb, zbv, dualpipev, zbh2,
zb-auto, gpipe, a schedule file), with ep + pp + ZeRO-1, and with tp and pp together (dp 2 x
tp 2 x pp 2, with and without sequence parallelism); ep with the asynchronous schedules (1f1b,
2bw) is rejected before launch (issue 29 item 5; docs/moe.md, docs/correctness.md).

Each layout reproduces one single process accumulating the same global batch of 16 sequences
in fp64 at rtol 1e-9 (conftest.FP64_TOL: per-step losses, gradient norms, every final
parameter, routers and experts included), with the three aux losses and DeepSeek-V3's bias
update on (the bias steers the choice from step 2 on, so it must match too). Micro-batches hold
2 sequences in every layout: the aux losses are per micro-batch, so the grouping of sequences
must not change. Four layers: pp 2 x 2 chunks puts one MoE layer in each virtual stage (two per
rank: the runtime's per-layer sums and bias updates are shared by a rank's chunks).
Each of these breakages, made by hand, fails the layouts it concerns: run_routed without the
1 / ep gradient scale; ZeRO sharding the experts over dp instead of edp; the bias update
skipping every other layer when dp > 1; with sequence parallelism, the tp all-reduce of the
replicated MoE block's gradients leaving the experts out (each tp rank routes its own
sequence shard)."""

import statistics

import pytest

from framework.metrics.breakdown import PARTS

from .conftest import assert_config_error, assert_same_training, final_params, read_metrics, run_local
from .test_expert_parallel import ROUTING
from .test_moe import MOE

FOUR_LAYERS = [*MOE, *ROUTING, "model.n_layer=4", "trainer.steps=3"]
EP_PP = ["parallelism=dp2_pp2", "parallelism.ep=2", "schedule.microbatches=4"]  # 4 ranks, edp = 1
LAYOUTS = {
    "interleaved": [*EP_PP, "schedule=interleaved", "schedule.virtual_stages=2"],
    "interleaved_zb": [*EP_PP, "schedule=interleaved-zb"],
    "zbv_nccl": [*EP_PP, "schedule=zbv", "debug.coalesced_p2p=true"],  # NCCL's one Work per p2p batch
    "dualpipev": [*EP_PP, "schedule=dualpipev"],
    # DualPipe's overlap: each steady-state pair's F on a second thread (its all-to-alls on a
    # second ep group) beside the B of the other chunk
    "dualpipev_overlap": [*EP_PP, "schedule=dualpipev", "parallelism.overlap_dualpipe=true"],
    "zero1_dp2": [*EP_PP, "schedule=flush", "parallelism.zero=1"],
    # 8 ranks: ep 2 of dp 4 leaves edp = 2 replicas of each expert, so ZeRO-1 shards the
    # experts' optimizer states over edp and the dense ones over dp, in two chunks per rank
    "zero1_dp4_zbv": ["parallelism=dp2_pp2", "parallelism.dp=4", "parallelism.ep=2", "parallelism.zero=1",
                      "schedule=zbv", "schedule.microbatches=2"],
    # one chunk per rank: the flushing schedules not run with ep before, and a schedule file
    "zbh2": [*EP_PP, "schedule=zbh2"],
    "zb_auto": [*EP_PP, "schedule=zb-auto"],
    "gpipe": [*EP_PP, "schedule=gpipe"],
    "csv_dualpipev": [*EP_PP, "schedule=csv"],  # dualpipev's dump: a V read from the file, B and I / W cells
    # 8 ranks: ep with tp and pp together (ep groups at one tp rank: experts split over tp inside)
    "tp2_pp2": ["parallelism=3d_2x2x2", "parallelism.ep=2", "schedule=flush", "schedule.microbatches=4"],
    "tp2_pp2_sp": ["parallelism=3d_2x2x2", "parallelism.ep=2", "parallelism.sequence_parallel=true",
                   "schedule=zbh1", "schedule.microbatches=4"],
}
ONE_CHUNK = {"zero1_dp2", "zbh2", "zb_auto", "gpipe", "tp2_pp2", "tp2_pp2_sp"}
SINGLE = ["parallelism=single", "schedule=flush", "schedule.microbatches=8"]


def _job(path, *layout):
    summary = run_local(path, *FOUR_LAYERS, *layout)
    return summary, read_metrics(path), final_params(path)


def _dump(name, tmp_path):
    from framework.schedules import build_schedule, dump_csv, get

    path = tmp_path / f"{name}.csv"
    v = get(name).preset_chunks
    dump_csv(build_schedule(name, 2, 4, v), get(name).stage_map(2, v), str(path))
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    return _job(tmp_path_factory.mktemp("ep_single"), f"data.cache_dir={data_cache}", *SINGLE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_composition_reproduces_the_single_process_in_fp64(single, layout, tmp_path, data_cache):
    layout_keys = LAYOUTS[layout]
    if layout.startswith("csv_"):  # the file the framework dumps, read back as schedule=csv
        layout_keys = [*layout_keys, f"schedule.csv={_dump(layout[4:], tmp_path)}"]
    summary, metrics, params = _job(tmp_path, f"data.cache_dir={data_cache}", *layout_keys)
    assert summary["global_batch"] == 16 and summary["virtual_stages"] == 2 - (layout in ONE_CHUNK)
    assert all(m["a2a_bytes"] > 0 for m in metrics)  # the experts were split over ep
    assert_same_training(metrics, params, *single[1:])
    # the MoE summary line: medians over the measured steps of what each row's counts give
    # (dropless: no assignment dropped; the worst layer's busiest expert over the mean load)
    measured = metrics[-summary["measured_steps"]:]
    assert summary["moe_dropped_fraction"] == 0 and all(m["moe_dropped_fraction"] == 0 for m in metrics)
    worst = [max(max(r["tokens_per_expert"]) * 4 / sum(r["tokens_per_expert"]) for r in m["moe_layers"].values())
             for m in measured]
    assert summary["moe_load_max_over_mean"] == pytest.approx(statistics.median(worst), rel=1e-12)
    assert 0 < summary["moe_a2a_share"] < 1
    if layout == "dualpipev_overlap":  # the pairs ran side by side: some all-to-all hidden, none lost
        assert all(m["comm_total_ep_s"] >= m["time_comm_ep_s"] > 0 for m in metrics)
        assert sum(m["comm_hidden_ep"] for m in metrics) > 0
        for m in metrics:  # each rank's parts, the pairs' serialised records among them, tile its step
            for parts, step_s in zip(m["rank_time_s"], m["rank_step_time_s"], strict=True):
                assert sum(parts[k] for k in PARTS) == pytest.approx(step_s, abs=1e-9)
                assert min(parts.values()) >= 0
    # the routing statistics are global (summed over dp, micro-batches and a rank's chunks)
    for mine, ref in zip(metrics, single[1], strict=True):
        assert set(mine["moe_layers"]) == set(ref["moe_layers"]) == {"0", "1", "2", "3"}
        for layer, row in ref["moe_layers"].items():
            assert mine["moe_layers"][layer]["tokens_per_expert"] == row["tokens_per_expert"]
            for key in ("aux", "seq_aux", "z", "router_entropy"):
                assert mine["moe_layers"][layer][key] == pytest.approx(row[key], rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.parametrize("extra", [[], ["model.moe.bias_update_rate=0", "model.tie_embeddings=false"]])
def test_ep_with_an_asynchronous_schedule_is_rejected_before_launch(schedule, extra):
    # 1f1b / 2bw update each stage alone at dp = 1 and ep is carved out of dp: no layout holds
    # both, so there is no update rule to prove (with or without the bias update and a tied embedding)
    assert_config_error([*FOUR_LAYERS, *EP_PP, f"schedule={schedule}", *extra], f"schedule.name='{schedule}'",
                        "asynchronous schedules update each stage alone with dp = 1, and ep > 1 needs dp > 1")
