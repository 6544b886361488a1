"""Exact memory accounting, the activation tracker, FLOPs, bubble and the lr schedule."""

import math

import pytest
import torch
from torch import nn

from framework.config import ModelConfig
from framework.metrics.bubble import analytic_bubble
from framework.metrics.flops import flops_per_token, matmul_params, mfu, probe_peak_flops
from framework.metrics.memory import ActivationTracker, model_state_bytes
from framework.models import build_hf_model, build_model
from framework.optim.build import build_optimizer, lr_at
from framework.metrics.model_states import optimizer_state_ratio

from .conftest import compose


def _gpt2():
    return build_model(ModelConfig(arch="gpt2", n_layer=2, n_embd=32, n_head=2, max_positions=16), 50, seed=0)


def test_model_state_bytes_are_exact_for_adamw():
    model = _gpt2()
    opt = build_optimizer({"_target_": "torch.optim.AdamW", "lr": 1e-3}, model.parameters())
    tensors = list(model.parameters())  # tied lm_head listed once
    P = sum(p.numel() for p in tensors) * 4
    model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))).backward()
    opt.step()
    got = model_state_bytes(model, opt)
    # exp_avg + exp_avg_sq per parameter, plus AdamW's fp32 scalar `step` per tensor
    assert got == {"params_bytes": P, "grads_bytes": P, "optimizer_bytes": 2 * P + 4 * len(tensors)}


def test_model_state_bytes_dedupe_views_of_one_storage():
    big = nn.Parameter(torch.zeros(100))
    m = nn.Module()
    m.a = big
    m.b = big  # the same tensor registered twice
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert model_state_bytes(m, opt) == {"params_bytes": 400, "grads_bytes": 0, "optimizer_bytes": 0}


def test_activation_tracker_excludes_weights_and_sums_live_microbatches():
    lin = nn.Linear(64, 64, bias=False)
    tracker = ActivationTracker(lin)
    x = [torch.randn(8, 64, requires_grad=True) for _ in range(3)]
    outs = []
    for j in range(2):  # two micro-batches in flight, as a pipeline warm-up holds them
        with tracker.forward(j):
            outs.append(lin(x[j]).sum())
    assert tracker.peak_bytes == 2 * 8 * 64 * 4  # each saves its input, never the weight
    for j, o in enumerate(outs):
        o.backward()
        tracker.backward_done(j)
    assert tracker.live_bytes() == 0
    with tracker.forward(2):
        lin(x[2]).sum().backward()
    assert tracker.peak_bytes == 2 * 8 * 64 * 4  # the peak is kept


def test_activation_tracker_set_params_replaces_and_include_again_forgets():
    """Weight keys are addresses, so the tracker must only remember live weights: set_params
    replaces the parameters (taken once they are final), exclude / include_again add and
    drop the weights that come and go, and a dropped key is gone from both."""
    lin = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    act, weight = 8 * 64 * 4, 64 * 64 * 4

    def saved(tracker):
        with tracker.forward(0):
            lin(x).sum()
        got = tracker.live_bytes()
        tracker.backward_done(0)
        return got

    tracker = ActivationTracker()  # no parameters yet: the saved weight counts
    assert saved(tracker) == act + weight
    tracker.set_params(lin.parameters())
    assert saved(tracker) == act
    tracker.set_params([])  # replaced, not added to
    assert saved(tracker) == act + weight
    tracker.exclude([lin.weight])
    tracker.set_params([])  # exclude's weights outlive set_params
    assert saved(tracker) == act
    tracker.include_again([lin.weight])
    assert saved(tracker) == act + weight
    tracker.set_params(lin.parameters())
    tracker.include_again([lin.weight])  # about to be freed: forgotten even as a parameter
    assert saved(tracker) == act + weight
    freed = nn.Parameter(torch.zeros(16))
    freed.data = torch.empty(0)  # as a pipeline stage drops a parameter it does not own
    tracker.set_params([freed])
    assert saved(tracker) == act + weight and not tracker._param_keys  # no address kept for it


def test_activation_tracker_sees_less_with_checkpointing():
    peaks = []
    for ckpt in (False, True):
        model = build_model(ModelConfig(arch="gpt2", n_layer=4, n_embd=32, n_head=2, max_positions=32), 50, 0,
                            checkpoint_blocks=ckpt)
        tracker = ActivationTracker(model)
        with tracker.forward(0):
            loss = model(torch.randint(0, 50, (4, 32)), torch.randint(0, 50, (4, 32)))
        loss.backward()
        peaks.append(tracker.peak_bytes)
    assert 0 < peaks[1] < peaks[0] / 2


def test_flops_per_token_follows_6n_plus_12lhs():
    model = _gpt2()  # tied: wte is the LM head's weight, counted once; wpe is a lookup
    n = sum(p.numel() for p in model.parameters()) - model.embedding.wpe.weight.numel()
    assert matmul_params(model) == n
    assert flops_per_token(n, 2, 32, 16) == 6 * n + 12 * 2 * 32 * 16


def test_gpt2_124m_flops_per_token_match_nanogpt():
    # conf/model/gpt2.yaml with the GPT-2 tokenizer: nanoGPT's estimate_mfu, 6N + 12·L·H·Q·T.
    model = build_hf_model(ModelConfig(arch="gpt2", n_layer=12, n_embd=768, n_head=12, max_positions=1024),
                           50257, seed=0, device="meta")
    assert flops_per_token(matmul_params(model), 12, 768, 1024) == 855_166_464


def test_llama_flops_per_token_leave_out_the_untied_embedding():
    # conf/model/llama-tiny.yaml, byte vocabulary, seq 128.
    L, h, heads, kv_heads, inner, vocab, s = 4, 128, 4, 2, 344, 257, 128
    model = build_hf_model(ModelConfig(arch="llama", n_layer=L, n_embd=h, n_head=heads, n_kv_head=kv_heads,
                                       n_inner=inner, max_positions=256, tie_embeddings=False),
                           vocab, seed=0, device="meta")
    head_dim = h // heads
    attention = h * h + 2 * h * kv_heads * head_dim + h * h  # q, k and v (GQA: 2 kv heads), o; no biases
    mlp = 3 * h * inner  # gate, up, down
    block = attention + mlp + 2 * h  # + input and post-attention RMSNorm
    n = L * block + h + vocab * h  # + final norm + lm_head; embed_tokens is a lookup, not counted
    assert n == 759_040
    assert matmul_params(model) == n
    assert flops_per_token(matmul_params(model), L, h, s) == 6 * n + 12 * L * h * s == 5_340_672


def test_mfu_and_the_probe():
    assert mfu(tokens_per_s=1000, flops_per_tok=1e6, world_size=2, peak_flops_per_rank=1e9) == pytest.approx(0.5)
    peak = probe_peak_flops(torch.device("cpu"), n=128, seconds=0.05)
    assert math.isfinite(peak) and peak > 1e6


def test_analytic_bubble():
    assert analytic_bubble("flush", 1, 8) == 0.0
    assert analytic_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert analytic_bubble("flush", 2, 8) == pytest.approx(1 / 9)
    assert analytic_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)


def test_lr_warms_up_then_decays_to_the_floor():
    run = compose("optimizer.lr=1.0", "trainer.steps=10", "trainer.warmup_steps=2", "trainer.min_lr_ratio=0.1")
    lrs = [lr_at(s, run) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] == pytest.approx(0.1)


def test_optimizer_state_ratio():
    assert optimizer_state_ratio({"_target_": "torch.optim.AdamW", "lr": 1e-3}) == 2.0
    assert optimizer_state_ratio({"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}) == 1.0
    assert optimizer_state_ratio({"_target_": "torch.optim.SGD", "lr": 0.1}) == 0.0


def test_the_activation_tracker_runs_on_the_sampled_steps_only():
    """metrics.activations=sampled: the saved-tensor hook runs on the first step this process
    runs, every trainer.log_interval-th and the last, every step of an asynchronous pipeline, and
    `every` on all; an untracked forward saves nothing into the tracker."""
    from types import SimpleNamespace

    from framework.metrics.memory import ActivationTracker
    from framework.train.trainer import tracks_activations

    def recorded(mode, log_interval, first, steps, is_async=False):
        run = compose("metrics.activations=" + mode, f"trainer.log_interval={log_interval}", f"trainer.steps={steps}")
        runner = SimpleNamespace(tracker=ActivationTracker(), is_async=is_async)
        out = []
        for step in range(first, steps):
            on = tracks_activations(step, runner, run)
            runner.tracker.steps_recorded += on
            out += [step + 1] * on
        return out

    assert recorded("sampled", 5, 0, 12) == [1, 5, 10, 12]
    assert recorded("sampled", 5, 6, 12) == [7, 10, 12]  # a resumed run records its first step
    assert recorded("sampled", 5, 0, 4, is_async=True) == [1, 2, 3, 4]
    assert recorded("every", 5, 0, 4) == [1, 2, 3, 4]

    tracker = ActivationTracker()
    w = torch.ones(8, requires_grad=True)
    for enabled in (False, True):
        tracker.enabled = enabled
        with tracker.forward(0):
            y = (w * torch.full((8,), 2.0)).sin().sum()
        assert tracker.live_bytes() == (64 if enabled else 0), tracker.live_bytes()
        y.backward()
        tracker.backward_done(0)


def test_fragmentation_is_reserved_less_allocated_on_cuda_and_absent_on_a_cpu(monkeypatch):
    """ZeRO-R's MD metric: the caching allocator's own counters, read without a device sync."""
    from framework.metrics.memory import fragmentation_bytes

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: (3 << 20) - 4096)
    assert fragmentation_bytes(torch.device("cuda", 0)) == 4096
    assert fragmentation_bytes(torch.device("cpu")) is None
