"""Every file read before launch, bad: a schedule CSV, sim.from's calibration.json, a
checkpoint's meta.json and DCP index, a directory given as a checkpoint, the token cache and
its directory. Each ends in the launching process as one `key=value: problem. Fix: ...`
line naming the key that points at the file (or, for a token cache, a rebuild), never a
traceback and never an allocation sized by a number in the file. In-process: the functions
run.py's job calls (load_config + validate, run_job, run_info, prepare); no rank starts."""

from __future__ import annotations

import copy
import functools
import json
import re
import resource
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from framework.checkpoint import finished, history
from framework.checkpoint.save import _meta
from framework.config import ConfigError, to_yaml
from framework.data import prepare
from framework.launch.job import meta_model, run_info, run_job
from framework.sim.cli import main as simulate_main
from framework.validate import validate

from .conftest import TINY
from .conftest import compose as _compose


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    return _compose(*overrides)


def compose(*overrides: str):
    """conftest.compose, each config composed once per session (a copy: run_job fills it in)."""
    return copy.deepcopy(_composed(overrides))


def _one_line(e: ConfigError, key: str) -> str:
    msg = str(e)
    assert e.key == key, msg
    assert "\n" not in msg and "Fix: " in msg, msg
    return msg


@contextmanager
def _headroom(extra: int = 2 << 30):
    """An address-space limit `extra` above what the process maps now: a regression that
    sizes memory by a number in a file fails with MemoryError instead of filling the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ---- schedule.csv ----

HUGE = "0F0,0F99999999999999999999\n1F0\n"  # pp 2; a micro-batch index of 10**20


def _csv_error(path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(*TINY, "parallelism=pp2", "schedule=csv", f"schedule.csv={path}", *overrides))
    return _one_line(e.value, "schedule.csv")


@pytest.mark.parametrize("given,why", [((), "no schedule runs that many"),
                                       (("schedule.microbatches=4",), "schedule.microbatches=4 numbers them 0..3")])
def test_a_huge_micro_batch_index_is_a_config_error_in_bounded_memory(tmp_path, given, why):
    path = tmp_path / "huge.csv"
    path.write_text(HUGE)
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        with _headroom():
            msg = _csv_error(path, *given)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "cell 2 '0F99999999999999999999': micro-batch" in msg and why in msg, msg
    assert peak < 50 << 20 and time.perf_counter() - t0 < 20, (peak, time.perf_counter() - t0)


@pytest.mark.parametrize("content,problem", [(b"\xff\xfe\x00\x81 binary", "is not a text file (byte 0 is not UTF-8)"),
                                             (b"\0" * ((4 << 20) + 1), "is over 4 MiB")])
def test_a_binary_or_oversized_csv_is_a_config_error(tmp_path, content, problem):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    msg = _csv_error(path)
    assert problem in msg and "Fix: give a schedule file" in msg, msg


# ---- sim.from's calibration.json ----

_CAL = {"compute": {"0,0,F": 0.01, "0,0,B": 0.02, "1,0,F": 0.01, "1,0,B": 0.02}, "gap_s": {"0": 0.001, "1": 0.001},
        "alpha_s": 0.001, "beta_Bps": None, "message_bytes": 1024, "flush_s": 0.0,
        "outside_s": {"0": 0.01, "1": 0.01}, "act_bytes": {"0": 1e5, "1": 1e5}, "latency_samples": 3, "steps": 4}
BAD_CALIBRATIONS = {
    "not JSON": "{compute: oops",
    "a list": "[1, 2, 3]",
    "keys missing": json.dumps({"compute": {}}),
    "a NaN time": json.dumps({**_CAL, "compute": {**_CAL["compute"], "0,0,F": float("nan")}}),
    "a negative time": json.dumps({**_CAL, "alpha_s": -1.0}),
}


def _source_job(tmp_path: Path, calibration: str) -> Path:
    """A finished pp 2 job's files, its calibration.json replaced."""
    src = tmp_path / "source"
    src.mkdir()
    (src / "config.yaml").write_text(to_yaml(compose(*TINY, "parallelism=pp2", "schedule.microbatches=4")))
    (src / "run_info.json").write_text(json.dumps({"vocab_size": 257}))
    (src / "summary.json").write_text("{}")
    (src / "calibration.json").write_text(calibration)
    return src


@pytest.mark.parametrize("path", ["zb-auto", "dry_run"])
@pytest.mark.parametrize("bad", list(BAD_CALIBRATIONS))
def test_a_bad_calibration_is_a_config_error_naming_sim_from(tmp_path, path, bad):
    src = _source_job(tmp_path, BAD_CALIBRATIONS[bad])
    extra = ["schedule=zb-auto"] if path == "zb-auto" else ["dry_run=true"]
    with pytest.raises(ConfigError) as e:
        run_job(compose(*TINY, "parallelism=pp2", "schedule.microbatches=4", f"sim.from={src}", *extra),
                str(tmp_path / "job"))
    assert "calibration.json" in _one_line(e.value, "sim.from")


@pytest.mark.parametrize("bad", [b for b in BAD_CALIBRATIONS if b != "not JSON"])  # sim/cli.py reads the JSON
def test_simulate_names_a_bad_calibration(tmp_path, capsys, bad):
    src = _source_job(tmp_path, BAD_CALIBRATIONS[bad])
    assert simulate_main([str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: sim.from='{src}'") and "\n" not in err and "calibration.json" in err, err


# ---- trainer.resume ----

MOE = ["model=moe-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1",
       "model.moe.expert_inner=16", "data=synthetic", "data.seq_len=32", "trainer.steps=4", "trainer.micro_batch_size=2",
       "logger=none", "parallelism=single", "metrics.peak_tflops=1.0"]


def _checkpoint(tmp_path: Path, *overrides: str, meta: dict | None = None) -> Path:
    """checkpoints/step_2 as a save writes it (its meta.json, COMPLETE, a DCP index of every
    parameter at its shape; zeros), for the MoE model with `overrides`; `meta` replaces keys
    of meta.json's model section."""
    run = compose(*MOE, *overrides)
    vocab = run.data.vocab_size
    path = tmp_path / "saved" / "checkpoints" / "step_2"
    path.mkdir(parents=True)
    state = {f"model/{n}": torch.zeros(p.shape) for n, p in meta_model(run, vocab).named_parameters()}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    m = _meta(run, 2, vocab, None)
    m["model"].update(meta or {})
    (path / "meta.json").write_text(json.dumps(m))
    (path / "COMPLETE").write_text("step 2\n")
    return path


def _resume(tmp_path: Path, resume: Path, *overrides: str):
    """What run_job does before launch with trainer.resume (run_info: resolve, data, check)."""
    return run_info(compose(*MOE, f"trainer.resume={resume}", *overrides), "cpu", str(tmp_path / "job"))


def _resume_error(tmp_path: Path, resume: Path, key: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        _resume(tmp_path, resume, *overrides)
    return _one_line(e.value, key)


@pytest.mark.parametrize("meta,problem", [(None, "has no meta.json"), ("{step: 2", "meta.json is not valid JSON"),
                                          ("[2]", "meta.json is a JSON list"),
                                          ('{"step": "2"}', "meta.json lacks or has an invalid step")])
def test_a_complete_checkpoint_with_a_missing_or_corrupt_meta_json(tmp_path, meta, problem):
    path = tmp_path / "checkpoints" / "step_2"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("step 2\n")
    (path / ".metadata").write_bytes(b"")
    if meta is not None:
        (path / "meta.json").write_text(meta)
    assert problem in _resume_error(tmp_path, path, "trainer.resume")


@pytest.mark.parametrize("what", ["job", "empty"])
def test_a_directory_without_a_checkpoint_says_so(tmp_path, what):
    d = tmp_path / "a_job"
    d.mkdir()
    if what == "job":  # a finished job that saved no checkpoint
        (d / "config.yaml").write_text(to_yaml(compose(*MOE)))
        (d / "summary.json").write_text('{"status": "completed"}')
    msg = _resume_error(tmp_path, d, "trainer.resume")
    assert "cut off" not in msg and ("job directory with no checkpoint" if what == "job" else "holds no checkpoint") \
        in msg and "meta.json and COMPLETE" in msg and "trainer.resume=auto" in msg, msg


@pytest.mark.parametrize("override,saved", [("model.moe.experts=8", "4"), ("model.moe.expert_inner=32", "16"),
                                            ("model.moe.top_k=1", "2"),
                                            ("model.moe.norm_topk_prob=False", "True")])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_checks_every_model_key_the_checkpoint_records(tmp_path, override, saved):
    path = _checkpoint(tmp_path)
    key = override.split("=")[0]
    msg = _resume_error(tmp_path, path, key, override)
    assert msg.startswith(f"{override}: the checkpoint {path} was saved with {key}={saved}"), msg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_allows_only_the_listed_model_keys_to_change_and_checks_stored_shapes(tmp_path):
    path = _checkpoint(tmp_path)
    assert _resume(tmp_path, path, "model.dropout=0.1", "model.moe.experts_impl=loop").resume_from == str(path)
    # a meta.json that does not describe its tensors: the DCP index's shapes decide
    lying = _checkpoint(tmp_path / "lying", meta={"moe": {**_meta(compose(*MOE), 2, 256, None)["model"]["moe"],
                                                          "experts": 8}})
    msg = _resume_error(tmp_path, lying, "trainer.resume", "model.moe.experts=8")
    assert "the checkpoint has shape (4, " in msg and "this run's model has shape (8, " in msg, msg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("index,problem", [(None, "has COMPLETE and meta.json but no .metadata"),
                                           (b"\x80garbage", "its .metadata is unreadable")])
def test_a_missing_or_damaged_dcp_index(tmp_path, index, problem):
    path = _checkpoint(tmp_path)
    (path / ".metadata").unlink()
    if index is not None:
        (path / ".metadata").write_bytes(index)
    assert problem in _resume_error(tmp_path, path, "trainer.resume")


@pytest.mark.parametrize("summary,config", [("[1]", None), ('{"status": "completed", "steps": 4}', "model: [x\n y: :")])
def test_resume_auto_over_a_damaged_summary_or_config_is_not_finished(tmp_path, summary, config):
    """run_job's first question with trainer.resume=auto: is this job done? Unreadable: no."""
    (tmp_path / "summary.json").write_text(summary)
    (tmp_path / "config.yaml").write_text(config or to_yaml(compose(*MOE)))
    assert finished(compose(*MOE, "trainer.resume=auto"), str(tmp_path)) is None


def test_a_checkpoints_unreadable_metrics_rows_are_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\x00garbage\n[3]\n{"step": 2}\n{"step": 3}\n')
    assert history(str(tmp_path), 2) == ['{"step": 1}\n', '{"step": 2}\n']


# ---- data.cache_dir and the token cache ----

def test_an_unusable_cache_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    for d, problem in ((tmp_path / "file", "is a file, not a directory"), (tmp_path / "file" / "sub", "cannot be "
                                                                                                        "created")):
        with pytest.raises(ConfigError) as e:
            validate(compose(*TINY, f"data.cache_dir={d}", "data.max_files=3"))
        assert problem in _one_line(e.value, "data.cache_dir")


def _cache_run(tmp_path: Path):
    return compose(*TINY, f"data.cache_dir={tmp_path / 'cache'}", "data.max_files=3")


@pytest.mark.parametrize("damage", ["offsets not numbers", "a huge block", "nested past the parser", "a directory"])
def test_damaged_token_cache_metadata_is_rebuilt_not_trusted(tmp_path, capsys, damage):
    run = _cache_run(tmp_path)
    first = prepare(run)
    npy = Path(first.tokens_path)
    meta_file = npy.with_suffix(".json")
    meta = json.loads(meta_file.read_text())
    if damage == "offsets not numbers":
        meta["sampled"]["offsets"] = ["x"]
        meta_file.write_text(json.dumps(meta))
    elif damage == "a huge block":
        meta["sampled"]["block_bytes"] = 10**15
        meta_file.write_text(json.dumps(meta))
    elif damage == "nested past the parser":
        meta_file.write_text("[" * 100_000)
    else:  # the cache's name taken by a directory: not ours to delete
        npy.unlink()
        npy.mkdir()
        (npy / "x").write_text("x")
        with pytest.raises(ConfigError) as e:
            prepare(run)
        assert "cannot be removed" in _one_line(e.value, "data.cache_dir")
        return
    capsys.readouterr()
    again = prepare(run)
    assert f"warning: token cache {npy}" in capsys.readouterr().err
    assert (again.tokens_path, again.num_samples) == (first.tokens_path, first.num_samples)


# ---- the CPU peak probe's cache ----

@pytest.mark.parametrize("content", [b"[1, 2]", b"\xff\xfe binary", b'{"KEY": "fast"}', b'{"KEY": NaN}',
                                     b"[" * 100_000])
def test_a_damaged_peak_cache_is_probed_again(tmp_path, monkeypatch, content):
    from framework.metrics import peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak, "probe_peak_flops", lambda device, dtype: 1e9)
    (tmp_path / "framework").mkdir()
    key = peak.probe_key(torch.device("cpu"), torch.float32).encode()
    (tmp_path / "framework" / "peak_flops.json").write_bytes(content.replace(b"KEY", key))
    assert peak.cached_probe(torch.device("cpu"), torch.float32) == 1e9
    assert list(json.loads((tmp_path / "framework" / "peak_flops.json").read_text()).values()) == [1e9]
