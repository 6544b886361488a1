"""Paths a run reads or writes, checked for existence, readability and format before any
rank starts: the pretrained checkpoint, the tokenizer, the data files, the token cache's
directory and the job directory (also as a Hydra callback, since Hydra creates that directory
before run.py). `read_json` reads any JSON file a launch reads, bounded where asked, as a
ConfigError naming the key that points at it when it is unreadable or not JSON."""

from __future__ import annotations

import glob
import json
import os
import uuid
import zipfile
from typing import Any, Optional

from framework.config import ConfigError, RunConfig
from framework.files import read_json
from framework.models.checks import check_model_type
from framework.commands import first_line

PRETRAINED_FIX = ("use a local directory with config.json and weights (as save_pretrained writes it), "
                  "or a hub name with network access or in the HF cache (huggingface-cli download <name>)")
TOKENIZER_FIX = ("use a local directory with tokenizer files (as save_pretrained writes it), data.tokenizer=bytes, "
                 "or a hub name with network access or in the HF cache (huggingface-cli download <name>)")
HUB_PROBE_TIMEOUT_S = 5.0
CACHE_DIR_FIX = "give a writable directory, e.g. data.cache_dir=/tmp/token_cache (or null: ~/.cache/framework)"


def check_paths(run: RunConfig) -> None:
    if run.model.pretrained:
        _pretrained(run)
    if run.data.name != "synthetic" and run.data.tokenizer != "bytes":
        _tokenizer(run.data.tokenizer)
    if run.data.name == "hf" and run.data.data_files:
        _data_files(run.data.data_files)
    if run.data.name != "synthetic":  # synthetic data is drawn in each rank: no cache
        _cache_dir(run.data.cache_dir)
    p = run.parallelism
    if p.states_on_drive:
        fix = "set parallelism.nvme_path to a writable directory on the drive, e.g. parallelism.nvme_path=/local_nvme/offload"
        if p.nvme_path is None:
            raise ConfigError("parallelism.nvme_path", None, "offload_device=nvme keeps the optimizer states in a file "
                              "on a drive: which directory is not said", fix)
        writable_dir("parallelism.nvme_path", p.nvme_path, p.nvme_path, fix)


def _cache_dir(cache_dir: Optional[str]) -> None:
    """data.cache_dir (null: ~/.cache/framework, where the token cache goes) can be created
    and written: the cache, its metadata and its lock file are written there."""
    path = os.path.expanduser(cache_dir or "~/.cache/framework")
    writable_dir("data.cache_dir", cache_dir, path, CACHE_DIR_FIX)


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


def _pretrained(run: RunConfig) -> None:
    name, key = run.model.pretrained, "model.pretrained"
    if not _is_local(name):
        _hub_name(key, name, ("config.json",), "AutoConfig", PRETRAINED_FIX)
        return
    path = _directory(key, name, PRETRAINED_FIX)
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(key, name, "has no config.json", PRETRAINED_FIX)
    hf = read_json(key, name, config, PRETRAINED_FIX)
    if not isinstance(hf, dict) or not hf.get("model_type"):
        raise ConfigError(key, name, "config.json has no model_type", PRETRAINED_FIX)
    check_model_type(run.model, hf["model_type"])
    _weights(key, name, path)


def _weights(key: str, name: str, path: str) -> None:
    """Every weight file transformers might pick, checked without loading a tensor: a
    safetensors header must describe exactly the file's size (catches truncated copies), a
    torch .bin must be a zip archive, and a shard index's shards must exist."""
    safetensors = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    bins = [f for f in [os.path.join(path, "pytorch_model.bin")] if os.path.isfile(f)]
    for index in sorted(glob.glob(os.path.join(glob.escape(path), "*.index.json"))):
        shards = read_json(key, name, index, PRETRAINED_FIX)
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
        read_json(key, name, os.path.join(path, f), TOKENIZER_FIX)


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
        from framework.report.wandb_sink import probe

        reason = probe(constants.ENDPOINT, HUB_PROBE_TIMEOUT_S)
        if reason is not None:
            raise ConfigError(key, name, f"{head} (hub {constants.ENDPOINT} unreachable: {reason})", fix)
    import transformers

    try:
        getattr(transformers, loader).from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - OSError, HFValidationError, ValueError, ...
        raise ConfigError(key, name, f"{head} ({first_line(e)})", fix) from None


def local_data_files(data_files: Any) -> dict[str, list[str]]:
    """data.data_files (a path or glob; a list, or a dict of split -> entries) -> each local
    entry's matching files. URLs are left out: `datasets` downloads them itself."""
    if not data_files:
        return {}
    entries = data_files.values() if isinstance(data_files, dict) else [data_files]
    flat = [str(e) for v in entries for e in (v if isinstance(v, (list, tuple)) else [v])]
    return {e: sorted(m for m in glob.glob(os.path.expanduser(e), recursive=True) if os.path.isfile(m))
            for e in flat if "://" not in e}


def _data_files(data_files: Any) -> None:
    """Each local entry matches at least one readable file."""
    fix = "give existing readable files (a path or glob pattern), or a URL"
    for entry, matches in local_data_files(data_files).items():
        if not matches:
            raise ConfigError("data.data_files", entry, "matches no file", fix)
        unreadable = [m for m in matches if not os.access(m, os.R_OK)]
        if unreadable:
            raise ConfigError("data.data_files", entry, f"{unreadable[0]} is not readable (permissions)", fix)


def check_job_dir(job_dir: str) -> None:
    """The job directory can be created and written (config, metrics, summary go there):
    checked with a probe file before anything is prepared or launched."""
    writable_dir("hydra.run.dir", job_dir, job_dir,
                 "choose a writable directory, e.g. hydra.run.dir=/tmp/runs/run1 (hydra.sweep.dir for -m)")


def writable_dir(key: str, value: Any, path: str, fix: str) -> None:
    """`path` is a directory (created if missing) where a file can be written: a probe file
    is written and removed. Else a ConfigError naming `key`."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        why = "is a file, not a directory" if os.path.isfile(path) else f"cannot be created ({e.strerror or e})"
        raise ConfigError(key, value, why, fix) from None
    probe = os.path.join(path, f".write-probe-{uuid.uuid4().hex}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(key, value, f"is not writable ({e.strerror or e})", fix) from None
