"""What the machine and the environment must allow: how many ranks one node can hold, and
W&B's credentials and environment variables (which would otherwise fail first inside the
logging rank, after launch). Also the rank-side check of what torchrun started."""

from __future__ import annotations

import os

from framework.config import ConfigError, RunConfig
from framework.validate.common import choice

LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "online", "offline", "disabled")


def check_logger(run: RunConfig) -> None:
    """W&B's own failures would come from the logging rank after launch: a bad WANDB_MODE
    (wandb parses it at init even when mode= overrides it, see framework.report.wandb_sink) and
    an online run without credentials. An unreachable server is not an error: the run
    logs offline (framework.report.wandb_sink.init_run)."""
    from framework.report.wandb_sink import WANDB_MODES, api_key_found, base_url

    lg = run.logger
    choice("logger.name", lg.name, LOGGERS)
    choice("logger.mode", lg.mode, LOGGER_MODES)
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


def cpu_rank_limit() -> int:
    """Local CPU ranks: 4 per core, at least 8 (the suite runs 8 ranks on 2 cores); beyond
    that a node spends its time switching processes, or runs out of memory starting them."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_node_capacity(run: RunConfig) -> None:
    """A local launch starts every rank on this node; refuse what it cannot hold before
    spawning thousands of processes. External launches, dry runs and a cluster's simulated
    search (search.mode=simulate hardware=...) start nothing here."""
    if run.launcher != "local" or run.dry_run or (run.search.mode == "simulate" and run.hardware.name != "none"):
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


def check_rank_env(run: RunConfig, world: int, local_world: int, cuda_devices: int, cuda: bool) -> None:
    """In a rank started by torchrun (launcher=external), where nothing checked the launch
    before: the world it joined, and one GPU per local rank."""
    if world != run.world_size:
        raise ConfigError("parallelism", f"dp*tp*pp={run.world_size}", f"the launcher started {world} ranks",
                          "launch dp*tp*pp ranks (torchrun --nnodes * --nproc-per-node)")
    if cuda and local_world > cuda_devices:
        raise ConfigError("device", run.device, f"{local_world} ranks on this node but {cuda_devices} CUDA device(s)",
                          "start one rank per GPU (torchrun --nproc-per-node)")
