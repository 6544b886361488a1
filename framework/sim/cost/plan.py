"""Plan a cluster without a job or a model build:

    python -m framework.simulate hardware=h100-sxm hardware.gpus=16384 model=llama-tiny model.n_layer=126 ... \\
        parallelism.dp=128 parallelism.tp=8 parallelism.pp=16 schedule=NAME [--json]

The overrides are run.py's (Hydra groups and keys), composed and checked as a dry run's
(`framework.validate`: nothing starts, so no node-capacity check); the model is read as
shapes (shapes.py), never built, so a 405B layout on 16,384 GPUs prices in seconds. Memory:
each pipeline rank's model states by this configuration's exact formula
(metrics/model_states.py) over the ZeRO units the cost model places on it
(traffic.rank_units: its blocks tp-sharded, experts ep-sharded, its embedding and / or head),
plus its saved activations over the schedule (activations.py; price.report adds them).
"""

from __future__ import annotations

import os

from framework.config import ConfigError, RunConfig

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                    "conf")


def compose_plan(overrides: list[str]) -> RunConfig:
    """run.py's composition and checks of `overrides`, as a dry run."""
    from hydra import compose, initialize_config_dir

    from framework.validate import configure, validate
    from framework.validate.overrides import add_absent_keys, check_command_line

    argv = [*overrides, "dry_run=true"]
    check_command_line(argv, CONF)
    argv = add_absent_keys(argv, CONF)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=argv)
    run = configure(cfg, argv)
    if run.hardware.name == "none":
        raise ConfigError("hardware", "none", "prices nothing: planning with no job needs a hardware profile",
                          "add hardware=h100-sxm (or a100-dgx, h200, a file of yours in conf/hardware/)")
    validate(run)
    return run


def plan(overrides: list[str]) -> dict:
    """The cost model's report (price.report) of the layout the overrides describe."""
    run = compose_plan(overrides)
    vocab = run.model.vocab_size or (run.data.vocab_size if run.data.name == "synthetic" else None)
    if vocab is None:
        raise ConfigError("model.vocab_size", None, "is needed to plan with no job (the data's tokenizer is not "
                          "loaded)", "set model.vocab_size=<the tokenizer's size>, e.g. 128256 for Llama 3")
    return predict_run(run, vocab)


def predict_run(run: RunConfig, vocab: int) -> dict:
    """A validated run's price on its hardware profile, with the fullest rank's model states
    and the layout (what `plan` prints and search.mode=simulate ranks)."""
    from framework.sim.cost.hardware import Profile
    from framework.sim.cost.price import job_of, price, report

    check_shapes(run, vocab)  # before pricing: a layout run.py refuses is refused here too
    prof, job = Profile.of(run.hardware), job_of(run, vocab)
    p = run.parallelism
    out = report(prof, job, price(prof, job), model_states(run, job, per_rank=True))
    if p.offload_optimizer:  # a node's ranks each hold the fullest rank's host share at most
        per_node = model_states(run, job, where="host") * min(prof.gpus_per_node, job.world)
        capacity = prof.host_memory_gib * 2 ** 30 if prof.host_memory_gib else None
        out.update(host_state_bytes_per_node=per_node, host_memory_bytes=capacity,
                   fits_host=None if capacity is None else per_node <= capacity)
        if p.offload_device == "nvme":  # the states on the node's drives
            drive = model_states(run, job, where="drive") * min(prof.gpus_per_node, job.world)
            out.update(nvme_state_bytes_per_node=drive, fits_nvme=None if prof.nvme_gib is None
                       else drive <= prof.nvme_gib * 2 ** 30)
    out.update(model=run.model.name, layout={"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "zero": p.zero,
                                             "sequence_parallel": p.sequence_parallel, "schedule": run.schedule.name,
                                             "microbatches": run.schedule.microbatches,
                                             "virtual_stages": run.schedule.virtual_stages,
                                             "micro_batch_size": run.trainer.micro_batch_size,
                                             "seq_len": run.data.seq_len, "recompute":
                                             run.trainer.activation_checkpointing,
                                             "recompute_mode": run.trainer.recompute,
                                             "offload_optimizer": p.offload_optimizer})
    return out


def check_shapes(run: RunConfig, vocab: int) -> None:
    """validate_model's check that the ranges and the composed config's checks do not make
    (framework/validate/: seq_len against the positions and the partition are checked
    there), on the model's transformers config instead of its meta build: the sizes tp
    splits, by models/checks.py's check_tp_sizes, the dry run's own error."""
    from framework.models import ARCHS
    from framework.models.checks import check_tp_sizes

    if run.parallelism.tp > 1:
        arch = ARCHS[run.model.arch]
        check_tp_sizes(arch.tp_sizes(arch.hf_config(run.model, vocab)), run.parallelism.tp)


def model_states(run: RunConfig, job, per_rank: bool = False, where: str = "device"):
    """The fullest rank's (`per_rank`: each pipeline rank's) model-state bytes by this configuration's formula, for the ZeRO
    units the cost model places on each pipeline rank (traffic.rank_units: a block's tp
    shards and replicated parameters in two flat buffers, over dp; its experts in a third,
    over edp). `where`: device (the GPU's), host (ZeRO-Offload's masters, and its optimizer
    states but with the NVMe tier) or drive (the NVMe tier's optimizer states)."""
    from framework.metrics.model_states import config_model_states
    from framework.metrics.model_states import optimizer_state_ratio
    from framework.precision import policy_of
    from framework.sim.cost.traffic import rank_units

    p = run.parallelism
    ratio, pol = optimizer_state_ratio(run.optimizer), policy_of(run)

    def states(units: list[int], n: int) -> float:
        units = [u for u in units if u]
        if not units:
            return 0
        parts = config_model_states(p.zero, units, n, pol, ratio, offload=p.offload_optimizer)
        place = {k: "device" for k in parts}
        if p.offload_optimizer:
            place.update(master_bytes="host", optimizer_bytes="drive" if p.offload_device == "nvme" else "host")
            if p.params_on_drive:  # ZeRO 3's slices too
                place["params_bytes"] = "drive"
        return sum(v for k, v in parts.items() if place[k] == where)

    def of_rank(r: int) -> float:
        units = rank_units(job, r)
        return (states([n for u in units for n, g in u.buffers() if g == "dp"], p.dp)
                + states([n for u in units for n, g in u.buffers() if g == "edp"], p.dp // p.ep))

    each = [of_rank(r) for r in range(p.pp)]
    return each if per_rank else max(each)


def command_line(overrides: list[str], as_json: bool, png) -> int:
    """`python -m framework.simulate hardware=... [overrides]` (sim/cli.py hands it over)."""
    import json

    from framework.sim.cost.describe import describe

    if png:
        raise ConfigError("--png", png, "is not drawn for a planned cluster", "leave --png out")
    rep = plan(overrides)
    print(json.dumps(rep, indent=1) if as_json else describe(rep))
    return 0
