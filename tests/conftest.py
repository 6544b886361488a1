"""Shared helpers: compose configs like run.py does, and run jobs through the real launcher."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from framework.config import RunConfig, load_config
from framework.launch.job import run_job

from .run_py import run_py

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")

# README's command runs the suite in two passes: every test but these on two pytest-xdist
# workers (`-n 2 -m "not serial"`, one file per unit of work: below), then these alone (`-m serial`). Each
# asserts on wall-clock time measured in its own run, which a second worker on this 2-core
# machine would slow by up to 2x, or one rank of it: injected costs landing in their part of
# the step, hidden shares of overlapped communication, replay within 6 % of the measured
# step, a hang told within a window, noise flagged beside busy loops that would slow the
# other worker too. A plain `pytest tests` runs everything in one process, as before.
SERIAL = (
    "tests/test_breakdown.py::",  # injected delays land in their part at 0.6-1.6x; spans < 40 ms
    "tests/test_overlap.py::",  # comm_hidden_dp above a floor
    # replay within 6 % + SE of the measured run; what-if ratios (the tests of the one timed
    # launch each file shares; their in-process tests and the ep pipeline's byte counts run beside)
    "tests/test_simulator.py::test_replay_meets_its_bound", "tests/test_simulator.py::test_what_if_replays",
    "tests/test_simulator.py::test_dry_run_with_sim_from", "tests/test_simulator.py::test_search_mode_simulate",
    "tests/test_simulator_ep.py::test_the_volume_model_equals", "tests/test_simulator_ep.py::test_replay_and_the_what_if",
    "tests/test_simulator_ep.py::test_a_simulated_layout_search",  # replay error of the all-to-all within 6 % + SE
    "tests/test_cost_profile.py::",  # the bench times GEMMs and the link; refuses a busy machine
    "tests/test_context_parallel.py::test_cp_reproduces_the_single_process[gpt2-cp4_ring_overlap]",
    "tests/test_context_parallel.py::test_cp_reproduces_the_single_process[llama-cp4_ring_contiguous_overlap]",
    "tests/test_context_parallel.py::test_the_ring_overlap_shows_the_transfer_time_its_products_hid",
    "tests/test_ep_compositions.py::test_ep_composition_reproduces_the_single_process_in_fp64[dualpipev_overlap]",
    "tests/test_p2p.py::test_a_slower_stage_raises_the_other_stages_measured_bubble_by_its_extra_time",
    "tests/test_noise.py::test_a_run_beside_busy_loops_is_flagged",
    "tests/test_repeats.py::test_a_real_sweep_with_three_repeats_beside_busy_loops",
    "tests/test_failures.py::test_a_stopped_rank_is_detected_as_a_hang",
    "tests/test_run.py::test_a_crashing_rank_ends_the_job_with_its_traceback",
    "tests/test_multinode.py::test_a_stopped_rank_on_the_second_node_is_named_with_its_host",
    "tests/test_wandb.py::test_a_silent_server_is_unreachable_within_the_timeout",
    "tests/test_checkpoint_io.py::test_a_stop_at_the_last_step_finishes_the_job",  # SIGTERM in a 2 s window
)
# A worker takes a whole file (its module fixtures launch once); files that read one
# session fixture's run go to one worker together, so that run is made once.
GROUPS = {
    "test_run.py": "layout_sweep", "test_dashboard.py": "layout_sweep",
    "test_dashboard_moe.py": "moe_sweep", "test_wandb.py": "moe_sweep",
    "test_fsdp2.py": "shared_run", "test_tp_equivalence.py": "shared_run", "test_zero.py": "shared_run",
}


# The slowest files (fresh-clone durations, 2 cores), handed out first under xdist: a worker
# left at the end with one of them alone leaves the other core idle (xdist's own order is
# the number of tests a file has, which put the one-test 60 s files last). A stale list only
# costs time.
SLOWEST_FIRST = ("test_failures.py", "test_compile.py", "test_fp8.py", "test_mixed_memory.py", "test_run.py",
                 "test_multinode.py", "test_checkpoint.py", "test_context_parallel.py", "test_zero_bubble.py",
                 "test_pipeline.py", "test_ep_compositions.py", "test_checkpoint_io.py", "test_schema_fuzz.py",
                 "test_mixed_precision.py", "test_recompute.py", "test_expert_parallel.py", "test_gpu_multi_check.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: asserts on its own wall-clock time; README's command runs it alone")


def pytest_itemcollected(item):
    if item.nodeid.startswith(SERIAL):
        item.add_marker(pytest.mark.serial)


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist: each file (or GROUPS' set of files) is one unit of work, so a
    module fixture's launches run once, on one worker. (xdist's own `--dist loadgroup` did
    not keep a group on one worker here, and its `load` splits a file between workers: every
    module fixture then ran on both, ~25 % more work on a saturated CPU.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return GROUPS.get(path.rsplit("/", 1)[-1], path)

    config.option.loadscopereorder = False  # the collection's order: SLOWEST_FIRST first
    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the same order on every worker; alone, unchanged
        rank = {f: i for i, f in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], len(rank)))


# A model small enough for many multi-process runs on 2 CPU cores.
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=32", "logger=none",
        "trainer.micro_batch_size=2", "trainer.log_interval=2", "metrics.skip_first=0",
        "metrics.peak_tflops=1.0"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


_COMPOSED: dict = {}


def compose(*overrides: str) -> RunConfig:
    """What run.py composes from these overrides, typed. Hydra's composition (~0.25 s here)
    depends only on conf/ and the overrides, so each list is composed once per session and
    kept as plain containers (load_config reads those; a copy of them is cheaper than of the
    DictConfig); the typed load runs every time (sim.from reads a job's files)."""
    if overrides not in _COMPOSED:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            _COMPOSED[overrides] = OmegaConf.to_container(hydra_compose("config", overrides=list(overrides)))
    return load_config(copy.deepcopy(_COMPOSED[overrides]))


def assert_config_error(overrides: list[str], head: str, problem: str) -> None:
    """Validation rejects the overrides with `key=value: problem. Fix: ...`."""
    from framework.config import ConfigError
    from framework.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(*overrides))
    msg = str(e.value)
    assert msg.startswith(head + ":"), msg
    assert problem in msg and "Fix: " in msg, msg


def run_local(job_dir: Path, *overrides: str) -> dict:
    """Compose, validate and launch through framework.launch.job (the path run.py takes)."""
    return run_job(compose(*overrides), str(job_dir))


def run_layouts(tmp_path_factory, prefix: str, layouts: dict[str, list[str]], *common: str) -> dict:
    """Each layout's run with the common overrides, in its own directory: name -> (metrics
    rows, final parameters), what an equivalence test compares against the single process."""
    out = {}
    for name, layout in layouts.items():
        job = tmp_path_factory.mktemp(f"{prefix}_{name}")
        run_local(job, *common, *layout)
        out[name] = (read_metrics(job), final_params(job))
    return out


def read_metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(job_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(job_dir / "final_model.pt", weights_only=True)


# Equivalence is proved in fp64 (trainer.precision=fp64): a parallel layout differs from the
# single process only in the order it sums (matmul splits, all-reduces, accumulation), ~1e-16
# relative per operation. AdamW's g / sqrt(v) amplifies that where gradients are small: in
# fp32 that turned 1e-7 into 2.5e-5 on some CPUs, so fp32 cannot prove equivalence; in fp64
# the worst measured after 3-6 steps is 2e-11 (Llama tp2), losses and gradient norms 2e-16.
# atol 1e-12 is for GPT-2's key bias only: softmax is invariant to it, so its exact gradient
# is zero and AdamW leaves it at round-off (|value| ~1e-15, layouts differ by up to 1.4e-15);
# atol outweighs rtol only below |value| = 1e-3; measured, even elements near 1e-9 agree to
# 2e-11 relative, so it hides nothing there.
FP64 = "trainer.precision=fp64"
FP64_TOL = dict(rtol=1e-9, atol=1e-12)
# One fp32 run per family guards the production dtype, against the fp64 reference at the
# loss level: a step's loss is a mean over 8 x 32 tokens, so fp32 round-off and the few
# AdamW-amplified parameter elements move it ~1e-7 relative (measured 1.0e-7 at most);
# 1e-5 leaves a 100x margin for other CPUs and still catches a wrong gradient (~1e-3).
FP32_LOSS_TOL = dict(rtol=1e-5, atol=0.0)


def _series(metrics: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([m[key] for m in metrics], dtype=torch.float64)


def assert_same_training(metrics: list[dict], params: dict, ref_metrics: list[dict], ref_params: dict) -> None:
    """An fp64 run against its fp64 reference: per-step losses, gradient norms and every final
    parameter agree to FP64_TOL."""
    assert len(metrics) == len(ref_metrics) > 0
    torch.testing.assert_close(_series(metrics, "loss"), _series(ref_metrics, "loss"), **FP64_TOL)
    torch.testing.assert_close(_series(metrics, "grad_norm"), _series(ref_metrics, "grad_norm"), **FP64_TOL)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        assert ref.dtype == params[name].dtype == torch.float64, name
        torch.testing.assert_close(params[name], ref, **FP64_TOL, msg=name)


def assert_same_losses_fp32(metrics: list[dict], ref_metrics: list[dict]) -> None:
    """The family's fp32 run against the fp64 reference: per-step losses to FP32_LOSS_TOL."""
    assert len(metrics) == len(ref_metrics) > 0
    torch.testing.assert_close(_series(metrics, "loss"), _series(ref_metrics, "loss"), **FP32_LOSS_TOL)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(*overrides)` -> (summary, metrics, final params): a run several modules
    compare against (a single-process reference), run once per session per resolved config."""
    done: dict[str, tuple] = {}

    def run(*overrides: str) -> tuple:
        key = repr(compose(*overrides))  # the resolved config: override order does not matter
        if key not in done:
            job = tmp_path_factory.mktemp("shared")
            done[key] = (run_local(job, *overrides), read_metrics(job), final_params(job))
        return done[key]

    return run


@pytest.fixture(scope="session")
def layout_sweep(tmp_path_factory):
    """`python run.py -m` over three layouts at one global batch (16 sequences: each layout
    derives its micro-batches), W&B offline, held-out evaluation on: the sweep the report,
    the dashboard and the W&B grouping tests read. Returns (sweep dir, the finished process)."""
    sweep = tmp_path_factory.mktemp("layout_sweep")
    r = run_cli(["-m", "parallelism=single,dp2,pp2", "trainer.global_batch_size=16", "experiment=smoke",
                 "metrics.skip_first=0", "trainer.eval_interval=3", "logger=wandb", "logger.mode=offline",
                 f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep, r


@pytest.fixture(scope="session")
def moe_sweep(tmp_path_factory):
    """`python run.py -m` over ep 1 and 2 of a tiny MoE model (2 layers of 4 experts, aux and
    z losses on), W&B offline: the sweep the MoE dashboard and W&B tests read. ~20 s."""
    sweep = tmp_path_factory.mktemp("moe_sweep")
    r = run_cli(["-m", "parallelism.ep=1,2", "parallelism=dp2", "model=moe-tiny", "model.n_layer=2", "model.n_embd=32",
                 "model.n_head=2", "model.n_kv_head=1", "model.moe.expert_inner=16", "data=synthetic",
                 "data.seq_len=32", "trainer.steps=4", "trainer.micro_batch_size=2", "metrics.skip_first=1",
                 "model.moe.aux_losses=[{type:aux,coeff:0.01},{type:z,coeff:0.001}]", "logger=wandb",
                 "logger.mode=offline", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep


# The pp 2 flush job of `pipeline_job_files`: TINY on synthetic data, 4 micro-batches.
PIPELINE_JOB = [*TINY, "parallelism=pp2", "schedule=flush", "schedule.microbatches=4", "data=synthetic"]


@pytest.fixture(scope="session")
def pipeline_job_files(tmp_path_factory) -> Path:
    """The files `python -m framework.simulate` and `sim.from` read from a finished pp 2 job
    (PIPELINE_JOB), written without running it: its resolved config.yaml, run_info.json's
    vocabulary, and a calibration.json of the shape such a run writes, at the durations one
    run of it measured on this machine. For the commands' argument checks and the what-if's
    refusals, which read no measured number; the simulator's accuracy is tested on real runs
    (test_simulator.py). Launching the job instead costs ~13 s here."""
    from framework.config import to_yaml

    job = tmp_path_factory.mktemp("pipeline_job")
    (job / "config.yaml").write_text(to_yaml(compose(*PIPELINE_JOB)))
    (job / "run_info.json").write_text(json.dumps({"vocab_size": 256}))
    calibration = {
        "compute": {"0,0,F": 1.72e-3, "0,0,B": 0.98e-3, "1,0,F": 1.56e-3, "1,0,B": 1.06e-3},
        "gap_s": {"0": 1.68e-3, "1": 1.11e-3}, "alpha_s": 1.67e-3, "beta_Bps": None, "alpha_late_s": 5.19e-3,
        "message_bytes": 8192, "flush_s": 0.61e-3, "outside_s": {"0": 7.67e-3, "1": 11.26e-3},
        "act_bytes": {"0": 231680.0, "1": 313860.0}, "latency_samples": 13, "steps": 3}
    (job / "calibration.json").write_text(json.dumps(calibration))
    (job / "summary.json").write_text(json.dumps({"status": "completed", "device": "cpu"}))
    return job


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None,
            unset: tuple = ()) -> subprocess.CompletedProcess:
    """`python run.py *args`: its exit code, stdout and stderr (tests/run_py.py: in a fork of the
    rank server, without a fresh interpreter's imports); `env` added to os.environ, `unset` removed."""
    return run_py(args, timeout, env, unset)


def modelled_activation_peak(job_dir) -> float:
    """framework/sim/cost/activations.py's peak (the fullest pipeline rank) for a finished job."""
    import json

    from framework.config import read_config
    from framework.sim.cost.activations import peak_bytes
    from framework.sim.cost.price import job_of

    vocab = json.loads((job_dir / "run_info.json").read_text())["vocab_size"]
    job = job_of(read_config(str(job_dir / "config.yaml")), vocab)
    return max(peak_bytes(job.shape, job.lay, job.pp, job.microbatches, job.schedule, job.virtual_stages))
