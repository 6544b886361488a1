"""Every check of a run, made in the launching process before any rank starts: the one home
of validation. Each failure is a ConfigError naming the key, the value and the fix.

`validate(run)`: the config on its own (this module), the optimizer (`optimizer.py`), the
node and the environment (`environment.py`), and the paths the run reads (`paths.py`).
Checks that need what only preparation builds run right after it, still before launch:
`validate_model` on the meta-device model (positions, tensor-parallel sizes, stage
partition), `validate_prepared` on the tokenized data (vocabulary, enough samples).
"""

from __future__ import annotations

import os


from framework.config import ConfigError, DataConfig, RunConfig, check_overrides, load_config
from framework.parallel.pipeline.partition import PartitionError
from framework.schedules import get as get_schedule
from framework.schedules import never_flushes
from framework.commands import first_line
from framework.validate.compile import check_compile
from framework.validate.expert import check_expert_parallel, check_moe
from framework.validate.context import check_context_parallel
from framework.validate.fsdp2 import check_fsdp2
from framework.validate.hardware import check_hardware
from framework.validate.environment import check_logger, check_node_capacity, check_rank_env, cpu_rank_limit
from framework.validate.heldout import check_eval, flushing
from framework.validate.optimizer import check_optimizer
from framework.validate.precision import check_fp8_widths, check_precision
from framework.validate.schedule import check_schedule, load_schedule_modules
from framework.models.checks import check_model_type, check_tp_sizes
from framework.validate.paths import check_job_dir, check_paths, local_data_files, safetensors_problem
from framework.validate.ranges import check_effect, check_ranges

__all__ = ["configure", "validate", "validate_model", "validate_prepared", "check_tp_sizes", "check_text_field",
           "check_model_type", "local_data_files", "check_rank_env", "check_job_dir", "cpu_rank_limit",
           "safetensors_problem", "first_line"]

# Ranges, choices and finiteness of single keys are the schema's (framework/config/, each
# key's Rule, enforced by ranges.check_ranges first); what follows is what a rule cannot say.


def configure(cfg, overrides: list[str]) -> RunConfig:
    """The composed config as the typed schema, with what the command line asked checked
    against it: a derived size it contradicts, a key it sets that has no effect here."""
    run = load_config(cfg)
    check_overrides(run, overrides)
    check_effect(run, overrides)
    return run


def validate(run: RunConfig) -> None:
    for check in (check_ranges, load_schedule_modules, _parallelism, _model, check_schedule, check_precision,
                  check_compile, _data,
                  check_eval,
                  check_optimizer, check_logger, _misc, check_node_capacity, check_paths, check_hardware):
        check(run)


def _parallelism(run: RunConfig) -> None:
    p = run.parallelism
    if p.world_size is not None and p.world_size != run.world_size:
        raise ConfigError("parallelism.world_size", p.world_size,
                          f"does not match dp*cp*tp*pp = {p.dp}*{p.cp}*{p.tp}*{p.pp} = {run.world_size}",
                          "change dp/cp/tp/pp so their product is the world size, or leave world_size null")
    _zero(run)
    if p.bucket_mb is not None:
        _constant_buffers(run)
    check_expert_parallel(run)
    check_context_parallel(run)
    if p.tp > 1:
        _tensor_parallel(run)


def _constant_buffers(run: RunConfig) -> None:
    """ZeRO-R's CB where it bounds what it says: one buffer reused, reduction by reduction."""
    p, fix = run.parallelism, "leave parallelism.bucket_mb unset (null)"
    if p.overlap_grad_reduce:
        raise ConfigError("parallelism.bucket_mb", p.bucket_mb, "with parallelism.overlap_grad_reduce every piece of "
                          "an overlapped reduction holds its buffer until the wait, so no buffer size is constant",
                          f"{fix}, or set parallelism.overlap_grad_reduce=false")
    if p.zero and p.zero_impl == "fsdp2":
        raise ConfigError("parallelism.bucket_mb", p.bucket_mb, "torch's fully_shard sizes its own reduce-scatter "
                          "buffers (one per unit)", f"{fix}, or use parallelism.zero_impl=ours")


def _zero(run: RunConfig) -> None:
    p = run.parallelism
    if p.zero_impl == "fsdp2":  # torch's back end: its own rules
        check_fsdp2(run)
        return
    if p.offload_optimizer and p.zero == 0:
        raise ConfigError("parallelism.offload_optimizer", True, "ZeRO-Offload moves the sharded optimizer step to "
                          "the host and needs a ZeRO stage (parallelism.zero >= 1)",
                          "set parallelism.zero=1 (or 2, 3), or offload_optimizer=false")
    if p.zero == 0:
        return
    if never_flushes(run.schedule):
        raise ConfigError("parallelism.zero", p.zero,
                          f"schedule={run.schedule.name} is asynchronous: each stage updates on its own with dp = 1, "
                          "so there is no dp group to shard over and no step-wide update to shard",
                          f"use parallelism.zero=0 with {run.schedule.name}, or a flushing schedule "
                          f"({', '.join(flushing())})")
    if p.zero >= 2 and p.pp > 1:
        raise ConfigError("parallelism.zero", p.zero,
                          "ZeRO-2/3 shard gradients, which a pipeline accumulates over its micro-batches: each "
                          "micro-batch's backward would need its own reduce-scatter (DeepSpeed rejects this too)",
                          "use parallelism.zero=1 with pipeline parallelism, or pp=1 (tp and dp) with zero 2 / 3")
    if p.zero == 3 and run.trainer.activation_checkpointing:
        raise ConfigError("parallelism.zero", p.zero,
                          "with trainer.activation_checkpointing the recomputed forward inside backward would free "
                          "the block's gathered parameters before its backward uses them",
                          "set trainer.activation_checkpointing=false, or use parallelism.zero=2")


def _tensor_parallel(run: RunConfig) -> None:
    """Divisibility of heads and MLP width is checked on the built (meta) model before
    launch, in framework.launch.job, so it covers pretrained checkpoints too."""
    p, m = run.parallelism, run.model
    if m.dropout > 0:
        raise ConfigError("model.dropout", m.dropout,
                          f"with parallelism.tp={p.tp} every tp rank would draw the same dropout masks (no "
                          "per-rank RNG tracker as in Megatron yet), which is not the single model's dropout",
                          "use model.dropout=0 with tensor parallelism")
    if p.sequence_parallel and run.data.seq_len % p.tp:
        raise ConfigError("data.seq_len", run.data.seq_len,
                          f"sequence parallelism splits the sequence over tp={p.tp}",
                          f"use a multiple of {p.tp}, e.g. data.seq_len={p.tp * max(1, run.data.seq_len // p.tp)}")
    if run.trainer.partition_activations:
        _partitioned_activations(run)


def _partitioned_activations(run: RunConfig) -> None:
    """ZeRO-R's Pa where it is verified: its checkpoint recomputes a whole block inside the
    backward and back-propagates through it at once."""
    p, t, fix = run.parallelism, run.trainer, "set trainer.partition_activations=false"
    if p.sequence_parallel:
        raise ConfigError("trainer.partition_activations", True,
                          f"under sequence parallelism each block input is already 1/tp={p.tp} of the sequence "
                          "on each tp rank: there is nothing left to partition", fix)
    if get_schedule(run.schedule.name).splits_backward:
        raise ConfigError("trainer.partition_activations", True,
                          f"schedule={run.schedule.name} splits each backward into input and weight gradients; "
                          "the partitioned checkpoint computes both at once", f"{fix}, or use a schedule that "
                          "does not split the backward (1f1b, gpipe, interleaved)")
    if run.model.arch == "qwen3_moe":
        raise ConfigError("trainer.partition_activations", True, "an MoE block's routing statistics and its expert "
                          "bias update are recorded in a forward with a graph; the partitioned checkpoint runs the "
                          "block without one and recomputes it inside the backward, so neither would be recorded",
                          f"{fix}, or a dense model")
    if t.compile != "none":
        raise ConfigError("trainer.partition_activations", True, "not yet verified with compiled blocks "
                          "(the block runs without a graph in forward, with one in backward)",
                          f"{fix}, or trainer.compile=none")


def _model(run: RunConfig) -> None:
    m = run.model
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_head", m.n_head, f"does not divide model.n_embd={m.n_embd}",
                          "pick n_head that divides n_embd")
    if m.n_kv_head is not None:
        if m.arch == "gpt2" or m.n_head % m.n_kv_head:
            raise ConfigError("model.n_kv_head", m.n_kv_head,
                              f"key-value heads need arch=llama or qwen3_moe and must divide n_head={m.n_head}",
                              "pick a divisor of n_head, or null")
    if m.arch == "qwen3_moe":
        check_moe(run)


def _data(run: RunConfig) -> None:
    d = run.data
    if d.name == "hf" and not d.path:
        raise ConfigError("data.path", d.path, "data=hf needs a dataset",
                          "set data.path to a hub name or a loader such as json with data.data_files")


def _misc(run: RunConfig) -> None:
    _search_and_sim(run)
    _debug_delay(run)


def _search_and_sim(run: RunConfig) -> None:
    src = run.sim.source
    cluster = run.hardware.name != "none"
    if run.search.mode == "simulate" and not src and not cluster:
        raise ConfigError("sim.from", src, "search.mode=simulate ranks candidates by a prediction from a measured job "
                          "or a hardware profile", "set sim.from=<the directory of a finished pipeline job>, or "
                          "hardware=<a profile> to rank layouts for a cluster (docs/cost_model.md)")
    if run.search.mode == "simulate" and src and cluster:
        raise ConfigError("sim.from", src, f"and hardware={run.hardware.name} both predict: a measured job's "
                          "replay on this machine, or the cost model on a cluster", "give one of them")
    if src and not os.path.isfile(os.path.join(src, "calibration.json")):
        raise ConfigError("sim.from", src, "has no calibration.json: not the directory of a finished pipeline job "
                          "(parallelism.pp > 1) or expert-parallel job (parallelism.ep > 1)",
                          "run one (e.g. python run.py trainer.steps=20) and give its directory")


def _debug_delay(run: RunConfig) -> None:
    d, pp = run.debug, run.parallelism.pp
    if d.stage_delay_ms > 0 and pp == 1:
        raise ConfigError("debug.stage_delay_ms", d.stage_delay_ms,
                          "the delay slows one pipeline rank, and parallelism.pp=1 has no pipeline",
                          "use a pipeline layout (pp > 1), or debug.stage_delay_ms=0")


def validate_model(run: RunConfig, hf_model) -> list[range]:
    """On the model built on the meta device (also a pretrained checkpoint's): its
    positions, its tensor-parallel sizes, and the blocks of each pipeline stage (returned)."""
    from framework.models import ARCHS, num_positions
    from framework.parallel.pipeline.stage import stage_ranges

    if run.data.seq_len > num_positions(hf_model):
        raise ConfigError("data.seq_len", run.data.seq_len, f"above the model's {num_positions(hf_model)} positions",
                          f"use data.seq_len <= {num_positions(hf_model)}")
    arch = ARCHS[run.model.arch]
    if run.parallelism.tp > 1:
        check_tp_sizes(arch.tp_sizes(hf_model.config), run.parallelism.tp)
    if run.precision.fp8 != "none":
        check_fp8_widths(run, hf_model, arch.TP_PLAN)
    stages = run.parallelism.pp * run.schedule.virtual_stages
    try:
        return stage_ranges(run.parallelism.partition, arch.split(hf_model), stages)
    except PartitionError as e:
        raise ConfigError("parallelism.partition", run.parallelism.partition, str(e),
                          "use fewer stages, another method, or a balance list with a block per stage") from None


def validate_prepared(run: RunConfig, vocab_size: int, num_samples: int, val_num_samples: int = 0) -> None:
    """The tokenized data: the model's vocabulary holds the tokenizer's, the corpus gives at
    least one global batch, and with evaluation on the held-out data at least one micro-batch
    (an evaluation wraps around a smaller held-out set, but a micro-batch never repeats a sequence)."""
    if run.model.vocab_size is not None and run.model.vocab_size < vocab_size:
        raise ConfigError("model.vocab_size", run.model.vocab_size,
                          f"smaller than the tokenizer's vocabulary ({vocab_size})",
                          f"set model.vocab_size >= {vocab_size} or null")
    if num_samples < run.global_batch:
        synthetic = run.data.name == "synthetic"
        raise ConfigError("data.num_samples" if synthetic else "data.seq_len",
                          run.data.num_samples if synthetic else run.data.seq_len,
                          f"the corpus gives {num_samples} sequences, fewer than the global batch {run.global_batch}",
                          "use more data (data.max_files / data.num_samples), a shorter seq_len or a smaller batch")
    mbs = run.trainer.micro_batch_size
    if run.trainer.eval_interval > 0 and val_num_samples < mbs:
        d = run.data
        field = {"pycode": "val_files", "hf": "val_split" if d.val_split else "val_fraction"}.get(d.name)
        raise ConfigError(f"data.{field}" if field else "trainer.eval_batches",
                          getattr(d, field) if field else run.trainer.eval_batches,
                          f"the held-out data gives {val_num_samples} sequences of data.seq_len={run.data.seq_len}, "
                          f"fewer than one micro-batch (trainer.micro_batch_size={mbs})",
                          "hold out more data (more files, a larger fraction, a bigger split), a shorter seq_len or "
                          "a smaller micro-batch")


def check_text_field(d: DataConfig, columns: list[str]) -> None:
    """On the loaded dataset: the column the text is read from exists."""
    field = d.text_field if d.name == "hf" else "text"
    if field not in columns:
        raise ConfigError("data.text_field", field, f"not a column of {d.path} ({columns})",
                          "set data.text_field to the column that holds the text")
