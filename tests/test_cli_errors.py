"""`python -m framework.simulate` and `python -m framework.report` turn bad arguments into one
line on stderr and exit code 2, never a traceback (docs/simulator.md, docs/sweeps.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.config import to_yaml
from framework.report.compare import main as report
from framework.sim.calibrate import Calibration
from framework.sim.cli import main as simulate

from .conftest import compose


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The files of a finished pp = 2 job, enough for the arguments to be checked against."""
    job = tmp_path_factory.mktemp("pp2_job")
    (job / "config.yaml").write_text(to_yaml(compose("parallelism=pp2")))
    (job / "run_info.json").write_text(json.dumps({"vocab_size": 257}))
    times = {f"{r},0,{op}": 1e-3 for r in range(2) for op in "FB"}  # a calibration holds op times
    (job / "calibration.json").write_text(json.dumps(Calibration(compute=times).to_json()))
    (job / "summary.json").write_text("{}")
    return job


def _one_line(capsys, start: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


SIMULATE = [
    (["schedule=zbhh1"], "config error: schedule='zbhh1': no such schedule. Did you mean zbh1"),
    (["schedule.name=zbhh1"], "config error: schedule.name='zbhh1': no such schedule. Did you mean zbh1"),
    (["schedul=flush"], "config error: schedul='flush': is not a layout key the simulator rescales. Did you mean"),
    (["schedule.microbatches=abc"], "config error: schedule.microbatches='abc': does not fit the schema"),
    (["parallelism.pp=two"], "config error: parallelism.pp='two': does not fit the schema"),
    (["schedule.microbatches=0"], "config error: schedule.microbatches=0: must be a positive integer"),
    (["schedule"], "config error: schedule=None: has no value"),
]


@pytest.mark.parametrize("overrides,start", SIMULATE, ids=[o[0] for o, _ in SIMULATE])
def test_simulate_names_a_bad_key_or_value_in_one_line(job, overrides, start, capsys):
    assert simulate([str(job), *overrides]) == 2
    _one_line(capsys, start)


def test_simulate_names_a_directory_that_is_not_a_finished_job(job, tmp_path, capsys):
    assert simulate([str(tmp_path / "missing")]) == 2
    _one_line(capsys, f"config error: sim.from='{tmp_path / 'missing'}': no such directory. Fix: ")
    assert simulate([str(job / "config.yaml")]) == 2
    assert "is a file, not a job directory. Fix: " in _one_line(capsys, "config error: sim.from=")
    assert simulate([str(tmp_path)]) == 2
    assert "has no config.yaml, run_info.json" in _one_line(capsys, "config error: sim.from=")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in job.iterdir():
        (broken / f.name).write_text(f.read_text())
    (broken / "calibration.json").write_text('{"compute": ')  # truncated (a full disk)
    assert simulate([str(broken)]) == 2
    assert "a file is unreadable (JSONDecodeError" in _one_line(capsys, "config error: sim.from=")
    with pytest.raises(SystemExit) as e:
        simulate([str(job), "--bogus"])
    assert e.value.code == 2
    _one_line(capsys, "error: unrecognized arguments: --bogus. Fix: python -m framework.simulate")


def test_report_names_a_bad_argument_in_one_line(job, tmp_path, capsys):
    assert report([]) == 2
    _one_line(capsys, "error: python -m framework.report <sweep dir> takes one directory, not 0 arguments. Fix: ")
    assert report([str(tmp_path / "missing")]) == 2
    _one_line(capsys, f"error: {tmp_path / 'missing'}: no such directory. Fix: give a sweep directory")
    assert report([str(job / "config.yaml")]) == 2
    _one_line(capsys, f"error: {job / 'config.yaml'}: is a file, not a directory. Fix: ")
    (tmp_path / "empty").mkdir()
    assert report([str(tmp_path / "empty")]) == 2
    _one_line(capsys, f"error: {tmp_path / 'empty'}: no job directories")


def test_report_lists_a_job_with_a_broken_file_and_names_an_unwritable_sweep(tmp_path, capsys):
    hydra = tmp_path / "0" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text("- [unclosed")
    (tmp_path / "multirun.yaml").write_text("hydra: {")
    (tmp_path / "report.csv").mkdir()  # the report cannot be written there
    assert report([str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "(.hydra/overrides.yaml unreadable)" in out.out
    assert out.err == f"error: {tmp_path}: Is a directory: {tmp_path / 'report.csv'}. Fix: make the sweep directory " \
                      "writable\n", out.err
    (tmp_path / "report.csv").rmdir()
    assert report([str(tmp_path)]) == 0
