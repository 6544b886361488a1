"""Mixture-of-Experts models (model.arch=qwen3_moe, docs/moe.md), first step of issue 22:
the split model equals transformers' own Qwen3-MoE on the same weights; FLOPs count active
parameters (a hand-worked count); dp, pp and ZeRO-3 train a MoE model exactly as the single
process (fp64, rtol 1e-9); what is not built yet is rejected before launch."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from framework.config import ModelConfig, MoEConfig
from framework.metrics.flops import active_expert_params, executed_flops_per_token, flops_per_token, matmul_params
from framework.models import build_model

from .conftest import FP64, TINY, assert_config_error, assert_same_training, run_layouts

SMALL = ModelConfig(arch="qwen3_moe", n_layer=2, n_embd=32, n_head=2, n_kv_head=1, max_positions=64,
                    tie_embeddings=False, moe=MoEConfig(experts=4, top_k=2, expert_inner=16))


def test_logits_equal_transformers_own_model_on_the_same_weights():
    """Ours (split, per-expert loop) against a Qwen3MoeForCausalLM built by transformers from
    the same config.json and loaded with our weights, with its eager experts and with whatever
    experts implementation it picks by default: equal within fp32 round-off."""
    ours = build_model(SMALL, vocab_size=64, seed=0)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = ours(ids)
    state = ours.hf_model.state_dict()
    for impl in ("eager", None):
        cfg = Qwen3MoeConfig(**{k: v for k, v in ours.hf_model.config.to_dict().items()
                                if k not in ("experts_implementation", "_experts_implementation")})
        if impl:
            cfg._experts_implementation = impl
        theirs = Qwen3MoeForCausalLM(cfg).eval()
        theirs.load_state_dict(state)
        ref = theirs(ids).logits
        # Not torch.equal: the same products summed by other kernels round differently (BLAS
        # picks its blocking and vector path by shape and CPU: bit-equal here, 1 ulp off on
        # AVX-512 CPUs). A logit is a few chained sums of <= 64 fp32 terms (attention, experts,
        # norms, head), each off by at most ~64 eps relative to the largest logit (3e-6 here);
        # a wrong expert moves them 2000x more (measured: zeroing expert 1's down_proj in layer
        # 0 moves them by 7e-3).
        tol = 64 * torch.finfo(torch.float32).eps * ref.abs().max().item()
        torch.testing.assert_close(logits, ref, rtol=0, atol=tol, msg=f"experts_implementation={impl}")


def test_flops_count_active_parameters_by_hand():
    """H = 32, 2 query heads and 1 key-value head of 16, E = 4 experts of width I = 16, top-2,
    2 layers, vocabulary 64 (untied). Per layer: q 32x32 + k 32x16 + v 32x16 + o 32x32 = 3072,
    q / k norms 16 + 16, two RMSNorms 2 x 32, router 4 x 32 = 128, experts 4 x (2*16*32 + 32*16)
    = 6144 of which a token uses 2 of 4: 3072. Active per layer 3072 + 32 + 64 + 128 + 3072 =
    6368; two layers 12736, final norm 32, LM head 64 x 32 = 2048 (the embedding table is a
    lookup): 14816. All parameters but the table: 14816 + 2 x 3072 = 20960."""
    model = build_model(SMALL, vocab_size=64, seed=0, on_meta=True).hf_model
    assert matmul_params(model) == 14816
    dense_count = sum(p.numel() for p in model.parameters()) - 64 * 32
    assert dense_count == 20960


def test_a_step_that_drops_assignments_counts_only_the_executed_expert_flops():
    """The same model as above: a token's routed experts are 2 of 4 per layer, 3072 parameters
    per layer, 6144 over both; a step whose capacity dropped a quarter of the assignments ran
    6 x 6144 / 4 = 9216 fewer FLOPs per token, and one that dropped none the full count."""
    model = build_model(SMALL, vocab_size=64, seed=0, on_meta=True).hf_model
    assert active_expert_params(model) == 6144
    fpt = flops_per_token(matmul_params(model), 2, 32, 16)
    assert executed_flops_per_token(fpt, 6.0 * 6144, 0.25) == fpt - 9216
    assert executed_flops_per_token(fpt, 6.0 * 6144, 0.0) == fpt


MOE = [*TINY, "model=moe-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1",
       "model.moe.expert_inner=16", "data=pycode", "data.max_files=20", "trainer.steps=3", "trainer.warmup_steps=1",
       "trainer.save_checkpoint=true", "optimizer.lr=3e-3", "schedule=flush", FP64]
LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "pp2": ["parallelism=pp2", "schedule.microbatches=4"],
           "zero3": ["parallelism=zero3", "schedule.microbatches=2"]}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, data_cache):
    return run_layouts(tmp_path_factory, "moe", LAYOUTS, *MOE, f"data.cache_dir={data_cache}")


@pytest.mark.parametrize("layout", ["dp2", "pp2", "zero3"])
def test_moe_layouts_reproduce_the_single_process_in_fp64(moe_runs, layout):
    assert_same_training(*moe_runs[layout], *moe_runs["single"])
    assert any(".mlp.experts.gate_up_proj" in k for k in moe_runs[layout][1])  # the experts trained and exported


def test_bad_moe_and_ep_keys_are_rejected_before_launch():
    assert_config_error(["model=moe-tiny", "model.moe.top_k=5"], "model.moe.top_k=5", "must be <= model.moe.experts (model.moe.experts=4)")
    assert_config_error(["model=llama-tiny", "parallelism=dp2", "parallelism.ep=2"], "parallelism.ep=2",
                        "has none")
    assert_config_error(["model=moe-tiny", "parallelism=dp4", "parallelism.ep=3"], "parallelism.ep=3",
                        "must divide parallelism.dp=4")
    assert_config_error(["model=moe-tiny", "parallelism=dp4", "parallelism.ep=4", "model.moe.experts=6"],
                        "parallelism.ep=4", "must divide model.moe.experts=6")
    assert_config_error(["model=moe-tiny", "parallelism=zero3", "parallelism.zero_impl=fsdp2", "parallelism.ep=2"],
                        "parallelism.zero_impl='fsdp2'", "expert dp")
    assert_config_error(["model=moe-tiny", "parallelism=pp2", "schedule=1f1b", "model.moe.bias_update_rate=0.01"],
                        "model.moe.bias_update_rate=0.01", "do not include the expert biases")


def test_the_mixtral_shaped_preset_plans(tmp_path):
    """moe-mixtral (Mixtral 8x7B's shape, 46.7B parameters) is for planning: its dry run
    counts every rank's parameters, the experts included, on the meta device."""
    import json

    from .conftest import run_cli

    r = run_cli([f"hydra.run.dir={tmp_path}", "model=moe-mixtral", "dry_run=true", "parallelism.pp=8",
                 "parallelism.dp=4", "parallelism.zero=1", "schedule=flush", "schedule.microbatches=8", "logger=none"])
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    total = sum(st["params"] for st in plan["stages"])
    assert abs(total - 46.7e9) < 0.2e9, total  # Mixtral 8x7B: 46.7B (with q / k norms: a few thousand more)
    assert len(plan["memory_estimate_per_rank"]) == 8
    # ep 4 of dp 4: each rank holds 2 of the 8 experts of its 4 layers. By hand: an expert is
    # 3 x 14336 x 4096 = 176,160,768 parameters, so 4 layers x 2 experts = 1,409,286,144
    r = run_cli([f"hydra.run.dir={tmp_path / 'ep'}", "model=moe-mixtral", "dry_run=true", "parallelism.pp=8",
                 "parallelism.dp=4", "parallelism.ep=4", "parallelism.zero=1", "schedule=flush",
                 "schedule.microbatches=8", "logger=none"])
    assert r.returncode == 0, r.stderr[-2000:]
    ep = json.loads((tmp_path / "ep" / "plan.json").read_text())
    assert all(st["expert_params"] == 1_409_286_144 for st in ep["stages"])
    assert all(m["expert_psi"] == 1_409_286_144 for m in ep["memory_estimate_per_rank"])
    assert [st["params"] + 3 * st["expert_params"] for st in ep["stages"]] == [st["params"] for st in plan["stages"]]
    assert ep["groups"]["ep"][0] == [0, 1, 2, 3] and ep["groups"]["edp"][0] == [0]
    # ZeRO-1 shards the dense optimizer states over dp 4, the experts' over expert dp 1 (none)
    m0, e0 = plan["memory_estimate_per_rank"][0], ep["memory_estimate_per_rank"][0]
    dense = e0["psi"] - e0["expert_psi"]
    assert e0["optimizer_bytes"] == 8 * (dense // 4 + e0["expert_psi"]) and m0["optimizer_bytes"] == 8 * (m0["psi"] // 4)


def test_expert_shards_come_from_the_same_values_and_pretrained_slices(tmp_path):
    """ep rank 1 of 2: its experts are rows [2, 4) of every fused expert tensor, both from the
    seeded init and read per slice from a transformers safetensors checkpoint (only those rows:
    the reader gets the slice, not the tensor); everything else whole."""
    from framework.models import build_hf_model
    from framework.models.materialise import PretrainedWeights
    from framework.comm.expert_parallel import EPComm

    whole = build_hf_model(SMALL, 64, seed=2)
    full = dict(whole.named_parameters())
    whole.save_pretrained(tmp_path)
    for pretrained in (None, str(tmp_path)):
        cfg = ModelConfig(**{**SMALL.__dict__, "pretrained": pretrained})
        model = build_model(cfg, 64, seed=2, ep_comm=EPComm(None, 2, 1))
        split = 0
        for n, p in model.hf_model.named_parameters():
            spec = getattr(p, "ep_shard", None)
            want = full[n][2:4] if spec is not None else full[n]
            assert torch.equal(p.detach(), want), (pretrained, n)
            split += spec is not None
        assert split == 2 * SMALL.n_layer  # gate_up_proj and down_proj of each layer
    meta = build_model(ModelConfig(**{**SMALL.__dict__, "pretrained": str(tmp_path)}), 64, 0,
                       ep_comm=EPComm(None, 2, 1), on_meta=True).hf_model
    p = meta.model.layers[1].mlp.experts.down_proj
    part = PretrainedWeights(str(tmp_path), "model").local("model.layers.1.mlp.experts.down_proj", p)
    assert part.shape == (2, 32, 16) and torch.equal(part, full["model.layers.1.mlp.experts.down_proj"][2:])


def test_grouped_gemm_equals_the_per_expert_loop(monkeypatch):
    """model.moe.experts_impl=grouped (torch._grouped_mm, fp32 here) against the loop on the
    same routing: outputs and every gradient, an empty expert included; fp64 is rejected
    (no kernel), as is a width grouped GEMM cannot align."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from framework.comm.expert_parallel import run_routed

    torch.manual_seed(0)
    loop = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4))
    for p in loop.parameters():
        torch.nn.init.normal_(p, std=0.2)
    grouped = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4))
    grouped.load_state_dict(loop.state_dict())
    grouped.grouped = True
    x = torch.randn(24, 32)
    index = torch.randint(0, 3, (24, 2))  # expert 3 gets nothing
    index[:, 1] = (index[:, 0] + 1) % 3
    weights = torch.rand(24, 2)
    outs = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        y, _ = run_routed(experts, xi, index, weights, None)
        y.sum().backward()  # an expanded gradient: what _grouped_mm's backward rejects unguarded
        outs.append((y, xi.grad, [p.grad for p in experts.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for a, b in zip(gp1, gp0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(a[3]) == 0  # the empty expert: a zero gradient, not None
    import dataclasses

    built = build_model(dataclasses.replace(SMALL, moe=dataclasses.replace(SMALL.moe, experts_impl="grouped")), 64, 0)
    assert all(b.mlp.experts.grouped for b in built.hf_model.model.layers)  # the key reaches the layers
    from framework.models import moe_layer
    from framework.models.moe_layer import grouped_gemm

    # the probe: this CPU has fp32 grouped GEMM kernels, not fp64 ones
    assert moe_layer._device_runs_grouped_mm("cpu", torch.float32)
    assert not moe_layer._device_runs_grouped_mm("cpu", torch.float64)
    monkeypatch.setattr(moe_layer, "_device_runs_grouped_mm", lambda device, dtype: True)  # as a GPU that has them

    def experts(dtype, inner=16):  # shapes only
        return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=inner, num_experts=4)).to(
            device="meta", dtype=dtype)
    # auto: grouped on CUDA in a dtype _grouped_mm takes with aligned rows; else the loop
    assert grouped_gemm("auto", experts(torch.bfloat16), "cuda") and grouped_gemm("auto", experts(torch.float32), "cuda")
    assert not grouped_gemm("auto", experts(torch.float32), "cpu")
    assert not grouped_gemm("auto", experts(torch.float64), "cuda")
    assert not grouped_gemm("auto", experts(torch.bfloat16, inner=12), "cuda")  # 24-byte rows
    assert grouped_gemm("grouped", experts(torch.float32), "cpu") and not grouped_gemm("loop", experts(torch.float32),
                                                                                        "cuda")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # grouped casts as F.linear does under autocast
        outs = [run_routed(e, x, index, weights, None)[0] for e in (loop, grouped)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)  # both ran their matmuls in bf16
    assert (run_routed(grouped, x, index, weights, None)[0] - outs[0]).abs().max() > 1e-3  # fp32 would differ
    assert_config_error(["model=moe-tiny", "model.moe.experts_impl=grouped", "trainer.precision=fp64"],
                        "model.moe.experts_impl='grouped'", "no fp64 kernel")
    assert_config_error(["model=moe-tiny", "model.moe.experts_impl=grouped", "model.moe.expert_inner=18"],
                        "model.moe.expert_inner=18", "16-byte-aligned")


def test_the_export_warns_what_transformers_config_cannot_hold():
    import dataclasses

    from framework.report.export import routing_not_exported
    from framework.models.moe_layer import MoERuntime

    assert routing_not_exported(None) is None
    assert routing_not_exported(MoERuntime(MoEConfig(capacity_factor=float("inf")), None)) is None
    note = routing_not_exported(MoERuntime(dataclasses.replace(MoEConfig(), score="sigmoid", capacity_factor=1.25,
                                                               bias_update_rate=0.01), None))
    assert "score=sigmoid" in note and "capacity_factor=1.25" in note and "expert biases" in note
