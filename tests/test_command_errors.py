"""`python -m framework.simulate`, `python -m framework.report` and `python -m
framework.schedules` turn every bad argument into ONE line on stderr, `config error:
<argument>=<value>: problem. Fix: ...`, and exit code 2, never a traceback or silence
(framework/commands.py; docs/failures.md). And a what-if never predicts other work
than its job measured: a target whose model, micro-batch or sequence length differs is
refused, in the CLI, the dry run, search.mode=simulate and zb-auto's times (docs/simulator.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.config import ConfigError, to_yaml
from framework.schedules.cli import main as schedules
from framework.report.compare import main as report
from framework.sim.cli import main as simulate
from framework.sim.cli import what_if

from .conftest import PIPELINE_JOB, TINY, compose, run_local


def _one_line(capsys, start: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- framework.simulate ------------------------------------------------------------------

SIMULATE = [
    (["schedule=zbhh1"], "config error: schedule='zbhh1': no such schedule. Did you mean zbh1"),
    (["schedule=nosuch"], "config error: schedule='nosuch': no such schedule. Fix: use one of "),
    (["schedule.name=zbhh1"], "config error: schedule.name='zbhh1': no such schedule. Did you mean zbh1"),
    (["schedul=flush"], "config error: schedul='flush': is not a layout key the simulator rescales. Did you mean"),
    (["schedule.microbatches=abc"], "config error: schedule.microbatches='abc': does not fit the schema"),
    (["parallelism.pp=abc"], "config error: parallelism.pp='abc': does not fit the schema"),
    (["schedule.microbatches=0"], "config error: schedule.microbatches=0: must be >= 1"),
    (["schedule.microbatches=-1"], "config error: schedule.microbatches=-1: must be >= 1"),
    (["parallelism.pp=0"], "config error: parallelism.pp=0: must be >= 1"),
    (["schedule.microbatches=99999999999999999999"],
     "config error: schedule.microbatches=99999999999999999999: must be <= 2**16"),
    (["schedule"], "config error: schedule=None: has no value"),
    ([""], "config error: overrides='': an override without a key"),
    # more stages than blocks: the key the user changed, not the job's partition
    (["parallelism.pp=8"], "config error: parallelism.pp=8: makes 8 pipeline stages (parallelism.pp x "
                           "schedule.virtual_stages = 8 x 1), and the job's parallelism.partition='uniform' gives: "
                           "8 stages for 2 blocks"),
    (["schedule=interleaved"], "config error: schedule='interleaved': makes 4 pipeline stages"),
    (["parallelism.pp=2", "parallelism.partition=[1,1,1]"], "config error: parallelism.partition=[1, 1, 1]: "),
    # another model: the job's durations do not carry over
    (["model.n_embd=256"], "config error: model.n_embd=256: differs from the job sim.from="),
    (["model.moe.experts=8"], "config error: model.moe.experts=8: differs from the job sim.from="),
    (["data.seq_len=64"], "config error: data.seq_len=64: differs from the job sim.from="),
    (["trainer.micro_batch_size=4"], "config error: trainer.micro_batch_size=4: differs from the job sim.from="),
    # a pp = 1 layout from a pipeline job: sim.from is what cannot predict it
    (["parallelism.pp=1"], "config error: sim.from='{job}': is a pipeline job (parallelism.pp=2): its per-stage "
                           "times predict pipelines (parallelism.pp >= 2), not parallelism.pp=1. Fix: to predict a "
                           "pp = 1 layout give sim.from a pp = 1 job run with parallelism.ep > 1"),
    (["--bogus"], "config error: --bogus=None: no such option. Fix: python -m framework.simulate --help"),
    (["--pn", "x.png"], "config error: --pn=None: no such option. Did you mean --png"),
    (["--png"], "config error: --png=None: expected one argument. Fix: "),
    (["--png", ""], "config error: --png='': is empty. Fix: "),
    (["--png", "{tmp}/missing/x.png"], "config error: --png='{tmp}/missing/x.png': its directory {tmp}/missing "
                                       "does not exist. Fix: create it first"),
    (["--png", "{tmp}/x.xyz"], "config error: --png='{tmp}/x.xyz': cannot be written as .xyz. Fix: end the name in "
                               "one of .png, .svg, .pdf"),
]


@pytest.mark.parametrize("overrides,start", SIMULATE, ids=[" ".join(o) or "empty" for o, _ in SIMULATE])
def test_simulate_names_a_bad_key_or_value_in_one_line(pipeline_job_files, tmp_path, overrides, start, capsys):
    job = pipeline_job_files
    fill = {"job": job, "tmp": tmp_path}
    assert simulate([str(job), *(o.format(**fill) for o in overrides)]) == 2
    _one_line(capsys, start.format(**fill))
    assert capsys.readouterr().out == ""  # nothing that looks like a prediction


def test_simulate_names_a_directory_that_is_not_a_finished_job(pipeline_job_files, tmp_path, capsys):
    job = pipeline_job_files
    assert simulate([str(tmp_path / "missing")]) == 2
    _one_line(capsys, f"config error: sim.from='{tmp_path / 'missing'}': no such directory. Fix: ")
    assert simulate([str(job / "config.yaml")]) == 2
    assert "is a file, not a job directory. Fix: " in _one_line(capsys, "config error: sim.from=")
    assert simulate([str(tmp_path)]) == 2
    assert "has no config.yaml, run_info.json" in _one_line(capsys, "config error: sim.from=")
    assert simulate([]) == 2
    _one_line(capsys, "config error: sim.from=None: is required. Fix: python -m framework.simulate --help")
    broken = tmp_path / "broken"
    for name, text, said in [("calibration.json", '{"compute": ', "calibration.json is not valid JSON"),  # truncated
                             ("calibration.json", '{"compute": "abc"}', "calibration.json lack"),  # another shape
                             ("config.yaml", "model: [unclosed", "config.yaml is unreadable"),
                             ("summary.json", "[]", "must hold JSON objects")]:
        broken.mkdir(exist_ok=True)
        for f in job.iterdir():
            (broken / f.name).write_text(f.read_text())
        (broken / name).write_text(text)
        assert simulate([str(broken)]) == 2
        assert said in _one_line(capsys, f"config error: sim.from='{broken}'")


def test_simulate_replays_the_job_and_draws_it(pipeline_job_files, tmp_path, capsys):
    assert simulate([str(pipeline_job_files), "schedule=zbh1", "--png", str(tmp_path / "zbh1.png")]) == 0
    assert "zbh1 pp=2 m=4 v=1 (predicted from" in capsys.readouterr().out
    assert (tmp_path / "zbh1.png").stat().st_size > 10_000


# --- the what-if refuses other work, wherever run.py asks for it --------------------------

@pytest.mark.parametrize("override", ["model.n_embd=64", "model.n_layer=4", "model.arch=llama", "++model.moe.top_k=1",
                                      "model.vocab_size=300", "data.vocab_size=300", "data.seq_len=64",
                                      "trainer.micro_batch_size=4", "trainer.precision=fp64", "parallelism.tp=2"])
def test_what_if_refuses_a_target_that_does_other_work_per_op(pipeline_job_files, override):
    key = override.partition("=")[0].lstrip("+")
    with pytest.raises(ConfigError) as e:
        what_if(str(pipeline_job_files), target=compose(*PIPELINE_JOB, override))
    assert str(e.value).startswith(f"{key}=") and f"differs from the job sim.from={pipeline_job_files}, which ran " \
                                                  "with " in str(e.value), e.value
    assert what_if(str(pipeline_job_files), target=compose(*PIPELINE_JOB, "schedule=zbh1"))["schedule"] == "zbh1"
    # the same vocabulary stated as model.vocab_size (the job's came from data.vocab_size) is the same work
    assert what_if(str(pipeline_job_files), target=compose(*PIPELINE_JOB, "model.vocab_size=256"))["replay"]


def test_the_dry_run_and_search_refuse_another_model(pipeline_job_files, tmp_path):
    """run.py's paths: the dry run's prediction, search.mode=simulate (framework/sim/sweep.py) and
    zb-auto's times from sim.from (filled before validation) all refuse, naming the key, and
    the job says rejected."""
    src = f"sim.from={pipeline_job_files}"
    for i, extra in enumerate([["dry_run=true", "model.n_embd=64"], ["search.mode=simulate", "data.seq_len=64"],
                               ["dry_run=true", "schedule=zb-auto", "model.n_layer=4"]]):
        with pytest.raises(ConfigError, match=f"^{extra[-1].replace('.', '[.]')}: differs from the job sim.from="):
            run_local(tmp_path / str(i), *PIPELINE_JOB, src, *extra)
        assert json.loads((tmp_path / str(i) / "summary.json").read_text())["status"] == "rejected"
    plan = run_local(tmp_path / "same", *PIPELINE_JOB, src, "dry_run=true", "schedule=zbh1")
    assert plan["simulated"]["schedule"] == "zbh1" and not plan["simulated"]["replay"]


def test_search_from_a_pipeline_job_names_sim_from_for_a_pp1_candidate(pipeline_job_files, tmp_path):
    with pytest.raises(ConfigError) as e:
        run_local(tmp_path, *TINY, "data=synthetic", "parallelism=single", "schedule.microbatches=4",
                  "search.mode=simulate", f"sim.from={pipeline_job_files}")
    assert str(e.value).startswith(f"sim.from='{pipeline_job_files}': is a pipeline job (parallelism.pp=2): its "
                                   "per-stage times predict pipelines (parallelism.pp >= 2), not parallelism.pp=1. "
                                   "Fix: to predict a pp = 1 layout give sim.from a pp = 1 job run with "
                                   "parallelism.ep > 1"), e.value


# --- framework.schedules -----------------------------------------------------------------

SCHEDULES = [
    ("dump flush --pp 2 --microbatches 4 -o {tmp}/missing/x.csv",
     "config error: --output='{tmp}/missing/x.csv': its directory {tmp}/missing does not exist. Fix: "),
    ("dump flush --pp 2 --microbatches 4 -o {tmp}", "config error: --output='{tmp}': is a directory. Fix: "),
    ("dump zb-auto --pp 2 --microbatches 0", "config error: --microbatches=0: must be 1 or more. Fix: give a whole "
                                             "number from 1 to 4,096"),
    ("dump flush --pp 0 --microbatches 4", "config error: --pp=0: must be 1 or more. Fix: "),
    ("grid flush --pp -2 --microbatches 4", "config error: --pp=-2: must be 1 or more. Fix: "),
    ("grid flush --pp 99999999999999999999 --microbatches 4",
     "config error: --pp=99999999999999999999: is more than 256 (pipeline ranks)"),
    ("grid interleaved --pp 2 --microbatches 4 --virtual-stages 0", "config error: --virtual-stages=0: must be 1 or "
                                                                     "more"),
    ("grid flush --pp 2 --microbatches -1", "config error: --microbatches=-1: must be 1 or more. Fix: "),
    ("grid flush --pp 2 --microbatches abc", "config error: --microbatches='abc': is not a whole number. Fix: "),
    ("grid flsh --pp 2 --microbatches 4", "config error: name='flsh': no such choice. Did you mean flush? Fix: use "
                                          "one of gpipe, flush"),
    ("grid flush --pp 2 --microbatches 4 --virtual-stages 2",
     "config error: --virtual-stages=2: flush runs exactly 1 chunk(s) per rank. Fix: set --virtual-stages 1"),
    ("grid dualpipev --pp 2 --microbatches 1", "config error: --microbatches=1: dualpipev needs at least"),
    ("grid flush --pp 256 --microbatches 4096", "config error: --microbatches=4096: pp x microbatches x virtual "
                                                "stages = 1,048,576 forwards per step, more than 32,768"),
    ("grid flush --pp 2", "config error: --microbatches=None: is required. Fix: python -m framework.schedules grid "
                          "--help lists its arguments"),
    ("show flush", "config error: command='show': no such choice. Fix: use one of list, dump, grid"),
]


@pytest.mark.parametrize("argv,start", SCHEDULES, ids=[a for a, _ in SCHEDULES])
def test_schedules_names_a_bad_argument_in_one_line(tmp_path, argv, start, capsys):
    assert schedules(argv.format(tmp=tmp_path).split()) == 2
    _one_line(capsys, start.format(tmp=tmp_path))
    assert capsys.readouterr().out == "" and not (tmp_path / "missing").exists()


def test_schedules_dump_writes_the_csv(tmp_path, capsys):
    assert schedules(["dump", "zbh1", "--pp", "2", "--microbatches", "4", "-o", str(tmp_path / "z.csv")]) == 0
    assert len((tmp_path / "z.csv").read_text().splitlines()) == 2 and capsys.readouterr().err == ""


# --- framework.report --------------------------------------------------------------------

def test_report_names_a_bad_argument_in_one_line(pipeline_job_files, tmp_path, capsys):
    fix = "Fix: give a sweep directory (hydra.sweep.dir, e.g. multirun/<date>/<time>) or one job's directory"
    assert report([]) == 2
    _one_line(capsys, "config error: sweep_dir=None: is required. Fix: python -m framework.report --help")
    assert report([str(tmp_path / "missing")]) == 2
    _one_line(capsys, f"config error: sweep_dir='{tmp_path / 'missing'}': no such directory. {fix}")
    assert report([str(pipeline_job_files / "config.yaml")]) == 2
    _one_line(capsys, f"config error: sweep_dir='{pipeline_job_files / 'config.yaml'}': is a file, not a directory. ")
    assert report([""]) == 2
    _one_line(capsys, f"config error: sweep_dir='': is empty. {fix}")
    (tmp_path / "empty").mkdir()
    assert report([str(tmp_path / "empty")]) == 2
    _one_line(capsys, f"config error: sweep_dir='{tmp_path / 'empty'}': has no job directories")
    assert report([str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    _one_line(capsys, f"config error: arguments='{tmp_path / 'empty'}': one argument too many")


GARBAGE = {"0": b"not json{", "1": json.dumps({"status": "completed", "tokens_per_s": "abc"}).encode(),
           "2": b"[1, 2]", "3": bytes(range(256)), "4": json.dumps({"status": "done"}).encode(),
           "5": json.dumps({"status": "completed", "ranks": "abc"}).encode()}


def test_report_leaves_unreadable_summaries_out_and_names_each(tmp_path, capsys):
    """A summary.json that is not JSON or whose fields have other types is no result: one
    warning per file, naming it; the readable job is the table; nothing readable: one line."""
    for job, data in GARBAGE.items():
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_bytes(data)
    assert report([str(tmp_path)]) == 2
    _one_line(capsys, f"config error: sweep_dir='{tmp_path}': none of its 6 summary.json files is readable "
                      f"({tmp_path / '0' / 'summary.json'} is unreadable (not JSON: ")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "config.yaml").write_text(to_yaml(compose()))
    (tmp_path / "9" / "summary.json").write_text(json.dumps({"status": "completed", "loss": 3.5, "tokens_per_s": 99.0}))
    assert report([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING: ")]
    assert [w.split()[1] for w in warnings] == [str(tmp_path / job / "summary.json") for job in GARBAGE], out
    assert "tokens_per_s is 'abc', not a number" in warnings[1] and "status 'done' is none of" in warnings[4]
    table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| job")]
    assert len(table) == 1 and table[0].startswith("| 9 |") and "abc" not in out.split("| job")[1]


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


def test_each_command_is_one_line_from_the_shell_too(tmp_path):
    """The entry points (`python -m ...`) keep the exit code and the one line."""
    import subprocess
    import sys

    for module, args in [("framework.report", [str(tmp_path / "missing")]),
                         ("framework.schedules", ["grid", "flush", "--pp", "0", "--microbatches", "4"])]:
        r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("config error: "), r.stderr
