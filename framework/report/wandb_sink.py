"""W&B for one run, on the terms that it never costs the run.

The training job must not wait on, or die of, the W&B server: an online run first probes
the server (bounded, `probe`), then starts with a bounded `init_timeout`; when either
fails, the run logs offline into the job directory (upload later with `wandb sync`) and
says so once on stderr. Offline and disabled runs never touch the network.

Which mode a run gets (wandb 0.31): `wandb.init(mode=...)` beats the WANDB_MODE
environment variable (wandb's settings precedence: init arguments > settings= > env >
config files; checked: WANDB_MODE=disabled with mode="offline" gives an offline run). We
always pass a mode, so WANDB_MODE alone never decides; `logger.mode=auto` consults it
(see `wandb_mode`). wandb still parses WANDB_MODE at init and raises on a value outside
WANDB_MODES (case-sensitive, "" included), so framework.validate rejects a bad one before
any rank starts. `api_key_found` mirrors where wandb looks for a key, so the validator
can reject `logger.mode=online` without one instead of letting the logging rank fail.
No `import wandb` at module level: the validator imports this module.
"""

from __future__ import annotations

import hashlib
import netrc
import os
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from framework.config import RunConfig
from urllib.parse import urlsplit

DEFAULT_BASE_URL = "https://api.wandb.ai"
# wandb 0.31's Settings.mode literal; "dryrun" is an alias of offline, "run" of online.
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
# WANDB_MODE values that make `logger.mode=auto` stay off the network.
_ENV_OFFLINE = {"offline": "offline", "dryrun": "offline", "disabled": "disabled"}

PROBE_TIMEOUT_S = 5.0  # api.wandb.ai answers in well under a second
INIT_TIMEOUT_S = 30.0  # wandb's default is 90 s, a full minute and a half of a stalled job
# At the end of an online run, stop waiting for uploads after this long (wandb's default
# waits forever, e.g. when the network dropped mid-run); what is left stays on disk.
FINISH_TIMEOUT_S = 120.0


def base_url() -> str:
    return (os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")


def _netrc_path() -> Path:
    """wandb's lookup order (wandb/sdk/lib/wbauth/wbnetrc.py): $NETRC, ~/.netrc, ~/_netrc."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    home = Path("~").expanduser()
    return next((p for p in (home / ".netrc", home / "_netrc") if p.exists()), home / ".netrc")


def api_key_found(url: Optional[str] = None) -> bool:
    """An API key for the server: WANDB_API_KEY (or an identity token file), or a netrc
    entry for the server's host[:port], where `wandb login` writes it."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(url or base_url()).netloc
    try:
        creds = netrc.netrc(str(_netrc_path())).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def wandb_mode(requested: str) -> str:
    """auto -> offline / disabled when WANDB_MODE asks for that, else online when an API
    key is configured, else offline. An explicit logger.mode is used as is."""
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE", "")
    if env in _ENV_OFFLINE:
        return _ENV_OFFLINE[env]
    return "online" if api_key_found() else "offline"


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when an HTTP server answers at `url` within `timeout_s` (any status: a 401 or
    404 still proves the server is there), else why not. Never raises. The request runs in
    a daemon thread because the socket timeout does not bound DNS resolution."""
    outcome: list[Optional[str]] = []

    def request() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s):
                outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - any failure means "not reachable"
            reason = getattr(e, "reason", None) or e
            outcome.append(f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason)

    worker = threading.Thread(target=request, name="wandb-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else "no HTTP answer"


def reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    return probe(url, timeout_s) is None


def _warn_offline(url: str, reason: str, timeout_s: float, run_dir: str) -> None:
    print(f"WARNING: W&B server {url} unreachable ({reason}) within {timeout_s:g} s: logging offline to "
          f"{os.path.join(run_dir, 'wandb')}; upload later with wandb sync", file=sys.stderr, flush=True)


def init_run(mode: str, run_dir: str, *, probe_timeout_s: float = PROBE_TIMEOUT_S,
             init_timeout_s: float = INIT_TIMEOUT_S, **init_kwargs: Any):
    """wandb.init in `mode` (already resolved by `wandb_mode`); None when disabled or when
    even an offline run cannot start. `init_kwargs` go to wandb.init (project, config, ...)."""
    if mode == "disabled":
        return None
    import wandb

    settings = dict(console="off", quiet=True)
    if mode == "online":
        url = base_url()
        reason = probe(url, probe_timeout_s)
        if reason is None:
            try:
                return wandb.init(mode=mode, dir=run_dir, **init_kwargs, settings=wandb.Settings(
                    **settings, init_timeout=init_timeout_s, finish_timeout=FINISH_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - CommError, auth errors, ...: never the run's end
                reason, probe_timeout_s = _first_line(e), init_timeout_s
        _warn_offline(url, reason, probe_timeout_s, run_dir)
    try:
        return wandb.init(mode="offline", dir=run_dir, **init_kwargs, settings=wandb.Settings(**settings))
    except Exception as e:  # noqa: BLE001
        print(f"WARNING: W&B offline run could not start ({_first_line(e)}): no W&B for this run; "
              "metrics.jsonl and summary.json are written as usual", file=sys.stderr, flush=True)
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def layout_keys(run: RunConfig) -> dict:
    """The layout as flat keys: what W&B's filters, grouping and parallel-coordinates views
    (and framework.report.compare) compare runs by, with no nesting to dig through."""
    p, s, t = run.parallelism, run.schedule, run.trainer
    return {
        "dp": p.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "cp": p.cp, "zero": p.zero, "schedule": s.name, "microbatches": s.microbatches,
        "virtual_stages": s.virtual_stages, "world_size": run.world_size, "micro_batch_size": t.micro_batch_size,
        "global_batch": run.global_batch, "tokens_per_step": run.tokens_per_step, "seq_len": run.data.seq_len,
        "sequence_parallel": p.sequence_parallel and p.tp > 1, "offload_optimizer": p.offload_optimizer,
        "activation_checkpointing": t.activation_checkpointing, "precision": t.precision,
        "model_name": run.model.name, "data_name": run.data.name, "lr": run.optimizer.get("lr"),
        "zero_impl": p.zero_impl, "zero_states": zero_states(run),
        "repeat": run.sweep.repeat, "repeats": run.sweep.repeats,  # sweep.repeats: which repeat, of how many
        "cp_comm": p.cp_comm, "cp_balance": p.cp_balance, **{k: getattr(p, k) for k in OVERLAPS},
        "layout": layout_name(run),
    }


OVERLAPS = {"overlap_grad_reduce": "grad", "overlap_param_gather": "gather", "overlap_cp_ring": "ring",
            "overlap_dualpipe": "dualpipe"}  # parallelism's overlap keys, as the layout name spells them


def layout_name(run: RunConfig) -> str:
    """One name per layout: W&B's group-by-layout must not merge runs that differ in a cp key,
    an overlap or sequence parallelism (each named only when it is on, or cp > 1)."""
    p, s = run.parallelism, run.schedule
    on = [short for k, short in OVERLAPS.items() if getattr(p, k)]
    return (f"dp{p.dp}-tp{p.tp}-pp{p.pp}-{zero_label(run)}-{s.name}-m{s.microbatches}"
            + (f"-v{s.virtual_stages}" if s.virtual_stages > 1 else "") + (f"-ep{p.ep}" if p.ep > 1 else "")
            + (f"-cp{p.cp}-{p.cp_comm}-{p.cp_balance}" if p.cp > 1 else "")
            + ("-sp" if p.sequence_parallel and p.tp > 1 else "") + ("-offload" if p.offload_optimizer else "")
            + ("-nvme" if p.states_on_drive else "") + ("-params" if p.params_on_drive else "")
            + (f"-overlap_{'+'.join(on)}" if on else ""))


JOB_TYPE_CHARS = 64  # W&B's limit on job_type


def job_type(run: RunConfig) -> Optional[str]:
    """A sweep with repeats: the configuration (the run's name without `sweep.repeat=`), so
    W&B's runs of one configuration share a job_type and its grouped charts draw their
    mean and spread without setup (docs/sweeps.md); None otherwise."""
    if run.sweep.repeats <= 1:
        return None
    name = " ".join(o for o in (run.logger.run_name or "").split() if not o.startswith("sweep.repeat=")) or "default"
    if len(name) <= JOB_TYPE_CHARS:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[:JOB_TYPE_CHARS - 9]}~{digest}"


def zero_states(run: RunConfig) -> int:
    """The ZeRO stage of the model states a rank holds between steps. FSDP2 always holds
    stage 3's (its optimizer steps the sharded parameters, framework/parallel/fsdp2.py): its
    zero 2 differs from its zero 3 only between a forward and its backward."""
    p = run.parallelism
    return 3 if p.zero_impl == "fsdp2" and p.zero >= 2 else p.zero


def zero_label(run: RunConfig) -> str:
    """`z<stage>` for our ZeRO; FSDP2's say so, and its zero 2 says it holds stage 3's states."""
    p = run.parallelism
    if p.zero_impl != "fsdp2":
        return f"z{p.zero}"
    return "fsdp2-z3" if p.zero == 3 else f"fsdp2-z{p.zero}-holds-z3"


def wandb_config(run: RunConfig) -> dict:
    """The flat layout keys, then every config group nested under its name (`parallelism`,
    `trainer`, ...) for the rest. `schedule` is the flat schedule name: the schedule group's
    three keys are all flat (schedule, microbatches, virtual_stages)."""
    nested = {k: v for k, v in asdict(run).items() if k != "schedule"}
    return {**layout_keys(run), **nested}


def declare_metrics(run, summary_keys: tuple) -> None:
    """Every logged metric is plotted against `step` (1-based, the framework's numbering),
    and the summary of `summary_keys` is summary.json's (medians after warm-up, the last
    loss: written at the end), not W&B's default last value."""
    run.define_metric("step", hidden=True)
    run.define_metric("*", step_metric="step")
    for key in summary_keys:
        run.define_metric(key, step_metric="step", summary="none")


def wandb_row(rec: dict) -> dict:
    """A metrics.jsonl row as W&B history: scalars only (W&B charts no lists), the per-rank
    bubbles as `bubble_fraction/rank<i>`, and a MoE row's layers flattened (`moe_keys`)."""
    row = {k: v for k, v in rec.items()  # None: fp64 has no mfu
           if not k.startswith("rank_") and k != "moe_layers" and v is not None}
    row.update({f"bubble_fraction/rank{i}": b for i, b in enumerate(rec["rank_bubble_fraction"])})
    row.update(moe_keys(rec.get("moe_layers") or {}))
    return row


# Per MoE layer, the scalars of metrics.jsonl's `moe_layers` that W&B charts as lines.
MOE_SCALARS = ("load_cv", "load_max_over_mean", "dead_experts", "dropped_fraction", "router_entropy", "ep_straggler",
               "aux", "seq_aux", "z")
HISTOGRAM_MAX_BINS = 512  # wandb.Histogram.MAX_LENGTH (wandb 0.31): it raises above that


def moe_keys(layers: dict) -> dict:
    """`moe/layer<i>/<scalar>`, `moe/layer<i>/tokens_received_ep<r>`, and the expert load as
    `moe/layer<i>/expert_load`: a histogram whose bin e holds expert e's tokens. W&B draws a
    histogram logged every step as a heat map over steps (expert on one axis, step on the
    other), the per-layer load picture; wandb is imported only here, for MoE rows, so the
    validator can still import this module without it."""
    if not layers:
        return {}
    import wandb

    out = {}
    for i, layer in layers.items():
        head = f"moe/layer{i}"
        out.update({f"{head}/{k}": layer[k] for k in MOE_SCALARS if layer.get(k) is not None})
        out.update({f"{head}/tokens_received_ep{r}": n for r, n in enumerate(layer["tokens_received_per_ep_rank"])})
        counts = layer["tokens_per_expert"]
        if len(counts) <= HISTOGRAM_MAX_BINS:  # more experts: the scalars only (docs/metrics.md)
            out[f"{head}/expert_load"] = wandb.Histogram(np_histogram=(counts, list(range(len(counts) + 1))))
    return out
