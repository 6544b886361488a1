"""framework/sim/cost/activations.py against the framework's own measurement: the model of each
architecture built in process (fp32, one rank), one micro-batch's forward under the
ActivationTracker (metrics/memory.py) that every run reports `activation_peak_bytes` from.
Exact, byte for byte, with and without recomputation; the multi-rank layouts (tp, SP, pp,
interleaved, ZeRO, ep) are compared in fp64 runs in tests/test_comm_bytes.py."""

import pytest
import torch
from omegaconf import OmegaConf

from framework.config import ModelConfig
from framework.metrics.memory import ActivationTracker
from framework.models import ARCHS
from framework.sim.cost.activations import block_bytes, peak_bytes
from framework.sim.cost.shapes import Layout, ModelShape

from .conftest import ROOT

VOCAB = 96


def _measured(preset: str, layers: int, batch: int, seq: int, recompute: bool) -> tuple[int, ModelShape]:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf" / "model" / f"{preset}.yaml"))
    cfg.n_layer = layers
    m = OmegaConf.to_object(cfg)
    arch = ARCHS[m.arch]
    torch.manual_seed(0)
    hf = arch.MODEL_CLASS(arch.hf_config(m, VOCAB))
    if hasattr(arch, "install_moe"):
        arch.install_moe(hf, m, torch.device("cpu"), None, None)
    model = arch.split(hf, recompute)
    tracker = ActivationTracker(model)
    ids = torch.randint(0, VOCAB, (batch, seq + 1))
    with tracker.forward(0):
        loss = model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())  # as the loader hands them
    loss.backward()
    return tracker.peak_bytes, ModelShape.of(m, VOCAB)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "moe-tiny"])
def test_modelled_saved_activations_equal_the_tracker_byte_for_byte(preset, recompute):
    measured, shape = _measured(preset, 2, 3, 40, recompute)
    lay = Layout(3, 40, dtype="fp32", recompute=recompute)
    assert peak_bytes(shape, lay, 1, 1, "flush") == [measured]


def test_a_block_costs_what_one_more_layer_adds():
    """The per-block term alone: the difference a third layer makes to the measurement."""
    two, shape = _measured("llama-tiny", 2, 2, 24, False)
    three, _ = _measured("llama-tiny", 3, 2, 24, False)
    assert block_bytes(shape, Layout(2, 24, dtype="fp32")) == three - two
