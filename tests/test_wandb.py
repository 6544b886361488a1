"""W&B never costs the run: an unreachable server means an offline run and one warning;
what W&B would reject after launch (no key for an online run, a bad WANDB_MODE) is a
config error before it."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time

import pytest

from framework.wandb_sink import api_key_found, init_run, probe, reachable, wandb_mode

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

def test_a_refusing_port_is_unreachable_at_once(refusing_url):
    start = time.monotonic()
    assert not reachable(refusing_url, 5.0)
    assert "refused" in probe(refusing_url, 5.0).lower()
    assert time.monotonic() - start < 4


def test_a_silent_server_is_unreachable_within_the_timeout(silent_server):
    start = time.monotonic()
    assert probe(silent_server, 1.0) is not None
    assert time.monotonic() - start < 3


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
    from framework.logging import wandb_mode as from_logging

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
    monkeypatch.setattr("framework.wandb_sink.probe", lambda url, timeout_s: None)
    run = init_run("online", str(tmp_path), init_timeout_s=2, project="p", reinit="finish_previous")
    try:
        assert run is not None and run.settings._offline
    finally:
        run.finish()
    err = capsys.readouterr().err
    assert err.count(_warning(silent_server)) == 1, err


def test_disabled_starts_no_run(tmp_path):
    assert init_run("disabled", str(tmp_path)) is None
