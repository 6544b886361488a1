"""The cost model's collective bytes (framework/sim/cost/traffic.py) equal what the framework
hands to torch.distributed in a real run of the same layout (debug.comm_ledger: a dispatch
mode on every rank records each c10d operator's payload and process group).

One fp64 GPT-2 (or MoE) run per layout, 2 steps: per step and per (dimension, operator),
the modelled bytes equal the measured ones exactly, on the first and the last pipeline rank.
What the model leaves out is listed in traffic.py: scalar flags and norms, routing counts;
here each such measured entry is checked to be at most a few scalars per call.
"""

import json
from collections import defaultdict

import pytest

from framework.config import read_config
from framework.sim.cost.price import job_of
from framework.sim.cost.activations import peak_bytes
from framework.sim.cost.traffic import step_collectives

from .conftest import FP64, TINY, run_local

STEPS = 2
MOE = ["model=moe-tiny", "model.moe.capacity_factor=null"]
LAYOUTS = {
    "dp2": ["parallelism=dp2"],
    "dp2_zero1": ["parallelism=dp2", "parallelism.zero=1"],
    "dp2_zero2": ["parallelism=dp2", "parallelism.zero=2"],
    "dp2_zero3": ["parallelism=dp2", "parallelism.zero=3"],
    "tp2": ["parallelism=tp2"],
    "tp2_sp_recompute": ["parallelism=tp2", "parallelism.sequence_parallel=true",
                         "trainer.activation_checkpointing=true"],
    # ZeRO-R's Pa: each block input all-gathered in backward, the whole block recomputed
    "tp2_recompute_pa": ["parallelism=tp2", "trainer.recompute=full", "trainer.partition_activations=true"],
    "pp2": ["parallelism=pp2", "schedule=flush"],
    "tp2_pp2_sp_interleaved": ["parallelism=tp2_pp2", "parallelism.sequence_parallel=true", "schedule=interleaved",
                               "schedule.virtual_stages=2", "model.n_layer=4"],
    # Llama: hook entries (no second gather backward), an untied head, grouped-query attention
    "llama_tp2_pp2_sp": ["model=llama-tiny", "parallelism=tp2_pp2",
                         "parallelism.sequence_parallel=true", "schedule=flush"],
    "dp2_pp2_zero1": ["parallelism=dp2_pp2", "parallelism.zero=1", "schedule=flush"],
    # a V: the tied table's two uses both on pipeline rank 0, in two chunks
    "zbv_dp2_pp2_zero1": ["parallelism=dp2_pp2", "parallelism.zero=1", "schedule=zbv", "model.n_layer=4"],
    "ep2": ["parallelism=dp2", "parallelism.ep=2", *MOE],
    "ep2_zero1": ["parallelism=dp4", "parallelism.ep=2", "parallelism.zero=1", *MOE],
}
INTEGERS = ("int32", "int64")


def _measured(job_dir, rank) -> dict:
    """Per step: (dim, op) -> bytes, without single scalars and integer payloads."""
    ledger = json.loads((job_dir / "comm_ledger" / f"rank_{rank}.json").read_text())
    assert ledger["steps"] == STEPS
    out = defaultdict(float)
    for e in ledger["entries"]:
        if e["op"] == "recv":  # a send's other end: counted once, at the sender
            continue
        if e["dtype"] in INTEGERS:  # routing counts, DDP's bucket layout (its first step)
            continue
        if e["scalar"]:  # flags, norms' partial sums
            assert e["bytes"] <= 8 * e["calls"], e
            continue
        out[(e["dim"], e["op"])] += e["bytes"] / STEPS
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory, data_cache):
    job = tmp_path_factory.mktemp(request.param)
    run_local(job, *TINY, *LAYOUTS[request.param], "data=synthetic", f"trainer.steps={STEPS}",
              "trainer.warmup_steps=1", "debug.comm_ledger=true", FP64)
    return request.param, job, read_config(str(job / "config.yaml"))


def test_modelled_collective_bytes_equal_the_measured(run):
    name, job_dir, cfg = run
    job = job_of(cfg, json.loads((job_dir / "run_info.json").read_text())["vocab_size"])
    ranks = {0: 0}  # global rank -> pipeline rank; the last stage's first rank too
    if cfg.parallelism.pp > 1:
        ranks[cfg.parallelism.dp * cfg.parallelism.tp * (cfg.parallelism.pp - 1)] = cfg.parallelism.pp - 1
    for rank, pp_rank in ranks.items():
        modelled = defaultdict(float)
        for c in step_collectives(job, pp_rank):
            modelled[(c.dim, c.op)] += c.total
        measured = _measured(job_dir, rank)
        if cfg.model.arch == "qwen3_moe":  # one rank's combine sends what was routed to it:
            a2a = modelled.pop(("ep", "all_to_all"))  # the modelled mean is the ep group's
            measured.pop(("ep", "all_to_all"))
            group = range(cfg.parallelism.ep)  # rank 0's ep group: the first ep dp ranks (tp = pp = 1)
            assert sum(_measured(job_dir, r)[("ep", "all_to_all")] for r in group) == pytest.approx(
                a2a * cfg.parallelism.ep, rel=1e-12)
        assert dict(modelled) == pytest.approx(measured, rel=1e-12), (name, rank)


def test_modelled_activation_peak_equals_the_measured(run):
    """framework/sim/cost/activations.py against ActivationTracker's peak (the largest rank's)
    in the same run: exact for dense models; a MoE rank's routed share is the expectation."""
    name, job_dir, cfg = run
    job = job_of(cfg, json.loads((job_dir / "run_info.json").read_text())["vocab_size"])
    modelled = max(peak_bytes(job.shape, job.lay, job.pp, job.microbatches, job.schedule, job.virtual_stages))
    measured = json.loads((job_dir / "summary.json").read_text())["activation_peak_bytes_max"]
    assert modelled == pytest.approx(measured, rel=0.1 if job.shape.experts else 1e-12), name
