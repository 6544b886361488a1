"""Memory to the byte: for every precision mode x ZeRO stage (0-3, and 1-3 with ZeRO-Offload)
at dp 2 and 4, the parameter, gradient, master and optimizer-state bytes each rank measures
(the tensors themselves, framework/metrics/memory.py) equal this configuration's formula
exactly, and the formula (framework/metrics/model_states.py) equals the one written here from
the per-element table in docs/precision.md. bf16-mixed with precision.reduce_dtype=param is
the ZeRO paper's 2 + 2 + 12 exactly, once ZeRO's padding and AdamW's step counters (4 bytes per
stepped tensor) are taken out.

In-process: each rank builds every configuration's runner in turn over one process group and
steps it once (no launch per configuration: 70 of them would cost minutes)."""

import copy

import pytest
import torch

from .conftest import compose
from .distributed import run_ranks

MODES = ("fp32", "bf16-autocast", "bf16-mixed", "fp16-mixed", "fp64")
STAGES = ((0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True))
# (parameter and gradient bytes, master and optimizer-state bytes) per element
BYTES = {"fp32": (4, 4), "bf16-autocast": (4, 4), "bf16-mixed": (2, 4), "fp16-mixed": (2, 4), "fp64": (8, 8)}
VOCAB = 64
MODEL = ["parallelism=single", "model.n_layer=2", "model.n_embd=24", "model.n_head=2", f"model.vocab_size={VOCAB}", "data=synthetic",
         "data.seq_len=16", "trainer.micro_batch_size=2", "schedule.microbatches=1", "logger=none"]


def _runs(dp: int) -> dict:
    """Each configuration: one composed base with its four keys set, as the command line sets
    them (none of them derives another key in load_config; Hydra's compose takes 0.2 s, 35 of
    them a dp took 8 s). One configuration per dp is composed whole and must equal its copy."""
    base = compose(*MODEL, f"parallelism.dp={dp}")
    out = {}
    for mode in MODES:
        for stage, offload in STAGES:
            run = copy.deepcopy(base)
            run.parallelism.zero, run.parallelism.offload_optimizer, run.trainer.precision = stage, offload, mode
            if mode == "bf16-mixed":
                run.precision.reduce_dtype = "param"
            out[mode, stage, offload] = run
    whole = compose(*MODEL, f"parallelism.dp={dp}", "parallelism.zero=2", "parallelism.offload_optimizer=true",
                    "trainer.precision=bf16-mixed", "precision.reduce_dtype=param")
    assert out["bf16-mixed", 2, True] == whole
    return out


def _rank(rank: int, world: int, runs: dict) -> dict:
    from framework.metrics.model_states import formula_report
    from framework.report.records import RunInfo
    from framework.topology import ParallelContext, ParallelDims
    from framework.train.trainer import build_runner

    ctx = ParallelContext.create(ParallelDims(pp=1, dp=world, tp=1), rank, torch.device("cpu"))
    info = RunInfo(None, VOCAB, 64, 1.0, None, "none", 0.0)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen))
               for _ in range(1)]
    out = {}
    for key, run in runs.items():
        runner, full = build_runner(run, info, ctx)
        res = runner.step(0, lambda j: batches[j])
        s = res.states
        units = ([[p.numel() for p in f.params] for f in runner.zero.flat] if runner.zero else
                 [[p.numel()] for p in runner.params])
        out[key] = {"measured": {"params_bytes": s.params_bytes, "grads_bytes": s.grads_bytes,
                                 "master_bytes": s.master_bytes, "optimizer_bytes": s.optimizer_bytes},
                    "formula": formula_report(runner, run)["model_state_formula"], "units": units,
                    "psi": sum(p.numel() for p in full.parameters()), "loss": res.loss}
    return out


@pytest.fixture(scope="module")
def measured():
    return {dp: run_ranks(_rank, dp, _runs(dp), timeout=600) for dp in (2, 4)}


def _table(mode: str, stage: int, offload: bool, units: list[list[int]], n: int) -> dict:
    """docs/precision.md's per-element table, written out: P bytes of parameters and gradients,
    S of master and states; ZeRO pads each flat unit to a multiple of n."""
    p, s = BYTES[mode]
    sizes = [sum(u) for u in units]
    whole = sum(-(-u // n) * n for u in sizes) if stage else sum(sizes)
    part = sum(-(-u // n) for u in sizes) if stage else sum(sizes)
    stepped = part if stage else whole
    master = mode.endswith("-mixed") or offload
    return {"params_bytes": p * (part if stage == 3 else whole), "grads_bytes": p * (part if stage >= 2 else whole),
            "master_bytes": s * stepped if master else 0,
            "optimizer_bytes": 2 * s * stepped + 4 * len(sizes)}  # AdamW: m, v and a 4-byte step per tensor


@pytest.mark.parametrize("dp", (2, 4))
@pytest.mark.parametrize("mode", MODES)
def test_measured_bytes_equal_the_configuration_formula(measured, dp, mode):
    for stage, offload in STAGES:
        for r, ranks in enumerate(measured[dp]):
            got = ranks[mode, stage, offload]
            want = _table(mode, stage, offload, got["units"], dp)
            assert got["measured"] == got["formula"] == want, (mode, stage, offload, r)
            assert got["loss"] == got["loss"]  # a finite step ran (nan != nan)


@pytest.mark.parametrize("dp", (2, 4))
def test_bf16_mixed_with_a_bf16_reduction_is_the_papers_2_2_12(measured, dp):
    from framework.metrics.model_states import zero_model_states

    for stage in (0, 1, 2, 3):
        for ranks in measured[dp]:
            got = ranks["bf16-mixed", stage, False]
            m = got["measured"]
            sizes = [sum(u) for u in got["units"]]
            pad = sum(-(-u // dp) * dp - u for u in sizes) if stage else 0  # elements of ZeRO's padding
            paper = zero_model_states(stage, got["psi"], dp, 2.0, bf16=True)
            n = {s: dp if cond else 1 for s, cond in (("p", stage == 3), ("g", stage >= 2), ("o", stage >= 1))}
            assert m["params_bytes"] - 2 * pad / n["p"] == paper["params_bytes"]
            assert m["grads_bytes"] - 2 * pad / n["g"] == paper["grads_bytes"]
            steps = 4 * len(sizes)  # AdamW's step counters: the paper counts none
            assert m["master_bytes"] + m["optimizer_bytes"] - steps - 12 * pad / n["o"] == paper["optimizer_bytes"]
