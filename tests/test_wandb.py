"""W&B never costs the run: an unreachable server means an offline run and one warning;
what W&B would reject after launch (no key for an online run, a bad WANDB_MODE) is a
config error before it."""

from __future__ import annotations

import glob
import http.server
import json
import os
import socket
import sys
import threading
import time

import pytest

from framework.report.wandb_sink import api_key_found, init_run, probe, reachable, wandb_mode

from . import wandb_reader
from .conftest import assert_config_error, compose, run_cli

SMOKE = ["experiment=smoke", "metrics.skip_first=0"]
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, the shape of a real key


@pytest.fixture
def silent_server():
    """A TCP port that accepts connections (the kernel completes the handshake from the
    listen backlog) and never answers: the hard case, a timeout rather than a refusal."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def refusing_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused at once
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def no_wandb_env(monkeypatch, tmp_path):
    """No key anywhere: no WANDB_* variables, and HOME / NETRC at an empty directory."""
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    return home


# ---- the probe ----

# Wall-time bounds here are one-sided and far from what load can add (a thread start and a
# local connect, milliseconds; seconds at worst beside CPU hogs): the refusal's bound is half
# a 60 s timeout, which a probe that waited for the timeout can never meet; the silent
# server's is twice its 3 s timeout, which a probe that hung, or waited twice, cannot meet.

def test_a_refusing_port_is_unreachable_at_once(refusing_url):
    start = time.monotonic()
    assert not reachable(refusing_url, 60.0)
    assert "refused" in probe(refusing_url, 60.0).lower()  # the refusal decided it, not a timeout
    assert time.monotonic() - start < 30


def test_a_silent_server_is_unreachable_within_the_timeout(silent_server):
    start = time.monotonic()
    reason = probe(silent_server, 3.0)
    assert reason is not None and "refused" not in reason.lower(), reason
    assert time.monotonic() - start < 2 * 3.0


def test_any_http_answer_is_reachable():
    """A 404 (or 401) still proves the server is there."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert reachable(f"http://127.0.0.1:{server.server_address[1]}", 5.0)
    finally:
        server.shutdown()
        server.server_close()


# ---- the mode and the key ----

def test_auto_is_online_with_a_key_and_offline_without(no_wandb_env, monkeypatch):
    assert wandb_mode("auto") == "offline" and not api_key_found()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # auto honours an environment that asks for offline ...
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    assert wandb_mode("online") == "online"  # ... an explicit logger.mode wins, as wandb.init(mode=) does


def test_a_netrc_entry_for_the_server_host_is_a_key(no_wandb_env, monkeypatch):
    (no_wandb_env / ".netrc").write_text(f"machine 127.0.0.1:8080\n  login user\n  password {FAKE_KEY}\n")
    assert not api_key_found()  # the entry is for another server
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:8080")
    assert api_key_found()
    from framework.validate import validate

    validate(compose("logger=wandb", "logger.mode=online"))


def test_logging_keeps_wandb_mode_importable():
    from framework.report.sinks import wandb_mode as from_logging

    assert from_logging is wandb_mode


# ---- validation before launch ----

def test_online_without_a_key_is_a_config_error(no_wandb_env):
    assert_config_error(["logger=wandb", "logger.mode=online"], "logger.mode='online'",
                        "no W&B API key for https://api.wandb.ai")


@pytest.mark.parametrize("value", ["bogus", "OFFLINE", ""])
def test_a_bad_wandb_mode_variable_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("WANDB_MODE", value)
    assert_config_error(["logger=wandb", "logger.mode=offline"], f"WANDB_MODE={value!r}",
                        "wandb rejects this environment variable at init")


def test_wandb_mode_variable_does_not_matter_without_wandb(monkeypatch):
    from framework.validate import validate

    monkeypatch.setenv("WANDB_MODE", "bogus")
    validate(compose("logger=none"))
    for ok in ("online", "offline", "shared", "disabled", "dryrun", "run"):
        monkeypatch.setenv("WANDB_MODE", ok)
        validate(compose("logger=wandb", "logger.mode=offline"))


def test_cli_rejects_online_without_a_key_before_any_rank(no_wandb_env, tmp_path):
    job = tmp_path / "job"
    r = run_cli([f"hydra.run.dir={job}", *SMOKE, "logger=wandb", "logger.mode=online"])
    assert r.returncode != 0
    assert "config error: logger.mode='online': no W&B API key" in r.stderr, r.stderr[-2000:]
    assert not (job / "config.yaml").exists()  # nothing was prepared or launched


# ---- an unreachable server: the run goes on offline ----

def _warning(url: str) -> str:
    return f"W&B server {url} unreachable ("


def test_a_silent_server_makes_the_run_log_offline(no_wandb_env, silent_server, tmp_path, monkeypatch):
    """The ~100 s CommError case: a key, so auto means online, and a server that never
    answers. The job completes, writes its files and warns once."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", silent_server)
    job = tmp_path / "job"
    r = run_cli([f"hydra.run.dir={job}", *SMOKE, "logger=wandb", "logger.mode=auto"])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert len((job / "metrics.jsonl").read_text().splitlines()) == summary["steps"]
    assert r.stderr.count(_warning(silent_server)) == 1, r.stderr[-3000:]
    assert f"logging offline to {job / 'wandb'}; upload later with wandb sync" in r.stderr
    assert list((job / "wandb").glob("offline-run-*"))


def test_a_failing_online_init_falls_back_to_offline(no_wandb_env, silent_server, tmp_path, monkeypatch, capsys):
    """The probe passes (patched) but wandb.init cannot finish: bounded by init_timeout,
    then offline with the same single warning."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", silent_server)
    monkeypatch.setattr("framework.report.wandb_sink.probe", lambda url, timeout_s: None)
    run = init_run("online", str(tmp_path), init_timeout_s=2, project="p", reinit="finish_previous")
    try:
        assert run is not None and run.settings._offline
    finally:
        run.finish()
    err = capsys.readouterr().err
    assert err.count(_warning(silent_server)) == 1, err


def test_disabled_starts_no_run(tmp_path):
    assert init_run("disabled", str(tmp_path)) is None


# ---- MoE: each layer's numbers flattened, the expert load as a histogram ----

def _moe_rows(job) -> list[dict]:
    return [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]


def test_wandb_row_flattens_moe_layers_and_logs_the_load_as_a_histogram(moe_sweep):
    """A real metrics.jsonl row of the ep 2 job: no nested `moe_layers` (W&B charts no lists),
    `moe/layer<i>/<key>` scalars and tokens per ep rank, and per layer a histogram whose bin e
    is expert e's tokens (what W&B draws as a heat map over steps)."""
    import wandb

    from framework.report.wandb_sink import MOE_SCALARS, wandb_row

    rec = _moe_rows(moe_sweep / "1")[0]
    row = wandb_row(rec)
    assert "moe_layers" not in row and not [k for k in row if k.startswith("moe_layers")]
    assert {k: row[k] for k in ("moe_load_cv_max", "moe_dead_experts", "moe_dropped_fraction", "moe_aux_loss",
                                "a2a_bytes", "a2a_s")} == {k: rec[k] for k in ("moe_load_cv_max", "moe_dead_experts",
                                                                               "moe_dropped_fraction", "moe_aux_loss",
                                                                               "a2a_bytes", "a2a_s")}
    for i, layer in rec["moe_layers"].items():
        mine = {k[len(f"moe/layer{i}/"):]: v for k, v in row.items() if k.startswith(f"moe/layer{i}/")}
        hist = mine.pop("expert_load")
        assert isinstance(hist, wandb.Histogram)
        assert hist.histogram == layer["tokens_per_expert"] and hist.bins == [0, 1, 2, 3, 4]
        assert mine == {**{k: layer[k] for k in MOE_SCALARS if k in layer},
                        "tokens_received_ep0": layer["tokens_received_per_ep_rank"][0],
                        "tokens_received_ep1": layer["tokens_received_per_ep_rank"][1]}
        assert {"aux", "z", "load_cv", "router_entropy", "ep_straggler"} <= mine.keys() and "seq_aux" not in mine


def test_wandb_row_needs_no_wandb_for_a_dense_row_and_skips_oversized_histograms(monkeypatch):
    from framework.report.wandb_sink import HISTOGRAM_MAX_BINS, wandb_row

    dense = {"step": 1, "loss": 2.0, "mfu": None, "rank_bubble_fraction": [0.0, 0.1]}
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    assert wandb_row(dense) == {"step": 1, "loss": 2.0, "bubble_fraction/rank0": 0.0, "bubble_fraction/rank1": 0.1}
    monkeypatch.undo()
    layer = {"tokens_per_expert": [1.0] * (HISTOGRAM_MAX_BINS + 1), "load_cv": 0.0, "tokens_received_per_ep_rank": [1.0]}
    row = wandb_row({**dense, "moe_layers": {"0": layer}})
    assert "moe/layer0/load_cv" in row and "moe/layer0/expert_load" not in row  # wandb caps a histogram at 512 bins


def test_a_moe_run_s_wandb_history_has_each_layer_s_keys_and_load_every_step(moe_sweep):
    """The offline W&B runs of both jobs: every step has every layer's scalars and its
    expert-load histogram (values = that step's tokens per expert), and no list-valued keys."""
    for job, ep in ((moe_sweep / "0", 1), (moe_sweep / "1", 2)):
        files = glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) == 1
        history, rows = wandb_reader.history(files[0]), _moe_rows(job)
        assert [h["step"] for h in history] == [r["step"] for r in rows] == [1, 2, 3, 4]
        for h, rec in zip(history, rows, strict=True):
            assert not [k for k in h if k.startswith("moe_layers")]
            assert ("a2a_s" in h) == (ep > 1) and h["moe_load_cv_max"] == rec["moe_load_cv_max"]
            for i, layer in rec["moe_layers"].items():
                head = f"moe/layer{i}"
                # the histogram's dict arrives as nested keys under its name
                assert h[f"{head}/expert_load/_type"] == "histogram"
                assert h[f"{head}/expert_load/values"] == layer["tokens_per_expert"]
                assert h[f"{head}/expert_load/bins"] == [0, 1, 2, 3, 4]
                assert h[f"{head}/load_cv"] == layer["load_cv"] and h[f"{head}/aux"] == layer["aux"]
                assert [h[f"{head}/tokens_received_ep{r}"] for r in range(ep)] == layer["tokens_received_per_ep_rank"]
