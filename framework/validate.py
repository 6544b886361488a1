"""Semantic checks of a RunConfig, run in the launching process before any rank starts.

Each failure is a ConfigError naming the key, the value and the fix. Checks that need the
tokenizer or the dataset (vocabulary size, enough samples) run in `framework.data.prepare`,
also before launch. Here too: what one node can hold (`_node_capacity`), the paths a run
reads (checkpoint, tokenizer, data files: existence, readability, format) and W&B's
credentials and environment, so none of them fails first inside a started rank.

Float keys go through `_number`, which tests `math.isfinite` first: nan fails every
comparison, so a check written `x < 0` would let it through.
"""

from __future__ import annotations

import glob
import importlib
import inspect
import json
import math
import os
import re
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterable
from typing import Any, Optional

from .config import ConfigError, RunConfig
from .parallel.pipeline.partition import uniform
from .parallel.pipeline.schedules import ASYNC_SCHEDULES, SCHEDULES, interleaved_check

ARCHS = ("gpt2", "llama")
DATASETS = ("pycode", "synthetic", "hf")
PRECISIONS = ("fp32", "bf16", "fp64")
LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "online", "offline", "disabled")
DEVICES = ("auto", "cpu", "cuda")
LAUNCHERS = ("local", "external")
# Summary keys a sweeper may optimise (see framework/logging.py for their meaning).
OBJECTIVES = ("loss", "tokens_per_s", "step_time_s", "mfu", "memory_peak_bytes", "bubble_fraction")


def validate(run: RunConfig) -> None:
    for check in (_parallelism, _model, _schedule, _trainer, _data, _optimizer, _logger, _misc, _node_capacity,
                  _paths):
        check(run)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(key, value, "unknown name", f"use one of {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value is None or value < 1:
        raise ConfigError(key, value, "must be a positive integer", f"set {key} to 1 or more")


def _number(key: str, value: Any, ok: Callable[[float], bool], problem: str, fix: str) -> None:
    """A finite number (not a bool) for which `ok` holds; else `key=value: problem`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(key, value, problem, fix)


def _parallelism(run: RunConfig) -> None:
    p = run.parallelism
    for k in ("dp", "tp", "pp"):
        _positive(f"parallelism.{k}", getattr(p, k))
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError("parallelism.zero", p.zero, "ZeRO stage must be 0, 1, 2 or 3", "pick a stage in 0..3")
    if p.world_size is not None and p.world_size != run.world_size:
        raise ConfigError("parallelism.world_size", p.world_size,
                          f"does not match dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {run.world_size}",
                          "change dp/tp/pp so their product is the world size, or leave world_size null")
    _zero(run)
    if p.tp > 1:
        _tensor_parallel(run)


def _zero(run: RunConfig) -> None:
    p = run.parallelism
    if p.offload_optimizer and p.zero == 0:
        raise ConfigError("parallelism.offload_optimizer", True, "ZeRO-Offload moves the sharded optimizer step to "
                          "the host and needs a ZeRO stage (parallelism.zero >= 1)",
                          "set parallelism.zero=1 (or 2, 3), or offload_optimizer=false")
    if p.zero == 0:
        return
    if run.schedule.name in ASYNC_SCHEDULES:
        raise ConfigError("parallelism.zero", p.zero,
                          f"schedule={run.schedule.name} is asynchronous: each stage updates after every micro-batch "
                          "with dp = 1, so there is no dp group to shard over and no step-wide update to shard",
                          "use parallelism.zero=0 with 1f1b / 2bw, or a flushing schedule (gpipe, flush, interleaved)")
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
    launch, in framework.job, so it covers pretrained checkpoints too."""
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


def _schedule(run: RunConfig) -> None:
    s, pp = run.schedule, run.parallelism.pp
    _choice("schedule.name", s.name, SCHEDULES)
    _positive("schedule.microbatches", s.microbatches)
    _positive("schedule.virtual_stages", s.virtual_stages)
    if pp == 1 and s.name not in ("gpipe", "flush"):
        raise ConfigError("schedule.name", s.name,
                          "with pp = 1 only the synchronous gpipe / flush (gradient accumulation) run",
                          "use schedule=flush, or set parallelism.pp > 1")
    if s.virtual_stages != 1 and (pp == 1 or s.name != "interleaved"):
        raise ConfigError("schedule.virtual_stages", s.virtual_stages,
                          "several model chunks per rank need schedule=interleaved and pp > 1",
                          "set schedule.virtual_stages=1, or schedule=interleaved with parallelism.pp > 1")
    if s.name == "interleaved" and pp > 1 and interleaved_check(pp, s.microbatches, s.virtual_stages):
        raise ConfigError("schedule.microbatches", s.microbatches, interleaved_check(pp, s.microbatches, s.virtual_stages),
                          f"use a multiple of {pp}, e.g. schedule.microbatches={pp * max(1, s.microbatches // pp)}")
    if s.name in ASYNC_SCHEDULES:
        _async_schedule(run)
    stages = pp * s.virtual_stages
    if stages > run.model.n_layer and not run.model.pretrained:
        raise ConfigError("parallelism.pp", pp, f"{stages} stages (pp * virtual_stages) for model.n_layer="
                          f"{run.model.n_layer} blocks: a stage would hold no block",
                          f"use pp * virtual_stages <= {run.model.n_layer}")
    _partition(run, stages)
    if pp > 1:
        _prove_schedule(run)


def _prove_schedule(run: RunConfig) -> None:
    """The exact (pp, m, v) the ranks will run, proved under gloo's and NCCL's rules before
    launch (tests cover pp <= 8, m <= 16; this covers whatever a user asks for). Two steps
    show an asynchronous schedule's steady state across a step boundary."""
    from .parallel.pipeline.check import ScheduleError, check

    s = run.schedule
    try:
        check(s.name, run.parallelism.pp, s.microbatches, s.virtual_stages, steps=min(2, run.trainer.steps))
    except ScheduleError as e:
        raise ConfigError("schedule.name", s.name, f"fails the schedule checker at pp={run.parallelism.pp}, "
                          f"microbatches={s.microbatches}, virtual_stages={s.virtual_stages}: {e}",
                          "choose another schedule or micro-batch count, and report this as a bug") from None


def _async_schedule(run: RunConfig) -> None:
    s, p = run.schedule, run.parallelism
    if p.dp > 1:
        raise ConfigError("parallelism.dp", p.dp, f"schedule={s.name} is asynchronous; its per-update gradient "
                          "all-reduce over dp is not implemented", "use parallelism.dp=1 with 1f1b / 2bw")
    if run.model.tie_embeddings and p.pp > 1:
        raise ConfigError("model.tie_embeddings", True,
                          f"schedule={s.name} updates the first and last stage at different times from different "
                          "weight versions, so their two copies of a tied embedding cannot stay one weight",
                          "set model.tie_embeddings=false (the schedule=1f1b / schedule=2bw presets do)")
    if s.name == "2bw" and s.microbatches < p.pp:
        raise ConfigError("schedule.microbatches", s.microbatches,
                          f"2bw keeps two weight versions only when microbatches >= pp={p.pp} (a stage must "
                          "finish a step's backward before the step after next starts)",
                          f"use schedule.microbatches >= {p.pp}")


def _partition(run: RunConfig, stages: int) -> None:
    method = run.parallelism.partition
    if isinstance(method, (list, tuple)):
        if len(method) != stages or any(not isinstance(b, int) or b < 1 for b in method) \
                or (not run.model.pretrained and sum(method) != run.model.n_layer):
            raise ConfigError("parallelism.partition", list(method),
                              f"an explicit balance lists {stages} positive block counts summing to model.n_layer",
                              f"e.g. parallelism.partition={[len(r) for r in uniform(run.model.n_layer, stages)]}")
        return
    if method in ("uniform", "parameters"):
        return
    if isinstance(method, str) and method.startswith("type:"):
        try:
            re.compile(method[5:])
            return
        except re.error as e:
            raise ConfigError("parallelism.partition", method, f"bad regular expression ({e})", "e.g. type:Block") from None
    raise ConfigError("parallelism.partition", method, "unknown partition method",
                      "use uniform, parameters, type:<regex> or a list of blocks per stage")


def _trainer(run: RunConfig) -> None:
    t = run.trainer
    _positive("trainer.steps", t.steps)
    _positive("trainer.micro_batch_size", t.micro_batch_size)
    _positive("trainer.log_interval", t.log_interval)
    _choice("trainer.precision", t.precision, PRECISIONS)
    if t.global_batch_size is not None:
        per = t.micro_batch_size * run.parallelism.dp
        if t.global_batch_size < 1 or t.global_batch_size % per:
            raise ConfigError("trainer.global_batch_size", t.global_batch_size,
                              f"not divisible by micro_batch_size * dp = {t.micro_batch_size}*{run.parallelism.dp}",
                              f"use a multiple of {per}, or change trainer.micro_batch_size")
        if t.global_batch_size != run.global_batch:
            m = t.global_batch_size // per
            raise ConfigError("trainer.global_batch_size", t.global_batch_size,
                              f"micro_batch_size * microbatches * dp = {run.global_batch}",
                              f"set schedule.microbatches={m}, or leave global_batch_size null")
    if t.warmup_steps < 0:
        raise ConfigError("trainer.warmup_steps", t.warmup_steps, "must be >= 0", "set 0 for no warm-up")
    _number("trainer.min_lr_ratio", t.min_lr_ratio, lambda x: 0 <= x <= 1, "must be a finite number in [0, 1]",
            "e.g. 0.1")
    # nan would turn clipping off silently (nan comparisons are False), inf means no clipping
    _number("trainer.grad_clip", t.grad_clip, lambda x: x >= 0, "must be a finite number >= 0",
            "set 0 to disable clipping, e.g. trainer.grad_clip=1.0")
    _number("trainer.hang_timeout_s", t.hang_timeout_s, lambda x: x > 0, "must be a finite number of seconds > 0",
            "e.g. trainer.hang_timeout_s=300 (it also sets the collectives' timeout)")
    if not 0 <= t.seed < 2**32:  # numpy's default_rng rejects the rest inside the ranks
        raise ConfigError("trainer.seed", t.seed, "must lie in [0, 2**32)", "e.g. trainer.seed=1234")


def _model(run: RunConfig) -> None:
    m = run.model
    _choice("model.arch", m.arch, ARCHS)
    for k in ("n_layer", "n_embd", "n_head", "max_positions"):
        _positive(f"model.{k}", getattr(m, k))
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_head", m.n_head, f"does not divide model.n_embd={m.n_embd}",
                          "pick n_head that divides n_embd")
    if m.n_kv_head is not None:
        _positive("model.n_kv_head", m.n_kv_head)
        if m.arch != "llama" or m.n_head % m.n_kv_head:
            raise ConfigError("model.n_kv_head", m.n_kv_head,
                              f"key-value heads need arch=llama and must divide n_head={m.n_head}",
                              "pick a divisor of n_head, or null")
    if m.vocab_size is not None:
        _positive("model.vocab_size", m.vocab_size)
    _number("model.dropout", m.dropout, lambda x: 0 <= x < 1, "must be a finite number in [0, 1)",
            "use 0 for exact runs")


def _data(run: RunConfig) -> None:
    d = run.data
    _choice("data.name", d.name, DATASETS)
    _positive("data.seq_len", d.seq_len)
    if d.seq_len > run.model.max_positions:
        raise ConfigError("data.seq_len", d.seq_len,
                          f"above the model's positions (model.max_positions={run.model.max_positions})",
                          f"use data.seq_len <= {run.model.max_positions}")
    _positive("data.num_samples", d.num_samples)
    _positive("data.vocab_size", d.vocab_size)
    if d.max_files is not None:
        _positive("data.max_files", d.max_files)
    if d.name == "hf" and not d.path:
        raise ConfigError("data.path", d.path, "data=hf needs a dataset",
                          "set data.path to a hub name or a loader such as json with data.data_files")


def _optimizer(run: RunConfig) -> None:
    o = run.optimizer
    target = o.get("_target_")
    try:
        module, _, name = str(target).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError("optimizer._target_", target, "cannot be imported",
                          "use a class path such as torch.optim.AdamW") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("optimizer._target_", target, "is not a torch.optim.Optimizer", "use torch.optim.AdamW")
    _number("optimizer.lr", o.get("lr"), lambda x: x > 0, "must be a finite positive number",
            "e.g. optimizer.lr=3e-4")
    _optimizer_arguments(o, cls)
    _optimizer_values(o, cls)


def _optimizer_arguments(spec: dict[str, Any], cls: type) -> None:
    """Every key but _target_ is a constructor argument (framework.optim.build_optimizer)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return  # takes **kwargs: any name may be right
    accepted = [p.name for p in params if p.name != "params" and p.kind != p.VAR_POSITIONAL]
    for key, value in spec.items():
        if key != "_target_" and key not in accepted:
            raise ConfigError(f"optimizer.{key}", value, f"not an argument of {spec['_target_']}",
                              f"use one of {', '.join(accepted)} (remove it with ~optimizer.{key})")


def _optimizer_values(spec: dict[str, Any], cls: type) -> None:
    """Build the optimizer on one dummy parameter and take two steps with a zero gradient:
    torch's own argument checks run, and so do the values they let through (nan momentum,
    weight decay or eps=0 leave the parameter non-finite). The culprit is found by trying
    the arguments one at a time beside lr."""
    problem = _optimizer_trial(spec)
    if problem is None:
        return
    for key, value in spec.items():
        if key not in ("_target_", "lr"):
            alone = _optimizer_trial({"_target_": spec["_target_"], "lr": spec["lr"], key: value})
            if alone is not None:
                raise ConfigError(f"optimizer.{key}", value, f"{spec['_target_']} rejects it ({alone})",
                                  f"use a value it accepts (its default: {_default(cls, key)})")
    raise ConfigError("optimizer._target_", spec["_target_"], f"rejects these arguments together "
                      f"({', '.join(k for k in spec if k != '_target_')}): {problem}",
                      "change the optimizer's arguments (see its documentation)")


def _optimizer_trial(spec: dict[str, Any]) -> Optional[str]:
    """None when the optimizer builds and steps cleanly, else torch's message."""
    import torch

    from .optim import build_optimizer

    param = torch.nn.Parameter(torch.ones(1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = build_optimizer(spec, [param])
            for _ in range(2):  # a momentum buffer is only mixed with the gradient from step 2
                param.grad = torch.zeros_like(param)
                opt.step(lambda: torch.zeros(()))  # closure: optimizers such as LBFGS require one
    except ValueError as e:  # torch's own argument checks: "Invalid beta parameter at index 1: 1.5"
        return _first_line(e)
    except Exception as e:  # noqa: BLE001 - anything else (a 1-tuple of betas: IndexError) is the arguments' too
        return f"{type(e).__name__}: {_first_line(e)}"
    if not torch.isfinite(param).all():
        return "leaves a parameter non-finite after two steps with a zero gradient"
    return None


def _default(cls: type, key: str) -> Any:
    try:
        default = inspect.signature(cls).parameters[key].default
    except (TypeError, ValueError, KeyError):
        return "see its documentation"
    return "none" if default is inspect.Parameter.empty else repr(default)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _logger(run: RunConfig) -> None:
    """W&B's own failures would come from the logging rank after launch: a bad WANDB_MODE
    (wandb parses it at init even when mode= overrides it, see framework.wandb_sink) and
    an online run without credentials. An unreachable server is not an error: the run
    logs offline (framework.wandb_sink.init_run)."""
    from .wandb_sink import WANDB_MODES, api_key_found, base_url

    lg = run.logger
    _choice("logger.name", lg.name, LOGGERS)
    _choice("logger.mode", lg.mode, LOGGER_MODES)
    if lg.name != "wandb" or lg.mode == "disabled":
        return
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode is not None and env_mode not in WANDB_MODES:
        raise ConfigError("WANDB_MODE", env_mode, "wandb rejects this environment variable at init",
                          f"unset WANDB_MODE or use one of {', '.join(WANDB_MODES)} (lower case)")
    if lg.mode == "online" and not api_key_found():
        raise ConfigError("logger.mode", lg.mode, f"no W&B API key for {base_url()} (WANDB_API_KEY is unset and "
                          "the netrc file has no entry for it)",
                          "run `wandb login`, set WANDB_API_KEY, or use logger.mode=offline (or auto)")


def _misc(run: RunConfig) -> None:
    _choice("device", run.device, DEVICES)
    _choice("launcher", run.launcher, LAUNCHERS)
    _choice("objective", run.objective, OBJECTIVES)
    if not 0 <= run.metrics.skip_first < run.trainer.steps:
        raise ConfigError("metrics.skip_first", run.metrics.skip_first,
                          f"must leave at least one of trainer.steps={run.trainer.steps} to summarise",
                          f"use 0 <= metrics.skip_first < {run.trainer.steps}")
    if run.metrics.peak_tflops is not None:
        _number("metrics.peak_tflops", run.metrics.peak_tflops, lambda x: x > 0, "must be a finite positive number",
                "set the per-rank peak, or null to measure it")
    fr = run.debug.fail_rank
    if fr is not None and not 0 <= fr < run.world_size:
        raise ConfigError("debug.fail_rank", fr, f"no such rank in world size {run.world_size}",
                          f"use 0..{run.world_size - 1} or null")
    _debug_delay(run)


def _debug_delay(run: RunConfig) -> None:
    d, pp = run.debug, run.parallelism.pp
    _number("debug.stage_delay_ms", d.stage_delay_ms, lambda x: x >= 0, "must be a finite duration >= 0",
            "set it to 0 (off) or to the milliseconds one stage should be slower")
    if d.stage_delay_ms > 0 and not (pp > 1 and 0 <= d.delay_pp_rank < pp):
        raise ConfigError("debug.delay_pp_rank", d.delay_pp_rank,
                          f"the delay slows one pipeline rank, and parallelism.pp={pp} has ranks 0..{pp - 1}",
                          "use a pipeline layout (pp > 1) and a pipeline rank below pp")


# ---- what one node can hold ----

def cpu_rank_limit() -> int:
    """Local CPU ranks: 4 per core, at least 8 (the suite runs 8 ranks on 2 cores); beyond
    that a node spends its time switching processes, or runs out of memory starting them."""
    return max(8, 4 * (os.cpu_count() or 1))


def _node_capacity(run: RunConfig) -> None:
    """A local launch starts every rank on this node; refuse what it cannot hold before
    spawning thousands of processes. External launches and dry runs start nothing here."""
    if run.launcher != "local" or run.dry_run:
        return
    import torch

    n, p = run.world_size, run.parallelism
    layout = f"(dp {p.dp} x tp {p.tp} x pp {p.pp})"
    fix = ("use launcher=external and start the ranks with torchrun over several nodes, or lower "
           "parallelism.dp / tp / pp")
    cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
    if cuda:
        gpus = torch.cuda.device_count()
        if n > gpus:
            raise ConfigError("launcher", run.launcher, f"{n} CUDA ranks {layout}, but this node has {gpus} CUDA "
                              f"device(s) (device={run.device}) and a local launch runs one rank per GPU",
                              f"{fix}, or device=cpu")
    elif n > cpu_rank_limit():
        raise ConfigError("launcher", run.launcher, f"{n} CPU ranks {layout} on this node's {os.cpu_count()} cores; "
                          f"a local CPU launch runs at most {cpu_rank_limit()} (max(8, 4 per core))", fix)


# ---- paths a run reads: existence, readability, format ----

PRETRAINED_FIX = ("use a local directory with config.json and weights (as save_pretrained writes it), "
                  "or a hub name with network access or in the HF cache (huggingface-cli download <name>)")
TOKENIZER_FIX = ("use a local directory with tokenizer files (as save_pretrained writes it), data.tokenizer=bytes, "
                 "or a hub name with network access or in the HF cache (huggingface-cli download <name>)")
HUB_PROBE_TIMEOUT_S = 5.0


def _paths(run: RunConfig) -> None:
    if run.model.pretrained:
        _pretrained(run)
    if run.data.name != "synthetic" and run.data.tokenizer != "bytes":
        _tokenizer(run.data.tokenizer)
    if run.data.name == "hf" and run.data.data_files:
        _data_files(run.data.data_files)


def _is_local(name: str) -> bool:
    """What transformers would read from disk (it tries a directory of that name first)."""
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(name))


def _directory(key: str, name: str, fix: str) -> str:
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise ConfigError(key, name, "no such directory", fix)
    if not os.path.isdir(path):
        raise ConfigError(key, name, "is a file, not a directory", fix)
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(key, name, "is not readable (permissions)", fix)
    if not os.listdir(path):
        raise ConfigError(key, name, "is an empty directory", fix)
    return path


def _read_json(key: str, name: str, path: str, fix: str) -> Any:
    label = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(key, name, f"{label} is not readable ({e.strerror})", fix) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(key, name, f"{label} is not valid JSON ({e})", fix) from None


def _pretrained(run: RunConfig) -> None:
    name, key = run.model.pretrained, "model.pretrained"
    if not _is_local(name):
        _hub_name(key, name, ("config.json",), "AutoConfig", PRETRAINED_FIX)
        return
    path = _directory(key, name, PRETRAINED_FIX)
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(key, name, "has no config.json", PRETRAINED_FIX)
    hf = _read_json(key, name, config, PRETRAINED_FIX)
    if not isinstance(hf, dict) or not hf.get("model_type"):
        raise ConfigError(key, name, "config.json has no model_type", PRETRAINED_FIX)
    from .models import HF_MODEL_TYPES

    found = hf["model_type"]
    if found != HF_MODEL_TYPES[run.model.arch]:
        other = [a for a, t in HF_MODEL_TYPES.items() if t == found]
        raise ConfigError(key, name, f"is a {found} model (config.json), not model.arch={run.model.arch}",
                          f"use model.arch={other[0]}" if other else
                          f"use a {' or '.join(HF_MODEL_TYPES)} checkpoint (the architectures this framework splits)")
    _weights(key, name, path)


def _weights(key: str, name: str, path: str) -> None:
    """Every weight file transformers might pick, checked without loading a tensor: a
    safetensors header must describe exactly the file's size (catches truncated copies), a
    torch .bin must be a zip archive, and a shard index's shards must exist."""
    safetensors = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    bins = [f for f in [os.path.join(path, "pytorch_model.bin")] if os.path.isfile(f)]
    for index in sorted(glob.glob(os.path.join(glob.escape(path), "*.index.json"))):
        shards = _read_json(key, name, index, PRETRAINED_FIX)
        files = sorted(set(shards.get("weight_map", {}).values())) if isinstance(shards, dict) else []
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if not files:
            raise ConfigError(key, name, f"{os.path.basename(index)} lists no shards (no weight_map)", PRETRAINED_FIX)
        if missing:
            raise ConfigError(key, name, f"{os.path.basename(index)} lists missing shards: {', '.join(missing)}",
                              PRETRAINED_FIX)
        bins += [os.path.join(path, f) for f in files if f.endswith(".bin")]
    if not safetensors and not bins:
        raise ConfigError(key, name, "has config.json but no weights (model.safetensors, pytorch_model.bin or a "
                          "*.index.json shard index)", PRETRAINED_FIX)
    for f in safetensors:
        problem = safetensors_problem(f)
        if problem:
            raise ConfigError(key, name, f"{os.path.basename(f)} {problem}", PRETRAINED_FIX)
    for f in sorted(set(bins)):
        if not os.access(f, os.R_OK) or not zipfile.is_zipfile(f):
            raise ConfigError(key, name, f"{os.path.basename(f)} is unreadable or not a zip archive "
                              "(torch.save's format): truncated or corrupt", PRETRAINED_FIX)


SAFETENSORS_MAX_HEADER = 100_000_000  # the format's own limit


def safetensors_problem(path: str) -> Optional[str]:
    """None for a complete safetensors file. The format: 8-byte little-endian header
    length n, n bytes of JSON header, then the data, whose size is the largest tensor end
    offset; so size == 8 + n + max end exactly, and anything shorter was cut off."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > SAFETENSORS_MAX_HEADER:
                return f"has no valid safetensors header (header length {n})"
            if size < 8 or 8 + n > size:
                return f"is truncated ({size} bytes; its header alone needs {8 + n})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"is not readable ({e.strerror})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"has no valid safetensors header ({type(e).__name__}: {e})"
    if size != 8 + n + end:
        return (f"is {size} bytes but its header describes {8 + n + end}: "
                f"{'truncated' if size < 8 + n + end else 'trailing bytes'}, copy or download it again")
    return None


def _tokenizer(name: str) -> None:
    key = "data.tokenizer"
    if not _is_local(name):
        _hub_name(key, name, ("tokenizer_config.json", "tokenizer.json", "vocab.json"), "AutoTokenizer",
                  TOKENIZER_FIX)
        return
    path = _directory(key, name, TOKENIZER_FIX)
    has = {f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
           if os.path.isfile(os.path.join(path, f))}
    if not ({"tokenizer.json"} <= has or {"vocab.json", "merges.txt"} <= has or "tokenizer_config.json" in has):
        raise ConfigError(key, name, "has no tokenizer files (tokenizer.json, vocab.json + merges.txt, or "
                          "tokenizer_config.json)", TOKENIZER_FIX)
    for f in sorted(has & {"tokenizer.json", "tokenizer_config.json", "vocab.json"}):
        _read_json(key, name, os.path.join(path, f), TOKENIZER_FIX)


def _hub_name(key: str, name: str, cache_files: tuple[str, ...], loader: str, fix: str) -> None:
    """A hub name resolves from the local HF cache (instant), or else from the hub: probed
    first, so an offline machine answers in seconds instead of huggingface_hub's minute of
    retries, then loaded by transformers, whose exception becomes the error."""
    head = "is not a local directory and could not be loaded from the hub or the local HF cache"
    from huggingface_hub import constants, try_to_load_from_cache

    for f in cache_files:
        try:
            if isinstance(try_to_load_from_cache(name, f), str):
                return
        except Exception:  # noqa: BLE001 - an invalid repo id: the loader below says why
            break
    if not constants.HF_HUB_OFFLINE:
        from .wandb_sink import probe

        reason = probe(constants.ENDPOINT, HUB_PROBE_TIMEOUT_S)
        if reason is not None:
            raise ConfigError(key, name, f"{head} (hub {constants.ENDPOINT} unreachable: {reason})", fix)
    import transformers

    try:
        getattr(transformers, loader).from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - OSError, HFValidationError, ValueError, ...
        raise ConfigError(key, name, f"{head} ({_first_line(e)})", fix) from None


def _data_files(data_files: Any) -> None:
    """Each entry (a path or glob; a list, or a dict of split -> entries) matches at least
    one readable file, unless it is a URL, which `datasets` downloads itself."""
    entries = data_files.values() if isinstance(data_files, dict) else [data_files]
    flat = [e for v in entries for e in (v if isinstance(v, (list, tuple)) else [v])]
    fix = "give existing readable files (a path or glob pattern), or a URL"
    for entry in flat:
        entry = str(entry)
        if "://" in entry:
            continue
        matches = [m for m in glob.glob(os.path.expanduser(entry), recursive=True) if os.path.isfile(m)]
        if not matches:
            raise ConfigError("data.data_files", entry, "matches no file", fix)
        unreadable = [m for m in matches if not os.access(m, os.R_OK)]
        if unreadable:
            raise ConfigError("data.data_files", entry, f"{unreadable[0]} is not readable (permissions)", fix)


def check_job_dir(job_dir: str) -> None:
    """The job directory can be created and written (config, metrics, summary go there):
    checked with a probe file before anything is prepared or launched."""
    fix = "choose a writable directory, e.g. hydra.run.dir=/tmp/runs/run1 (hydra.sweep.dir for -m)"
    try:
        os.makedirs(job_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("hydra.run.dir", job_dir, f"cannot be created ({e.strerror})", fix) from None
    probe = os.path.join(job_dir, f".write-probe-{uuid.uuid4().hex}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError("hydra.run.dir", job_dir, f"is not writable ({e.strerror})", fix) from None


class RunDirCheck:
    """A Hydra callback (conf/config.yaml hydra.callbacks): Hydra creates the job directory
    before run.py runs, so an unwritable `hydra.run.dir` / `hydra.sweep.dir` would end in
    Hydra's own traceback; checked here first, with the usual one-line error, exit 1."""

    def on_run_start(self, config, **kwargs) -> None:
        _dir_or_exit(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        _dir_or_exit(str(config.hydra.sweep.dir), "hydra.sweep.dir")

    def __getattr__(self, name):  # Hydra calls every other hook too; they do nothing here
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def _dir_or_exit(path: str, key: str) -> None:
    import sys

    try:
        check_job_dir(path)
    except ConfigError as e:
        print(f"config error: {str(e).replace('hydra.run.dir=', key + '=', 1)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
